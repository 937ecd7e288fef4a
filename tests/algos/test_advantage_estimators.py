"""Advantage estimators: values derived by hand on small batches, plus group properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trellis.interfaces.signatures import AdvantageInputs
from trellis_algos.advantages import (
    GAEOptions,
    GDPOOptions,
    GPGOptions,
    GRPOOptions,
    ReinforcePlusPlusOptions,
    gae,
    gdpo,
    gpg,
    grpo,
    grpo_passk,
    opo,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    remax,
    rloo,
)

FAST = settings(max_examples=50, deadline=None)
R3 = math.sqrt(3.0)


def close(actual, expected, rtol=1e-6):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=rtol, atol=1e-9)


def outcome(scores, lengths, groups, width=4, dtype=torch.float64):
    """Token rewards with each score on the last valid token; mask = first `length` tokens."""
    b = len(scores)
    rewards = torch.zeros(b, width, dtype=dtype)
    mask = torch.zeros(b, width, dtype=torch.long)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        mask[i, :n] = 1
        rewards[i, n - 1] = s
    return AdvantageInputs(rewards, mask, torch.tensor(groups))


def per_sample(adv, data):
    """The value on valid tokens (checked constant), asserting zeros on masked ones."""
    valid = data.response_mask.bool()
    assert torch.all(adv[~valid] == 0)
    out = []
    for row, m in zip(adv, valid):
        vals = row[m]
        assert torch.allclose(vals, vals[0].expand_as(vals))
        out.append(vals[0].item())
    return out


# group 0: R = 0, 0, 3 -> mean 1, deviations -1, -1, 2, unbiased var (1 + 1 + 4) / 2 = 3, std sqrt 3
# group 7: a single sample R = 5 -> mean 0, std 1
GROUPED = dict(scores=[0.0, 0.0, 3.0, 5.0], lengths=[2, 4, 1, 3], groups=[0, 0, 0, 7])


def test_grpo_by_hand():
    data = outcome(**GROUPED)
    adv, ret = grpo(data, GRPOOptions(epsilon=0.0))
    assert per_sample(adv, data) == pytest.approx([-1 / R3, -1 / R3, 2 / R3, 5.0])
    assert torch.equal(adv, ret)
    adv, _ = grpo(data, GRPOOptions(epsilon=1e-6))  # default eps added to the std
    assert per_sample(adv, data)[2] == pytest.approx(2 / (R3 + 1e-6), rel=1e-12)


def test_grpo_without_std_is_dr_grpo():
    data = outcome(**GROUPED)
    adv, _ = grpo(data, GRPOOptions(norm_by_std=False))
    assert per_sample(adv, data) == pytest.approx([-1.0, -1.0, 2.0, 5.0])


def test_grpo_accepts_string_group_ids():
    data = outcome(**GROUPED)
    data.group_ids = ["a", "a", "a", "b"]
    adv, _ = grpo(data, GRPOOptions(norm_by_std=False))
    assert per_sample(adv, data) == pytest.approx([-1.0, -1.0, 2.0, 5.0])


def test_rloo_by_hand():
    # leave-one-out: 0 - mean(0, 3) = -1.5, 0 - 1.5 = -1.5, 3 - mean(0, 0) = 3; single: kept as 5
    data = outcome(**GROUPED)
    adv, _ = rloo(data)
    assert per_sample(adv, data) == pytest.approx([-1.5, -1.5, 3.0, 5.0])


def test_opo_by_hand():
    # lengths 1 and 3, R = 1 and 0: b = (1*1 + 3*0) / 4 = 0.25
    data = outcome(scores=[1.0, 0.0], lengths=[1, 3], groups=[4, 4])
    adv, _ = opo(data)
    assert per_sample(adv, data) == pytest.approx([0.75, -0.25])


def test_gpg_by_hand():
    # batch 4, group a R = 1, 0 (mean .5), group b R = 0, 0. One non-zero reward: alpha = 4.
    data = outcome(scores=[1.0, 0.0, 0.0, 0.0], lengths=[1, 2, 3, 4], groups=[0, 0, 1, 1])
    adv, _ = gpg(data)
    assert per_sample(adv, data) == pytest.approx([2.0, -2.0, 0.0, 0.0])
    # two samples with a non-zero advantage: alpha = 2
    adv, _ = gpg(data, GPGOptions(alpha_from="nonzero_advantages"))
    assert per_sample(adv, data) == pytest.approx([1.0, -1.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="alpha_from"):
        gpg(data, GPGOptions(alpha_from="other"))


def test_remax_by_hand():
    # token rewards .5, 0, 1: reward-to-go 1.5, 1, 1; minus the greedy reward .25
    rewards = torch.tensor([[0.5, 0.0, 1.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    data = AdvantageInputs(rewards, mask, torch.tensor([0]), baseline_rewards=torch.tensor([0.25]))
    adv, ret = remax(data)
    close(adv, [[1.25, 0.75, 0.75, 0.0]])
    close(ret, [[1.5, 1.0, 1.0, 0.0]])
    with pytest.raises(ValueError, match="baseline_rewards"):
        remax(AdvantageInputs(rewards, mask, torch.tensor([0])))


def test_reinforce_plus_plus_by_hand():
    # gamma .5, reward 1 on the 3rd token: returns .25, .5, 1 (0 on padding)
    data = AdvantageInputs(torch.tensor([[0.0, 0.0, 1.0, 0.0]]), torch.tensor([[1, 1, 1, 0]]), torch.tensor([0]))
    adv, ret = reinforce_plus_plus(data, ReinforcePlusPlusOptions(gamma=0.5))
    close(ret, [[0.25, 0.5, 1.0, 0.0]])
    # mean 7/12, deviations -4/12, -1/12, 5/12, unbiased var (16 + 1 + 25)/144 / 2 = 21/144
    s = math.sqrt(21)
    close(adv, [[-4 / s, -1 / s, 5 / s, 0.0]], rtol=1e-6)


def test_grpo_passk_by_hand():
    # group 0: R = 0, 3, 1 (std sqrt(7/3)): only sample 1 learns, (3 - 1) / std
    # group 1: R = 2, 2 (a tie, std 0): the first best gets (2 - 2) / eps = 0
    data = outcome([0.0, 3.0, 1.0, 2.0, 2.0], [2, 1, 3, 1, 2], [0, 0, 0, 1, 1])
    adv, ret = grpo_passk(data, GRPOOptions(epsilon=0.0 + 1e-6))
    std = math.sqrt(((0 - 4 / 3) ** 2 + (3 - 4 / 3) ** 2 + (1 - 4 / 3) ** 2) / 2)
    assert per_sample(adv, data) == pytest.approx([0.0, 2 / (std + 1e-6), 0.0, 0.0, 0.0])
    assert torch.equal(adv, ret)
    adv, _ = grpo_passk(data, GRPOOptions(norm_by_std=False))
    assert per_sample(adv, data) == pytest.approx([0.0, 2.0, 0.0, 0.0, 0.0])


def test_grpo_passk_refuses_a_group_of_one():
    with pytest.raises(ValueError, match="at least 2 samples per group"):
        grpo_passk(outcome([1.0, 0.0, 1.0], [1, 1, 1], [0, 0, 5]))


def test_reinforce_plus_plus_carries_the_return_over_environment_tokens():
    # multi-turn: token 1 is an environment token (reward 9 there is ignored). gamma .5:
    # G_2 = 1, G_0 = 0 + .5 * 1 = .5 (verl 0.9.1 carries it over the env token the same way)
    data = AdvantageInputs(torch.tensor([[0.0, 9.0, 1.0]]), torch.tensor([[1, 0, 1]]), torch.tensor([0]))
    _, ret = reinforce_plus_plus(data, ReinforcePlusPlusOptions(gamma=0.5))
    close(ret, [[0.5, 0.0, 1.0]])


def test_reinforce_plus_plus_baseline_by_hand():
    # one group R = 1 (2 tokens), 0 (1 token): mean .5 -> token values .5, .5, -.5;
    # token mean 1/6, deviations 1/3, 1/3, -2/3, unbiased var (1/9 + 1/9 + 4/9) / 2 = 1/3
    data = outcome(scores=[1.0, 0.0], lengths=[2, 1], groups=[3, 3], width=3)
    adv, _ = reinforce_plus_plus_baseline(data)
    close(adv, [[1 / R3, 1 / R3, 0.0], [-2 / R3, 0.0, 0.0]], rtol=1e-6)


def test_gae_by_hand():
    # gamma = lam = 1, token 2 is padding. t=1: delta = 1 + 0 - .2 = .8, A = .8;
    # t=0: delta = 0 + .2 - .5 = -.3, A = -.3 + .8 = .5. Returns A + V = 1, 1.
    # Whitening two values gives -1/sqrt2, +1/sqrt2.
    data = AdvantageInputs(
        torch.tensor([[0.0, 1.0, 0.0]]),
        torch.tensor([[1, 1, 0]]),
        torch.tensor([0]),
        values=torch.tensor([[0.5, 0.2, 0.9]]),
    )
    adv, ret = gae(data)
    close(ret, [[1.0, 1.0, 0.0]])
    close(adv, [[-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0]], rtol=1e-6)


def test_gae_skips_environment_tokens_and_discounts():
    # token 1 is an environment token. gamma .5, lam .5:
    # t=2: delta = 1 - .4 = .6, A = .6; t=0: V_next = .4 (skipping token 1),
    # delta = 0 + .5*.4 - .2 = 0, A = 0 + .5*.5*.6 = .15. Returns .15 + .2 = .35 and .6 + .4 = 1.
    data = AdvantageInputs(
        torch.tensor([[0.0, 9.0, 1.0]]),
        torch.tensor([[1, 0, 1]]),
        torch.tensor([0]),
        values=torch.tensor([[0.2, 9.0, 0.4]]),
    )
    _, ret = gae(data, GAEOptions(gamma=0.5, lam=0.5))
    close(ret, [[0.35, 0.0, 1.0]])


def test_gae_needs_values():
    with pytest.raises(ValueError, match="values"):
        gae(outcome(**GROUPED))


@st.composite
def groups_of_two_or_more(draw):
    sizes = draw(st.lists(st.integers(2, 5), min_size=1, max_size=4))
    scores, lengths, ids = [], [], []
    for g, n in enumerate(sizes):
        scores += draw(st.lists(st.floats(-10, 10), min_size=n, max_size=n))
        lengths += draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
        ids += [g * 3] * n
    order = draw(st.permutations(range(len(ids))))  # groups need not be contiguous
    return [scores[i] for i in order], [lengths[i] for i in order], [ids[i] for i in order]


@FAST
@given(groups_of_two_or_more(), st.sampled_from(["grpo", "grpo_dr", "rloo"]))
def test_group_advantages_sum_to_zero(batch, name):
    scores, lengths, ids = batch
    data = outcome(scores, lengths, ids)
    fn = {"grpo": grpo, "rloo": rloo, "grpo_dr": lambda d: grpo(d, GRPOOptions(norm_by_std=False))}[name]
    values = per_sample(fn(data)[0], data)
    for g in set(ids):
        members = [v for v, i in zip(values, ids) if i == g]
        assert abs(sum(members)) <= 1e-6 * max(1.0, max(abs(v) for v in members))


@FAST
@given(groups_of_two_or_more(), st.integers(1, 4))
def test_opo_with_equal_lengths_is_the_mean_baseline(batch, length):
    scores, _, ids = batch
    data = outcome(scores, [length] * len(scores), ids)
    values = per_sample(opo(data)[0], data)
    for v, s, g in zip(values, scores, ids):
        group = [x for x, i in zip(scores, ids) if i == g]
        assert v == pytest.approx(s - sum(group) / len(group), abs=1e-9)


def components_case():
    """Four one-token samples in two groups with components fmt = 1, 0 | 1, 1 and acc = 0, 1 | 1, 0."""
    data = outcome([1, 1, 2, 1], [1, 1, 1, 1], [0, 0, 1, 1], width=1)
    data.reward_components = {"fmt": torch.tensor([1.0, 0, 1, 1]), "acc": torch.tensor([0.0, 1, 1, 0])}
    return data


def test_gdpo_by_hand():
    # per component, a pair (x, y) normalises to +-|x - y| / 2 / (|x - y| / sqrt 2) = +-1/sqrt 2:
    # fmt -> +s, -s | 0, 0 and acc -> -s, +s | +s, -s (s = 1/sqrt 2); sum 0, 0, s, -s; whitened over 4
    # tokens (mean 0, unbiased var 1/3): 0, 0, +-sqrt(3/2)
    data = components_case()
    adv, ret = gdpo(data, GDPOOptions(reward_keys="fmt, acc"))
    close(adv, [[0.0], [0.0], [math.sqrt(1.5)], [-math.sqrt(1.5)]], rtol=1e-5)
    assert torch.equal(adv, ret)
    # weights 2, 1: sum s, -s, s, -s; var 4 (1/2) / 3 = 2/3 -> +-sqrt(3)/2
    adv, _ = gdpo(data, GDPOOptions(reward_keys="fmt,acc", reward_weights="2,1"))
    close(adv, [[R3 / 2], [-R3 / 2], [R3 / 2], [-R3 / 2]], rtol=1e-5)


@pytest.mark.parametrize(
    "options, components, message",
    [
        (GDPOOptions(), None, "needs algorithm.advantage.reward_keys"),
        (GDPOOptions(reward_keys="fmt,acc", reward_weights="1"), None, r"reward_weights='1' must be 2 comma-separated numbers"),
        (GDPOOptions(reward_keys="fmt,acc", reward_weights="1,x"), None, "must be 2 comma-separated numbers"),
        (GDPOOptions(reward_keys="fmt,style"), None, r"\['style'\] of algorithm.advantage.reward_keys are not among .* \['acc', 'fmt'\]"),
        (GDPOOptions(reward_keys="fmt"), {}, r"\['fmt'\].*not among the reward's components \[\]"),
    ],
)
def test_gdpo_names_bad_keys_and_weights(options, components, message):
    data = components_case()
    if components is not None:
        data.reward_components = components
    with pytest.raises(ValueError, match=message):
        gdpo(data, options)
