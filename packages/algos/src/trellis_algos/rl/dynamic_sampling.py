"""Dynamic sampling for the rl recipe (``algorithm.dynamic_sampling``): prompt groups that the
filters drop (``group_filter`` kind; the default ``zero_variance``: samples that all score the same
give a group-relative estimator no signal) are replaced by fresh prompts, generated until the step
holds ``data.train_batch_prompts`` kept groups. Generating ahead of training, the kept groups a
step does not need are carried to the next step instead of dropped, while fresh enough."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from trellis import Batch, ConfigError, Registry, RewardResult, checked_options, choice, ranged, switch

log = logging.getLogger("trellis")


@dataclass
class DynamicSamplingConfig:
    """enable: drop zero-variance prompt groups and refill the batch with new prompts.
    metric: the per-sample values the filters read: ``reward`` (the sample's score, shaping
        included) or ``acc`` (the reward's ``acc`` component when it returns one, else the score).
    filters: registered group filters (kind ``group_filter``), each ``f(values, groups) -> keep``
        with ``values`` and ``groups`` ``(batch,)`` and ``keep`` ``(groups,)`` bool; a group is kept
        when every filter keeps it. A filter registered with an options dataclass is called
        ``f(values, groups, options)``.
    filter_options: the options of such filters, by name (``{min_spread: {spread: 0.5}}``), checked
        against each one's dataclass; the others take the defaults.
    max_rounds: generation rounds a step may take; when they do not fill the batch, the step
        trains on the groups kept (a warning says how many), or is skipped if none."""

    enable: bool = switch(field(default=False), off=False, turn_on="to true to filter groups")
    metric: str = choice("reward", ("reward", "acc"))
    max_rounds: int = ranged(10, ge=1)
    filters: list[str] = choice(kind="group_filter", default_factory=lambda: ["zero_variance"])
    filter_options: dict[str, Any] = field(default_factory=dict)


def group_filters(cfg: DynamicSamplingConfig, registry: Registry) -> list[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """The filters ``cfg.filters`` names, each as ``f(values, groups) -> keep`` with its checked
    options bound; options for a filter not listed, or for one that takes none, are refused."""
    key = "algorithm.dynamic_sampling.filter_options"
    for name in cfg.filter_options:
        if name not in cfg.filters:
            raise ConfigError(
                f"config key '{key}.{name}' gives options to a filter that algorithm.dynamic_sampling.filters ({list(cfg.filters)}) "
                f"does not list, so they would be ignored; add {name} to the filters or drop its options"
            )
    out = []
    for name in cfg.filters:
        entry = registry.get("group_filter", name)
        options = checked_options(entry, cfg.filter_options.get(name), registry, f"{key}.{name}")
        out.append(entry.obj if entry.options is None else _with_options(entry.obj, options))
    return out


def _with_options(f: Callable, options: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return lambda values, groups: f(values, groups, options)


def kept_groups(filters: list, values: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """``(groups,)`` bool: the groups every filter keeps."""
    keep = torch.ones(int(groups.max()) + 1, dtype=torch.bool)
    for f in filters:
        keep &= f(values, groups)
    return keep


def group_has_signal(scores: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """``(groups,)`` bool: whether the samples of each group differ in ``scores`` ``(batch,)``;
    ``groups`` ``(batch,)`` numbers the groups from 0. Registered as group filter ``zero_variance``."""
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
    the reward metrics describe; None when carried groups filled the step) and the
    ``dynamic_sampling/*`` metrics. ``batch`` is None when no group was kept. ``leftover``: the
    kept groups beyond the target, in order (each a ``(batch, reward result)`` part)."""

    batch: Batch | None
    scores: torch.Tensor | None
    components: dict[str, torch.Tensor] | None
    first: RewardResult | None
    metrics: dict[str, float]
    leftover: list[tuple[Batch, RewardResult]]


Part = tuple[Batch, RewardResult]


def fill(
    generate: Callable[[int], Part],
    groups_wanted: int,
    cfg: DynamicSamplingConfig,
    step: int,
    group_multiple: int = 1,
    filters: Sequence[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = (group_has_signal,),
    carried: Sequence[Part] = (),
) -> Filled:
    """Take the groups ``carried`` over (kept by an earlier step's rounds), then call
    ``generate(round)`` (new prompts each call, their samples and rewards) until the groups every
    filter keeps reach ``groups_wanted`` (then cut to exactly that many, in the order generated;
    the rest are ``leftover``) or ``cfg.max_rounds`` rounds ran. Short of the target, the kept
    groups are cut to a multiple of ``group_multiple`` (what the batch must divide into) and a
    warning says how many remain."""
    kept: list[Part] = []
    leftover: list[Part] = []
    count = dropped = rounds = 0
    first = None

    def keep(batch: Batch, scored: RewardResult, chosen: torch.Tensor) -> None:
        """Groups ``chosen`` of a part towards the target, the rest of them left over."""
        nonlocal count
        groups = batch.group_index("uid")
        needed, rest = chosen[: groups_wanted - count], chosen[groups_wanted - count :]
        count += len(needed)
        for into, which in ((kept, needed), (leftover, rest)):
            rows = torch.isin(groups, which)
            if rows.any():
                into.append(_take(batch, scored, rows))

    for batch, scored in carried:
        keep(batch, scored, torch.arange(int(batch.group_index("uid").max()) + 1))
    while count < groups_wanted and rounds < cfg.max_rounds:
        batch, scored = generate(rounds)
        rounds += 1
        first = first or scored
        batch["token_scores"] = scored.token_scores
        signal = kept_groups(filters, metric_values(scored, cfg.metric), batch.group_index("uid"))
        dropped += int((~signal).sum())
        keep(batch, scored, signal.nonzero().flatten())
    if count < groups_wanted:
        usable = count - count % group_multiple
        log.warning(
            "step %d: dynamic sampling found %d of data.train_batch_prompts=%d prompt groups that algorithm.dynamic_sampling.filters "
            "keep (on the %s) in algorithm.dynamic_sampling.max_rounds=%d rounds; %s (raise max_rounds, or check that the reward "
            "can vary)",
            step,
            count,
            groups_wanted,
            cfg.metric,
            cfg.max_rounds,
            f"training on {usable} groups" + (f" (a multiple of {group_multiple})" if usable != count else "") if usable else "skipping the step",
        )
        kept, count = _first_groups(kept, usable), usable
    metrics = {
        "dynamic_sampling/rounds": float(rounds),
        "dynamic_sampling/kept_groups": float(count),
        "dynamic_sampling/dropped_groups": float(dropped),
        "dynamic_sampling/carried_groups": float(sum(int(b.group_index("uid").max()) + 1 for b, _ in carried)),
    }
    if not count:
        return Filled(None, None, None, first, metrics, leftover)
    keys = sorted({k for _, s in kept for k in s.components})
    components = {k: torch.cat([s.components.get(k, torch.zeros(len(s.scores))) for _, s in kept]) for k in keys}
    batch = Batch.cat([b for b, _ in kept], pad=True)
    return Filled(batch, torch.cat([s.scores for _, s in kept]), components or None, first, metrics, leftover)


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
