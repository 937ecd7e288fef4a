"""Rollout batches built by hand in the layout every engine returns, for tests that merge, pad or
check them with prompts and responses of mixed widths."""

from __future__ import annotations

import torch

from trellis.batch import Batch
from trellis.data import left_pad
from trellis.interfaces.rollout import SamplingParams, samples_batch


def rollout_round(prompts: list[list[int]], responses: list[list[int]], first_uid: int = 0) -> Batch:
    """A generation round as every engine returns it (``rollout_batch``): prompts left-padded to
    this round's longest, responses right-padded to its longest, one sample per prompt."""
    ids, mask, pos = left_pad(prompts, 0)
    batch = Batch({"input_ids": ids, "attention_mask": mask, "position_ids": pos}, {"uid": [f"u{first_uid + i}" for i in range(len(prompts))]})
    out = samples_batch(batch, SamplingParams(), responses, [[-0.5] * len(r) for r in responses], 0)
    out["token_scores"] = torch.zeros(len(responses), out["responses"].shape[1])
    return out
