"""GRPO with ``rollout.name=vllm`` and rollout correction on: the IS metrics between the vLLM
engine's log-probs and the FSDP actor's are logged every step, and stay near identity (both
run float32 on CPU here, so the engines nearly agree)."""

from __future__ import annotations

import json
import math

from trellis.recipes.train import train
from trellis_demo.tasks import make_arithmetic_split, write_rows


def test_grpo_with_vllm_logs_rollout_correction_metrics(tiny_model_path, tmp_path):
    train_file = write_rows(make_arithmetic_split(32, 0, max_value=50), tmp_path / "train.parquet")
    run_dir = tmp_path / "rl"
    train(
        None,
        [
            "recipe=rl",
            f"model.path={tiny_model_path}",
            f"data.train_path={train_file}",
            "data.train_batch_prompts=4",
            "sampling.n=4",
            "sampling.max_new_tokens=6",
            "actor.micro_batch_samples=8",
            "actor.optim.lr=1e-3",
            "actor.policy_loss.rollout_is=token",
            "actor.policy_loss.rollout_is_threshold=2.0",
            "actor.policy_loss.rollout_rs=token_k1",
            "actor.policy_loss.rollout_rs_threshold='2.0'",
            "rollout.name=vllm",
            "rollout.max_model_len=128",
            "validation.before_train=false",
            "trainer.total_steps=2",
            "trainer.trackers=[jsonl]",
            f"trainer.run_dir={run_dir}",
        ],
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert len(steps) == 2
    for row in steps:
        for key in ("is_mean", "is_max", "rs_masked_fraction", "kl", "k3_kl", "chi2_token"):
            assert math.isfinite(row[f"actor/rollout_corr/{key}"]), (key, row)
        assert abs(row["actor/rollout_corr/is_mean"] - 1.0) < 0.05
        assert abs(row["actor/rollout_corr/kl"]) < 0.05
        assert row["actor/rollout_corr/rs_masked_fraction"] < 0.05
