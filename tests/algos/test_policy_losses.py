"""Policy losses: values and gradients derived by hand, Clip-Cov / KL-Cov selection properties,
and micro-batch invariance of the losses whose tokens are independent."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trellis.interfaces.signatures import Aggregation, PolicyLossInputs
from trellis_algos.aggregation import MODES, aggregation_for
from trellis_algos.policy_losses import (
    CISPOOptions,
    ClipCovOptions,
    DPPOOptions,
    DROOptions,
    GMPOOptions,
    GSPOOptions,
    KLCovOptions,
    SAPOOptions,
    VanillaOptions,
    cispo,
    clip_cov,
    clip_cov_selection,
    clip_range,
    dppo_kl,
    dppo_tv,
    dro,
    gmpo,
    gspo,
    kl_cov,
    kl_cov_selection,
    reinforce,
    sapo,
    vanilla,
)

FAST = settings(max_examples=50, deadline=None)
TOKEN_MEAN = Aggregation("token-mean")


def inputs(log_ratio, adv, mask=None, logp=None, dtype=torch.float64):
    """Inputs with a given log-ratio logp - logp_old; logp defaults to -1 everywhere."""
    log_ratio = torch.tensor(log_ratio, dtype=dtype)
    logp = torch.full_like(log_ratio, -1.0) if logp is None else torch.tensor(logp, dtype=dtype)
    mask = torch.ones_like(log_ratio, dtype=torch.long) if mask is None else torch.tensor(mask)
    return PolicyLossInputs(logp.clone().requires_grad_(True), (logp - log_ratio).detach(), torch.tensor(adv, dtype=dtype), mask)


def grad_of(loss, data):
    (g,) = torch.autograd.grad(loss, data.log_prob)
    return g


def close(actual, expected, rtol=1e-6):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=rtol, atol=1e-9)


# -- vanilla -----------------------------------------------------------------------------------
def test_vanilla_by_hand():
    # eps .2, c 3; a 5th, masked token with a wild ratio must not matter.
    # t0: r 1.5, A  1: max(-1.5, -1.2) = -1.2   (clipped, no gradient)
    # t1: r 0.5, A -1: max(0.5, 0.8)  = 0.8    (clipped, no gradient); dual bound 3 inactive
    # t2: r 5,   A -1: max(5, 1.2)    = 5 -> min(5, 3) = 3 (dual clip, no gradient)
    # t3: r 1,   A  2: -2, gradient d(-A r)/dlogp = -A r = -2, / 4 tokens = -.5
    data = inputs(
        [[math.log(1.5), math.log(0.5), math.log(5.0), 0.0, 15.0]],
        [[1.0, -1.0, -1.0, 2.0, 1.0]],
        mask=[[1, 1, 1, 1, 0]],
    )
    loss, metrics = vanilla(data, TOKEN_MEAN, VanillaOptions())
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 3.0 - 2.0) / 4)
    assert metrics["pg_loss"] == pytest.approx(0.15)
    assert metrics["clip_frac"] == pytest.approx(0.5)
    assert metrics["clip_frac_lower"] == pytest.approx(0.25)
    assert metrics["approx_kl"] == pytest.approx(-math.log(1.5 * 0.5 * 5.0) / 4)
    close(grad_of(loss, data), [[0.0, 0.0, 0.0, -0.5, 0.0]])


def test_vanilla_clip_higher():
    # r = 1.25, A = 1: clipped at 1.2 with eps_high .2, not with eps_high .28
    data = inputs([[math.log(1.25)]], [[1.0]])
    assert vanilla(data, TOKEN_MEAN, VanillaOptions())[0].item() == pytest.approx(-1.2)
    assert vanilla(data, TOKEN_MEAN, VanillaOptions(clip_ratio_high=0.28))[0].item() == pytest.approx(-1.25)


def test_vanilla_rejects_dual_clip_bound_not_above_one():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        vanilla(inputs([[0.0]], [[1.0]]), TOKEN_MEAN, VanillaOptions(clip_ratio_c=1.0))


# -- cispo, reinforce ----------------------------------------------------------------------------
def test_cispo_by_hand():
    # t0: r = e^.5 = 1.65 -> weight 1.2 (detached), A 1, logp -.5: loss -1.2 * 1 * -.5 = .6
    # t1: r = 1 -> weight 1, A -2, logp -1: loss -1 * -2 * -1 = -2. Mean -.7.
    # gradient -w A / 2: t0 -.6, t1 +1
    data = inputs([[0.5, 0.0]], [[1.0, -2.0]], logp=[[-0.5, -1.0]])
    loss, metrics = cispo(data, TOKEN_MEAN, CISPOOptions())
    assert loss.item() == pytest.approx(-0.7)
    assert metrics["clip_frac"] == pytest.approx(0.5)
    close(grad_of(loss, data), [[-0.6, 1.0]])


def test_reinforce_by_hand():
    # -A logp: -(1)(-.5) = .5, -(-2)(-1) = -2, mean -.75; gradient -A / 2 = -.5, 1
    data = inputs([[0.3, 0.0]], [[1.0, -2.0]], logp=[[-0.5, -1.0]])
    data.rollout_log_prob = torch.tensor([[-0.4, -1.2]], dtype=torch.float64)
    loss, metrics = reinforce(data, TOKEN_MEAN)
    assert loss.item() == pytest.approx(-0.75)
    close(grad_of(loss, data), [[-0.5, 1.0]])
    # KL against the rollout policy: mean(rollout - logp) = mean(.1, -.2)
    assert metrics["approx_kl"] == pytest.approx(-0.05)


# -- gspo --------------------------------------------------------------------------------------
def test_gspo_sequence_ratio_by_hand():
    # log-ratios .1, .3: sequence ratio s = e^.2 on both tokens, A = 1.
    # Default clip (3e-4, 4e-4): s clipped to 1.0004, loss -1.0004, no gradient.
    data = inputs([[0.1, 0.3]], [[1.0, 1.0]])
    loss, metrics = gspo(data, TOKEN_MEAN, GSPOOptions())
    assert loss.item() == pytest.approx(-1.0004)
    assert metrics["clip_frac"] == 1.0
    close(grad_of(loss, data), [[0.0, 0.0]])
    # Wide clip: loss -s; d(-A s_t)/dlogp_t = -s, times the token mean 1/2
    data = inputs([[0.1, 0.3]], [[1.0, 1.0]])
    loss, _ = gspo(data, TOKEN_MEAN, GSPOOptions(clip_ratio_low=0.5, clip_ratio_high=0.5))
    s = math.exp(0.2)
    assert loss.item() == pytest.approx(-s)
    close(grad_of(loss, data), [[-s / 2, -s / 2]])


def test_gspo_honours_the_aggregation_mode():
    # ratio 1; seq 1 has two tokens with A 1, seq 2 one token with A 4:
    # token-mean = -6 / 3 = -2; seq-mean-token-mean = (-1 + -4) / 2 = -2.5 (as verl 0.9.1)
    data = inputs([[0.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [4.0, 4.0]], mask=[[1, 1], [1, 0]])
    assert gspo(data, TOKEN_MEAN)[0].item() == pytest.approx(-2.0)
    assert gspo(data, Aggregation("seq-mean-token-mean"))[0].item() == pytest.approx(-2.5)
    # the global counts are those of the mini-batch: 4 sequences -> -5 / 4; 6 tokens -> -6 / 6
    assert gspo(data, Aggregation("seq-mean-token-mean", global_seqs=4.0))[0].item() == pytest.approx(-1.25)
    assert gspo(data, Aggregation("token-mean", global_tokens=6.0))[0].item() == pytest.approx(-1.0)


def test_symmetric_clip_ratio_fills_the_bounds_left_null():
    # r = 1.25, A = 1: clip_ratio .1 clips at 1.1; an explicit clip_ratio_high .3 wins over it
    data = inputs([[math.log(1.25)]], [[1.0]])
    assert vanilla(data, TOKEN_MEAN, VanillaOptions(clip_ratio=0.1))[0].item() == pytest.approx(-1.1)
    assert vanilla(data, TOKEN_MEAN, VanillaOptions(clip_ratio=0.1, clip_ratio_high=0.3))[0].item() == pytest.approx(-1.25)
    # GSPO's bounds default to the paper's; nulling them hands over to clip_ratio
    assert gspo(data, TOKEN_MEAN, GSPOOptions(clip_ratio=0.1, clip_ratio_low=None, clip_ratio_high=None))[0].item() == pytest.approx(-1.1)
    with pytest.raises(ValueError, match="gspo: set clip_ratio"):
        gspo(data, TOKEN_MEAN, GSPOOptions(clip_ratio_high=None))


# -- sapo / dppo / dro ------------------------------------------------------------------------
def test_sapo_gate_by_hand():
    # r = 1: gate (4 / tau) sigmoid(0) = 2 / tau; A = 1 (tau_pos 1) -> -2, A = -1 (tau_neg 1.05) -> 2 / 1.05.
    # d/dlogp of -A (4 / tau) sigmoid(tau (r - 1)) at r = 1 is -A (PPO's); one sequence of 2 tokens: / 2
    data = inputs([[0.0, 0.0]], [[1.0, -1.0]])
    loss, _ = sapo(data, TOKEN_MEAN, SAPOOptions())
    assert loss.item() == pytest.approx((-2.0 + 2.0 / 1.05) / 2)
    close(grad_of(loss, data), [[-0.5, 0.5]])
    # always seq-mean-token-mean (as verl): seqs of 2 and 1 tokens, means -2 and -2 -> -2, not token-mean's
    data = inputs([[0.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]], mask=[[1, 1], [1, 0]])
    assert sapo(data, Aggregation("token-mean", global_seqs=4.0))[0].item() == pytest.approx(-4.0 / 4)
    with pytest.raises(ValueError, match="tau_pos"):
        sapo(data, TOKEN_MEAN, SAPOOptions(tau_pos=0.0))


def dppo_inputs():
    # p_old = .5 everywhere; p = .8, .6 (A = 1), .2, .4 (A = -1)
    p = [[0.8, 0.6, 0.2, 0.4]]
    return inputs([[math.log(x / 0.5) for x in p[0]]], [[1.0, 1.0, -1.0, -1.0]], logp=[[math.log(x) for x in p[0]]])


@pytest.mark.parametrize("loss_fn", [dppo_tv, dppo_kl])
def test_dppo_masks_tokens_that_moved_past_the_threshold(loss_fn):
    # TV: |p - p_old| = .3 (out), .1 (in), .3 (out), .1 (in) with threshold .2.
    # binary KL: .5 ln(.5/.8) + .5 ln(.5/.2) = .223 (out), .020 (in), .223 (out), .020 (in), moved the advantage's way.
    # inside tokens: -A sg(r) logp with r = 1.2 and .8; token-mean over 4
    data = dppo_inputs()
    loss, metrics = loss_fn(data, TOKEN_MEAN, DPPOOptions())
    assert loss.item() == pytest.approx((-1.2 * math.log(0.6) + 0.8 * math.log(0.4)) / 4, rel=1e-6)
    close(grad_of(loss, data), [[0.0, -1.2 / 4, 0.0, 0.8 / 4]])
    assert metrics["clip_frac"] == 0.5 and metrics["clip_frac_lower"] == 0.0
    # truncating the ratio at 1: the inside A > 0 token's weight 1.2 becomes 1 and counts as truncated
    loss, metrics = loss_fn(dppo_inputs(), TOKEN_MEAN, DPPOOptions(clip_ratio_c=1.0))
    assert loss.item() == pytest.approx((-math.log(0.6) + 0.8 * math.log(0.4)) / 4, rel=1e-6)
    assert metrics["clip_frac_lower"] == 0.25


def test_dppo_kl_keeps_a_token_that_moved_against_its_advantage():
    # p .8 -> .2 with A = 1 is far in KL but moved down: it keeps learning
    data = inputs([[math.log(0.2 / 0.8)]], [[1.0]], logp=[[math.log(0.2)]])
    assert dppo_kl(data, TOKEN_MEAN)[1]["clip_frac"] == 0.0


def test_dro_by_hand():
    # beta 2: L = -(A logp - (logp - old)^2); logp -1 on both tokens.
    # t0: x .5, A 1: -(-1 - .25) = 1.25, dL/dlogp = -(A - beta x) = 0. t1: x 0, A 2: 2, gradient -2. token-mean
    data = inputs([[0.5, 0.0]], [[1.0, 2.0]])
    loss, _ = dro(data, TOKEN_MEAN, DROOptions(dro_beta=2.0))
    assert loss.item() == pytest.approx((1.25 + 2.0) / 2)
    close(grad_of(loss, data), [[0.0, -1.0]])
    with pytest.raises(ValueError, match="set actor.policy_loss.dro_beta"):
        dro(data, TOKEN_MEAN)


def test_rollout_is_weights_multiply_every_token_loss():
    # reinforce with weights 2 and .5: -(A w logp) = -(1 * 2 * -1), -(1 * .5 * -1), token-mean
    data = inputs([[0.0, 0.0]], [[1.0, 1.0]])
    data.rollout_is_weights = torch.tensor([[2.0, 0.5]], dtype=torch.float64)
    assert reinforce(data, TOKEN_MEAN)[0].item() == pytest.approx(1.25)
    # gmpo takes one weight per sequence, the geometric mean sqrt(2 * .5) = 1
    assert gmpo(data, TOKEN_MEAN)[0].item() == pytest.approx(-1.0)


# -- gmpo / geo_mean ---------------------------------------------------------------------------
def test_gmpo_by_hand():
    # A > 0, log-ratios .5, -.1, clip .4: pessimistic = min(x, clip(x)) = .4, -.1; mean .15
    # loss = -A e^.15; token 0 counts as clipped with A > 0.
    data = inputs([[0.5, -0.1]], [[1.0, 1.0]])
    loss, metrics = gmpo(data, TOKEN_MEAN, GMPOOptions())
    assert loss.item() == pytest.approx(-math.exp(0.15))
    assert (metrics["clip_frac"], metrics["clip_frac_lower"]) == (0.5, 0.0)
    # A < 0: -min(-x, -clip(x)) = max(x, clip(x)) = .5, -.1; mean .2; loss = -(-1) e^.2
    data = inputs([[0.5, -0.1]], [[-1.0, -1.0]])
    loss, metrics = gmpo(data, TOKEN_MEAN, GMPOOptions())
    assert loss.item() == pytest.approx(math.exp(0.2))
    assert (metrics["clip_frac"], metrics["clip_frac_lower"]) == (0.0, 0.5)
    # gradient: d/dlogp_1 of e^{mean} (token 1 unclipped) = e^.2 / 2; token 0 unclipped too
    close(grad_of(loss, data), [[math.exp(0.2) / 2, math.exp(0.2) / 2]])


def test_gmpo_divides_by_global_sequences():
    # two sequences, ratio 1, sequence advantages 1 and 3 -> losses -1, -3; 8 sequences overall
    data = inputs([[0.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [3.0, 3.0]])
    assert gmpo(data, TOKEN_MEAN)[0].item() == pytest.approx(-2.0)
    assert gmpo(data, Aggregation("seq-mean-token-sum", global_seqs=8.0))[0].item() == pytest.approx(-0.5)


# -- clip_cov ----------------------------------------------------------------------------------
# A = 2, 2, -2, -2 (mean 0); logp = -1, -3, -3, -1 (mean -2, deviations 1, -1, -1, 1)
# cov = 2, -2, 2, -2: tokens 0 and 2 lie inside the band (1, 5).
COV_ADV = [[2.0, 2.0, -2.0, -2.0]]
COV_LOGP = [[-1.0, -3.0, -3.0, -1.0]]


def test_clip_cov_by_hand():
    data = inputs([[0.0] * 4], COV_ADV, logp=COV_LOGP)
    # k = max(1, int(.25 * 4)) = 1: one of tokens 0, 2
    torch.manual_seed(0)
    one = clip_cov_selection(data, ClipCovOptions(clip_cov_ratio=0.25))
    assert one.sum() == 1 and (one[0, 0] or one[0, 2])
    # k = 2: both; token losses -A r = -2, -2, 2, 2 -> 0, -2, 0, 2: token-mean 0
    loss, metrics = clip_cov(data, TOKEN_MEAN, ClipCovOptions(clip_cov_ratio=0.5))
    assert loss.item() == pytest.approx(0.0)
    assert metrics["clip_cov_frac"] == 0.5 and metrics["clip_frac"] == 0.0
    close(grad_of(loss, data), [[0.0, -0.5, 0.0, 0.5]])


def test_clip_cov_skips_tokens_already_clipped():
    # token 0 now has ratio 1.5 with A > 0: PPO-clipped, so only token 2 can be chosen
    data = inputs([[math.log(1.5), 0.0, 0.0, 0.0]], COV_ADV, logp=COV_LOGP)
    selected = clip_cov_selection(data, ClipCovOptions(clip_cov_ratio=0.5))
    assert selected.tolist() == [[False, False, True, False]]


def test_clip_cov_is_reproducible_by_seed():
    data = inputs([[0.0] * 4], COV_ADV, logp=COV_LOGP)
    picks = []
    for _ in range(2):
        torch.manual_seed(123)
        picks.append([clip_cov_selection(data, ClipCovOptions(clip_cov_ratio=0.25)) for _ in range(5)])
    assert all(torch.equal(a, b) for a, b in zip(*picks))


# -- kl_cov ------------------------------------------------------------------------------------
def test_kl_cov_by_hand():
    # A = 3, 1, -1, -3 (mean 0); logp = 0, -3, -1, -2 (mean -1.5, deviations 1.5, -1.5, .5, -.5)
    # cov = 4.5, -1.5, -.5, 1.5; k = int(.5 * 4) = 2 -> tokens 0 and 3 get + |log r|
    x = [0.1, 0.2, -0.3, -0.4]
    data = inputs([x], [[3.0, 1.0, -1.0, -3.0]], logp=[[0.0, -3.0, -1.0, -2.0]])
    assert kl_cov_selection(data, KLCovOptions(kl_cov_ratio=0.5)).tolist() == [[True, False, False, True]]
    loss, metrics = kl_cov(data, TOKEN_MEAN, KLCovOptions(kl_cov_ratio=0.5, ppo_kl_coef=1.0))
    terms = [-3 * math.exp(0.1) + 0.1, -math.exp(0.2), math.exp(-0.3), 3 * math.exp(-0.4) + 0.4]
    assert loss.item() == pytest.approx(sum(terms) / 4)
    assert metrics["kl_cov_frac"] == 0.5
    assert metrics["abs_kl"] == pytest.approx(1.0 / 4)


# -- properties --------------------------------------------------------------------------------
@st.composite
def policy_batches(draw, min_rows=1):
    b = draw(st.integers(min_rows, 4))
    t = draw(st.integers(1, 6))
    n = b * t
    floats = lambda lo, hi: st.lists(st.floats(lo, hi), min_size=n, max_size=n)  # noqa: E731
    logp = torch.tensor(draw(floats(-6, 0)), dtype=torch.float64).reshape(b, t)
    log_ratio = torch.tensor(draw(floats(-0.5, 0.5)), dtype=torch.float64).reshape(b, t)
    adv = torch.tensor(draw(floats(-3, 3)), dtype=torch.float64).reshape(b, t)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n))).reshape(b, t)
    data = PolicyLossInputs(logp.clone().requires_grad_(True), logp - log_ratio, adv, mask)
    return data


def reference_covariance(data):
    """cov from the definition, over valid tokens only (plain python means)."""
    valid = data.response_mask.bool()
    a, lp = data.advantages[valid], data.log_prob.detach()[valid]
    cov = torch.full_like(data.advantages, float("nan"))
    cov[valid] = (a - a.mean()) * (lp - lp.mean())
    return cov


def check_clip_cov(data, opts, seed):
    """Clip-Cov against its definition; returns how many tokens were detached."""
    valid = data.response_mask.bool()
    cov = reference_covariance(data)
    r = torch.exp(data.log_prob.detach() - data.old_log_prob)
    a = data.advantages
    low, high = clip_range(opts, "clip_cov")
    ppo_clipped = -a * torch.clamp(r, 1 - low, 1 + high) > -a * r
    band = valid & ~ppo_clipped & (cov > opts.clip_cov_lb) & (cov < opts.clip_cov_ub)
    k = max(1, int(opts.clip_cov_ratio * int(valid.sum())))

    torch.manual_seed(seed)
    selected = clip_cov_selection(data, opts)
    assert int(selected.sum()) == min(k, int(band.sum()))
    assert not torch.any(selected & ~band)

    torch.manual_seed(seed)  # the loss draws the same tokens
    loss, _ = clip_cov(data, TOKEN_MEAN, opts)
    per_token = torch.maximum(-a * r, -a * torch.clamp(r, 1 - low, 1 + high))
    expected = per_token[valid & ~selected].sum() / max(1, int(valid.sum()))
    assert loss.item() == pytest.approx(expected.item(), abs=1e-9)
    assert torch.all(grad_of(loss, data)[selected] == 0)
    return int(selected.sum())


@FAST
@given(policy_batches(min_rows=2), st.floats(0.1, 0.6), st.floats(-0.5, 0.3), st.floats(0.5, 4.0), st.integers(0, 2**16))
def test_clip_cov_zeroes_exactly_k_tokens_inside_the_band(data, ratio, lb, width, seed):
    check_clip_cov(data, ClipCovOptions(clip_cov_ratio=ratio, clip_cov_lb=lb, clip_cov_ub=lb + width), seed)


@pytest.mark.parametrize("seed", range(5))
def test_clip_cov_on_a_larger_batch(seed):
    # the same check where the band holds many more tokens than k (k = int(.05 * valid) > 1)
    g = torch.Generator().manual_seed(seed)
    logp = -3 * torch.rand(8, 32, generator=g, dtype=torch.float64)
    adv = 2 * torch.randn(8, 1, generator=g, dtype=torch.float64).expand(8, 32).contiguous()
    mask = torch.rand(8, 32, generator=g) < 0.8
    log_ratio = 0.3 * torch.randn(8, 32, generator=g, dtype=torch.float64)
    data = PolicyLossInputs(logp.clone().requires_grad_(True), logp - log_ratio, adv, mask)
    opts = ClipCovOptions(clip_cov_ratio=0.05, clip_cov_lb=0.2, clip_cov_ub=3.0)
    assert check_clip_cov(data, opts, seed) == max(1, int(0.05 * int(mask.sum())))


@FAST
@given(policy_batches(), st.floats(0.05, 1.0))
def test_kl_cov_penalises_exactly_the_top_k(data, ratio):
    valid = data.response_mask.bool()
    n_valid = int(valid.sum())
    selected = kl_cov_selection(data, KLCovOptions(kl_cov_ratio=ratio))
    assert not torch.any(selected & ~valid)
    assert int(selected.sum()) == (max(1, int(ratio * n_valid)) if n_valid else 0)
    cov = reference_covariance(data)
    rest = valid & ~selected
    if selected.any() and rest.any():
        assert cov[selected].min() >= cov[rest].max() - 1e-12


@FAST
@given(
    policy_batches(min_rows=2),
    st.sampled_from(MODES),
    st.sampled_from(["vanilla", "gspo", "gmpo", "cispo", "reinforce"]),
    st.data(),
)
def test_token_independent_losses_split_into_micro_batches(data, mode, name, draw):
    fn = {"vanilla": vanilla, "gspo": gspo, "gmpo": gmpo, "cispo": cispo, "reinforce": reinforce}[name]
    b = data.advantages.shape[0]
    cut = draw.draw(st.integers(1, b - 1))
    full_loss, _ = fn(data, Aggregation(mode))
    full_grad = grad_of(full_loss, data) if full_loss.requires_grad else torch.zeros_like(data.log_prob)

    agg = aggregation_for(mode, data.response_mask)
    logp = data.log_prob.detach().clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, cut), slice(cut, b)):
        part = PolicyLossInputs(logp[rows], data.old_log_prob[rows], data.advantages[rows], data.response_mask[rows])
        total = total + fn(part, agg)[0]
    assert float(total.detach()) == pytest.approx(full_loss.item(), abs=1e-9)
    if isinstance(total, torch.Tensor) and total.requires_grad:
        (split_grad,) = torch.autograd.grad(total, logp)
        torch.testing.assert_close(split_grad, full_grad)
