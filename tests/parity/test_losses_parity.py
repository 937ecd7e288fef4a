"""Policy losses (value and gradient, every aggregation mode), KL estimators, aggregation, entropy
and value loss against verl 0.9.1's ``core_algos``; deliberate differences named and checked."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from parity_inputs import TOL, make_case

from trellis.interfaces.signatures import AGG_MODES, Aggregation, PolicyLossInputs
from trellis_algos import kl as kl_mod
from trellis_algos import policy_losses as ours
from trellis_algos.aggregation import agg_loss
from trellis_algos.entropy import entropy_loss
from trellis_algos.value_loss import clipped_value_loss

core = pytest.importorskip("verl.trainer.ppo.core_algos", reason="the parity tests need verl==0.9.1 (nox -s parity)")
verl_config = pytest.importorskip("verl.workers.config")
from verl.trainer.config import RolloutCorrectionConfig  # noqa: E402
from verl.utils.torch_functional import entropy_from_logits  # noqa: E402

NORM = 5.0  # seq-mean-token-sum-norm divisor (verl's loss_scale_factor)


def counts(mask, scale):
    """Global counts of a mini-batch ``scale`` times this one (a micro-batch's share), or None (local)."""
    if scale is None:
        return {}, Aggregation
    tokens, seqs = float(mask.sum()) * scale, float(mask.bool().any(-1).sum()) * scale
    info = {"dp_size": 1, "batch_num_tokens": tokens, "global_batch_size": seqs, "loss_scale_factor": NORM}
    return info, lambda mode: Aggregation(mode, global_tokens=tokens, global_seqs=seqs, norm_constant=NORM)


def actor_config(global_info, **overrides):
    policy_loss = verl_config.PolicyLossConfig(**overrides.pop("policy_loss", {}))
    return verl_config.ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, use_dynamic_bsz=False,
        global_batch_info=global_info, policy_loss=policy_loss, **overrides,
    )  # fmt: skip


def run_both(name, ours_fn, ours_opts, case, mode, scale, verl_overrides=None, weights=None, seed=0):
    """(ours loss, ours grad, verl loss, verl grad) on ``case``; the global torch RNG is reseeded
    with ``seed`` before each side (clip_cov draws from it)."""
    info, agg_of = counts(case.mask, scale)
    agg = agg_of(mode) if scale is not None else Aggregation(mode, norm_constant=None)
    lp_ours, lp_verl = case.fresh_log_prob(), case.fresh_log_prob()
    data = PolicyLossInputs(lp_ours, case.old_log_prob, case.advantages, case.mask, case.rollout_log_prob, weights)
    torch.manual_seed(seed)
    loss, _ = ours_fn(data, agg, ours_opts)
    torch.manual_seed(seed)
    verl_loss, _ = core.get_policy_loss_fn(name)(
        case.old_log_prob, lp_verl, case.advantages, case.mask, mode, actor_config(info, **(verl_overrides or {})), weights
    )
    (g,) = torch.autograd.grad(loss, lp_ours, allow_unused=True)
    (vg,) = torch.autograd.grad(verl_loss, lp_verl, allow_unused=True)
    zero = torch.zeros_like(case.log_prob)
    return loss, g if g is not None else zero, verl_loss, vg if vg is not None else zero


def assert_same(loss, grad, verl_loss, verl_grad):
    torch.testing.assert_close(loss.detach(), verl_loss.detach().to(loss.dtype), **TOL)
    torch.testing.assert_close(grad, verl_grad.to(grad.dtype), **TOL)


# name -> (trellis fn, trellis options, verl config overrides); all with rollout weights too
SAME = {
    "vanilla": (ours.vanilla, ours.VanillaOptions(clip_ratio_low=0.2, clip_ratio_high=0.28), {"clip_ratio_high": 0.28}),
    "gspo": (ours.gspo, ours.GSPOOptions(), {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}),
    "sapo": (ours.sapo, ours.SAPOOptions(tau_pos=1.0, tau_neg=1.05), {}),
    "cispo": (ours.cispo, ours.CISPOOptions(clip_ratio_high=5.0), {"clip_ratio_high": 5.0}),
    "dppo_tv": (ours.dppo_tv, ours.DPPOOptions(clip_ratio_c=3.0), {}),
    "dppo_kl": (ours.dppo_kl, ours.DPPOOptions(clip_ratio_c=3.0), {}),
    "dro": (ours.dro, ours.DROOptions(dro_beta=0.5), {"policy_loss": {"dro_beta": 0.5}}),
    "gpg": (ours.reinforce, None, {}),
}


@pytest.mark.parametrize("scale", [None, 3], ids=["local", "global"])
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", sorted(SAME))
def test_policy_loss_matches_verl(name, mode, scale, loss_case):
    fn, opts, overrides = SAME[name]
    if scale is None and mode == "seq-mean-token-sum-norm":
        pytest.skip("covered with the global counts, which carry the divisor")
    assert_same(*run_both(name, fn, opts, loss_case, mode, scale, overrides))
    weights = torch.rand(loss_case.mask.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64) * 2
    assert_same(*run_both(name, fn, opts, loss_case, mode, scale, overrides, weights=weights))


