#!/usr/bin/env bash
# The shape of verl's examples/sapo_trainer/run_qwen30b_sapo.sh: SAPO's soft gate with its two
# temperatures, GRPO advantages.
set -x
loss_mode=sapo
tau_pos=1.0
tau_neg=1.05

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=$HOME/data/math/train.parquet \
    data.train_batch_size=256 \
    actor_rollout_ref.model.path=Qwen/Qwen3-30B-A3B-Base \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.tau_pos=$tau_pos \
    actor_rollout_ref.actor.tau_neg=$tau_neg \
    actor_rollout_ref.actor.policy_loss.loss_mode=${loss_mode} \
    trainer.total_training_steps=50
