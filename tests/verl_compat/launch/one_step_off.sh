#!/usr/bin/env bash
# The shape of verl's tests/special_e2e/run_one_step_off_policy.sh (an array of common settings, the entry point
# choosing one-step-off, separate rollout GPUs).
set -xeuo pipefail

NUM_GPUS=${NUM_GPUS:-8}
n_gpus_rollout=2
n_gpus_training=$((NUM_GPUS - n_gpus_rollout))

common_params=(
    data.train_files="${HOME}/data/gsm8k/train.parquet"
    data.train_batch_size=32
    data.max_prompt_length=512
    data.max_response_length=512
    actor_rollout_ref.model.path="${HOME}/models/Qwen/Qwen2.5-0.5B-Instruct"
    actor_rollout_ref.actor.ppo_mini_batch_size=8  # prompts
    actor_rollout_ref.rollout.n=4
    algorithm.adv_estimator=grpo
    trainer.total_training_steps=2
)

python3 -m verl.experimental.one_step_off_policy.main_ppo \
    "${common_params[@]}" \
    trainer.nnodes=1 \
    trainer.n_gpus_per_node=${n_gpus_training} \
    rollout.nnodes=1 \
    rollout.n_gpus_per_node=${n_gpus_rollout} "$@"
