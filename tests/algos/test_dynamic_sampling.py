"""Dynamic sampling's refill (``trellis_algos.rl.dynamic_sampling.fill``), DAPO's overlong penalty
and ``actor.mask_truncated``, on hand-built batches with hand-derived values."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from trellis.batch import Batch
from trellis.interfaces.rollout import SamplingParams
from trellis.rewards import RewardResult
from trellis_algos.rewards import add_overlong_penalty, overlong_penalty
from trellis_algos.rl import groups_with_signal, truncated, without_truncated
from trellis_algos.rl.dynamic_sampling import DynamicSamplingConfig, fill, group_has_signal


def rounds_of(*rounds: list[list[float]]):
    """``generate(round)`` returning, per round, one group of samples per inner list with those scores."""
    calls = []

    def generate(r: int) -> tuple[Batch, RewardResult]:
        calls.append(r)
        groups = rounds[r]
        scores = torch.tensor([float(s) for g in groups for s in g])
        uids = [f"r{r}g{i}" for i, g in enumerate(groups) for _ in g]
        batch = Batch({"response_mask": torch.ones(len(scores), 2 + r)}, {"uid": uids})
        token_scores = torch.zeros(len(scores), 2 + r)
        token_scores[:, -1] = scores
        return batch, RewardResult(token_scores, {"reward/mean": float(scores.mean())}, scores, {"acc": (scores > 0).float()})

    return generate, calls


def test_zero_variance_groups_are_dropped_and_the_batch_is_filled_exactly():
    generate, calls = rounds_of([[1, 1], [0, 1], [0, 0], [1, 0]], [[0, 2], [3, 4], [5, 5], [6, 7]])
    out = fill(generate, 3, DynamicSamplingConfig(enable=True), step=1)
    assert calls == [0, 1]
    assert out.batch["uid"].tolist() == ["r0g1", "r0g1", "r0g3", "r0g3", "r1g0", "r1g0"]  # the third group: round 1's first
    assert out.scores.tolist() == [0, 1, 1, 0, 0, 2]
    assert out.batch["token_scores"].sum(-1).tolist() == [0, 1, 1, 0, 0, 2]  # padded to round 1's width
    assert out.components["acc"].tolist() == [0, 1, 1, 0, 0, 1]
    assert out.first.metrics == {"reward/mean": 0.5}  # the reward metrics describe the first, unfiltered round
    # round 0's two constant groups and round 1's [5, 5]; round 1's [3, 4] and [6, 7] vary but are not needed
    assert out.metrics == {
        "dynamic_sampling/rounds": 2.0, "dynamic_sampling/kept_groups": 3.0, "dynamic_sampling/dropped_groups": 3.0,
        "dynamic_sampling/carried_groups": 0.0,
    }  # fmt: skip


def test_groups_beyond_the_target_are_left_over_and_carried_first_next_time():
    generate, calls = rounds_of([[0, 1], [2, 2], [3, 4], [5, 6]], [[7, 8]])
    out = fill(generate, 2, DynamicSamplingConfig(enable=True), step=1)
    assert out.batch["uid"].tolist() == ["r0g0", "r0g0", "r0g2", "r0g2"]
    [(left, scored)] = out.leftover  # [5, 6] varies but was not needed
    assert left["uid"].tolist() == ["r0g3", "r0g3"] and scored.scores.tolist() == [5, 6]
    nxt = fill(generate, 2, DynamicSamplingConfig(enable=True), step=2, carried=out.leftover)
    assert calls == [0, 0]  # the next step's one round: generate numbers its rounds per call of fill
    assert nxt.batch["uid"].tolist() == ["r0g3", "r0g3", "r0g0", "r0g0"]  # the carried group first, then one fresh
    assert nxt.metrics["dynamic_sampling/carried_groups"] == 1.0 and nxt.metrics["dynamic_sampling/rounds"] == 1.0


def test_every_filter_must_keep_a_group():
    def some_right(values, groups):
        return torch.zeros(int(groups.max()) + 1).scatter_reduce(0, groups, values, "amax") > 0

    generate, _ = rounds_of([[0, 0], [-1, 0], [0, 3], [1, 1]])  # varies: groups 1, 2; some sample above 0: groups 2, 3
    out = fill(generate, 2, DynamicSamplingConfig(enable=True, max_rounds=1), step=1, filters=(group_has_signal, some_right))
    assert out.batch["uid"].tolist() == ["r0g2", "r0g2"] and out.metrics["dynamic_sampling/dropped_groups"] == 3.0


def test_acc_ignores_a_score_that_varies_with_the_same_answer():
    generate, _ = rounds_of([[1, 2], [0, 3]])  # acc: [1, 1] (constant), [0, 1]
    out = fill(generate, 1, DynamicSamplingConfig(enable=True, metric="acc", max_rounds=1), step=1)
    assert out.batch["uid"].tolist() == ["r0g1", "r0g1"]
    assert out.metrics["dynamic_sampling/dropped_groups"] == 1.0


def test_the_round_cap_trains_on_what_was_kept_and_says_so(caplog):
    generate, calls = rounds_of([[1, 1], [0, 1], [0, 0]], [[2, 3], [4, 4], [1, 5]], [[0, 9]])
    with caplog.at_level(logging.WARNING, logger="trellis"):
        out = fill(generate, 4, DynamicSamplingConfig(enable=True, max_rounds=2), step=7, group_multiple=2)
    assert calls == [0, 1]  # the third round is never generated
    assert out.batch["uid"].tolist() == ["r0g1", "r0g1", "r1g0", "r1g0"]  # 3 kept, cut to a multiple of 2
    assert out.metrics["dynamic_sampling/kept_groups"] == 2.0 and out.metrics["dynamic_sampling/rounds"] == 2.0
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith("step 7: dynamic sampling found 3 of data.train_batch_prompts=4 prompt groups that algorithm.dynamic")
    assert "algorithm.dynamic_sampling.max_rounds=2 rounds; training on 2 groups (a multiple of 2)" in warning


def test_no_group_kept_skips_the_step(caplog):
    generate, _ = rounds_of([[1, 1]], [[0, 0]])
    with caplog.at_level(logging.WARNING, logger="trellis"):
        out = fill(generate, 1, DynamicSamplingConfig(enable=True, max_rounds=2), step=1)
    assert out.batch is None and out.metrics["dynamic_sampling/kept_groups"] == 0.0
    assert "skipping the step" in caplog.text


@pytest.mark.parametrize(
    ("length", "want"),
    [(10, 0.0), (12, 0.0), (13, -0.125), (14, -0.25), (16, -0.5)],  # max 16, buffer 4, penalty 0.5: (12 - L) / 4 * 0.5
)
def test_overlong_penalty_by_hand(length, want):
    assert float(overlong_penalty(torch.tensor([length]), 16, 4, 0.5)[0]) == pytest.approx(want)


def test_overlong_penalty_goes_on_the_score_and_the_last_token():
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    token_scores = torch.zeros(3, 4)
    token_scores[0, 3], token_scores[1, 1], token_scores[2, 2] = 1.0, 1.0, 0.0
    scored = RewardResult(token_scores, {}, torch.tensor([1.0, 1.0, 0.0]))
    shaped = add_overlong_penalty(scored, mask, max_len=4, buffer_len=2, penalty=1.0)  # lengths 4, 2, 3: penalties -1, 0, -0.5
    assert shaped.scores.tolist() == [0.0, 1.0, -0.5]
    assert shaped.token_scores.tolist() == [[0, 0, 0, 0], [0, 1, 0, 0], [0, 0, -0.5, 0]]
    assert shaped.metrics["reward/overlong_penalty_mean"] == pytest.approx(-0.5)


def test_mask_truncated_zeroes_exactly_the_samples_cut_by_the_limit():
    eos, stop = 2, 7
    responses = torch.tensor([[5, 6, 5], [5, 6, 2], [5, 2, 0], [5, 6, 7], [9, 9, 9]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]])
    batch = Batch({"responses": responses, "response_mask": mask})
    params = SamplingParams(max_new_tokens=3, stop_token_ids=[stop])
    tokenizer = SimpleNamespace(eos_token_id=eos)
    # 0 and 4 hit the limit mid-answer; 1 ends with eos at the limit, 3 with a stop token, 2 before it
    assert truncated(batch, params, tokenizer).tolist() == [True, False, False, False, True]
    masked = without_truncated(batch, params, tokenizer)
    assert masked["response_mask"].tolist() == [[0, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1], [0, 0, 0]]
    assert batch["response_mask"].equal(mask)  # the batch the other roles read keeps its mask


def test_a_group_filter_with_options_gets_them_checked_and_bound():
    """The example plugin's ``example_some_right`` takes ``above``: groups whose best sample scores
    above it are kept; the options are checked against its dataclass, and options nothing reads
    are refused."""
    from omegaconf import OmegaConf

    import trellis_algos.plugin
    import trellis_example.plugin
    from trellis.config import ConfigError, validate
    from trellis.plugins import load_plugins
    from trellis_algos.rl.dynamic_sampling import group_filters

    registry = load_plugins(entry_points=False, extra=[("algos", trellis_algos.plugin), ("example", trellis_example.plugin)]).registry

    def section(**given):
        return validate(OmegaConf.create({"enable": True, **given}), DynamicSamplingConfig, registry, "algorithm.dynamic_sampling.")

    values, groups = torch.tensor([0.0, 0.4, 0.0, 0.9, 1.0, 1.0]), torch.tensor([0, 0, 1, 1, 2, 2])
    default, strict = (
        group_filters(section(filters=["zero_variance", "example_some_right"], filter_options=options), registry)
        for options in ({}, {"example_some_right": {"above": 0.5}})
    )
    assert [f(values, groups).tolist() for f in default] == [[True, True, False], [True, True, True]]
    assert strict[1](values, groups).tolist() == [False, True, True]
    with pytest.raises(ConfigError, match=r"'algorithm.dynamic_sampling.filter_options.example_some_right.abov'"):
        group_filters(section(filters=["example_some_right"], filter_options={"example_some_right": {"abov": 0.5}}), registry)
    with pytest.raises(ConfigError, match=r"filter_options.example_some_right' gives options to a filter that .* does not list"):
        group_filters(section(filter_options={"example_some_right": {"above": 0.5}}), registry)
    with pytest.raises(ConfigError, match=r"filter_options.zero_variance.: group_filter .zero_variance. takes no options, got \[.above.\]"):
        group_filters(section(filter_options={"zero_variance": {"above": 0.5}}), registry)


def test_groups_with_signal_counts_groups_whose_rewards_differ():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    assert groups_with_signal(scores, groups) == {"reward/groups_with_signal": 0.25}  # only group 1 differs
