"""The check after every weight sync (``sync_check``): an engine that samples from the trained
weights passes with a gap at float32 rounding, one that silently keeps its old weights stops the
run at the first sync, naming the engine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import spine_plugins  # noqa: E402  (test-only plugins beside this file)

from trellis import SyncCheckFailed  # noqa: E402
from trellis.plugins import load_plugins  # noqa: E402
from trellis.recipes.train import train  # noqa: E402
from trellis_algos.rl.invariants import InvariantFailed  # noqa: E402


@pytest.fixture
def plugins():
    return load_plugins(extra=[("spine_test", spine_plugins.SpinePlugin())])


LENGTH_REWARD = '''
def by_length(data_source, solution_str, ground_truth, extra_info=None):
    """Samples of one prompt differ in length, so every step has a gradient."""
    return float(len(solution_str))
'''


def _rl(tiny_model_path, data_files, run_dir, *overrides):
    reward = run_dir.parent / "length.py"
    reward.write_text(LENGTH_REWARD)
    return [
        "recipe=rl",
        f"model.path={tiny_model_path}",
        f"data.train_path={data_files['train']}",
        "data.train_batch_prompts=4",
        "sampling.n=2",
        "sampling.max_new_tokens=4",
        "actor.optim.lr=1e-2",
        f"reward.path={reward}",
        "reward.name=by_length",
        "trainer.total_steps=3",
        "trainer.trackers=[jsonl]",
        f"trainer.run_dir={run_dir}",
        *overrides,
    ]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_an_engine_with_weights_of_its_own_matches_the_trainer_after_every_sync(plugins, tiny_model_path, data_files, tmp_path):
    """The engine keeps its own copy (never adopts the actor's module): after each of 3 syncs its
    greedy probe log-probs equal the trainer's to float32 rounding; the weights did move."""
    train(None, _rl(tiny_model_path, data_files, tmp_path / "run", "rollout.name=strict_sleep"), plugins=plugins)
    rows = [r for r in _rows(tmp_path / "run") if "actor/pg_loss" in r]
    gaps = [r["sync/probe_gap"] for r in rows]
    assert len(gaps) == 3 and max(gaps) < 1e-5, gaps
    assert all(r["actor/grad_norm"] > 0 for r in rows)  # the weights moved: a skipped sync would show
    assert all(r["timing/sync_check_s"] >= 0 for r in rows)


def test_a_sync_that_silently_keeps_the_old_weights_stops_the_run_naming_the_engine(plugins, tiny_model_path, data_files, tmp_path):
    named = r"step 1: after the weight sync, rollout engine 0 of 1 \(SkipSyncEngine\) .*\(sync_check.max_gap=0.001; trainer float32, engine float32\)"
    with pytest.raises(SyncCheckFailed, match=named):
        train(None, _rl(tiny_model_path, data_files, tmp_path / "run", "rollout.name=skip_sync"), plugins=plugins)


def test_a_lost_sync_also_stops_the_run_at_the_next_batch(plugins, tiny_model_path, data_files, tmp_path):
    """With the probe's bound out of reach, the batch's own log-prob agreement check finds the same
    engine at step 2: its samples claim the weights of step 1, the trainer scores them otherwise."""
    named = r"step 2: log-prob agreement check: .* above the 0.001 that rounding explains \(trainer float32, engine float32\)"
    with pytest.raises(InvariantFailed, match=named):
        train(None, _rl(tiny_model_path, data_files, tmp_path / "run", "rollout.name=skip_sync", "sync_check.max_gap=100"), plugins=plugins)


def test_an_engine_sharing_the_actors_module_has_nothing_to_check(plugins, tiny_model_path, data_files, tmp_path):
    """The HF engine generating from the actor's own module (one process) gets no probe, and a
    run may turn the check off (here on the engine that drops its syncs)."""
    train(None, _rl(tiny_model_path, data_files, tmp_path / "shared", "trainer.total_steps=1"))
    assert not any("sync/probe_gap" in r for r in _rows(tmp_path / "shared"))
    off = ("rollout.name=skip_sync", "sync_check.enable=false", "trainer.total_steps=2")
    train(None, _rl(tiny_model_path, data_files, tmp_path / "off", *off), plugins=plugins)
    assert not any("sync/probe_gap" in r for r in _rows(tmp_path / "off"))
