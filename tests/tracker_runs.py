"""A run's steps fed to trackers by name, as the harness feeds them (the tracker tests of core and of trellis-trackers)."""

from __future__ import annotations

from pathlib import Path

from trellis.runtime.harness import Trackers

STEPS = {1: {"reward/mean": 0.25, "actor/pg_loss": -0.5}, 2: {"reward/mean": 0.5, "actor/pg_loss": -0.25}, 3: {"reward/mean": 0.75}}


def log_run(registry, names, run_dir: Path, steps=STEPS, start_step: int = 0) -> None:
    trackers = Trackers(names, registry, run_dir, 3, start_step=start_step)
    for step, metrics in steps.items():
        trackers.log(step, {**metrics, "note": "not a number"})
    trackers.close()
