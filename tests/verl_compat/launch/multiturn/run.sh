#!/usr/bin/env bash
# The shape of verl's examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh: the hydra config named by
# --config-path / --config-name, its defaults list followed, the rest as overrides.
set -x
PROJECT_DIR="$(pwd)"
CONFIG_PATH="$PROJECT_DIR/config"

python3 -m verl.trainer.main_ppo \
    --config-path="$CONFIG_PATH" \
    --config-name='gsm8k_multiturn_grpo' \
    algorithm.adv_estimator=grpo \
    data.train_batch_size=256 \
    data.max_prompt_length=1024 \
    data.max_response_length=1024 \
    actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct \
    actor_rollout_ref.rollout.name=sglang \
    actor_rollout_ref.rollout.n=16 \
    actor_rollout_ref.rollout.multi_turn.tool_config_path="$PROJECT_DIR/config/tool_config/gsm8k_tool_config.yaml" \
    trainer.total_epochs=15 $@
