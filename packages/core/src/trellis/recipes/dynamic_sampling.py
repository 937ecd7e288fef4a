"""Dynamic sampling for the rl recipe (``algorithm.dynamic_sampling``): prompt groups whose samples
all score the same give a group-relative estimator no signal, so they are dropped and fresh prompts
are generated until the step holds ``data.train_batch_prompts`` informative groups."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trellis.batch import Batch
from trellis.config import choice, ranged
from trellis.rewards import RewardResult

log = logging.getLogger("trellis")


@dataclass
class DynamicSamplingConfig:
    """enable: drop zero-variance prompt groups and refill the batch with new prompts.
    metric: what must vary within a group: ``reward`` (the sample's score, shaping included) or
        ``acc`` (the reward's ``acc`` component when it returns one, else the score).
    max_rounds: generation rounds a step may take; when they do not fill the batch, the step
        trains on the groups kept (a warning says how many), or is skipped if none."""

    enable: bool = False
    metric: str = choice("reward", ("reward", "acc"))
    max_rounds: int = ranged(10, ge=1)


def group_has_signal(scores: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """``(groups,)`` bool: whether the samples of each group differ in ``scores`` ``(batch,)``;
    ``groups`` ``(batch,)`` numbers the groups from 0."""
    n = int(groups.max()) + 1
    low = torch.full((n,), float("inf")).scatter_reduce(0, groups, scores.float(), "amin")
    high = torch.full((n,), float("-inf")).scatter_reduce(0, groups, scores.float(), "amax")
    return high > low


def metric_values(scored: RewardResult, metric: str) -> torch.Tensor:
    """``(batch,)`` the per-sample values a group must vary in."""
    if metric == "acc" and scored.components and "acc" in scored.components:
        return scored.components["acc"]
    return scored.scores


@dataclass
class Filled:
    """A step's training samples: ``batch`` (``token_scores`` included), their ``scores`` and reward
    ``components`` ``(batch,)``, the first round's reward result (``first``, the unfiltered draw
    the reward metrics describe) and the ``dynamic_sampling/*`` metrics. ``batch`` is None when
    no group was kept."""

    batch: Batch | None
    scores: torch.Tensor | None
    components: dict[str, torch.Tensor] | None
    first: RewardResult
    metrics: dict[str, float]


def fill(
    generate: Callable[[int], tuple[Batch, RewardResult]],
    groups_wanted: int,
    cfg: DynamicSamplingConfig,
    step: int,
    group_multiple: int = 1,
) -> Filled:
    """Call ``generate(round)`` (new prompts each call, their samples and rewards) until the
    informative groups kept reach ``groups_wanted`` (then cut to exactly that many, in the
    order generated) or ``cfg.max_rounds`` rounds ran. Short of the target, the kept groups are
    cut to a multiple of ``group_multiple`` (what the batch must divide into) and a warning says
    how many remain."""
    kept: list[tuple[Batch, RewardResult]] = []
    count = dropped = rounds = 0
    first = None
    while count < groups_wanted and rounds < cfg.max_rounds:
        batch, scored = generate(rounds)
        rounds += 1
        first = first or scored
        groups = batch.group_index("uid")
        signal = group_has_signal(metric_values(scored, cfg.metric), groups)
        dropped += int((~signal).sum())
        chosen = signal.nonzero().flatten()[: groups_wanted - count]
        count += len(chosen)
        rows = torch.isin(groups, chosen)
        if rows.any():
            batch["token_scores"] = scored.token_scores
            kept.append(_take(batch, scored, rows))
    if count < groups_wanted:
        usable = count - count % group_multiple
        log.warning(
            "step %d: dynamic sampling found %d of data.train_batch_prompts=%d prompt groups with varying %s in "
            "algorithm.dynamic_sampling.max_rounds=%d rounds; %s (raise max_rounds, or check that the reward can vary)",
            step, count, groups_wanted, cfg.metric, cfg.max_rounds,
            f"training on {usable} groups" + (f" (a multiple of {group_multiple})" if usable != count else "") if usable else "skipping the step",
        )
        kept, count = _first_groups(kept, usable), usable
    metrics = {
        "dynamic_sampling/rounds": float(rounds),
        "dynamic_sampling/kept_groups": float(count),
        "dynamic_sampling/dropped_zero_variance": float(dropped),
    }
    if not count:
        return Filled(None, None, None, first, metrics)
    keys = sorted({k for _, s in kept for k in s.components})
    components = {k: torch.cat([s.components.get(k, torch.zeros(len(s.scores))) for _, s in kept]) for k in keys}
    batch = Batch.cat([b for b, _ in kept], pad=True)
    return Filled(batch, torch.cat([s.scores for _, s in kept]), components or None, first, metrics)


def _first_groups(kept: list[tuple[Batch, RewardResult]], groups: int) -> list[tuple[Batch, RewardResult]]:
    """The first ``groups`` prompt groups of ``kept`` (rounds in order)."""
    out = []
    for batch, scored in kept:
        ids = batch.group_index("uid")
        rows = ids < groups
        if rows.any():
            out.append(_take(batch, scored, rows))
        groups -= int(ids.max()) + 1
    return out


def _take(batch: Batch, scored: RewardResult, rows: torch.Tensor) -> tuple[Batch, RewardResult]:
    """The samples ``rows`` ``(batch,)`` bool of ``batch`` and of its reward result."""
    components = {k: v[rows] for k, v in (scored.components or {}).items()}
    return batch[rows], RewardResult(scored.token_scores[rows], {}, scored.scores[rows], components)
