"""Metric trackers (kind ``tracker``): core's ``console`` (progress bar + a line per step) and ``jsonl``."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm


class Tracker:
    """Receives each step's metrics. Registered as a factory ``make(run_dir, total_steps) -> Tracker``."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Flush and release; called once at the end of the run, also after an error."""


KEY_FIGURES = ("reward/mean", "val/reward_mean", "actor/pg_loss", "actor/entropy", "sft/loss", "val/loss", "timing/step_s")


class ConsoleTracker(Tracker):
    """A progress bar showing the key figures, and one compact line per step on stderr."""

    def __init__(self, run_dir: Path, total_steps: int) -> None:
        self.bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        shown = {k.split("/", 1)[-1] if k != "val/reward_mean" else "val": v for k, v in metrics.items() if k in KEY_FIGURES}
        self.bar.set_postfix({k: _fmt(v) for k, v in shown.items()}, refresh=False)
        self.bar.update(step - self.bar.n)
        self.bar.write(f"step {step}: " + " ".join(f"{k}={_fmt(v)}" for k, v in sorted(metrics.items())), file=sys.stderr)

    def close(self) -> None:
        self.bar.close()


class JsonlTracker(Tracker):
    """One JSON object per step in ``<run_dir>/metrics.jsonl``, flushed at once so nothing is lost."""

    def __init__(self, run_dir: Path, total_steps: int) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.file.write(json.dumps({"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v
