#!/usr/bin/env bash
# The shape of verl's examples/rollout_correction/run_with_rollout_corr.sh: RLOO with sequence-level
# importance weights, self-normalised, in bypass mode with the REINFORCE loss.
set -xeuo pipefail

rollout_is="sequence"
rollout_is_threshold=2.0
rollout_is_batch_normalize="true"
rollout_rs="null"
bypass_mode="true"
loss_type="reinforce"
MODEL_PATH=${MODEL_PATH:-"Qwen/Qwen2.5-7B"}

python3 -m verl.trainer.main_ppo \
    data.train_files="data/train.parquet" \
    data.max_prompt_length=2048 \
    data.max_response_length=4096 \
    data.train_batch_size=128 \
    algorithm.adv_estimator=rloo \
    algorithm.gamma=1.0 \
    algorithm.rollout_correction.rollout_is=${rollout_is} \
    algorithm.rollout_correction.rollout_is_threshold=${rollout_is_threshold} \
    algorithm.rollout_correction.rollout_is_batch_normalize=${rollout_is_batch_normalize} \
    algorithm.rollout_correction.rollout_rs=${rollout_rs} \
    algorithm.rollout_correction.bypass_mode=${bypass_mode} \
    algorithm.rollout_correction.loss_type=${loss_type} \
    actor_rollout_ref.model.path="${MODEL_PATH}" \
    actor_rollout_ref.actor.optim.lr=5e-7 \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.rollout.calculate_log_probs=True \
    actor_rollout_ref.rollout.name=vllm \
    trainer.total_training_steps=10
