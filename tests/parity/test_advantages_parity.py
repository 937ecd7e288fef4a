"""Advantage estimators against verl 0.9.1's ``core_algos``: equal on every valid token; the
deliberate differences (what sits on masked tokens) are named and checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from parity_inputs import EMPTY_ROW, TOL, B, T, make_case

from trellis.interfaces.hf import sum_sq_probs_from_logits
from trellis.interfaces.signatures import AdvantageInputs
from trellis_algos import advantages as ours
from trellis_algos import token_baseline as tb

core = pytest.importorskip("verl.trainer.ppo.core_algos", reason="the parity tests need verl==0.9.1 (nox -s parity)")
AlgoConfig = pytest.importorskip("verl.trainer.config").AlgoConfig


def inputs(case):
    return AdvantageInputs(case.rewards, case.mask, case.group_ids, values=case.values, baseline_rewards=case.baselines)


def index(case):
    return np.array(case.group_ids.tolist())


def on_valid(ours_out, verl_out, mask):
    valid = mask.bool()
    torch.testing.assert_close(ours_out[valid], verl_out.to(ours_out.dtype)[valid], **TOL)


OUTCOME = {
    # trellis name -> (trellis call, verl call); both (advantages, returns)
    "grpo": (lambda d: ours.grpo(d), lambda c: core.compute_grpo_outcome_advantage(c.rewards, c.mask, index(c))),
    "grpo_dr": (
        lambda d: ours.grpo(d, ours.GRPOOptions(norm_by_std=False)),
        lambda c: core.compute_grpo_outcome_advantage(c.rewards, c.mask, index(c), norm_adv_by_std_in_grpo=False),
    ),
    "grpo_vectorized": (lambda d: ours.grpo(d), lambda c: core.compute_grpo_vectorized_outcome_advantage(c.rewards, c.mask, index(c))),
    "rloo": (lambda d: ours.rloo(d), lambda c: core.compute_rloo_outcome_advantage(c.rewards, c.mask, index(c))),
    "reinforce_plus_plus_baseline": (
        lambda d: ours.reinforce_plus_plus_baseline(d),
        lambda c: core.compute_reinforce_plus_plus_baseline_outcome_advantage(c.rewards, c.mask, index(c)),
    ),
    "opo": (lambda d: ours.opo(d), lambda c: core.compute_opo_outcome_advantage(c.rewards, c.mask, index(c))),
    "gpg": (lambda d: ours.gpg(d), lambda c: core.compute_gpg_outcome_advantage(c.rewards, c.mask, index(c))),
    "reinforce_plus_plus": (
        lambda d: ours.reinforce_plus_plus(d, ours.ReinforcePlusPlusOptions(gamma=0.9)),
        lambda c: core.compute_reinforce_plus_plus_outcome_advantage(c.rewards, c.mask, config=AlgoConfig(gamma=0.9)),
    ),
}


@pytest.mark.parametrize("name", sorted(OUTCOME))
def test_estimator_matches_verl(name, case):
    mine, theirs = OUTCOME[name]
    adv, ret = mine(inputs(case))
    verl_adv, verl_ret = theirs(case)
    on_valid(adv, verl_adv, case.mask)
    on_valid(ret, verl_ret, case.mask)
    # verl zeroes the masked tokens of these estimators too
    assert torch.all(verl_adv[~case.mask.bool()] == 0) and torch.all(adv[~case.mask.bool()] == 0)


def test_rloo_vectorized_is_rloo_including_singletons(case):
    """Deliberate difference: verl's ``rloo_vectorized`` gives a group of one advantage 0 where its
    own ``rloo`` keeps the raw score; trellis's ``rloo_vectorized`` is ``rloo`` (raw score)."""
    adv, _ = ours.rloo(inputs(case))
    verl_adv, _ = core.compute_rloo_vectorized_outcome_advantage(case.rewards, case.mask, index(case))
    single = (case.group_ids == 2)[:, None] & case.mask.bool()
    others = case.mask.bool() & ~single
    torch.testing.assert_close(adv[others], verl_adv.to(adv.dtype)[others], **TOL)
    torch.testing.assert_close(adv[single], case.rewards.sum(-1, keepdim=True).expand_as(adv)[single])
    assert torch.all(verl_adv[single] == 0)


