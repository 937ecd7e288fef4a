"""``trellis config from-verl``: a verl PPO/GRPO config (YAML and/or overrides) becomes a trellis
rl config that composes with the same settings; the verl keys it could not map are named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trellis.config import compose
from trellis.plugins import load_plugins
from trellis.verl_config import RULES, convert, read_verl

GRPO_COMMAND = [
    "actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct",
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.rollout.n=5",
    "data.train_batch_size=256",
    "data.max_prompt_length=512",
    "data.max_response_length=1024",
    "actor_rollout_ref.actor.ppo_mini_batch_size=64",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.rollout.name=hf",
    "actor_rollout_ref.rollout.temperature=0.8",
    "trainer.total_epochs=15",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
    "trainer.test_freq=5",
    "trainer.save_freq=-1",
    "trainer.logger=['console','wandb']",
    "actor_rollout_ref.model.use_remove_padding=True",
    "trainer.project_name=verl_grpo_example_gsm8k",
]


@pytest.fixture
def train_file(tmp_path) -> Path:
    row = {"prompt": [{"role": "user", "content": "1+1?"}], "data_source": "openai/gsm8k", "reward_model": {"ground_truth": "2"}}
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for _ in range(1000)))
    return path


def composed(conversion, tmp_path):
    path = tmp_path / "converted.yaml"
    from omegaconf import OmegaConf

    path.write_text(OmegaConf.to_yaml(OmegaConf.create(conversion.config)))
    return compose(path, [], load_plugins().registry)


def test_grpo_command_line_composes_with_verls_settings(train_file, tmp_path):
    registry = load_plugins().registry
    verl = [*GRPO_COMMAND, f"data.train_files={train_file}", f"data.val_files=[{train_file},{train_file}]"]
    cfg = composed(convert(read_verl(verl), registry), tmp_path)
    assert cfg.model.path == "Qwen/Qwen2.5-3B-Instruct"
    assert cfg.data.train_path == str(train_file) and list(cfg.data.val_path) == [str(train_file)] * 2
    assert (cfg.data.train_batch_prompts, cfg.data.max_prompt_length, cfg.sampling.max_new_tokens) == (256, 512, 1024)
    assert (cfg.sampling.n, cfg.sampling.temperature) == (5, 0.8)
    assert cfg.actor.mini_batch_samples == 64 * 5  # verl's mini-batch counts prompts; trellis's counts samples
    assert cfg.actor.micro_batch_samples == 16
    assert (cfg.actor.optim.lr, cfg.actor.optim.weight_decay) == (1e-6, 0.01)  # weight decay: verl's default
    assert (cfg.actor.use_kl_loss, cfg.actor.kl_loss_coef, cfg.actor.kl_loss_type, cfg.actor.entropy_coeff) == (True, 0.001, "low_var_kl", 0.0)
    assert cfg.algorithm.advantage.name == "grpo" and cfg.rollout.name == "hf" and cfg.reward.name == "auto"
    assert cfg.trainer.total_steps == 15 * (1000 // 256)  # epochs x full batches per epoch
    assert (cfg.trainer.nnodes, cfg.trainer.procs_per_node, cfg.trainer.controller) == (1, 8, "ray")
    assert (cfg.trainer.val_every_steps, cfg.trainer.save_every_steps) == (5, 0)
    assert list(cfg.trainer.trackers) == ["console", "wandb", "jsonl"]


def test_verl_yaml_with_overrides_on_top(tmp_path):
    verl_yaml = tmp_path / "ppo.yaml"
    verl_yaml.write_text(
        """
actor_rollout_ref:
  model: {path: /models/base}
  actor:
    clip_ratio_low: 0.2
    clip_ratio_high: 0.28
    clip_ratio_c: 10.0
    loss_agg_mode: seq-mean-token-sum
    ppo_epochs: 2
    grad_clip: 0.5
    optim: {lr: 3e-6, lr_warmup_steps: 10, warmup_style: cosine, min_lr_ratio: 0.1}
  rollout: {name: hf, n: 1, top_p: 0.9, top_k: 50, val_kwargs: {n: 4, temperature: 0.6}}
critic:
  model: {path: /models/critic}
  optim: {lr: 1e-5}
  ppo_mini_batch_size: ${actor_rollout_ref.actor.ppo_mini_batch_size}
  cliprange_value: 0.2
algorithm:
  adv_estimator: gae
  gamma: 0.99
  lam: 0.95
  use_kl_in_reward: true
  kl_penalty: kl
  kl_ctrl: {type: adaptive, kl_coef: 0.002, target_kl: 0.05, horizon: 500}
