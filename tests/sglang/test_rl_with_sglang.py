"""The rl recipe end to end with ``rollout.name=sglang``: the only change from the default config."""

from __future__ import annotations

import json
import math

from trellis.examples.tasks import make_arithmetic_split, write_rows
from trellis.recipes.train import train


def test_rl_recipe_runs_with_the_sglang_rollout(tiny_model_path, tmp_path):
    train_file = write_rows(make_arithmetic_split(64, 0, max_value=50), tmp_path / "train.parquet")
    test_file = write_rows(make_arithmetic_split(8, 0, split="test", max_value=50), tmp_path / "test.jsonl")
    run_dir = tmp_path / "rl"
    summary = train(
        None,
        [
            "recipe=rl",
            f"model.path={tiny_model_path}",
            f"data.train_path={train_file}",
            f"data.val_path={test_file}",
            "data.train_batch_prompts=4",
            "sampling.n=4",
            "sampling.max_new_tokens=6",
            "actor.micro_batch_samples=8",
            "actor.optim.lr=1e-3",
            "rollout.name=sglang",
            "rollout.context_length=128",
            "trainer.total_steps=3",
            "trainer.trackers=[jsonl]",
            f"trainer.run_dir={run_dir}",
        ],
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for row in steps:
        for key in ("timing/gen_s", "timing/weight_sync_s", "actor/pg_loss", "response/length_mean"):
            assert key in row and math.isfinite(row[key]), (key, row)
        assert 0.0 <= row["response/length_mean"] <= 6
    assert 0.0 <= summary["val_after"]["reward_mean"] <= 1.0
