"""Clipped value-function loss for the PPO critic."""

from __future__ import annotations

import torch

from trellis import Aggregation
from trellis_algos.aggregation import agg_loss
from trellis_algos.stats import masked_mean


def clipped_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    response_mask: torch.Tensor,
    agg: Aggregation,
    cliprange_value: float = 0.5,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``0.5 * agg(max((V - R)^2, (V_clip - R)^2))`` with ``V_clip = V_old + clip(V - V_old, -c, c)``
    (as verl / TRL). Metrics: ``vf_loss``, ``vf_clip_frac`` (clipped term larger), ``vpred_mean``."""
    clipped = old_values + torch.clamp(vpreds - old_values, -cliprange_value, cliprange_value)
    plain_loss = (vpreds - returns) ** 2
    clipped_loss = (clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(plain_loss, clipped_loss), response_mask, agg)
    return loss, {
        "vf_loss": float(loss.item()),
        "vf_clip_frac": float(masked_mean((clipped_loss > plain_loss).float(), response_mask).item()),
        "vpred_mean": float(masked_mean(vpreds.detach(), response_mask).item()),
    }