data: {train_files: /data/train.parquet, train_batch_size: 32}
trainer: {total_training_steps: 100, total_epochs: 3, nnodes: 1, n_gpus_per_node: 1, resume_mode: disable, val_before_train: false}
"""
    )
    overrides = ["actor_rollout_ref.actor.ppo_mini_batch_size=8", "+critic.ppo_epochs=3"]
    conversion = convert(read_verl([str(verl_yaml), *overrides]), load_plugins().registry)
    cfg = composed(conversion, tmp_path)
    loss = cfg.actor.policy_loss
    assert (loss.name, loss.clip_ratio_low, loss.clip_ratio_high, loss.clip_ratio_c) == ("vanilla", 0.2, 0.28, 10.0)
    assert (cfg.actor.loss_agg_mode, cfg.actor.ppo_epochs, cfg.actor.mini_batch_samples) == ("seq-mean-token-sum", 2, 8)
    assert (cfg.actor.optim.lr, cfg.actor.optim.grad_clip, cfg.actor.optim.warmup_steps, cfg.actor.optim.lr_schedule) == (3e-6, 0.5, 10, "cosine")
    assert cfg.actor.optim.min_lr_ratio == 0.1
    assert (cfg.sampling.top_p, cfg.sampling.top_k, cfg.validation.n, cfg.validation.temperature) == (0.9, 50, 4, 0.6)
    assert (cfg.critic.model_path, cfg.critic.optim.lr, cfg.critic.mini_batch_samples, cfg.critic.cliprange_value) == ("/models/critic", 1e-5, 8, 0.2)
    assert cfg.critic.ppo_epochs == 3
    adv = cfg.algorithm.advantage
    assert (adv.name, adv.gamma, adv.lam) == ("gae", 0.99, 0.95)
    algo = cfg.algorithm
    assert (algo.use_kl_in_reward, algo.kl_penalty, algo.kl_ctrl_type, algo.kl_coef, algo.target_kl, algo.kl_horizon) == (
        True,
        "kl",
        "adaptive",
        0.002,
        0.05,
        500,
    )
    assert (cfg.trainer.total_steps, cfg.trainer.controller, cfg.trainer.resume, cfg.validation.before_train) == (100, "local", "never", False)
    assert conversion.unmapped == []


def test_unmapped_keys_are_named_with_why():
    conversion = convert(
        read_verl(
            [
                "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
                "actor_rollout_ref.actor.clip_ratio_c=3.0",
                "actor_rollout_ref.actor.fsdp_config.param_offload=True",
                "trainer.logger=[console,swanlab]",
                "trainer.critic_warmup=2",
                "data.train_files=/nowhere/train.parquet",
                "data.prompt_key=question",
                "data.reward_fn_key=data_source",
                "actor_rollout_ref.rollout.name=hf",
                "something.verl.added=1",
            ]
        ),
        load_plugins().registry,
    )
    why = {key: reason for key, _, reason in conversion.unmapped}
    assert why["actor_rollout_ref.actor.clip_ratio_c"] == "policy_loss 'gspo' has no option clip_ratio_c"
    assert "backend section" in why["actor_rollout_ref.actor.fsdp_config.param_offload"]
    assert "swanlab is not one" in why["trainer.logger"]
    assert "trainer.critic_warmup" in why and "something.verl.added" in why
    assert why["data.prompt_key"] == "the prompt column is always 'prompt'"
    assert "data.reward_fn_key" not in why  # data_source: what trellis does anyway
    # verl's default of 30 epochs needs the training rows, which are not there
    assert "/nowhere/train.parquet" in why["trainer.total_epochs"] and why["trainer.total_epochs"].endswith("(verl's default)")
    assert conversion.config["actor"]["policy_loss"] == {"name": "gspo"}
    assert "trainer" not in conversion.config or "total_steps" not in conversion.config["trainer"]
    assert "actor_rollout_ref.actor.ppo_mini_batch_size=256" in conversion.defaults_used


def trellis(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trellis.cli", *args], cwd=cwd, capture_output=True, text=True)


def test_cli_prints_the_config_and_reports_on_stderr(train_file, tmp_path):
    out = trellis("config", "from-verl", *GRPO_COMMAND, f"data.train_files={train_file}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    (tmp_path / "run.yaml").write_text(out.stdout)
    shown = trellis("config", "show", "run.yaml", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "mini_batch_samples: 320" in shown.stdout and "total_steps: 45" in shown.stdout
    assert "actor_rollout_ref.model.use_remove_padding=True: model loading knob" in out.stderr
    assert "trainer.project_name='verl_grpo_example_gsm8k'" in out.stderr

    missing = trellis("config", "from-verl", "nowhere.yaml", cwd=tmp_path)
    assert missing.returncode == 2 and "verl config 'nowhere.yaml' does not exist" in missing.stderr


def test_every_rule_is_in_the_docs_table():
    doc = (Path(__file__).parents[2] / "docs" / "coming-from-verl.md").read_text()
    assert [rule.verl for rule in RULES if f"`{rule.verl}`" not in doc] == []
