"""Warnings for a run that trains on nothing: a role's gradient exactly 0, or no prompt group whose
samples differ in reward (every group-relative advantage 0). Said at the first such step, then every
``every`` steps while it lasts, so a long run that lost its signal keeps saying so."""

from __future__ import annotations

import logging

log = logging.getLogger("trellis")


class SignalWatch:
    """Reads each step's metrics (``Run.end_step``) for ``<role>/grad_norm == 0`` and, with
    ``watch_reward``, ``reward/groups_with_signal == 0`` (a recipe turns it off when its advantages
    do not come from the reward alone, e.g. a teacher's log-probs)."""

    def __init__(self, every: int = 10, watch_reward: bool = True) -> None:
        self.every = every
        self.watch_reward = watch_reward
        self.streaks: dict[str, int] = {}

    def check(self, step: int, metrics: dict[str, float]) -> list[str]:
        """The problems of this step, each logged as a warning when due; returns them."""
        problems = {k: _no_gradient(k) for k, v in metrics.items() if k.endswith("/grad_norm") and v == 0.0}
        if self.watch_reward and metrics.get("reward/groups_with_signal") == 0.0:
            problems["reward"] = _no_reward_signal(metrics.get("reward/mean", 0.0))
        self.streaks = {k: self.streaks.get(k, 0) + 1 for k in problems}
        for key, message in problems.items():
            streak = self.streaks[key]
            if streak % self.every == 1 or self.every == 1:
                log.warning("step %d: %s%s", step, message, f" ({streak} steps in a row)" if streak > 1 else "")
        return list(problems.values())


def _no_gradient(key: str) -> str:
    return f"{key}=0: the gradient is exactly zero, so this step changed no weight of {key.split('/')[0]}"


def _no_reward_signal(mean: float) -> str:
    return (
        f"every prompt's samples got the same reward (reward/mean={mean:.3f}): the group-relative advantages are all 0 and "
        "the policy learns nothing; check that reward.name scores this data (gsm8k, the default, scores 0 on other tasks), "
        "or make the task easier or sampling.n larger"
    )
