"""Batches of decoded responses for reward tests (tests/core, tests/judges)."""

from __future__ import annotations

import torch

from trellis.batch import Batch


def responses(tok, texts, width=10, ground_truth="46"):
    """Right-padded responses ``(n, width)`` with their mask, plus the prompt fields a reward reads."""
    ids = torch.zeros(len(texts), width, dtype=torch.long)
    mask = torch.zeros(len(texts), width, dtype=torch.long)
    for i, t in enumerate(texts):
        x = tok(t, add_special_tokens=False)["input_ids"]
        ids[i, : len(x)], mask[i, : len(x)] = torch.tensor(x), 1
    n = len(texts)
    return Batch(
        {"responses": ids, "response_mask": mask},
        {"data_source": ["arithmetic"] * n, "ground_truth": [ground_truth] * n, "extra_info": [{"i": i} for i in range(n)]},
    )
