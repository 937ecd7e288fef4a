#!/usr/bin/env bash
# On-policy distillation in verl 0.9.1's layout (the distillation section of ppo_trainer: a top-k forward KL
# term without task rewards, one teacher).
set -x

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    data.train_batch_size=64 \
    actor_rollout_ref.model.path=Qwen/Qwen3-1.7B \
    actor_rollout_ref.rollout.n=1 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    distillation.enabled=True \
    distillation.distillation_loss.loss_mode=forward_kl_topk \
    distillation.distillation_loss.topk=64 \
    distillation.distillation_loss.use_task_rewards=False \
    distillation.teacher_models.teacher_model.model_path=Qwen/Qwen3-8B \
    trainer.total_training_steps=100