def test_grpo_passk_matches_verl():
    case = make_case(5, empty_row=False)
    case.group_ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 4])  # no singleton: pass@k refuses them
    case.group_ids[-1] = 3
    for norm in (True, False):
        adv, _ = ours.grpo_passk(inputs(case), ours.GRPOOptions(norm_by_std=norm))
        verl_adv, _ = core.compute_grpo_passk_outcome_advantage(case.rewards, case.mask, index(case), config=AlgoConfig(norm_adv_by_std_in_grpo=norm))
        on_valid(adv, verl_adv, case.mask)


def test_gae_matches_verl_on_valid_tokens_and_zeroes_the_holes(case):
    """Deliberate difference: verl leaves advantages and returns at masked tokens (holes and
    padding) non-zero; trellis zeroes them."""
    adv, ret = ours.gae(inputs(case), ours.GAEOptions(gamma=0.9, lam=0.8))
    verl_adv, verl_ret = core.compute_gae_advantage_return(case.rewards, case.values, case.mask, gamma=0.9, lam=0.8)
    on_valid(adv, verl_adv, case.mask)
    on_valid(ret, verl_ret, case.mask)
    masked = ~case.mask.bool()
    assert torch.all(adv[masked] == 0) and torch.all(ret[masked] == 0)
    assert verl_ret[masked].abs().max() > 0.1  # values + carried advantages


def test_remax_matches_verl_on_valid_tokens_and_zeroes_the_holes(case):
    """Deliberate difference: verl's returns at a hole carry the reward-to-go; trellis zeroes them."""
    adv, ret = ours.remax(inputs(case))
    verl_adv, verl_ret = core.compute_remax_outcome_advantage(case.rewards, case.baselines, case.mask)
    on_valid(adv, verl_adv, case.mask)
    on_valid(ret, verl_ret, case.mask)
    holes = ~case.mask.bool() & (case.mask.flip(-1).cumsum(-1).flip(-1) > 0)  # masked with a valid token after
    assert holes.any() and torch.all(ret[holes] == 0)
    assert verl_ret[holes].abs().max() > 0


def test_rewards_on_masked_tokens_are_ignored():
    """Deliberate difference: verl sums the score over every position; trellis over valid tokens."""
    case = make_case(0)
    case.rewards[EMPTY_ROW] = 0
    case.rewards[EMPTY_ROW, 0] = 5.0  # a reward on a masked token
    adv, _ = ours.grpo(inputs(case))
    verl_adv, _ = core.compute_grpo_outcome_advantage(case.rewards, case.mask, index(case))
    # the other samples of that group see a different mean: 5 counts for verl, not here
    group = (case.group_ids == case.group_ids[EMPTY_ROW]) & case.mask.bool().any(-1)
    assert not torch.allclose(adv[group], verl_adv[group].to(adv.dtype))


