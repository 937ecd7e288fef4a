"""Rollout correction: IS weights, rejection and metrics by hand; the policy objective with it
(identical engines change nothing; weights and rejection enter the loss and the counts); bypass mode."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from omegaconf import OmegaConf

from trellis.batch import Batch
from trellis.config import validate
from trellis.interfaces.signatures import Aggregation, PolicyLossInputs
from trellis.plugins import load_plugins
from trellis_algos import ActorConfig
from trellis_algos.policy_losses import BypassOptions, bypass_mode, vanilla
from trellis_algos.rollout_correction import RolloutCorrectionOptions, rejection_mask, rollout_correction, rs_criteria

LN3, LN2 = math.log(3.0), math.log(2.0)
# one sequence, log-ratios (trainer - rollout) ln 3, ln .5, and a masked token with a wild ratio
LOG_PROB = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64)
ROLLOUT = LOG_PROB - torch.tensor([[LN3, -LN2, 30.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0]])


def correct(**options):
    return rollout_correction(LOG_PROB, ROLLOUT, MASK, RolloutCorrectionOptions(**options))


def test_token_weights_are_truncated_at_the_threshold():
    weights, mask, metrics = correct(rollout_is="token", rollout_is_threshold=2.0)
    assert weights.tolist()[0] == pytest.approx([2.0, 0.5, 0.0])  # 3 -> 2, .5 kept, masked -> 0
    assert torch.equal(mask, MASK)
    assert metrics["rollout_corr/is_mean"] == pytest.approx(1.25)
    assert metrics["rollout_corr/is_max"] == 2.0 and metrics["rollout_corr/is_min"] == 0.5
    assert metrics["rollout_corr/is_fraction_high"] == 0.5  # raw 3 > 2
    assert metrics["rollout_corr/is_fraction_low"] == 0.0  # .5 is not below 1/2
    # ESS = 1 / mean((w / mean w)^2) = 1 / ((1.6^2 + .4^2) / 2)
    assert metrics["rollout_corr/is_eff_sample_size"] == pytest.approx(1 / ((1.6**2 + 0.4**2) / 2), rel=1e-6)


def test_icepop_zeroes_weights_outside_the_band():
    weights, _, _ = correct(rollout_is="token", rollout_is_threshold=4.0, rollout_is_threshold_lower=0.6)
    assert weights.tolist()[0] == pytest.approx([3.0, 0.0, 0.0])


def test_sequence_weight_is_the_product_of_token_ratios():
    weights, _, _ = correct(rollout_is="sequence", rollout_is_threshold=2.0)
    assert weights.tolist()[0] == pytest.approx([1.5, 1.5, 0.0])  # 3 * .5 on every valid token


def test_batch_normalised_weights_have_mean_one():
    weights, _, metrics = correct(rollout_is="token", rollout_is_batch_normalize=True)
    assert weights.tolist()[0] == pytest.approx([1.6, 0.4, 0.0])  # [2, .5] / 1.25
    assert metrics["rollout_corr/is_batch_norm_factor"] == pytest.approx(1.25)
    # a given batch mean (of a larger batch) is used instead
    options = RolloutCorrectionOptions(rollout_is="token", rollout_is_batch_normalize=True)
    weights, _, _ = rollout_correction(LOG_PROB, ROLLOUT, MASK, options, torch.tensor(2.5))
    assert weights.tolist()[0] == pytest.approx([0.8, 0.2, 0.0])


def test_token_k1_rejection_keeps_ratios_inside_the_band():
    # k1 = -log-ratio must lie in [ln(1/2), ln 2]: -ln 3 is out, ln 2 is on the edge (kept)
    _, mask, metrics = correct(rollout_rs="token_k1", rollout_rs_threshold="2")
    assert mask.tolist() == [[0, 1, 0]] and mask.dtype == MASK.dtype
    assert metrics["rollout_corr/rs_masked_fraction"] == 0.5 and metrics["rollout_corr/rs_seq_masked_fraction"] == 1.0


def test_sequence_k3_rejection_drops_the_whole_sequence():
    # k3 = e^x - 1 - x: 3 - 1 - ln 3 and .5 - 1 + ln 2, mean about .547
    mean_k3 = ((3 - 1 - LN3) + (0.5 - 1 + LN2)) / 2
    kept, _ = rejection_mask(LOG_PROB - ROLLOUT, MASK, "seq_mean_k3", mean_k3 + 1e-6)
    assert kept.tolist() == [[True, True, False]]
    kept, metrics = rejection_mask(LOG_PROB - ROLLOUT, MASK, "seq_mean_k3,token_k2", f"{mean_k3 - 1e-6},100")
    assert kept.tolist() == [[False, False, False]] and metrics["rs_masked_fraction"] == 1.0


def test_mismatch_metrics_by_hand():
    _, _, metrics = correct(log_metrics=True)
    assert metrics["rollout_corr/kl"] == pytest.approx(-(LN3 - LN2) / 2)  # mean(rollout - trainer)
    assert metrics["rollout_corr/abs_diff"] == pytest.approx((LN3 + LN2) / 2)  # mean |trainer - rollout|
    assert metrics["rollout_corr/k3_kl"] == pytest.approx(((3 - 1 - LN3) + (0.5 - 1 + LN2)) / 2)
    assert metrics["rollout_corr/chi2_token"] == pytest.approx((9 + 0.25) / 2 - 1)
    assert metrics["rollout_corr/chi2_seq"] == pytest.approx(1.5**2 - 1)
    assert not any("is_" in k or "rs_" in k for k in metrics)


def test_bad_options_name_the_key():
    with pytest.raises(ValueError, match="rollout_is is 'tokens'"):
        correct(rollout_is="tokens")
    with pytest.raises(ValueError, match="rollout_is_threshold_lower"):
        correct(rollout_is="token", rollout_is_threshold_lower=3.0)
    with pytest.raises(ValueError, match="unknown criterion 'seq_max_k1'"):
        rs_criteria("seq_max_k1", "2")
    with pytest.raises(ValueError, match="rollout_rs_threshold must be set"):
        rs_criteria("token_k2", None)
    with pytest.raises(ValueError, match="2 entries for 3"):
        rs_criteria("token_k1,token_k2,seq_sum_k3", "1,2")
    with pytest.raises(ValueError, match="one upper bound"):
        rs_criteria("token_k2", "0.1_2")
    assert rs_criteria("token_k1, seq_sum_k2", "0.5_4,3") == [("token", "k1", 0.5, 4.0), ("seq_sum", "k2", None, 3.0)]


# -- the policy objective ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def registry():
    return load_plugins().registry


def policy(registry, **loss_options):
    cfg = validate(OmegaConf.create({"policy_loss": {"name": "vanilla", **loss_options}}), ActorConfig, registry)
    return registry.get("objective", "policy").obj(cfg, registry)


def micro(rollout_shift: torch.Tensor) -> Batch:
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0], [1, 0, 0]])
    old = -torch.rand(4, 3, generator=g)
    return Batch(
        {
            "responses": torch.ones(4, 3, dtype=torch.long),
            "response_mask": mask,
            "old_log_probs": old,
            "rollout_log_probs": (old - rollout_shift) * mask,
            "advantages": torch.randn(4, 1, generator=g).expand(4, 3) * mask,
        }
    )


def test_identical_engines_give_weights_of_one_and_the_uncorrected_loss(registry):
    batch = micro(torch.zeros(4, 3))
    log_probs = batch["old_log_probs"] + 0.3 * torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    plain = policy(registry)
    corrected = policy(registry, rollout_is="token", rollout_rs="token_k1,seq_max_k2", rollout_rs_threshold="1.5,0.1")
    weights, _, _ = rollout_correction(batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"], corrected.correction)
    assert torch.equal(weights, batch["response_mask"].to(weights.dtype))  # 1 on every valid token
    agg = plain.counts(batch)
    assert corrected.counts(batch) == agg  # nothing rejected
    a, b = log_probs.clone().requires_grad_(True), log_probs.clone().requires_grad_(True)
    loss, _ = plain.loss(batch, {"log_probs": a}, agg)
    loss_c, metrics = corrected.loss(batch, {"log_probs": b}, agg)
    loss.backward()
    loss_c.backward()
    assert loss_c.item() == loss.item()
    assert torch.equal(a.grad, b.grad)
    assert metrics["rollout_corr/is_mean"] == 1.0 and metrics["rollout_corr/rs_masked_fraction"] == 0.0
    assert metrics["rollout_corr/kl"] == 0.0


def test_weights_multiply_the_token_loss_and_rejection_leaves_the_counts(registry):
    shift = torch.tensor([[LN3, 0.0, 0.0], [0.0, -LN2, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    batch = micro(shift)
    log_probs = batch["old_log_probs"].clone()  # ratio 1: vanilla's token loss is -A
    objective = policy(registry, rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="2.5")
    agg = objective.counts(batch)
    assert agg.global_tokens == 5.0  # token (0, 0) has weight 3 > 2.5: rejected, 5 of 6 tokens count
    loss, metrics = objective.loss(batch, {"log_probs": log_probs}, agg)
    adv, mask = batch["advantages"], batch["response_mask"].clone()
    mask[0, 0] = 0
    weights = torch.ones(4, 3)
    weights[1, 1] = 0.5  # e^-ln2; truncation at 2 does not touch it
    assert float(loss) == pytest.approx(float((-adv * weights * mask).sum() / 5), abs=1e-6)
    assert metrics["rollout_corr/rs_masked_fraction"] == pytest.approx(1 / 6)


def test_batch_normaliser_comes_from_the_counted_mini_batch(registry):
    shift = torch.zeros(4, 3)
    shift[0, 0] = -LN2  # weight .5 among five 1s: mean 5.5 / 6 over the mini-batch
    batch = micro(shift)
    objective = policy(registry, rollout_is="token", rollout_is_batch_normalize=True)
    agg = objective.counts(batch)
    part = batch[[0]]  # a micro-batch with only the first row: its own mean would be 2.5 / 3
    _, metrics = objective.loss(part, {"log_probs": part["old_log_probs"]}, agg)
    assert metrics["rollout_corr/is_batch_norm_factor"] == pytest.approx(5.5 / 6)


def test_missing_rollout_log_probs_is_a_clear_error(registry):
    batch = micro(torch.zeros(4, 3))
    del_batch = Batch({k: batch[k] for k in batch.keys() if k != "rollout_log_probs"})
    with pytest.raises(ValueError, match="needs the rollout engine's rollout_log_probs"):
        policy(registry, rollout_is="token").counts(del_batch)


# -- bypass mode -------------------------------------------------------------------------------
def bypass_inputs():
    logp = torch.tensor([[-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    rollout = torch.tensor([[-1.5, -2.0]], dtype=torch.float64)  # ratios e^.5, e^1
    old = torch.full((1, 2), -7.0, dtype=torch.float64)  # ignored in bypass mode
    return PolicyLossInputs(logp, old, torch.tensor([[1.0, 1.0]], dtype=torch.float64), torch.ones(1, 2), rollout_log_prob=rollout)


def test_bypass_ppo_clip_is_ppo_against_the_rollout_log_probs():
    data = bypass_inputs()
    loss, metrics = bypass_mode(data, Aggregation(), BypassOptions())
    expected, _ = vanilla(dataclasses.replace(data, old_log_prob=data.rollout_log_prob), Aggregation())
    assert float(loss) == pytest.approx(float(expected))
    assert float(loss) == pytest.approx(-1.2)  # both ratios clipped at 1.2 with A = 1
    assert metrics["rollout_corr/kl"] == pytest.approx(-0.75)


def test_bypass_reinforce_weights_the_log_prob_term():
    # weights min(e^.5, 2), min(e^1, 2) = 1.6487, 2: L = -(w0 * -1 + w1 * -1) / 2, dL/dlogp = -w / 2
    data = bypass_inputs()
    loss, metrics = bypass_mode(data, Aggregation(), BypassOptions(loss_type="reinforce", rollout_is="token"))
    w = [math.exp(0.5), 2.0]
    assert float(loss) == pytest.approx(sum(w) / 2)
    (grad,) = torch.autograd.grad(loss, data.log_prob)
    assert grad.tolist()[0] == pytest.approx([-w[0] / 2, -w[1] / 2])
    assert metrics["approx_kl"] == pytest.approx(-0.75)  # mean(rollout - logp)
    with pytest.raises(ValueError, match="loss_type is 'ppo'"):
        bypass_mode(data, Aggregation(), BypassOptions(loss_type="ppo"))


def test_bypass_leaves_the_objective_without_its_own_correction(registry):
    assert policy(registry, rollout_is="token").correction is not None
    cfg = validate(OmegaConf.create({"policy_loss": {"name": "bypass_mode", "rollout_is": "token"}}), ActorConfig, registry)
    assert registry.get("objective", "policy").obj(cfg, registry).correction is None