COV = {
    "clip_cov": (ours.clip_cov, ours.ClipCovOptions(clip_cov_ratio=0.2, clip_cov_lb=0.0, clip_cov_ub=5.0),
                 {"policy_loss": {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.0, "clip_cov_ub": 5.0}}),
    "kl_cov": (ours.kl_cov, ours.KLCovOptions(kl_cov_ratio=0.2), {"policy_loss": {"kl_cov_ratio": 0.2}}),
}  # fmt: skip


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", sorted(COV))
def test_covariance_losses_match_verl_within_the_log_ratio_clamp(name, mode):
    """clip_cov draws its tokens with the global torch RNG in the same order as verl: reseeded, the
    same tokens. Deliberate difference: trellis clamps log r to ±20 (verl does not), so beyond it
    the losses differ."""
    fn, opts, overrides = COV[name]
    for case, same in ((make_case(0), True), (make_case(2, extreme=True), False)):
        ours_loss, ours_grad, verl_loss, verl_grad = run_both(name, fn, opts, case, mode, 3, overrides, seed=7)
        if same:
            assert_same(ours_loss, ours_grad, verl_loss, verl_grad)
        else:
            assert not torch.isclose(ours_loss.detach(), verl_loss.detach(), **TOL)


def test_geo_mean_matches_verl_but_averages_valid_sequences_by_global_count():
    """Deliberate differences: verl takes a plain mean over every row of the call (a fully masked
    row counts, and splitting a mini-batch changes the loss); trellis divides the valid sequences'
    sum by ``global_seqs``. Beyond the ±20 clamp the values differ too."""
    opts, clip = ours.GMPOOptions(), {"clip_ratio": 0.4, "clip_ratio_low": 0.4, "clip_ratio_high": 0.4}
    assert_same(*run_both("geo_mean", ours.gmpo, opts, make_case(1, empty_row=False), "token-mean", None, clip))
    # row 4 fully masked: verl divides by 12 rows, trellis by 11 sequences
    loss, _, verl_loss, _ = run_both("geo_mean", ours.gmpo, opts, make_case(1), "token-mean", None, clip)
    torch.testing.assert_close(loss.detach() * 11 / 12, verl_loss.detach(), **TOL)


def test_dppo_truncation_default_differs():
    """Deliberate difference: verl's DPPO falls back to a ratio truncation of 20 only when the
    config lacks ``clip_ratio_c``, which ``ActorConfig`` always has (3.0, dual-clip's default), so
    20 never applies; trellis's ``DPPOOptions.clip_ratio_c`` defaults to 20 (DPPO's recommendation)."""
    assert actor_config({}).get("clip_ratio_c", 20.0) == 3.0
    assert ours.DPPOOptions().clip_ratio_c == 20.0


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_bypass_mode_matches_verl(loss_type, mode):
    case = make_case(3)
    correction = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "token_k1", "rollout_rs_threshold": "1.3"}
    opts = ours.BypassOptions(loss_type=loss_type, **{k: str(v) if k == "rollout_rs_threshold" else v for k, v in correction.items()})
    # verl's bypass reads old_log_prob as the rollout's: hand both the rollout log-probs there
    case = dataclasses.replace(case, old_log_prob=case.rollout_log_prob)
    overrides = {"policy_loss": {"rollout_correction": RolloutCorrectionConfig(loss_type=loss_type, **correction)}}
    assert_same(*run_both("bypass_mode", ours.bypass_mode, opts, case, mode, 3, overrides))


# -- KL, aggregation, entropy, value loss ------------------------------------------------------
@pytest.mark.parametrize("name", sorted(kl_mod.ESTIMATORS))
def test_kl_estimator_matches_verl(name, loss_case):
    ref = loss_case.old_log_prob
    a, b = loss_case.fresh_log_prob(), loss_case.fresh_log_prob()
    ours_kl = kl_mod.ESTIMATORS[name](a, ref)
    verl_kl = core.kl_penalty(b, ref, name)
    torch.testing.assert_close(ours_kl, verl_kl, **TOL)
    (ga,) = torch.autograd.grad(ours_kl.sum(), a)
    (gb,) = torch.autograd.grad(verl_kl.sum(), b)
    torch.testing.assert_close(ga, gb, **TOL)


@pytest.mark.parametrize("scale", [None, 3], ids=["local", "global"])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregation_entropy_and_value_loss_match_verl(mode, scale, case):
    info, agg_of = counts(case.mask, scale)
    agg = agg_of(mode) if scale is not None else Aggregation(mode)
    values = case.advantages
    torch.testing.assert_close(agg_loss(values, case.mask, agg), core.agg_loss(values, case.mask, mode, **info), **TOL)
    logits = torch.randn(*case.mask.shape, 11, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    if scale is None:  # verl's entropy loss aggregates with local counts only
        ours_entropy = entropy_loss(entropy_from_logits(logits), case.mask, agg)
        torch.testing.assert_close(ours_entropy, core.compute_entropy_loss(logits, case.mask, mode), **TOL)
    a, b = case.values.clone().requires_grad_(True), case.values.clone().requires_grad_(True)
    vpreds_a, vpreds_b = a + 0.3 * case.returns, b + 0.3 * case.returns
    ours_loss, metrics = clipped_value_loss(vpreds_a, case.returns, case.values, case.mask, agg, 0.2)
    verl_loss, verl_clip = core.compute_value_loss(vpreds_b, case.returns, case.values, case.mask, 0.2, mode, **info)
    torch.testing.assert_close(ours_loss, verl_loss, **TOL)
    assert metrics["vf_clip_frac"] == pytest.approx(float(verl_clip), abs=1e-6)
    torch.testing.assert_close(torch.autograd.grad(ours_loss, a)[0], torch.autograd.grad(verl_loss, b)[0], **TOL)
