"""SFT losses (kind ``sft_loss``) on per-token label log-probs: cross_entropy and dft."""

from __future__ import annotations

import torch

from trellis import Aggregation
from trellis_algos.aggregation import agg_loss
from trellis_algos.stats import masked_mean


def cross_entropy(
    token_log_probs: torch.Tensor, loss_mask: torch.Tensor, agg: Aggregation, options: None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative log-likelihood of the labels: ``agg(-logp)``. Metric: ``loss``."""
    loss = agg_loss(-token_log_probs, loss_mask, agg)
    return loss, {"loss": float(loss.item())}


def dft(token_log_probs: torch.Tensor, loss_mask: torch.Tensor, agg: Aggregation, options: None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Dynamic Fine-Tuning: each token's cross-entropy times its own predicted probability,
    detached: ``agg(-sg(p) logp)`` with ``p = exp(logp)`` (= ``softmax(logits).gather(label)``).
    Metrics: ``loss``, ``token_prob_mean`` (mean ``p`` over counted tokens)."""
    prob = token_log_probs.detach().exp()
    loss = agg_loss(-prob * token_log_probs, loss_mask, agg)
    return loss, {"loss": float(loss.item()), "token_prob_mean": float(masked_mean(prob, loss_mask).item())}


# name -> (loss, options dataclass or None); plugin.py registers these.
LOSSES = {
    "cross_entropy": (cross_entropy, None),
    "dft": (dft, None),
}
