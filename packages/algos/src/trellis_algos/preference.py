"""Preference losses (kind ``preference_loss``: sigmoid, ipo) and chosen/rejected pairs from scored groups."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from trellis import PreferenceInputs, ranged
from trellis_algos.stats import group_index


@dataclass
class SigmoidOptions:
    """beta: inverse temperature; label_smoothing: eps of conservative DPO (cDPO);
    reference_free: drop the reference log-ratio."""

    beta: float = ranged(0.1, gt=0)
    label_smoothing: float = ranged(0.0, ge=0, lt=0.5)
    reference_free: bool = False


@dataclass
class IPOOptions:
    """beta: regularisation (the target margin is 1 / (2 beta)); reference_free: drop the reference."""

    beta: float = ranged(0.1, gt=0)
    reference_free: bool = False


def _margin(data: PreferenceInputs, reference_free: bool) -> torch.Tensor:
    """``x = (chosen - rejected) - (ref_chosen - ref_rejected)``, or without the reference."""
    x = data.chosen - data.rejected
    return x if reference_free else x - (data.ref_chosen - data.ref_rejected)


def _metrics(data: PreferenceInputs, beta: float, reference_free: bool, loss: torch.Tensor) -> dict[str, float]:
    """Implicit rewards ``beta (logp - logp_ref)`` of chosen and rejected, their margin and how
    often chosen wins (``reward_accuracy``)."""
    with torch.no_grad():
        chosen = beta * (data.chosen if reference_free else data.chosen - data.ref_chosen)
        rejected = beta * (data.rejected if reference_free else data.rejected - data.ref_rejected)
        return {
            "loss": float(loss.item()),
            "reward_chosen": float(chosen.mean().item()),
            "reward_rejected": float(rejected.mean().item()),
            "reward_margin": float((chosen - rejected).mean().item()),
            "reward_accuracy": float((chosen > rejected).float().mean().item()),
        }


def sigmoid(data: PreferenceInputs, options: SigmoidOptions | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """DPO: ``-log sigmoid(beta x) (1 - eps) - log sigmoid(-beta x) eps``, mean over pairs."""
    opts = options if options is not None else SigmoidOptions()
    x = _margin(data, opts.reference_free)
    losses = -F.logsigmoid(opts.beta * x) * (1.0 - opts.label_smoothing) - F.logsigmoid(-opts.beta * x) * opts.label_smoothing
    loss = losses.mean()
    return loss, _metrics(data, opts.beta, opts.reference_free, loss)


def ipo(data: PreferenceInputs, options: IPOOptions | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """IPO: ``(x - 1 / (2 beta))^2``, mean over pairs."""
    opts = options if options is not None else IPOOptions()
    if opts.beta <= 0:
        raise ValueError(f"ipo: beta must be > 0, got {opts.beta}")
    x = _margin(data, opts.reference_free)
    loss = ((x - 1.0 / (2.0 * opts.beta)) ** 2).mean()
    return loss, _metrics(data, opts.beta, opts.reference_free, loss)


def make_pairs(scores: torch.Tensor, group_ids: torch.Tensor | Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One pair per group of scored samples: chosen = best score, rejected = worst (the first
    such sample on ties). A group whose scores are all equal, a group of one included, gives no
    pair and is counted in ``skipped_ties``. Returns ``(chosen_idx, rejected_idx, skipped_ties)``,
    index tensors ``(pairs,)`` in group order (sorted ids for a tensor, first appearance else)."""
    inverse, n_groups = group_index(group_ids, scores.device)
    if inverse.numel() != scores.shape[0]:
        raise ValueError(f"group_ids has {inverse.numel()} entries but there are {scores.shape[0]} scores")
    chosen, rejected, skipped = [], [], 0
    for g in range(n_groups):
        members = torch.nonzero(inverse == g, as_tuple=True)[0]
        group_scores = scores[members]
        best, worst = group_scores.max(), group_scores.min()
        if not bool(best > worst):
            skipped += 1
            continue
        # argmax/argmin of the first occurrence: nonzero is in index order.
        chosen.append(members[torch.nonzero(group_scores == best, as_tuple=True)[0][0]])
        rejected.append(members[torch.nonzero(group_scores == worst, as_tuple=True)[0][0]])
    empty = torch.zeros(0, dtype=torch.long, device=scores.device)
    return (torch.stack(chosen) if chosen else empty, torch.stack(rejected) if rejected else empty, skipped)


# name -> (loss, options dataclass); plugin.py registers these.
LOSSES = {
    "sigmoid": (sigmoid, SigmoidOptions),
    "ipo": (ipo, IPOOptions),
}
