"""On-policy distillation (kind ``advantage``): ``reverse_kl_teacher``, the student's per-token
reverse KL to a frozen teacher on its own samples as a negative advantage, optionally plus a task
reward's group-relative advantage.

For each sampled token, ``A_t = -(log p_student(y_t) - log p_teacher(y_t))`` (the student's
log-probs are the old log-probs, the policy that sampled). Maximising it lowers the sampled
estimate of KL(student || teacher); each token is credited with its own gap only (no return over
later tokens). This is the advantage of NeMo-RL's on-policy distillation estimator
(``adv_estimator: opd``, MOPD: ``sg[log pi_teacher - log pi_student]`` on ``prev_logprobs``) and
of Thinking Machines' "On-Policy Distillation" (2025: advantage = negative reverse KL, discount 0).
``reward_weight`` > 0 adds ``reward_weight x`` grpo's advantage of the task reward to every valid
token (a mix of our own choosing; the sources above train on the teacher alone). Masked tokens
(padding, multi-turn environment tokens) get 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trellis import AdvantageInputs, ranged
from trellis_algos.advantages import GRPOOptions, grpo, require_inputs


@dataclass
class ReverseKLTeacherOptions:
    """reward_weight: weight of the task reward's group-relative advantage ``(R - mean_g) /
    (std_g + epsilon)`` added to each token's distillation advantage (0: the teacher alone; it
    needs ``sampling.n`` >= 2 to compare samples); norm_by_std, epsilon: as grpo, for that term."""

    reward_weight: float = ranged(0.0, ge=0)
    norm_by_std: bool = True
    epsilon: float = ranged(1e-6, ge=0)


@torch.no_grad()
def reverse_kl_teacher(data: AdvantageInputs, options: ReverseKLTeacherOptions | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``A = -(old_log_probs - teacher_log_probs) + reward_weight x grpo(R)`` on valid tokens, 0
    elsewhere, ``(batch, response_len)``. Returns = A."""
    opts = options if options is not None else ReverseKLTeacherOptions()
    require_inputs(data, "reverse_kl_teacher", ("old_log_probs", "teacher_log_probs"), hint="; a teacher from teacher.path")
    valid = data.response_mask.bool()
    gap = data.old_log_probs.to(data.token_rewards.dtype) - data.teacher_log_probs.to(data.token_rewards.dtype)
    adv = torch.where(valid, -gap, torch.zeros_like(gap))
    if opts.reward_weight:
        adv = adv + opts.reward_weight * grpo(data, GRPOOptions(norm_by_std=opts.norm_by_std, epsilon=opts.epsilon))[0]
    return adv, adv


ESTIMATORS = {"reverse_kl_teacher": (reverse_kl_teacher, ReverseKLTeacherOptions)}

reverse_kl_teacher.needs = ("old_log_probs", "teacher_log_probs")