def with_sum_sq_probs(case):
    """The case's inputs plus the behaviour policy's log-probs and a seeded ``sum_sq_probs``."""
    sum_sq = 0.9 * torch.rand(case.mask.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    return AdvantageInputs(case.rewards, case.mask, case.group_ids, old_log_probs=case.old_log_prob, sum_sq_probs=sum_sq)


TOKEN_BASELINES = {
    "optimal_token_baseline": (tb.optimal_token_baseline, core.compute_optimal_token_baseline_advantage),
    "tir_optimal_token_baseline": (tb.tir_optimal_token_baseline, core.compute_multi_turn_optimal_token_baseline_advantage),
}


@pytest.mark.parametrize("zero_tail", [True, False], ids=["zero_tail", "no_zero_tail"])
@pytest.mark.parametrize("name", sorted(TOKEN_BASELINES))
def test_token_baselines_match_verl_on_valid_tokens_and_zero_the_holes(name, zero_tail, case):
    """Deliberate difference: verl's returns at a hole carry the reward-to-go; trellis zeroes them."""
    mine, theirs = TOKEN_BASELINES[name]
    data = with_sum_sq_probs(case)
    adv, ret = mine(data, tb.TokenBaselineOptions(handle_zero_tail=zero_tail))
    verl_adv, verl_ret = theirs(case.rewards, case.mask, index(case), data.old_log_probs, data.sum_sq_probs, handle_zero_tail=zero_tail)
    on_valid(adv, verl_adv, case.mask)
    on_valid(ret, verl_ret, case.mask)
    masked = ~case.mask.bool()
    assert torch.all(adv[masked] == 0) and torch.all(verl_adv[masked] == 0)
    holes = masked & (case.mask.flip(-1).cumsum(-1).flip(-1) > 0)
    assert holes.any() and torch.all(ret[holes] == 0) and verl_ret[holes].abs().max() > 0


def test_token_baseline_variants_and_zero_tail_change_the_numbers(case):
    """The parity cases exercise what tells the two apart: holes shift the position alignment
    (tir aligns by valid-token count) and some group has a unique longest sample."""
    data = with_sum_sq_probs(case)
    otb, _ = tb.optimal_token_baseline(data)
    tir, _ = tb.tir_optimal_token_baseline(data)
    no_tail, _ = tb.optimal_token_baseline(data, tb.TokenBaselineOptions(handle_zero_tail=False))
    assert not torch.allclose(otb, tir) and not torch.allclose(otb, no_tail)


def test_sum_sq_probs_matches_verl():
    """The forward's ``sum_sq_probs`` (``trellis.interfaces.hf``) against verl's ``calculate_sum_pi_squared_from_logits``."""
    from verl.utils.torch_functional import calculate_sum_pi_squared_from_logits

    logits = 4 * torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    torch.testing.assert_close(sum_sq_probs_from_logits(logits), calculate_sum_pi_squared_from_logits(logits), **TOL)


def gdpo_inputs(case, empty_component=0.0):
    """Two seeded reward components per sample (the empty row's set to ``empty_component``), as
    trellis gets them and as verl reads them (``non_tensor_batch`` plus prompt/attention fields
    from which it finds each response's last token)."""
    g = torch.Generator().manual_seed(11)
    components = {k: torch.randint(0, 3, (B,), generator=g).double() for k in ("fmt", "acc")}
    for c in components.values():
        c[EMPTY_ROW] = empty_component
    prompt = torch.ones(B, 2, dtype=torch.long)
    # verl puts a component on token attention_mask[:, prompt:].sum() - 1 and sums every position,
    # so any position works (the empty row's -1 lands on a masked token and still counts)
    attention = torch.cat([prompt, (torch.arange(T) < case.mask.sum(-1, keepdim=True)).long()], dim=-1)
    batch = {"prompts": prompt, "attention_mask": attention}
    non_tensor = {k: v.numpy() for k, v in components.items()}
    return components, batch, non_tensor


@pytest.mark.parametrize("weights", [None, [2.0, 0.5]], ids=["equal", "weighted"])
def test_gdpo_matches_verl(weights, case):
    """The empty row's components are 0 here (see the next test)."""
    components, batch, non_tensor = gdpo_inputs(case)
    data = AdvantageInputs(case.rewards, case.mask, case.group_ids, reward_components=components)
    options = ours.GDPOOptions(reward_keys="fmt,acc", reward_weights=",".join(map(str, weights)) if weights else "")
    adv, ret = ours.gdpo(data, options)
    config = AlgoConfig(gdpo_reward_keys=["fmt", "acc"], gdpo_reward_weights=weights)
    verl_adv, _ = core.compute_gdpo_outcome_advantage(case.rewards, case.mask, index(case), config=config, non_tensor_batch=non_tensor, batch=batch)
    on_valid(adv, verl_adv, case.mask)
    assert torch.equal(adv, ret) and torch.all(adv[~case.mask.bool()] == 0)


def test_gdpo_counts_an_empty_response_with_components_0():
    """Deliberate difference: verl keeps an empty response's components (it puts them on a masked
    token and sums every position); trellis takes 0, as for the score of every outcome estimator."""
    case = make_case(3)
    components, batch, non_tensor = gdpo_inputs(case, empty_component=2.0)
    data = AdvantageInputs(case.rewards, case.mask, case.group_ids, reward_components=components)
    adv, _ = ours.gdpo(data, ours.GDPOOptions(reward_keys="fmt,acc"))
    config = AlgoConfig(gdpo_reward_keys=["fmt", "acc"])
    verl_adv, _ = core.compute_gdpo_outcome_advantage(case.rewards, case.mask, index(case), config=config, non_tensor_batch=non_tensor, batch=batch)
    assert not torch.allclose(adv[case.mask.bool()], verl_adv.to(adv.dtype)[case.mask.bool()])
    for c in components.values():
        c[EMPTY_ROW] = 0.0
    non_tensor = {k: v.numpy() for k, v in components.items()}
    verl_adv, _ = core.compute_gdpo_outcome_advantage(case.rewards, case.mask, index(case), config=config, non_tensor_batch=non_tensor, batch=batch)
    on_valid(adv, verl_adv, case.mask)
