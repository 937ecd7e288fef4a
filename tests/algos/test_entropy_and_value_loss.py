"""Entropy from logits (stable, chunked) and the clipped critic loss, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trellis.interfaces.hf import entropy_from_logits
from trellis.interfaces.signatures import Aggregation
from trellis_algos.entropy import entropy_loss
from trellis_algos.value_loss import clipped_value_loss

TOKEN_MEAN = Aggregation("token-mean")


def test_entropy_by_hand():
    # uniform over 4: ln 4; p = (1/4, 3/4) from logits (0, ln 3): ln 4 - (3/4) ln 3
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -math.inf, -math.inf]])
    h = entropy_from_logits(logits)
    assert h.tolist() == pytest.approx([math.log(4), math.log(4) - 0.75 * math.log(3)])


def test_entropy_is_stable_for_huge_and_banned_logits():
    # two equal huge logits: ln 2, no overflow; a -inf logit is a zero-probability token
    logits = torch.tensor([[1000.0, 1000.0, -math.inf]], requires_grad=True)
    h = entropy_from_logits(logits)
    assert h.item() == pytest.approx(math.log(2))
    h.sum().backward()
    assert torch.all(torch.isfinite(logits.grad))


def test_entropy_chunked_matches_in_value_and_gradient():
    torch.manual_seed(0)
    base = 3 * torch.randn(2, 5, 7, dtype=torch.float64)
    whole = base.clone().requires_grad_(True)
    chunked = base.clone().requires_grad_(True)
    h_whole = entropy_from_logits(whole)
    h_chunked = entropy_from_logits(chunked, chunk_size=3)
    torch.testing.assert_close(h_chunked, h_whole)
    weights = torch.randn(2, 5, dtype=torch.float64)
    (h_whole * weights).sum().backward()
    (h_chunked * weights).sum().backward()
    torch.testing.assert_close(chunked.grad, whole.grad)
    with torch.no_grad():
        torch.testing.assert_close(entropy_from_logits(base, chunk_size=4), h_whole.detach())


def test_entropy_of_low_precision_logits_is_float32():
    logits = torch.zeros(3, 8, dtype=torch.bfloat16)
    h = entropy_from_logits(logits, chunk_size=2)
    assert h.dtype == torch.float32 and h.tolist() == pytest.approx([math.log(8)] * 3)


def test_entropy_loss_is_the_aggregated_entropy():
    # entropies ln2 and ln4 on valid tokens, the third masked: token-mean (ln2 + ln4) / 2 = 1.5 ln2
    ent = torch.tensor([[math.log(2), math.log(4), 9.0]])
    assert entropy_loss(ent, torch.tensor([[1, 1, 0]]), TOKEN_MEAN).item() == pytest.approx(1.5 * math.log(2))


def test_clipped_value_loss_by_hand():
    # c = .5
    # t0: V 1, V_old 0, R 2: V_clip = 0 + clip(1) = .5; (1-2)^2 = 1, (.5-2)^2 = 2.25 -> 2.25 (clipped)
    # t1: V 0, V_old 1, R 2: V_clip = .5; (0-2)^2 = 4, (.5-2)^2 = 2.25 -> 4 (unclipped)
    # loss = .5 * (2.25 + 4) / 2 = 1.5625; gradient: t0 0 (clip saturated), t1 .5 * 2 (0 - 2) / 2 = -1
    vpreds = torch.tensor([[1.0, 0.0, 3.0]], requires_grad=True)
    loss, metrics = clipped_value_loss(
        vpreds,
        torch.tensor([[2.0, 2.0, 0.0]]),
        torch.tensor([[0.0, 1.0, 0.0]]),
        torch.tensor([[1, 1, 0]]),
        TOKEN_MEAN,
        0.5,
    )
    assert loss.item() == pytest.approx(1.5625)
    assert metrics["vf_clip_frac"] == 0.5 and metrics["vpred_mean"] == pytest.approx(0.5)
    loss.backward()
    assert vpreds.grad.tolist() == [[0.0, -1.0, 0.0]]
