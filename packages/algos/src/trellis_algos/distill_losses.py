"""Distillation divergences (kind ``distill_loss``) between a student's and a teacher's next-token
distributions at each response position: ``reverse_kl``, ``forward_kl`` and the generalised
``jsd``, exact over the whole vocabulary or over the teacher's top-k tokens plus one bucket for
the rest (:func:`top_k_buckets`).

Each takes the student's and the teacher's log-probs ``(batch, response_len, m)`` over the same
``m`` buckets (each row a whole distribution) and returns the divergence ``(batch, response_len)``;
the gradient flows through the student's only. ``p`` is the student, ``q`` the teacher.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trellis import ranged


def top_k_buckets(student: torch.Tensor, teacher: torch.Tensor, whole_vocabulary: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Both distributions over the teacher's top-k tokens ``(..., k)``, plus, unless those are
    ``whole_vocabulary``, one last bucket holding each side's remaining mass ``1 - sum_k``
    (``(..., k + 1)``). Lumping the tail can only lower a divergence (data processing), so the
    top-k loss is a lower bound of the exact one, equal to it when the tail is empty. A tail
    below float32's smallest normal number counts as that number."""
    if whole_vocabulary:
        return student, teacher

    def tail(log_probs: torch.Tensor) -> torch.Tensor:
        rest = 1.0 - log_probs.exp().sum(-1, keepdim=True)
        return rest.clamp(min=torch.finfo(torch.float32).tiny).log()

    return torch.cat([student, tail(student)], -1), torch.cat([teacher, tail(teacher)], -1)


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``KL(p || q) = sum_m p (log p - log q)`` over the last dimension."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def reverse_kl(student: torch.Tensor, teacher: torch.Tensor, options: None = None) -> torch.Tensor:
    """``KL(p || q)``: mode-seeking, the student is penalised for mass where the teacher has
    little (TRL GKD's ``beta=1``; the sampled-token ``reverse_kl_teacher`` advantage estimates it
    from one token a position)."""
    return _kl(student, teacher.detach())


def forward_kl(student: torch.Tensor, teacher: torch.Tensor, options: None = None) -> torch.Tensor:
    """``KL(q || p)``: mass-covering, the student is penalised for little mass where the
    teacher has much (TRL GKD's ``beta=0``; supervised distillation's usual loss)."""
    return _kl(teacher.detach(), student)


@dataclass
class JSDOptions:
    """beta: the teacher's weight in the mixture ``m = beta q + (1 - beta) p`` and in the loss;
    strictly between 0 and 1 (TRL GKD's convention: its endpoints 0 and 1 are the forward and
    reverse KL, here ``forward_kl`` and ``reverse_kl``; the mixture formula itself is 0 there)."""

    beta: float = ranged(0.5, gt=0, lt=1)


def jsd(student: torch.Tensor, teacher: torch.Tensor, options: JSDOptions | None = None) -> torch.Tensor:
    """The generalised Jensen-Shannon divergence ``beta KL(q || m) + (1 - beta) KL(p || m)`` with
    ``m = beta q + (1 - beta) p``; symmetric at ``beta`` 0.5."""
    beta = (options or JSDOptions()).beta
    teacher = teacher.detach()
    mixture = torch.logsumexp(torch.stack([teacher + math.log(beta), student + math.log(1.0 - beta)]), 0)
    return beta * _kl(teacher, mixture) + (1.0 - beta) * _kl(student, mixture)


# name -> (divergence, options dataclass or None); plugin.py registers these.
LOSSES = {
    "reverse_kl": (reverse_kl, None),
    "forward_kl": (forward_kl, None),
    "jsd": (jsd, JSDOptions),
}
