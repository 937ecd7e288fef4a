"""Metric trackers (kind ``tracker``): ``console`` (progress bar + a line per step) and ``jsonl``;
trellis-trackers adds ``tensorboard``, ``wandb`` and ``mlflow``."""

from __future__ import annotations

import importlib
import json
import math
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from trellis.config import ConfigError
from trellis.registry import Registry, RegistryError
from trellis.runtime.run_summary import RunSummary


class Tracker:
    """Receives each step's metrics. Registered as a factory ``make(run_dir, total_steps) -> Tracker``.
    ``requires``: ``(module, pip requirement)`` that the config check imports before any model is built."""

    requires: tuple[str, str] | None = None

    def resume(self, step: int) -> None:
        """The run continues after ``step`` (from a checkpoint; -1 for a fresh start): forget what an
        earlier attempt in this run folder logged after it."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Flush and release; called once at the end of the run, also after an error."""


KEY_FIGURES = ("reward/mean", "val/reward_mean", "actor/pg_loss", "actor/entropy", "sft/loss", "val/loss", "timing/step_s")


class ConsoleTracker(Tracker):
    """A progress bar showing the key figures every step (only when stderr is a terminal: redirected
    to a file it would mix redraws into the lines), a line with every metric on stderr for the
    first step, every ``total_steps / LINES`` steps, validation steps and the last step, and at the
    end the run's summary (:class:`~trellis.runtime.run_summary.RunSummary`): training figures
    beside held-out ones, start to end."""

    LINES = 25

    def __init__(self, run_dir: Path, total_steps: int) -> None:
        bar = sys.stderr.isatty()
        self.bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr, disable=not bar)
        self.total = total_steps
        self.every = max(1, total_steps // self.LINES)
        self.summary = RunSummary()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        shown = {k.split("/", 1)[-1] if k != "val/reward_mean" else "val": v for k, v in metrics.items() if k in KEY_FIGURES}
        self.bar.set_postfix({k: _fmt(v) for k, v in shown.items()}, refresh=False)
        self.bar.update(step - self.bar.n)
        if step in (1, self.total) or step % self.every == 0 or any(k.startswith("val/") for k in metrics):
            self.bar.write(f"step {step}: " + " ".join(f"{k}={_fmt(v)}" for k, v in sorted(metrics.items())), file=sys.stderr)
        self.summary.add(step, metrics)

    def close(self) -> None:
        self.bar.close()
        table = self.summary.table()
        if table:
            print(table, file=sys.stderr, flush=True)


class JsonlTracker(Tracker):
    """One JSON object per step in ``<run_dir>/metrics.jsonl``, flushed at once so nothing is lost."""

    def __init__(self, run_dir: Path, total_steps: int) -> None:
        self.rows = StepRows(run_dir / "metrics.jsonl")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.rows.write([{"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}])

    def resume(self, step: int) -> None:
        self.rows.rewind(step)

    def close(self) -> None:
        self.rows.close()


class StepRows:
    """A JSONL file of rows that each carry ``step``, appended and flushed at once; ``rewind``
    drops the rows of steps a resumed run repeats."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, rows: list[dict[str, Any]]) -> None:
        self.file.write("".join(json.dumps(row) + "\n" for row in rows))
        self.file.flush()

    def rewind(self, step: int) -> None:
        """Rewrite the file without the rows after ``step`` (and any line a kill cut short)."""
        path = Path(self.file.name)
        self.file.close()
        kept = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line + "\n")
            except (ValueError, KeyError, TypeError):
                continue
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        tmp.replace(path)
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def close(self) -> None:
        self.file.close()


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class Trackers:
    """Every tracker named in ``trainer.trackers``, fed together, closed together. A run (re)started
    after ``start_step`` tells each tracker to drop what came later (``Tracker.resume``, a no-op
    unless it keeps what it logged), so a relaunch never repeats a step: a fresh start (0) drops
    everything, step 0's validation too."""

    def __init__(self, names: Iterable[str], registry: Registry, run_dir: Path, total_steps: int, start_step: int = 0) -> None:
        self.trackers = [registry.get("tracker", n).obj(run_dir, total_steps) for n in names]
        for t in self.trackers:
            t.resume(start_step if start_step else -1)

    @staticmethod
    def check(names: Iterable[str], registry: Registry) -> None:
        """Each tracker is installed and its library imports (``requires``: module, pip requirement),
        so a missing one fails at start-up, not at the first log."""
        for i, name in enumerate(names):
            key = f"trainer.trackers[{i}]"
            try:
                declared = registry.get("tracker", name).declared
            except RegistryError as exc:
                raise ConfigError(f"config key {key!r}: {exc}") from None
            module, requirement = declared["requires"] or (None, None)
            if module is not None:
                try:
                    importlib.import_module(module)
                except ImportError as exc:
                    raise ConfigError(f"config key {key!r}: tracker {name!r} needs {module} ({exc}): pip install '{requirement}'") from None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for t in self.trackers:
            t.log(step, metrics)

    def close(self) -> None:
        for t in self.trackers:
            t.close()
