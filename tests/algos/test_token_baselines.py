"""Optimal token baselines (plain and multi-turn) and their forward input ``sum_sq_probs``, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trellis.interfaces.hf import sum_sq_probs_from_logits
from trellis.interfaces.signatures import AdvantageInputs
from trellis_algos.token_baseline import TokenBaselineOptions, optimal_token_baseline, tir_optimal_token_baseline

NO_TAIL = TokenBaselineOptions(handle_zero_tail=False)


def close(actual, expected):
    # the baseline's epsilon (1e-8) moves values by up to ~1e-8
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=0, atol=1e-7)


def inputs(mask, rewards, groups, pi, sum_sq):
    """``w = 1 - 2 pi + sum_sq`` per token from the given probabilities."""
    mask = torch.tensor(mask)
    return AdvantageInputs(
        torch.tensor(rewards, dtype=torch.float64),
        mask,
        torch.tensor(groups),
        old_log_probs=torch.tensor(pi, dtype=torch.float64).log(),
        sum_sq_probs=torch.tensor(sum_sq, dtype=torch.float64),
    )


def uniform(mask, rewards, groups):
    """pi = 0.5 and sum p^2 = 0.5 everywhere: w = 0.5 on every token."""
    shape = (len(mask), len(mask[0]))
    return inputs(mask, rewards, groups, torch.full(shape, 0.5).tolist(), torch.full(shape, 0.5).tolist())


def test_optimal_token_baseline_by_hand():
    # group 0: a (R = 1) with w = 0.5, 0.5 -> W = 0.5, 1.0; b (R = 0) with w = 1 - 0.5 + 0.5 = 1.0 and
    # 1 - 1 + 0.25 = 0.25 -> W = 1.0, 1.25. B_0 = 1 * 0.5 / 1.5 = 1/3, B_1 = 1 * 1.0 / 2.25 = 4/9.
    # c alone in group 1 keeps its return.
    data = inputs(
        mask=[[1, 1], [1, 1], [1, 0]],
        rewards=[[0, 1], [0, 0], [2, 0]],
        groups=[0, 0, 1],
        pi=[[0.5, 0.5], [0.25, 0.5], [0.5, 0.5]],
        sum_sq=[[0.5, 0.5], [0.5, 0.25], [0.5, 0.5]],
    )
    adv, ret = optimal_token_baseline(data)
    close(adv, [[2 / 3, 5 / 9], [-1 / 3, -4 / 9], [2, 0]])
    close(ret, [[1, 1], [0, 0], [2, 0]])


def test_zero_tail_leaves_a_unique_longest_sample_without_baseline_past_the_others():
    # a: length 1, R = 0; b: length 3, R = 1; w = 0.5. B_0 = (0 + 1 * 0.5) / 1 = 0.5; at t = 1, 2
    # only b is valid so B_t = G_b W_b / W_b = 1 and b's advantage would be 0 there.
    data = uniform(mask=[[1, 0, 0], [1, 1, 1]], rewards=[[0, 0, 0], [0, 0, 1]], groups=[0, 0])
    adv, _ = optimal_token_baseline(data, NO_TAIL)
    close(adv, [[-0.5, 0, 0], [0.5, 0, 0]])
    adv, _ = optimal_token_baseline(data)
    close(adv, [[-0.5, 0, 0], [0.5, 1, 1]])


def test_two_longest_samples_of_equal_length_are_no_tail():
    # equal W for both: B_t = 1/2 everywhere
    data = uniform(mask=[[1, 1, 1], [1, 1, 1]], rewards=[[0, 0, 1], [0, 0, 0]], groups=[0, 0])
    adv, _ = optimal_token_baseline(data)
    close(adv, [[0.5, 0.5, 0.5], [-0.5, -0.5, -0.5]])


def test_tir_aligns_samples_by_valid_tokens_across_environment_tokens():
    # a: valid, env, valid (R = 1); b: two valid tokens (R = 0); w = 0.5.
    # tir: k-th valid tokens pair up: W = 0.5, 1.0 for both, B_k = 1/2; a's advantages sit on its
    # valid positions 0 and 2.
    # position-aligned: t = 0: B = 0.5; t = 1: only b (G = 0) -> 0; t = 2: only a -> B = G_a = 1.
    data = uniform(mask=[[1, 0, 1], [1, 1, 0]], rewards=[[0, 0, 1], [0, 0, 0]], groups=[0, 0])
    adv, ret = tir_optimal_token_baseline(data)
    close(adv, [[0.5, 0, 0.5], [-0.5, -0.5, 0]])
    close(ret, [[1, 0, 1], [0, 0, 0]])
    adv, _ = optimal_token_baseline(data)
    close(adv, [[0.5, 0, 0], [-0.5, 0, 0]])


def test_tir_does_not_count_an_empty_sample_in_the_group():
    # with an empty partner, tir leaves a alone (baseline 0); the plain form counts the empty
    # sample and, without the zero tail, subtracts a's own return (advantage ~0)
    data = uniform(mask=[[1, 1], [0, 0]], rewards=[[0, 1], [0, 0]], groups=[0, 0])
    adv, _ = tir_optimal_token_baseline(data, NO_TAIL)
    close(adv, [[1, 1], [0, 0]])
    adv, _ = optimal_token_baseline(data, NO_TAIL)
    close(adv, [[0, 0], [0, 0]])


@pytest.mark.parametrize("estimator", [optimal_token_baseline, tir_optimal_token_baseline])
@pytest.mark.parametrize("field", ["old_log_probs", "sum_sq_probs"])
def test_missing_forward_inputs_are_named(estimator, field):
    data = uniform(mask=[[1, 1]], rewards=[[0, 1]], groups=[0])
    setattr(data, field, None)
    with pytest.raises(ValueError, match=f"{estimator.__name__}.*AdvantageInputs.{field}.*sum_sq_probs"):
        estimator(data)


def test_sum_sq_probs_by_hand_and_stable():
    # p = (1/4, 3/4): 1/16 + 9/16 = 5/8; uniform over 4: 1/4; huge equal logits: 1/2; -inf is p = 0
    logits = torch.tensor([[0.0, math.log(3.0), -math.inf], [0.0, 0.0, 0.0], [1000.0, 1000.0, -math.inf]], dtype=torch.float32)
    logits = torch.cat([logits, torch.tensor([[-math.inf], [0.0], [-math.inf]])], dim=-1)
    assert sum_sq_probs_from_logits(logits).tolist() == pytest.approx([5 / 8, 1 / 4, 1 / 2])


def test_sum_sq_probs_chunked_matches_in_value_and_gradient():
    torch.manual_seed(0)
    base = 3 * torch.randn(2, 5, 7, dtype=torch.float64)
    whole, chunked = base.clone().requires_grad_(True), base.clone().requires_grad_(True)
    expected = torch.softmax(base, -1).pow(2).sum(-1)
    torch.testing.assert_close(sum_sq_probs_from_logits(whole), expected)
    torch.testing.assert_close(sum_sq_probs_from_logits(chunked, chunk_size=3), expected)
    sum_sq_probs_from_logits(whole).sum().backward()
    sum_sq_probs_from_logits(chunked, chunk_size=3).sum().backward()
    torch.testing.assert_close(chunked.grad, whole.grad)
