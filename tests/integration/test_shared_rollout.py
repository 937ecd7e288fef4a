"""The HF rollout on the actor's one rank generates from the actor's own model (no second copy,
no weight sync) and trains exactly as the run that keeps a copy and syncs it after every update."""

from __future__ import annotations

import logging

import pytest

from trellis.runtime import controller

VARIED_REWARD = """
def varied(data_source, solution_str, ground_truth, extra_info=None):
    return (len(solution_str) * 7 + sum(map(ord, solution_str))) % 11 / 10
"""


def numbers(rows):
    """Every step's metrics but timings (which differ from run to run) and the sync check's gap
    (only an engine with weights of its own has one to check)."""
    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "sync/"))} for r in rows]


def record_sharing(monkeypatch) -> list[bool]:
    """The list each local rollout group appends to whether its engine adopted the actor's model."""
    shared = []
    init = controller.LocalRollout.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        shared.append(self.shared)

    monkeypatch.setattr(controller.LocalRollout, "__init__", record)
    return shared


TWO_EPOCHS = ["trainer.total_steps=3", "actor.ppo_epochs=2", "actor.mini_batch_samples=8"]


@pytest.mark.parametrize("overrides", [[], TWO_EPOCHS], ids=["on-policy", "two-epochs"])
def test_generating_from_the_actors_model_equals_the_synced_copy(run_rl, tmp_path, caplog, monkeypatch, overrides):
    reward = tmp_path / "varied.py"
    reward.write_text(VARIED_REWARD)
    shared_groups = record_sharing(monkeypatch)
    args = ["trainer.threads=1", f"reward.path={reward}", "reward.name=varied", *overrides]
    with caplog.at_level(logging.INFO, logger="trellis"):
        shared_summary, shared = run_rl(*args, run_dir=tmp_path / "shared")
    assert "generates from the actor's own model" in caplog.text
    copied_summary, copied = run_rl(*args, "rollout.share_actor_weights=false", run_dir=tmp_path / "copied")
    assert shared_groups == [True, False]
    steps = [r for r in shared if "reward/mean" in r]
    assert steps and all(r["actor/grad_norm"] > 0 for r in steps)
    assert numbers(shared) == numbers(copied)  # the copy's sync check after each sync perturbed nothing
    assert all(r["sync/probe_gap"] < 1e-6 for r in copied if "actor/pg_loss" in r)
    assert shared_summary == copied_summary  # validation before and after: the same generations


def test_an_engine_in_another_dtype_keeps_its_own_copy(run_rl, tmp_path, monkeypatch):
    shared_groups = record_sharing(monkeypatch)
    _, rows = run_rl("trainer.threads=1", "trainer.total_steps=1", "rollout.dtype=bfloat16", run_dir=tmp_path / "bf16")
    assert shared_groups == [False]
    assert any("reward/mean" in r for r in rows)
