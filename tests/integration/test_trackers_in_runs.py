"""Trackers in real runs: several at once see the same numbers; a tracker whose library is missing
stops the run at start-up, before any model is built, with the pip command."""

from __future__ import annotations

import json
import sys

import pytest

from trellis.config import ConfigError
from trellis.recipes.train import train


def test_sft_run_feeds_console_jsonl_and_tensorboard_at_once(tiny_model_path, data_files, tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "sft"
    overrides = [
        "recipe=sft",
        f"model.path={tiny_model_path}",
        f"data.train_path={data_files['train']}",
        "data.batch_samples=16",
        "trainer.total_steps=2",
        "trainer.trackers=[console,jsonl,tensorboard]",
        f"trainer.run_dir={run_dir}",
    ]
    train(None, overrides)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("sft/loss")] == [(r["step"], pytest.approx(r["sft/loss"], rel=1e-6)) for r in rows]
    assert "step 2: " in capsys.readouterr().err


def test_missing_tracker_library_stops_the_run_before_any_model_is_built(run_rl, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was built before the config error was found")

    monkeypatch.setattr("trellis.runtime.harness.spawn_worker", refuse)
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"tracker 'wandb' needs wandb .*: pip install 'trellis-trackers\[wandb\]'"):
        run_rl("trainer.trackers=[jsonl,wandb]")
