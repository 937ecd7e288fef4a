"""Loss aggregation: token losses ``(batch, response_len)`` to one scalar, normalised by the global batch.

Every mode divides by a count of the *whole* mini-batch when the :class:`~trellis.interfaces.signatures.Aggregation`
carries one (``global_tokens`` / ``global_seqs``), so the scalar returned for a micro-batch is that
micro-batch's share: summing the losses (and so the gradients) of all micro-batches gives exactly
the loss and gradient of the mini-batch in one piece. Use :func:`aggregation_for` on the full
mini-batch mask (``trellis.interfaces.signatures``, re-exported here) to build such an ``Aggregation``.

Data parallelism: the counts must then be global over ranks (all-reduce them first). Summing the
ranks' losses gives the mini-batch loss; a backend that *averages* gradients over ranks must
multiply each rank's loss by the world size (verl's ``dp_size`` factor).
"""

from __future__ import annotations

import torch

from trellis import AGG_MODES, Aggregation, aggregation_for  # noqa: F401 - aggregation_for is re-exported
from trellis_algos.stats import masked_count, masked_sum

MODES = AGG_MODES


def _divide(total: torch.Tensor, global_count: float | None, local_count: torch.Tensor, what: str) -> torch.Tensor:
    if global_count is not None:
        if global_count < 0:
            raise ValueError(f"Aggregation.{what} must be >= 0, got {global_count}")
        # A mini-batch with nothing to count has a zero loss (and keeps the graph).
        return total / global_count if global_count > 0 else total * 0.0
    # An empty micro-batch contributes 0 (and keeps the graph) instead of 0/0.
    return total / local_count.to(total.dtype).clamp(min=1)


def seq_mean(seq_losses: torch.Tensor, seq_valid: torch.Tensor, global_seqs: float | None = None) -> torch.Tensor:
    """Sum of per-sequence losses over valid sequences, divided by ``global_seqs`` (or by the
    number of valid sequences here). Sequences without any valid token do not count (as verl)."""
    return _divide(masked_sum(seq_losses, seq_valid), global_seqs, masked_count(seq_valid), "global_seqs")


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, agg: Aggregation | None = None) -> torch.Tensor:
    """Aggregate ``loss_mat`` ``(batch, response_len)`` over ``mask`` into a scalar.

    - ``token-mean``: sum over valid tokens / ``global_tokens`` (default: valid tokens here).
    - ``token-sum``: sum over valid tokens (no normaliser: the micro-batches' sums add up).
    - ``seq-mean-token-sum``: per-sequence token sum, summed / ``global_seqs``.
    - ``seq-mean-token-mean``: per-sequence token mean, summed / ``global_seqs``.
    - ``seq-mean-token-sum-norm`` (Dr. GRPO): per-sequence token sum / ``norm_constant``,
      summed / ``global_seqs``. ``aggregation_for`` sets ``norm_constant`` to the mini-batch's
      width (or the configured constant); without it, ``loss_mat.shape[-1]`` (this micro-batch's).

    ``global_seqs`` defaults to the number of sequences here that have at least one valid token.
    """
    agg = agg if agg is not None else Aggregation()
    mode = agg.mode
    if mode not in MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes: {', '.join(MODES)}")
    if mode == "token-mean":
        return _divide(masked_sum(loss_mat, mask), agg.global_tokens, masked_count(mask), "global_tokens")
    if mode == "token-sum":
        return masked_sum(loss_mat, mask)
    seq_tokens = masked_count(mask, dim=-1)
    token_sums = masked_sum(loss_mat, mask, dim=-1)
    if mode == "seq-mean-token-sum":
        seq_losses = token_sums
    elif mode == "seq-mean-token-mean":
        seq_losses = token_sums / seq_tokens.to(token_sums.dtype).clamp(min=1)
    else:  # seq-mean-token-sum-norm
        norm = agg.norm_constant if agg.norm_constant is not None else loss_mat.shape[-1]
        if norm <= 0:
            raise ValueError(f"Aggregation.norm_constant must be > 0, got {norm}")
        seq_losses = token_sums / norm
    return seq_mean(seq_losses, seq_tokens > 0, agg.global_seqs)
