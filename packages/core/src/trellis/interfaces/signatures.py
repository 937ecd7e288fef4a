"""Call signatures of the algorithm components (kinds ``advantage``, ``policy_loss``, ``kl``,
``sft_loss``, ``preference_loss``, ``distill_loss``, ``objective``, ``reward``). Implementations live in plugins
(trellis-algos).

Every token-level tensor is ``(batch, response_len)`` and comes with ``response_mask`` of the
same shape: 1 for tokens the model generated, 0 for padding and (multi-turn) environment tokens.
A registered component is a callable following one of these protocols; its ``Options``
dataclass (or the ``options=`` given to ``registry.add``) holds its config options.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from trellis.batch import Batch
from trellis.interfaces.backend import MODEL_INPUTS
from trellis.registry import Interface

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass
class AdvantageInputs:
    """What an advantage estimator may use.

    token_rewards: ``(batch, response_len)`` reward per token (the sequence score on the last
        valid token, minus any in-reward KL penalty).
    response_mask: ``(batch, response_len)`` 1 on generated tokens.
    group_ids: ``(batch,)`` int, samples of the same prompt share an id.
    values: ``(batch, response_len)`` critic values, for estimators that need them (gae).
    baseline_rewards: ``(batch,)`` reward of the greedy rollout of the sample's prompt (remax).
    old_log_probs: ``(batch, response_len)`` the behaviour policy's log-prob of each token.
    sum_sq_probs: ``(batch, response_len)`` ``sum_v p_v^2`` of the behaviour policy's next-token
        distribution at each token (optimal token baselines).
    reward_components: ``{key: (batch,)}`` the per-sample numbers a dict-returning reward gave
        besides ``score`` (gdpo).
    teacher_log_probs: ``(batch, response_len)`` a frozen teacher's log-prob of each token the
        policy sampled (on-policy distillation).
    fields: the step's batch fields the estimator names in its ``reads`` attribute, as the batch
        holds them (a tensor, or a list per sample: e.g. a multi-turn rollout's ``turn_scores``).
    """

    token_rewards: torch.Tensor
    response_mask: torch.Tensor
    group_ids: torch.Tensor
    values: torch.Tensor | None = None
    baseline_rewards: torch.Tensor | None = None
    old_log_probs: torch.Tensor | None = None
    sum_sq_probs: torch.Tensor | None = None
    reward_components: dict[str, torch.Tensor] | None = None
    teacher_log_probs: torch.Tensor | None = None
    fields: dict[str, Any] = field(default_factory=dict)


class AdvantageEstimator(Protocol):
    """An estimator declares in a ``needs`` attribute what it reads or requires beyond
    ``token_rewards``, ``response_mask`` and ``group_ids``; a recipe fills only the declared
    ``AdvantageInputs`` fields (the others are None) and sets up what they take:

    - ``"values"``: a critic; fills ``values``.
    - ``"greedy_baseline"``: a greedy rollout per prompt; fills ``baseline_rewards``.
    - ``"old_log_probs"``: the behaviour policy's log-probs, before the update; fills ``old_log_probs``.
    - ``"sum_sq_probs"``: the old-log-prob forward also returns them; fills ``sum_sq_probs``.
    - ``"reward_components"``: the reward's per-sample components; fills ``reward_components``.
    - ``"teacher_log_probs"``: a frozen ``teacher`` role from the model folder ``teacher.path``
      (same tokenizer) scores the policy's samples; fills ``teacher_log_probs``.
    - ``"groups"``: it compares samples of one prompt (with one sample per prompt every
      advantage is 0: the recipe warns).
    - ``"on_policy_only"``: exact on-policy, one update per batch of fresh samples (the recipe
      refuses settings that update more than once).

    A need not in this list (``trellis.registry.ADVANTAGE_NEEDS``) is refused when the estimator
    registers: nothing would fill it. What the step's batch already holds needs no setting up: an
    estimator names such fields in a ``reads`` attribute (``reads = ("turn_scores",)``) and gets
    them in ``AdvantageInputs.fields``; a field the run's samples lack stops the step, naming it."""

    def __call__(self, data: AdvantageInputs, options: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(advantages, returns)``, each ``(batch, response_len)``, zero where masked."""


@dataclass
class Aggregation:
    """How token losses become one scalar, normalised by the *global* mini-batch so that splitting
    it into micro-batches or data-parallel ranks leaves the loss and gradient unchanged.

    mode: ``token-mean`` | ``token-sum`` | ``seq-mean-token-sum`` | ``seq-mean-token-mean`` | ``seq-mean-token-sum-norm``.
    global_tokens: valid tokens in the whole mini-batch (``token-mean``); None = this micro-batch's.
    global_seqs: sequences in the whole mini-batch (``seq-mean-*``); None = this micro-batch's.
    norm_constant: divisor for ``seq-mean-token-sum-norm``; None = this micro-batch's width
        (``aggregation_for`` always sets it: a trimmed micro-batch's width is not the mini-batch's).
    """

    mode: str = "token-mean"
    global_tokens: float | None = None
    global_seqs: float | None = None
    norm_constant: float | None = None


def aggregation_for(mode: str, mask: torch.Tensor, norm_constant: float | None = None) -> Aggregation:
    """The ``Aggregation`` for a mini-batch with ``mask`` ``(batch, len)``: its valid-token and
    valid-sequence counts, to pass unchanged to every micro-batch cut from it (after summing the
    counts over data-parallel ranks), and the ``seq-mean-token-sum-norm`` divisor:
    ``norm_constant``, or else the mini-batch's full width ``len`` (the padded response length,
    the same on every data-parallel rank), so micro-batches trimmed to their own widths all
    divide by one constant."""
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")
    valid = mask != 0
    return Aggregation(
        mode=mode,
        global_tokens=float(valid.sum().item()),
        global_seqs=float(valid.any(-1).sum().item()),
        norm_constant=float(mask.shape[-1]) if norm_constant is None else norm_constant,
    )


@dataclass
class PolicyLossInputs:
    """log_prob, old_log_prob, advantages, response_mask: ``(batch, response_len)``.
    rollout_log_prob: the rollout engine's own log-probs, ``(batch, response_len)`` or None.
    rollout_is_weights: detached importance weights (rollout correction) the loss multiplies
    into its per-token loss before aggregating, ``(batch, response_len)`` or None."""

    log_prob: torch.Tensor
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    rollout_log_prob: torch.Tensor | None = None
    rollout_is_weights: torch.Tensor | None = None


class PolicyLoss(Protocol):
    def __call__(self, data: PolicyLossInputs, agg: Aggregation, options: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """Return ``(loss, metrics)``: a scalar with gradient and floats such as ``clip_frac``."""


class KLEstimator(Protocol):
    def __call__(self, log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
        """Per-token KL estimate ``(batch, response_len)`` from two ``(batch, response_len)`` inputs."""


class DistillLoss(Protocol):
    def __call__(self, student: torch.Tensor, teacher: torch.Tensor, options: Any) -> torch.Tensor:
        """A divergence ``(batch, response_len)`` between the student's and the teacher's
        next-token log-probs ``(batch, response_len, m)`` over the same ``m`` buckets (each row a
        whole distribution: the vocabulary, or the teacher's top-k tokens plus one for the rest);
        the gradient flows through the student's."""


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


# each side's fields in a pair batch: the rollout layout of a sample
PAIR_FIELDS = (*MODEL_INPUTS, "responses", "response_mask")


# a batch of scored pairs (the ``bradley_terry`` objective, the ``rm`` recipe): each side's model
# inputs ``(pairs, seq_len)`` right-padded, prefixed ``chosen_`` / ``rejected_``, and ``margin`` ``(pairs,)``
SCORED_PAIR_FIELDS = (*(f"{side}_{k}" for side in ("chosen", "rejected") for k in MODEL_INPUTS), "margin")


def pair_batch(chosen: Batch, rejected: Batch, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor) -> Batch:
    """Preference pairs for the ``preference`` objective: the rows of ``chosen`` and ``rejected``
    (rollout layout: ``input_ids``, ``attention_mask``, ``position_ids``, ``responses``,
    ``response_mask``), pair i = row i of each, prefixed ``chosen_`` / ``rejected_``, plus the
    reference's summed response log-probs ``ref_chosen_log_prob`` / ``ref_rejected_log_prob`` ``(pairs,)``."""
    fields = {f"{side}_{k}": part[k] for side, part in (("chosen", chosen), ("rejected", rejected)) for k in PAIR_FIELDS}
    fields["ref_chosen_log_prob"] = ref_chosen
    fields["ref_rejected_log_prob"] = ref_rejected
    return Batch(fields, meta=chosen.meta)


class PreferenceLoss(Protocol):
    def __call__(self, data: PreferenceInputs, options: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """Return ``(loss, metrics)``; the loss is the mean over pairs."""


class RewardFunction(Protocol):
    """verl's signature, so existing verl reward functions plug in unchanged."""

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float | dict:
        """Score one response. A dict must hold ``score``; its other numbers become metrics."""


class Objective(Protocol):
    """The loss of one training verb (kind ``objective``: ``policy``, ``value``, ``sft``,
    ``preference``), computed from what a backend's forward returns. A registered objective is a
    factory ``make(role_options, registry) -> Objective``.

    outputs: the forward outputs it needs (among the backend's ``Backend.outputs``).
    inputs: the ``Batch`` fields it reads (controllers ship only these, plus the model inputs).
    summed: metric names that are a micro-batch's share of the mini-batch (losses): summed over
        micro-batches and ranks. Every other metric is averaged.
    prefix (optional): its metrics' prefix (``sft`` -> ``sft/loss``); default the role's name.
    first_forward (optional): the field of the sampling policy's log-probs it reads (e.g.
        ``old_log_probs``) that, when a batch lacks it, may be the update's own first forward of
        ``log_probs``, detached (exact with one optimizer step per batch); None or absent: never.
    The role worker reads these once, when the role is built (:data:`OBJECTIVE`): a missing
    required part, or a name a typo away from an optional one, stops the build naming it.
    """

    outputs: tuple[str, ...]
    inputs: tuple[str, ...]
    summed: frozenset[str]

    def rows(self, batch: Batch) -> Batch:
        """The model-input rows of ``batch`` (a preference pair batch becomes its chosen then
        rejected rows); most objectives return ``batch`` itself."""

    def counts(self, batch: Batch) -> Aggregation:
        """This rank's part of the mini-batch counts (the worker sums them over ranks)."""

    def loss(self, micro: Batch, outputs: dict[str, torch.Tensor], agg: Aggregation) -> tuple[torch.Tensor, dict[str, float]]:
        """The micro-batch's share of the mini-batch loss (a scalar with gradient) and metrics.
        ``outputs`` are the forward outputs for ``rows(micro)``."""


# what a training objective (made by a factory of kind ``objective``) declares, read once when a role is built
OBJECTIVE = Interface(("outputs", "inputs", "summed", "rows", "counts", "loss"), {"prefix": None, "first_forward": None})
