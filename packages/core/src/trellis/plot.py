"""PNG curves of metrics from one or more runs' ``metrics.jsonl`` (runs overlaid per metric)."""

from __future__ import annotations

import json
import math
from pathlib import Path

# Drawn when no metric is named; each only where some run has it.
DEFAULT_METRICS = (
    "reward/mean", "val/reward_mean", "val/greedy_reward_mean", "actor/entropy", "actor/kl_loss", "actor/reward_kl", "response/length_mean",
    "sft/loss", "val/loss", "timing/step_s",
)  # fmt: skip


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; give a run folder written by a Trellis recipe with the jsonl tracker")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_metrics(run_dirs: list[Path], out_png: Path, metrics: tuple[str, ...] | list[str] = DEFAULT_METRICS) -> Path:
    """One panel per metric present in any run; a line per run; written to ``out_png``."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plots are drawn with matplotlib, which is not installed: pip install trellis-core[plot]") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {str(d): read_metrics(d) for d in run_dirs}
    present = [m for m in metrics if any(m in row for rows in runs.values() for row in rows)]
    if not present:
        have = sorted({k for rows in runs.values() for row in rows for k in row if k != "step"})
        raise ValueError(f"none of the metrics {list(metrics)} appear in {list(runs)}; they have: {', '.join(have)}")
    cols = min(3, len(present))
    rows_n = math.ceil(len(present) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.5 * cols, 3.2 * rows_n), squeeze=False)
    for ax, metric in zip(axes.flat, present):
        for name, rows in runs.items():
            points = [(r["step"], r[metric]) for r in rows if isinstance(r.get(metric), (int, float))]
            if points:
                ax.plot(*zip(*points), marker="." if len(points) < 50 else None, label=Path(name).name)
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(present) :]:
        ax.axis("off")
    if len(runs) > 1:
        axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
