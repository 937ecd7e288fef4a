"""Token entropy from logits (numerically stable, optionally chunked) and the entropy bonus term."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from trellis.signatures import Aggregation
from trellis_algos.aggregation import agg_loss


def _entropy_rows(logits: torch.Tensor) -> torch.Tensor:
    """``-sum_v p log p`` over the last dim, in float32 (or wider), from ``log_softmax`` so large
    logits do not overflow; ``-inf`` logits (banned tokens) contribute 0 instead of ``nan``."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    log_p = torch.log_softmax(logits, dim=-1)
    p = log_p.exp()
    log_p = log_p.masked_fill(torch.isneginf(log_p), 0.0)
    return -(p * log_p).sum(dim=-1)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """Entropy of the categorical distribution of every position: ``(..., vocab) -> (...)``.

    The result is float32 (float64 for float64 logits). With ``chunk_size``, rows (positions) are
    processed ``chunk_size`` at a time, so at most one chunk's ``(chunk, vocab)`` float32
    temporaries exist at once; when a gradient is needed, each chunk is checkpointed (its softmax is
    recomputed in the backward pass instead of kept), which is what bounds memory in training.
    """
    if chunk_size is None:
        return _entropy_rows(logits)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    rows = logits.reshape(-1, logits.shape[-1])
    keep_graph = torch.is_grad_enabled() and rows.requires_grad
    parts = [
        checkpoint(_entropy_rows, chunk, use_reentrant=False) if keep_graph else _entropy_rows(chunk)
        for chunk in rows.split(chunk_size, dim=0)
    ]
    out = torch.cat(parts) if parts else rows.new_zeros(0, dtype=torch.promote_types(rows.dtype, torch.float32))
    return out.reshape(logits.shape[:-1])


def entropy_loss(token_entropy: torch.Tensor, response_mask: torch.Tensor, agg: Aggregation) -> torch.Tensor:
    """The entropy bonus term: token entropies aggregated like the policy loss. The actor's total
    loss is ``pg_loss - entropy_coeff * entropy_loss`` (maximising entropy)."""
    return agg_loss(token_entropy, response_mask, agg)
