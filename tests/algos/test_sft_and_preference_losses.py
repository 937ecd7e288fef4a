"""SFT losses (cross_entropy, dft) and preference losses (sigmoid, ipo, make_pairs), by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trellis.interfaces.signatures import Aggregation, PreferenceInputs
from trellis_algos.preference import IPOOptions, SigmoidOptions, ipo, make_pairs, sigmoid
from trellis_algos.sft_losses import cross_entropy, dft

TOKEN_MEAN = Aggregation("token-mean")
LN2 = math.log(2.0)


def label_log_probs():
    # label probabilities 1/2, 1/4 and a masked third token
    return torch.tensor([[math.log(0.5), math.log(0.25), -7.0]], requires_grad=True), torch.tensor([[1, 1, 0]])


def test_cross_entropy_by_hand():
    # -(ln 1/2 + ln 1/4) / 2 = (ln2 + 2 ln2) / 2; gradient -1/2 per counted token
    logp, mask = label_log_probs()
    loss, metrics = cross_entropy(logp, mask, TOKEN_MEAN)
    assert loss.item() == pytest.approx(1.5 * LN2) and metrics["loss"] == pytest.approx(1.5 * LN2)
    loss.backward()
    assert logp.grad.tolist() == [[-0.5, -0.5, 0.0]]


def test_dft_by_hand():
    # -sg(p) ln p: 1/2 ln2 and 1/4 * 2 ln2 = 1/2 ln2 -> mean 1/2 ln2; gradient -p / 2 = -1/4, -1/8
    logp, mask = label_log_probs()
    loss, metrics = dft(logp, mask, TOKEN_MEAN)
    assert loss.item() == pytest.approx(0.5 * LN2)
    assert metrics["token_prob_mean"] == pytest.approx(0.375)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.25, -0.125, 0.0]]))


def pair(chosen=-1.0, rejected=-2.0, ref_chosen=-1.5, ref_rejected=-2.0):
    t = lambda v: torch.tensor([v])  # noqa: E731
    return PreferenceInputs(t(chosen), t(rejected), t(ref_chosen), t(ref_rejected))


def test_sigmoid_by_hand():
    # x = (-1 - -2) - (-1.5 - -2) = 1 - .5 = .5; beta 2: -log sigmoid(1) = log(1 + e^-1)
    loss, metrics = sigmoid(pair(), SigmoidOptions(beta=2.0))
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-1)))
    # implicit rewards 2 * (-1 + 1.5) = 1 and 2 * (-2 + 2) = 0
    assert metrics["reward_chosen"] == pytest.approx(1.0) and metrics["reward_rejected"] == 0.0
    assert metrics["reward_margin"] == pytest.approx(1.0) and metrics["reward_accuracy"] == 1.0
    # label smoothing .1: .9 log(1 + e^-1) + .1 log(1 + e^1)
    loss, _ = sigmoid(pair(), SigmoidOptions(beta=2.0, label_smoothing=0.1))
    assert loss.item() == pytest.approx(0.9 * math.log(1 + math.exp(-1)) + 0.1 * math.log(1 + math.e))
    # reference-free: x = 1, beta 2 -> log(1 + e^-2)
    loss, _ = sigmoid(pair(), SigmoidOptions(beta=2.0, reference_free=True))
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-2)))


def test_ipo_by_hand():
    # x = .5, beta .5: (x - 1/(2 beta))^2 = (.5 - 1)^2; reference-free x = 1: 0
    assert ipo(pair(), IPOOptions(beta=0.5))[0].item() == pytest.approx(0.25)
    assert ipo(pair(), IPOOptions(beta=0.5, reference_free=True))[0].item() == pytest.approx(0.0)
    with pytest.raises(ValueError, match="beta"):
        ipo(pair(), IPOOptions(beta=0.0))


def test_losses_are_means_over_pairs():
    # two pairs with x = .5 and x = 1.5, beta .5: ((.5 - 1)^2 + (1.5 - 1)^2) / 2 = .25
    data = PreferenceInputs(torch.tensor([-1.0, 0.0]), torch.tensor([-2.0, -2.0]), torch.tensor([-1.5, -0.5]), torch.tensor([-2.0, -2.0]))
    assert ipo(data, IPOOptions(beta=0.5))[0].item() == pytest.approx(0.25)


def test_make_pairs():
    # group 0: scores 1, 3, 3, 0 -> chosen index 1 (first best), rejected index 3
    # group 1: 2, 2 tied -> skipped; group 2: one sample -> skipped
    scores = torch.tensor([1.0, 3.0, 3.0, 0.0, 2.0, 2.0, 5.0])
    chosen, rejected, skipped = make_pairs(scores, torch.tensor([0, 0, 0, 0, 1, 1, 2]))
    assert chosen.tolist() == [1] and rejected.tolist() == [3] and skipped == 2
    # groups need not be contiguous; string ids work (numbered by first appearance)
    chosen, rejected, skipped = make_pairs(torch.tensor([0.0, 5.0, 1.0, 4.0]), ["a", "b", "a", "b"])
    assert (chosen.tolist(), rejected.tolist(), skipped) == ([2, 1], [0, 3], 0)


def test_make_pairs_with_nothing_to_pair():
    chosen, rejected, skipped = make_pairs(torch.tensor([1.0, 1.0]), torch.tensor([0, 0]))
    assert chosen.numel() == rejected.numel() == 0 and chosen.dtype == torch.long and skipped == 1
