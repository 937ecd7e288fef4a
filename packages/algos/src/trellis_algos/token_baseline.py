"""Optimal token baselines (kind ``advantage``): ``optimal_token_baseline`` and its multi-turn form
``tir_optimal_token_baseline``, a baseline per token weighted by each path's accumulated variance.

For sample ``i`` and valid token ``t``: ``w_it = 1 - 2 pi_it + sum_v pi_v^2`` (``pi_it`` the
behaviour policy's probability of the token, ``exp(old_log_probs)``; ``sum_sq_probs`` the sum over
the vocabulary), the squared norm of the token's score function w.r.t. the logits; ``W_it`` = sum
of ``w`` over the sample's valid tokens up to ``t``; ``G_it`` = sum of its valid-token rewards
from ``t`` on. Within a group of at least two samples, ``B_t = sum_i G_it W_it / (sum_i W_it +
epsilon)`` over the samples valid at ``t``, and ``A_it = G_it - B_t``; a sample alone in its group
gets ``B = 0``. Returns are ``G``. Everything is ``(batch, response_len)``, zero where masked, and
runs without gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trellis import AdvantageInputs, ranged
from trellis_algos.advantages import require_inputs
from trellis_algos.stats import group_index


@dataclass
class TokenBaselineOptions:
    """handle_zero_tail: when a group's longest sample is longer than all the others, its
    baseline is 0 past the second-longest length (no other sample informs it there); epsilon:
    added to the baseline's denominator."""

    handle_zero_tail: bool = True
    epsilon: float = ranged(1e-8, ge=0)


def _path_terms(data: AdvantageInputs, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G, W)``: reward-to-go and cumulative path variance, each ``(batch, response_len)``."""
    require_inputs(data, name, ("old_log_probs", "sum_sq_probs"))
    valid = data.response_mask.bool()
    zero = torch.zeros((), dtype=data.token_rewards.dtype, device=data.token_rewards.device)
    rewards = torch.where(valid, data.token_rewards, zero)
    returns = rewards.flip(-1).cumsum(-1).flip(-1)
    w = 1 - 2 * data.old_log_probs.to(zero.dtype).exp() + data.sum_sq_probs.to(zero.dtype)
    return returns, torch.where(valid, w, zero).cumsum(-1)


def _group_baseline(
    returns: torch.Tensor,
    path: torch.Tensor,
    valid: torch.Tensor,
    group_ids: torch.Tensor,
    members: torch.Tensor,
    opts: TokenBaselineOptions,
) -> torch.Tensor:
    """``B`` ``(batch, len)``: ``sum_i G_it W_it / (sum_i W_it + epsilon)`` over the ``members``
    ``(batch,)`` of each group valid at position ``t``; 0 for non-members and groups of one member."""
    inverse, n_groups = group_index(group_ids, returns.device)
    weight = torch.where(valid & members[:, None], path, torch.zeros_like(path))
    num = returns.new_zeros(n_groups, returns.shape[1]).index_add_(0, inverse, returns * weight)
    den = returns.new_zeros(n_groups, returns.shape[1]).index_add_(0, inverse, weight)
    size = torch.bincount(inverse[members], minlength=n_groups)
    baseline = (num / (den + opts.epsilon))[inverse]
    baseline = torch.where((members & (size[inverse] > 1))[:, None], baseline, torch.zeros_like(baseline))
    if opts.handle_zero_tail:
        lengths = valid.sum(-1)
        for g in range(n_groups):
            rows = torch.nonzero((inverse == g) & members, as_tuple=True)[0]
            if rows.numel() < 2:
                continue
            top = torch.topk(lengths[rows], 2)
            if top.values[0] > top.values[1]:
                baseline[rows[top.indices[0]], int(top.values[1]) :] = 0
    return baseline


@torch.no_grad()
def optimal_token_baseline(data: AdvantageInputs, options: TokenBaselineOptions | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal token baseline: ``B_t`` across a group's samples at the same response position
    ``t`` (every sample of the group is a member, also an empty one). Returns = ``G``."""
    opts = options if options is not None else TokenBaselineOptions()
    returns, path = _path_terms(data, "optimal_token_baseline")
    valid = data.response_mask.bool()
    members = torch.ones(valid.shape[0], dtype=torch.bool, device=valid.device)
    baseline = _group_baseline(returns, path, valid, data.group_ids, members, opts)
    zero = torch.zeros_like(returns)
    return torch.where(valid, returns - baseline, zero), torch.where(valid, returns, zero)


def _compact(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each row's valid entries moved to its front, in order, zeros after: ``(batch, len)``."""
    rows, cols = valid.nonzero(as_tuple=True)
    out = torch.zeros_like(x)
    out[rows, (valid.cumsum(-1) - 1)[rows, cols]] = x[rows, cols]
    return out


def _spread(compact: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_compact`: entry ``k`` of a row back on its ``k``-th valid token."""
    rows, cols = valid.nonzero(as_tuple=True)
    out = torch.zeros_like(compact)
    out[rows, cols] = compact[rows, (valid.cumsum(-1) - 1)[rows, cols]]
    return out


@torch.no_grad()
def tir_optimal_token_baseline(data: AdvantageInputs, options: TokenBaselineOptions | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal token baseline for multi-turn (tool-integrated) responses: ``t`` counts a sample's
    *valid* tokens, so environment tokens do not shift the alignment between samples; samples
    without a valid token are not group members. Returns = ``G``."""
    opts = options if options is not None else TokenBaselineOptions()
    returns, path = _path_terms(data, "tir_optimal_token_baseline")
    valid = data.response_mask.bool()
    lengths = valid.sum(-1)
    packed = torch.arange(valid.shape[1], device=valid.device) < lengths[:, None]
    packed_returns = _compact(returns, valid)
    baseline = _group_baseline(packed_returns, _compact(path, valid), packed, data.group_ids, lengths > 0, opts)
    return _spread(packed_returns - baseline, valid), torch.where(valid, returns, torch.zeros_like(returns))


# name -> (estimator, options dataclass); plugin.py registers these.
ESTIMATORS = {
    "optimal_token_baseline": (optimal_token_baseline, TokenBaselineOptions),
    "tir_optimal_token_baseline": (tir_optimal_token_baseline, TokenBaselineOptions),
}

optimal_token_baseline.needs = ("old_log_probs", "sum_sq_probs", "groups")
tir_optimal_token_baseline.needs = ("old_log_probs", "sum_sq_probs", "groups")
