"""Loss aggregation: hand-computed values per mode, and micro-batch invariance of loss and gradient."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trellis.interfaces.signatures import Aggregation
from trellis_algos.aggregation import MODES, agg_loss, aggregation_for

FAST = settings(max_examples=50, deadline=None)

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize(
    ("agg", "expected"),
    [
        # valid tokens 1, 2 | 4: (1 + 2 + 4) / 3 tokens
        (Aggregation("token-mean"), 7 / 3),
        # same sum over a global count of 7 tokens
        (Aggregation("token-mean", global_tokens=7.0), 1.0),
        # the plain sum of the valid tokens, whatever the counts
        (Aggregation("token-sum"), 7.0),
        (Aggregation("token-sum", global_tokens=7.0, global_seqs=4.0), 7.0),
        # sequence sums 3 and 4, mean over 2 sequences
        (Aggregation("seq-mean-token-sum"), 3.5),
        (Aggregation("seq-mean-token-sum", global_seqs=4.0), 7 / 4),
        # sequence means 1.5 and 4, mean over 2 sequences
        (Aggregation("seq-mean-token-mean"), 2.75),
        # sequence sums / padded length 3, mean over 2: (1 + 4/3) / 2
        (Aggregation("seq-mean-token-sum-norm"), 7 / 6),
        # with a constant 2: (1.5 + 2) / 2
        (Aggregation("seq-mean-token-sum-norm", norm_constant=2.0), 1.75),
    ],
)
def test_modes_by_hand(agg, expected):
    assert agg_loss(LOSS, MASK, agg).item() == pytest.approx(expected)


def test_default_is_token_mean():
    assert agg_loss(LOSS, MASK).item() == pytest.approx(7 / 3)


def test_fully_masked_sequence_does_not_count_and_masked_nan_is_ignored():
    loss = torch.tensor([[1.0, 1.0], [float("nan"), 9.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    # only the first sequence counts: its sum 2 over 1 sequence
    assert agg_loss(loss, mask, Aggregation("seq-mean-token-sum")).item() == 2.0
    assert agg_loss(loss, mask, Aggregation("token-mean")).item() == 1.0


def test_empty_mask_gives_zero_with_a_graph():
    x = torch.ones(2, 3, requires_grad=True)
    for mode in MODES:
        loss = agg_loss(x * 2, torch.zeros(2, 3), Aggregation(mode))
        assert loss.item() == 0.0
        loss.backward()
        assert x.grad.abs().sum() == 0


def test_unknown_mode_and_bad_count():
    with pytest.raises(ValueError, match="valid modes"):
        agg_loss(LOSS, MASK, Aggregation("token-total"))
    with pytest.raises(ValueError, match="global_tokens"):
        agg_loss(LOSS, MASK, Aggregation("token-mean", global_tokens=-1.0))


def test_aggregation_for_counts_the_full_batch():
    agg = aggregation_for("seq-mean-token-mean", torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]]), norm_constant=8.0)
    # 3 valid tokens, 2 sequences with at least one valid token
    assert (agg.mode, agg.global_tokens, agg.global_seqs, agg.norm_constant) == ("seq-mean-token-mean", 3.0, 2.0, 8.0)
    # without a constant, Dr. GRPO's divisor is the mini-batch's width, 3 columns
    assert aggregation_for("seq-mean-token-sum-norm", torch.ones(2, 3)).norm_constant == 3.0


@st.composite
def batches(draw):
    b = draw(st.integers(1, 6))
    t = draw(st.integers(1, 5))
    values = draw(st.lists(st.floats(-10, 10), min_size=b * t, max_size=b * t))
    mask = draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))
    cuts = sorted(set(draw(st.lists(st.integers(1, b), max_size=3))) | {b})
    return torch.tensor(values, dtype=torch.float64).reshape(b, t), torch.tensor(mask).reshape(b, t), cuts


@FAST
@given(batches(), st.sampled_from(MODES))
def test_micro_batches_sum_to_the_mini_batch(batch, mode):
    """Cut into micro-batches of rows, each trimmed to its own width, the losses and gradients add up."""
    values, mask, cuts = batch
    whole = values.clone().requires_grad_(True)
    full = agg_loss(whole * whole, mask, Aggregation(mode))  # local counts == the batch's counts
    full.backward()

    parts = values.clone().requires_grad_(True)
    agg = aggregation_for(mode, mask)
    total, start = torch.zeros((), dtype=torch.float64), 0
    for end in cuts:
        # as the worker trims a micro-batch: the trailing columns masked in all its rows go
        used = mask[start:end].any(0).nonzero()
        width = int(used.max()) + 1 if len(used) else 1
        piece = parts[start:end, :width]
        total = total + agg_loss(piece * piece, mask[start:end, :width], agg)
        start = end
    total.backward()
    assert math.isclose(total.item(), full.item(), rel_tol=1e-9, abs_tol=1e-9)
    torch.testing.assert_close(parts.grad, whole.grad)
