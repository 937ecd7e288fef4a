"""verl's own multi-turn example with an interaction (``examples/sglang_multiturn/
run_qwen2.5-0.5b_gsm8k_multiturn_w_interaction.sh``: GRPO, bf16 master weights through
``fsdp_config.model_dtype``, verl's ``Gsm8kInteraction`` named by its interaction config file),
converted by ``trellis config from-verl`` with only the model, sizes and rollout engine overridden,
trains its steps and resumes. verl 0.9.1's wheel ships no ``verl.interactions``, so the converted
entry's class is swapped for trellis-interactions' ``gsm8k`` (the same GSM8K rule and feedback).
Its trainer computes in bfloat16 and its engine holds float32 weights: the sync checks' bounds come
from both sides (a float32-only bound stopped it at step 1)."""

from __future__ import annotations

import json

import yaml
from omegaconf import OmegaConf

from trellis.plugins import load_plugins
from trellis.recipes.train import train
from trellis_demo.tasks import make_arithmetic_split, write_rows
from trellis_verl_compat.convert import convert, read_verl

# the script's settings, sizes scaled to the tiny model (batch 256 -> 4 prompts, n 8 -> 2, 1024 + 3072 tokens -> 32 + 24)
EXAMPLE = [
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=4",
    "data.max_prompt_length=32",
    "data.max_response_length=24",
    "data.filter_overlong_prompts=True",
    "data.truncation=error",
    "data.return_raw_chat=True",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.actor.fsdp_config.model_dtype=bfloat16",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.name=hf",  # sglang in the script
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.rollout.multi_turn.enable=True",
    "actor_rollout_ref.rollout.multi_turn.max_user_turns=1",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "algorithm.use_kl_in_reward=False",
    "trainer.critic_warmup=0",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "trainer.save_freq=-1",
    "trainer.test_freq=20",
    "trainer.total_training_steps=2",
]
INTERACTIONS = {"interaction": [{"name": "gsm8k", "class_name": "verl.interactions.gsm8k_interaction.Gsm8kInteraction", "config": {}}]}


def test_verls_multiturn_example_trains_its_steps_in_bfloat16_and_resumes(tiny_model_path, tmp_path):
    rows = make_arithmetic_split(16, 0, max_value=30, interaction="gsm8k")  # verl's preprocessing: interaction_kwargs per row
    for row in rows:
        row["data_source"] = "openai/gsm8k"
    train_file = write_rows(rows, tmp_path / "train.parquet")
    (tmp_path / "interaction.yaml").write_text(yaml.safe_dump(INTERACTIONS))
    verl = [
        *EXAMPLE,
        f"actor_rollout_ref.model.path={tiny_model_path}",
        f"data.train_files={train_file}",
        f"data.val_files={train_file}",
        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={tmp_path / 'interaction.yaml'}",
    ]
    converted = convert(read_verl(verl), load_plugins().registry)
    [entry] = converted.config["multi_turn"]["interactions"]
    assert entry == {"name": "gsm8k", "verl_class": INTERACTIONS["interaction"][0]["class_name"], "options": {}}
    converted.config["multi_turn"]["interactions"] = [{"name": "gsm8k", "component": "gsm8k"}]
    config = tmp_path / "converted.yaml"
    config.write_text(OmegaConf.to_yaml(OmegaConf.create(converted.config)))
    assert converted.config["backend"]["dtype"] == "bfloat16"
    run_dir = tmp_path / "run"
    common = [f"trainer.run_dir={run_dir}", "trainer.trackers=[jsonl]", "data.val_path=null"]
    train(str(config), common)
    train(str(config), [*common, "trainer.total_steps=3"])  # resumes from the checkpoint of step 2
    steps = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["multiturn/num_turns_mean"] >= 1 and r["multiturn/env_errors"] == 0
        # bfloat16 rounding, under the 16-bit bound the two dtypes give, above the float32 one that stopped the run
        assert 0 < r["sync/probe_gap"] < 0.1 and 0 < r["sync/batch_gap"] < 0.1, r
