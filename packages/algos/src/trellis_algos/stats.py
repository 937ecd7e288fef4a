"""Masked statistics over (batch, response_len) tensors and per-group statistics over samples.

Every estimator and loss in this package uses these helpers; nothing else re-implements them.
A *mask* is 1 (or True) on tokens that count and 0 elsewhere; values at masked positions are
ignored even when they are ``nan`` or ``inf`` (they are selected away, not multiplied by zero).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

WHITEN_EPS = 1e-8


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set (over ``dim``, or over everything)."""
    kept = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_count(mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Number of set mask entries (over ``dim``, or over everything)."""
    m = mask.bool()
    return m.sum() if dim is None else m.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is set; 0 where nothing is set (verl adds 1e-8 to the
    count instead, which gives the same value up to rounding and 0 for an empty mask)."""
    count = masked_count(mask, dim).to(values.dtype)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the set entries, with Bessel's correction when ``unbiased`` (as verl).

    verl raises when exactly one entry is set; here one (or no) entry has variance 0, so that a
    batch holding a single valid token whitens to 0 instead of stopping the run.
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = masked_count(mask).to(values.dtype)
        var = torch.where(n > 1, var * n / (n - 1).clamp(min=1), torch.zeros_like(var))
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``(values - mean) / sqrt(var + 1e-8)`` over the set entries (unbiased var, as verl's
    ``masked_whiten``); masked positions come back as 0 (verl leaves them whitened too)."""
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


# -- groups of samples (the responses of one prompt) -----------------------------------------
def group_index(group_ids: torch.Tensor | Sequence[Any], device: torch.device | None = None) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids to ``0..G-1``: returns ``(inverse (batch,) long, G)``.

    Accepts an int tensor (the signature's form) or any sequence of hashable ids (verl passes
    numpy arrays of uid strings); groups are numbered by sorted id for tensors and by first
    appearance otherwise.
    """
    if isinstance(group_ids, torch.Tensor):
        _, inverse = torch.unique(group_ids.reshape(-1), return_inverse=True)
        n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
        return inverse.to(device if device is not None else group_ids.device), n_groups
    numbering: dict[Any, int] = {}
    inverse = [numbering.setdefault(g.item() if hasattr(g, "item") else g, len(numbering)) for g in group_ids]
    return torch.tensor(inverse, dtype=torch.long, device=device), len(numbering)


def group_sum(values: torch.Tensor, inverse: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Per-group sums ``(G,)`` of per-sample ``values`` ``(batch,)`` (computed in float64)."""
    out = torch.zeros(n_groups, dtype=torch.float64, device=values.device)
    return out.index_add_(0, inverse, values.to(torch.float64))


def group_mean_std(scores: torch.Tensor, group_ids: torch.Tensor | Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample ``(mean_g, std_g, size_g)`` of the sample's group, each ``(batch,)``.

    ``std_g`` is the unbiased (n - 1) standard deviation, as ``torch.std`` in verl. A group of
    one sample has mean 0 and std 1 (verl's convention: its advantage is its raw score).
    Statistics are accumulated in float64 and returned in ``scores.dtype`` (size as float).
    """
    inverse, n_groups = group_index(group_ids, scores.device)
    if inverse.numel() != scores.shape[0]:
        raise ValueError(f"group_ids has {inverse.numel()} entries but there are {scores.shape[0]} samples")
    x = scores.to(torch.float64)
    size = group_sum(torch.ones_like(x), inverse, n_groups)
    mean = group_sum(x, inverse, n_groups) / size
    sq = group_sum((x - mean[inverse]) ** 2, inverse, n_groups)
    std = torch.sqrt(sq / (size - 1).clamp(min=1))
    single = size == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[inverse].to(scores.dtype), std[inverse].to(scores.dtype), size[inverse].to(scores.dtype)
