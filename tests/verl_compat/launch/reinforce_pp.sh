#!/usr/bin/env bash
# The shape of verl's examples/reinforce_plus_plus_trainer/run_qwen2-7b_math_rf_baseline.sh: REINFORCE++
# with a baseline over two data sets (a quoted list), the KL in the reward.
set -x

gsm8k_train_path=$HOME/data/gsm8k/train.parquet
math_train_path=$HOME/data/math/train.parquet
train_files="['$gsm8k_train_path', '$math_train_path']"

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=reinforce_plus_plus_baseline \
    data.train_files="$train_files" \
    data.train_batch_size=1024 \
    data.max_prompt_length=1024 \
    data.max_response_length=1024 \
    actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct \
    actor_rollout_ref.actor.optim.lr=3e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=1024 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.kl_loss_type=mse \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=8 \
    algorithm.use_kl_in_reward=True \
    algorithm.kl_penalty=kl \
    algorithm.kl_ctrl.kl_coef=0.001 \
    trainer.total_training_steps=100 $@
