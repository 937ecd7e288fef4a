#!/usr/bin/env bash
# The shape of verl's verl/experimental/fully_async_policy/shell/dapo_7b_math_fsdp2_4_4.sh (train_batch_size 0,
# steps from rollout.total_rollout_steps, staleness as a fraction, the reward manager's kwargs).
set -xeuo pipefail

max_response_length=$((1024 * 8))
overlong_buffer_len=$((1024 * 4))
n_resp_per_prompt=16
train_prompt_mini_bsz=32
total_rollout_steps=$(((512*400)))
staleness_threshold=0.1
trigger_parameter_sync_step=4
require_batches=4
partial_rollout=True

python -m verl.experimental.fully_async_policy.fully_async_main \
    data.train_files="${HOME}/data/dapo-math-17k.parquet" \
    data.max_prompt_length=2048 \
    data.max_response_length=${max_response_length} \
    data.train_batch_size=0 \
    data.gen_batch_size=1 \
    actor_rollout_ref.rollout.n=${n_resp_per_prompt} \
    algorithm.adv_estimator=grpo \
    actor_rollout_ref.actor.ppo_mini_batch_size=${train_prompt_mini_bsz} \
    actor_rollout_ref.model.path="${HOME}/models/Qwen2.5-Math-7B" \
    reward.reward_manager.name=dapo \
    +reward.reward_kwargs.overlong_buffer_cfg.enable=True \
    +reward.reward_kwargs.overlong_buffer_cfg.len=${overlong_buffer_len} \
    +reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0 \
    +reward.reward_kwargs.overlong_buffer_cfg.log=False \
    +reward.reward_kwargs.max_resp_len=${max_response_length} \
    trainer.nnodes=1 \
    trainer.n_gpus_per_node=4 \
    rollout.nnodes=1 \
    rollout.n_gpus_per_node=4 \
    rollout.total_rollout_steps="${total_rollout_steps}" \
    async_training.staleness_threshold="${staleness_threshold}" \
    async_training.trigger_parameter_sync_step="${trigger_parameter_sync_step}" \
    async_training.require_batches="${require_batches}" \
    async_training.partial_rollout="${partial_rollout}"
