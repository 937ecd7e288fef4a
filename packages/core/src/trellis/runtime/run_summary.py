"""The end-of-run summary the console prints: each training figure beside each held-out one, from
the start of the run to its end, so a training reward that climbs while held-out figures stand
still is seen at once."""

from __future__ import annotations

import collections
import math

# figures of the training batches (means over the first and last steps); every val/ key is held-out
TRAINING = ("reward/mean", "sft/loss", "rm/loss", "rm/accuracy", "teacher/reverse_kl", "actor/distill_loss")
WINDOW = 10  # steps averaged at each end of a training figure


class RunSummary:
    """Collects what :meth:`table` prints from each step's metrics (``add``)."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.first: dict[str, list[float]] = collections.defaultdict(list)
        self.last: dict[str, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=WINDOW))
        self.count: collections.Counter = collections.Counter()
        self.held_out: dict[str, list[tuple[int, float]]] = collections.defaultdict(list)

    def add(self, step: int, metrics: dict[str, float]) -> None:
        self.steps.append(step)
        for key, value in metrics.items():
            if not isinstance(value, (int, float)) or math.isnan(value):
                continue
            if key in TRAINING:
                self.count[key] += 1
                if len(self.first[key]) < WINDOW:
                    self.first[key].append(value)
                self.last[key].append(value)
            elif key.startswith("val/"):
                self.held_out[key].append((step, value))

    def table(self) -> str:
        """Lines ``figure  start  end  change`` (empty when no figure was logged): a training
        figure's start and end are the means of its first and last ``WINDOW`` steps (fewer in a
        short run, so the two never overlap), a held-out one's its first and last validation."""
        if not self.steps:
            return ""
        rows = []
        for key in TRAINING:
            if key in self.first:
                n = max(1, min(WINDOW, self.count[key] // 2))  # the two ends never overlap
                start, end = _mean(self.first[key][:n]), _mean(list(self.last[key])[-n:])
                rows.append((f"{key} (training, {n}-step means)", start, end))
        for key, points in sorted(self.held_out.items()):
            (s0, start), (s1, end) = points[0], points[-1]
            rows.append((f"{key} (held-out, steps {s0} and {s1})", start, end))
        if not rows:
            return ""
        width = max(len(r[0]) for r in rows)
        lines = [f"run summary, steps {self.steps[0]}-{self.steps[-1]}:", f"  {'figure':<{width}}     start       end    change"]
        lines += [f"  {name:<{width}}  {start:8.4f}  {end:8.4f}  {end - start:+8.4f}" for name, start, end in rows]
        return "\n".join(lines)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
