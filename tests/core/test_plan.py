"""The batch plan's token-budget micro-batches: samples go longest first, so a micro-batch holds
samples of about one length and the padding the forwards compute shrinks."""

from __future__ import annotations

import torch

from trellis.batch import Batch
from trellis.runtime.plan import Plan


def rl_rows(prompts: list[int], responses: list[int], width: int = 4) -> Batch:
    """Left-padded prompts and right-padded responses of these lengths, ``width`` columns each."""
    rows = [[0] * (width - p) + [1] * p + [1] * r + [0] * (width - r) for p, r in zip(prompts, responses)]
    return Batch({"attention_mask": torch.tensor(rows), "id": torch.arange(len(rows))})


def padded_tokens(micros: list[Batch]) -> int:
    return sum(m["attention_mask"].numel() for m in micros)


def test_length_order_is_longest_first_and_only_with_a_budget():
    batch = rl_rows([2, 4, 1, 3], [1, 4, 4, 2])  # spans 3, 8, 5, 5
    assert Plan(max_tokens_per_micro_batch=16).length_order(batch).tolist() == [1, 2, 3, 0]  # ties keep their order
    assert Plan(micro_batch_samples=2).length_order(batch) is None


def test_micro_batches_in_length_order_pad_less_and_keep_every_sample_once():
    # as in RL: prompts of about one length, responses from 1 token to the limit
    g = torch.Generator().manual_seed(0)
    batch = rl_rows(torch.randint(5, 8, (32,), generator=g).tolist(), torch.randint(1, 33, (32,), generator=g).tolist(), width=32)
    plan = Plan(max_tokens_per_micro_batch=160)
    consecutive = plan.micro_batches(batch)
    ordered = plan.micro_batches(batch.reorder(plan.length_order(batch)))
    assert all(padded_tokens([m]) <= 160 or len(m) == 1 for m in ordered)
    assert sorted(torch.cat([m["id"] for m in ordered]).tolist()) == list(range(32))
    attended = int(batch["attention_mask"].sum())
    # the forwards compute on the padded micro-batches: far fewer wasted columns in length order
    assert padded_tokens(ordered) - attended < 0.5 * (padded_tokens(consecutive) - attended)
