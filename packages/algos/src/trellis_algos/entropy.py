"""The entropy bonus term (token entropies come from the backend: ``trellis.interfaces.hf``)."""

from __future__ import annotations

import torch

from trellis import Aggregation
from trellis_algos.aggregation import agg_loss


def entropy_loss(token_entropy: torch.Tensor, response_mask: torch.Tensor, agg: Aggregation) -> torch.Tensor:
    """The entropy bonus term: token entropies aggregated like the policy loss. The actor's total
    loss is ``pg_loss - entropy_coeff * entropy_loss`` (maximising entropy)."""
    return agg_loss(token_entropy, response_mask, agg)
