"""Held-out curves of runs against steps and against training wall time, for benches that compare methods at equal time."""

from __future__ import annotations

import statistics
from pathlib import Path

GREEDY = "val/greedy_reward_mean"
SAMPLED = "val/reward_mean"  # validation.n samples a prompt at validation.temperature


def train_seconds(run_dir: Path, offset_s: float = 0.0) -> dict[int, float]:
    """Step -> training seconds up to its end: ``timing/step_s`` less ``timing/val_s`` (validating
    is not training) summed from ``offset_s`` (a cost paid before the run, e.g. data generated for it)."""
    from trellis.plot import read_metrics

    elapsed, seconds = offset_s, {0: offset_s}
    for r in read_metrics(run_dir):
        if "timing/step_s" in r:
            elapsed += r["timing/step_s"] - r.get("timing/val_s", 0.0)
            seconds[r["step"]] = elapsed
    return seconds


def val_curve(run_dir: Path, key: str = GREEDY) -> list[tuple[int, float, float]]:
    """``(step, training seconds, value)`` at each validation of a run (step 0 included)."""
    from trellis.plot import read_metrics

    seconds = train_seconds(run_dir)
    return [(r["step"], seconds[r["step"]], r[key]) for r in read_metrics(run_dir) if key in r]


def at_time(curve: list[tuple[int, float, float]], seconds: float) -> float:
    """The value of the last validation of ``curve`` made by ``seconds`` of training."""
    return [value for _, s, value in curve if s <= seconds + 1e-9][-1]


def mean_std(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values) if len(values) > 1 else 0.0:.3f}"


def plot_curves(curves: dict[str, list[list[tuple[int, float, float]]]], out_png: Path, title: str) -> Path:
    """Two panels, the value against steps and against training seconds; a line per run, a colour
    per method (``curves``: method -> one curve per seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for colour, (method, runs) in enumerate(curves.items()):
        for i, curve in enumerate(runs):
            steps, seconds, values = zip(*curve)
            label = method if i == 0 else None
            axes[0].plot(steps, values, color=f"C{colour}", marker=".", alpha=0.8, label=label)
            axes[1].plot(seconds, values, color=f"C{colour}", marker=".", alpha=0.8, label=label)
    for ax, xlabel in zip(axes, ("step", "training wall time (s)")):
        ax.set_xlabel(xlabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
