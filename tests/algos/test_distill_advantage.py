"""``reverse_kl_teacher``: the per-token reverse-KL advantage by hand on a three-token vocabulary,
masked environment tokens, the task-reward mix and the inputs it refuses to go without."""

from __future__ import annotations

import math

import pytest
import torch

from trellis.interfaces.signatures import AdvantageInputs
from trellis_algos.distill import ReverseKLTeacherOptions, reverse_kl_teacher

LOG2 = math.log(2)
# a vocabulary of 3 tokens: the student's and the teacher's next-token distributions at one position
STUDENT = torch.tensor([0.5, 0.25, 0.25])
TEACHER = torch.tensor([0.25, 0.25, 0.5])


def inputs(sampled: list[list[int]], mask: list[list[int]], rewards=None, groups=None) -> AdvantageInputs:
    """Samples of tokens ``sampled`` ``(batch, len)`` scored by the fixed distributions above."""
    tokens = torch.tensor(sampled)
    mask = torch.tensor(mask)
    token_rewards = torch.zeros(tokens.shape)
    if rewards is not None:
        token_rewards[:, -1] = torch.tensor(rewards)
    return AdvantageInputs(
        token_rewards,
        mask,
        torch.tensor(groups if groups is not None else range(len(sampled))),
        old_log_probs=STUDENT.log()[tokens],
        teacher_log_probs=TEACHER.log()[tokens],
    )


def test_each_token_gets_minus_its_log_ratio_by_hand():
    # token 0: log(1/4) - log(1/2) = -log 2; token 1: equal probabilities, 0; token 2: log(1/2) - log(1/4) = +log 2
    adv, returns = reverse_kl_teacher(inputs([[0, 1, 2]], [[1, 1, 1]]))
    assert adv[0].tolist() == pytest.approx([-LOG2, 0.0, LOG2])
    assert torch.equal(adv, returns)


def test_its_expectation_under_the_student_is_minus_the_reverse_kl():
    # KL(student || teacher) = 1/2 log 2 + 1/4 log 1 + 1/4 log(1/2) = log(2) / 4
    adv, _ = reverse_kl_teacher(inputs([[0], [1], [2]], [[1], [1], [1]]))
    assert float((STUDENT * adv[:, 0]).sum()) == pytest.approx(-LOG2 / 4)


def test_environment_tokens_and_padding_get_zero():
    # a multi-turn sample: model token, two environment tokens (mask 0), model token, padding
    adv, _ = reverse_kl_teacher(inputs([[0, 2, 2, 2, 0]], [[1, 0, 0, 1, 0]]))
    assert adv[0].tolist() == pytest.approx([-LOG2, 0.0, 0.0, LOG2, 0.0])


def test_the_same_model_gives_zero_advantage():
    data = inputs([[0, 1, 2]], [[1, 1, 1]])
    data.teacher_log_probs = data.old_log_probs.clone()
    assert reverse_kl_teacher(data)[0].abs().sum() == 0


def test_reward_weight_adds_the_group_relative_task_advantage():
    # one group of two samples with rewards 1 and 0: grpo's (R - 0.5) / (std 1/sqrt(2) + 1e-6) = +-0.7071
    data = inputs([[0, 1], [2, 2]], [[1, 1], [1, 1]], rewards=[1.0, 0.0], groups=[0, 0])
    adv, _ = reverse_kl_teacher(data, ReverseKLTeacherOptions(reward_weight=2.0))
    task = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert adv.tolist() == [pytest.approx([-LOG2 + 2 * task, 2 * task]), pytest.approx([LOG2 - 2 * task, LOG2 - 2 * task])]


@pytest.mark.parametrize("missing", ["old_log_probs", "teacher_log_probs"])
def test_it_names_a_missing_input(missing):
    data = inputs([[0]], [[1]])
    setattr(data, missing, None)
    with pytest.raises(ValueError, match=f"AdvantageInputs.{missing}, which is None"):
        reverse_kl_teacher(data)
