"""KL estimators (value and gradient by hand, straight-through forms), controllers, KL penalty and loss."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trellis.interfaces.signatures import Aggregation
from trellis_algos.kl import (
    ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLControlOptions,
    apply_kl_penalty,
    get_estimator,
    k1,
    k2,
    k3,
    kl_loss,
    make_kl_controller,
)

FAST = settings(max_examples=50, deadline=None)
LN2 = math.log(2.0)


def value_and_grad(name, delta):
    """Estimator value and d/dlogp at logp - ref = delta (ref fixed at -1)."""
    delta = torch.as_tensor(delta, dtype=torch.float64)
    ref = torch.full_like(delta, -1.0)
    logp = (ref + delta).requires_grad_(True)
    value = ESTIMATORS[name](logp, ref)
    (grad,) = torch.autograd.grad(value.sum(), logp)
    return value.detach(), grad


DELTAS = [0.0, LN2, -LN2]
# by hand at delta = 0, ln 2, -ln 2:
#   k1 = delta, grad 1;  abs = |delta|, grad sign(delta);  k2 = delta^2 / 2, grad delta
#   k3 = e^-delta + delta - 1: 0, 1/2 + ln2 - 1, 2 - ln2 - 1; grad 1 - e^-delta: 0, 1/2, -1
EXPECTED = {
    "k1": ([0.0, LN2, -LN2], [1.0, 1.0, 1.0]),
    "abs": ([0.0, LN2, LN2], [None, 1.0, -1.0]),  # |x| at 0: subgradient, not checked
    "k2": ([0.0, LN2**2 / 2, LN2**2 / 2], [0.0, LN2, -LN2]),
    "k3": ([0.0, LN2 - 0.5, 1 - LN2], [0.0, 0.5, -1.0]),
    # straight-through: the value of k1 / k3 with the gradient of k2
    "k1+": ([0.0, LN2, -LN2], [0.0, LN2, -LN2]),
    "k3+": ([0.0, LN2 - 0.5, 1 - LN2], [0.0, LN2, -LN2]),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_estimator_by_hand(name):
    values, grads = EXPECTED[name]
    value, grad = value_and_grad(name, DELTAS)
    assert value.tolist() == pytest.approx(values)
    for g, expected in zip(grad.tolist(), grads):
        if expected is not None:
            assert g == pytest.approx(expected)


def test_aliases_are_the_same_functions():
    assert ESTIMATORS["low_var_kl"] is ESTIMATORS["k3"] is k3
    assert ESTIMATORS["mse"] is ESTIMATORS["k2"] is k2
    assert ESTIMATORS["kl"] is ESTIMATORS["k1"] is k1
    assert get_estimator("low_var_kl") is k3 and get_estimator(k2) is k2
    with pytest.raises(ValueError, match="valid"):
        get_estimator("k4")


def test_k3_clamps():
    # delta = -30: -delta clamped to 20, e^20 - 20 - 1 clamped to 10
    # delta = 30: -delta clamped to -20, e^-20 + 20 - 1 = 19.000... clamped to 10
    value, _ = value_and_grad("k3", [-30.0, 30.0])
    assert value.tolist() == [10.0, 10.0]


@FAST
@given(st.lists(st.floats(-50, 50), min_size=1, max_size=8))
def test_k2_and_k3_are_non_negative(deltas):
    for name in ("k2", "k3", "mse", "low_var_kl"):
        value, _ = value_and_grad(name, deltas)
        assert torch.all(value >= 0)


@FAST
@given(
    st.lists(st.floats(-5, 5), min_size=1, max_size=8),
    st.sampled_from([("k1+", "k1"), ("kl+", "k1"), ("abs+", "abs"), ("k2+", "k2"), ("mse+", "k2"), ("k3+", "k3"), ("low_var_kl+", "k3")]),
)
def test_straight_through_has_value_of_one_and_gradient_of_k2(deltas, names):
    plus, plain = names
    v_plus, g_plus = value_and_grad(plus, deltas)
    v_plain, _ = value_and_grad(plain, deltas)
    _, g_k2 = value_and_grad("k2", deltas)
    torch.testing.assert_close(v_plus, v_plain)
    torch.testing.assert_close(g_plus, g_k2)


def test_abs_plus_by_hand():
    # delta = -ln 2: value |delta| = ln 2, gradient of k2 = delta = -ln 2 (abs alone: -1)
    value, grad = value_and_grad("abs+", [-LN2])
    assert value.item() == pytest.approx(LN2) and grad.item() == pytest.approx(-LN2)
    assert value_and_grad("abs", [-LN2])[1].item() == -1.0


def test_every_name_has_a_plus_variant():
    assert {n for n in ESTIMATORS if not n.endswith("+")} == {n[:-1] for n in ESTIMATORS if n.endswith("+")}


# -- controllers -------------------------------------------------------------------------------
def test_fixed_controller_never_moves():
    ctl = make_kl_controller(KLControlOptions(type="fixed", kl_coef=0.05))
    ctl.update(current_kl=100.0, n_steps=1000)
    assert isinstance(ctl, FixedKLController) and ctl.value == 0.05


def test_adaptive_controller_by_hand():
    # target .05, horizon 100, batch 10: error = clip(kl / .05 - 1, -.2, .2);
    # value *= 1 + error * 10 / 100
    ctl = make_kl_controller(KLControlOptions(type="adaptive", kl_coef=0.1, target_kl=0.05, horizon=100))
    assert isinstance(ctl, AdaptiveKLController)
    ctl.update(0.2, n_steps=10)  # error 3 -> .2: x 1.02
    assert ctl.value == pytest.approx(0.102)
    ctl.update(0.04, n_steps=10)  # error -.2: x .98
    assert ctl.value == pytest.approx(0.102 * 0.98)
    ctl.update(0.055, n_steps=10)  # error .1: x 1.01
    assert ctl.value == pytest.approx(0.102 * 0.98 * 1.01)


def test_controller_state_round_trip():
    ctl = AdaptiveKLController(0.1, target_kl=0.05, horizon=100)
    ctl.update(0.2, n_steps=10)
    fresh = AdaptiveKLController(0.1, target_kl=0.05, horizon=100)
    fresh.load_state_dict(ctl.state_dict())
    assert fresh.value == ctl.value and ctl.state_dict()["type"] == "adaptive"
    fixed = FixedKLController(0.3)
    fixed.load_state_dict({"type": "fixed", "value": 0.7})
    assert fixed.value == 0.7


def test_controller_options_are_checked():
    with pytest.raises(ValueError, match="horizon"):
        make_kl_controller(KLControlOptions(type="adaptive", horizon=0))
    with pytest.raises(ValueError, match="fixed, adaptive"):
        make_kl_controller(KLControlOptions(type="pid"))


def test_apply_kl_penalty_by_hand():
    # k1 on delta .1, .2 (third token masked) and .4, .4, .4; beta .5
    # rewards: scores - .5 * kl on valid tokens; current_kl = mean(.15, .4) = .275
    scores = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    ref = torch.zeros(2, 3)
    logp = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.4, 0.4]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    ctl = AdaptiveKLController(0.5, target_kl=0.1, horizon=20)
    rewards, metrics = apply_kl_penalty(scores, logp, ref, mask, ctl, estimator="k1")
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.9, 0.0], [-0.2, -0.2, 1.8]]))
    assert metrics["kl"] == pytest.approx(0.275) and metrics["kl_coef"] == 0.5
    # updated with the batch size 2: error clip(2.75 - 1) = .2 -> x (1 + .2 * 2 / 20)
    assert ctl.value == pytest.approx(0.5 * 1.02)


def test_kl_loss_aggregates_the_estimate():
    # k3 at delta ln2 and -ln2 (token-mean over 2): ((ln2 - .5) + (1 - ln2)) / 2 = .25
    logp = torch.tensor([[LN2, -LN2, 5.0]], requires_grad=True)
    loss, metrics = kl_loss(logp, torch.zeros(1, 3), torch.tensor([[1, 1, 0]]), Aggregation("token-mean"))
    assert loss.item() == pytest.approx(0.25) and metrics["kl_loss"] == pytest.approx(0.25)
