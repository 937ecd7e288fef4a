"""Call signatures of the algorithm components (kinds ``advantage``, ``policy_loss``, ``kl``,
``sft_loss``, ``preference_loss``, ``reward``). Implementations live in plugins (trellis-algos).

Every token-level tensor is ``(batch, response_len)`` and comes with ``response_mask`` of the
same shape: 1 for tokens the model generated, 0 for padding and (multi-turn) environment tokens.
A registered component is a callable following one of these protocols; its ``Options``
dataclass (or the ``options=`` given to ``registry.add``) holds its config options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class AdvantageInputs:
    """What an advantage estimator may use.

    token_rewards: ``(batch, response_len)`` reward per token (the sequence score on the last
        valid token, minus any in-reward KL penalty).
    response_mask: ``(batch, response_len)`` 1 on generated tokens.
    group_ids: ``(batch,)`` int, samples of the same prompt share an id.
    values: ``(batch, response_len)`` critic values, for estimators that need them (gae).
    baseline_rewards: ``(batch,)`` reward of the greedy rollout of the sample's prompt (remax).
    """

    token_rewards: torch.Tensor
    response_mask: torch.Tensor
    group_ids: torch.Tensor
    values: torch.Tensor | None = None
    baseline_rewards: torch.Tensor | None = None


class AdvantageEstimator(Protocol):
    def __call__(self, data: AdvantageInputs, options: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(advantages, returns)``, each ``(batch, response_len)``, zero where masked."""


@dataclass
class Aggregation:
    """How token losses become one scalar, normalised by the *global* mini-batch so that splitting
    it into micro-batches or data-parallel ranks leaves the loss and gradient unchanged.

    mode: ``token-mean`` | ``seq-mean-token-sum`` | ``seq-mean-token-mean`` | ``seq-mean-token-sum-norm``.
    global_tokens: valid tokens in the whole mini-batch (``token-mean``); None = this micro-batch's.
    global_seqs: sequences in the whole mini-batch (``seq-mean-*``); None = this micro-batch's.
    norm_constant: divisor for ``seq-mean-token-sum-norm``; None = the response length.
    """

    mode: str = "token-mean"
    global_tokens: float | None = None
    global_seqs: float | None = None
    norm_constant: float | None = None


@dataclass
class PolicyLossInputs:
    """log_prob, old_log_prob, advantages, response_mask: ``(batch, response_len)``.
    rollout_log_prob: the rollout engine's own log-probs, ``(batch, response_len)`` or None."""

    log_prob: torch.Tensor
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    rollout_log_prob: torch.Tensor | None = None


class PolicyLoss(Protocol):
    def __call__(self, data: PolicyLossInputs, agg: Aggregation, options: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """Return ``(loss, metrics)``: a scalar with gradient and floats such as ``clip_frac``."""


class KLEstimator(Protocol):
    def __call__(self, log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
        """Per-token KL estimate ``(batch, response_len)`` from two ``(batch, response_len)`` inputs."""


class SFTLoss(Protocol):
    def __call__(
        self, token_log_probs: torch.Tensor, loss_mask: torch.Tensor, agg: Aggregation, options: Any
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """``token_log_probs``: ``(batch, seq_len)`` log-prob of each label token (with gradient);
        ``loss_mask``: ``(batch, seq_len)`` 1 where the token counts. Return ``(loss, metrics)``."""


@dataclass
class PreferenceInputs:
    """Summed sequence log-probs, each ``(pairs,)``: policy and reference, chosen and rejected."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor


class PreferenceLoss(Protocol):
    def __call__(self, data: PreferenceInputs, options: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """Return ``(loss, metrics)``; the loss is the mean over pairs."""


class RewardFunction(Protocol):
    """verl's signature, so existing verl reward functions plug in unchanged."""

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float | dict:
        """Score one response. A dict must hold ``score``; its other numbers become metrics."""
