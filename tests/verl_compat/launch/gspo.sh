#!/usr/bin/env bash
# The shape of verl's examples/gspo_trainer/test_gspo_3b_math.sh: an environment set up by eval and
# exports, data prepared by a python command inside an if, $(basename ...), nested $(((...))), GSPO
# with the dapo reward manager's overlong buffer (off) under the older reward_model.reward_kwargs.
set -xeuo pipefail
eval "$(conda shell.bash hook)"
export HYDRA_FULL_ERROR=1

loss_mode=gspo
loss_agg_mode="seq-mean-token-mean"
MODEL_PATH=Qwen/Qwen2.5-3B-Instruct
rollout_engine=vllm
reward_manager=dapo
first_time_dataset_prep=true
clip_ratio_low=0.0003
clip_ratio_high=0.0004
max_prompt_length=$((1024 * 2))
max_response_length=$((1024 * 8))
enable_overlong_buffer=false
SFT_MODEL=$(basename $MODEL_PATH)
exp_name="${loss_mode}-${SFT_MODEL}-RL"
val_top_p=0.7
use_dynamic_bsz=true
actor_ppo_max_token_len=$(((max_prompt_length + max_response_length) * 2))

if [ "$first_time_dataset_prep" = true ]; then
    python examples/data_preprocess/gsm8k.py --local_save_dir /data/gsm8k/
fi
train_files="['/data/gsm8k/train.parquet']"

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    actor_rollout_ref.actor.policy_loss.loss_mode=${loss_mode} \
    data.train_files="${train_files}" \
    data.train_batch_size=512 \
    data.max_prompt_length=${max_prompt_length} \
    data.max_response_length=${max_response_length} \
    actor_rollout_ref.rollout.n=16 \
    actor_rollout_ref.actor.clip_ratio_low=${clip_ratio_low} \
    actor_rollout_ref.actor.clip_ratio_high=${clip_ratio_high} \
    actor_rollout_ref.actor.use_dynamic_bsz=${use_dynamic_bsz} \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=${actor_ppo_max_token_len} \
    actor_rollout_ref.rollout.name=${rollout_engine} \
    actor_rollout_ref.model.path="${MODEL_PATH}" \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.05 \
    actor_rollout_ref.actor.ppo_mini_batch_size=128 \
    actor_rollout_ref.actor.grad_clip=1.0 \
    actor_rollout_ref.actor.loss_agg_mode=${loss_agg_mode} \
    actor_rollout_ref.rollout.max_num_batched_tokens=$((max_prompt_length + max_response_length)) \
    actor_rollout_ref.rollout.val_kwargs.top_p=${val_top_p} \
    actor_rollout_ref.rollout.val_kwargs.do_sample=true \
    reward_model.reward_manager=${reward_manager} \
    +reward_model.reward_kwargs.overlong_buffer_cfg.enable=${enable_overlong_buffer} \
    +reward_model.reward_kwargs.max_resp_len=${max_response_length} \
    trainer.experiment_name="${exp_name}" \
    trainer.total_training_steps=500
