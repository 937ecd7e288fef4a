"""The objectives (kind ``objective``): each training verb's loss from a backend's forward outputs,
composed from the registered components the role's config names. Backends hold no loss code.

Each is a factory ``make(options, registry)`` for the role's (or algorithm's) config section.
"""

from __future__ import annotations

from typing import Any

import torch

from trellis import PAIR_FIELDS, SCORED_PAIR_FIELDS, Aggregation, Batch, PolicyLossInputs, PreferenceInputs, aggregation_for, resolve_component
from trellis_algos.aggregation import agg_loss
from trellis_algos.distill_losses import top_k_buckets
from trellis_algos.entropy import entropy_loss
from trellis_algos.kl import KLControlOptions, apply_kl_penalty, kl_loss, make_kl_controller
from trellis_algos.rollout_correction import RolloutCorrectionOptions, batch_normaliser, mismatch_metrics, rejection_mask, rollout_correction
from trellis_algos.value_loss import clipped_value_loss


class PolicyObjective:
    """The actor's PPO-family loss: ``policy_loss - entropy_coeff * entropy + kl_loss_coef * KL +
    distill.coef * D(student, teacher) + router_aux_loss_coef * aux``, every term aggregated over the
    global mini-batch with ``loss_agg_mode`` (the mixture-of-experts load-balancing loss ``aux``: the
    mean over the mini-batch's sequences of their micro-batch's, the model's own formula). The
    distillation term (``distill.coef`` > 0) compares the student's log-probs at the teacher's top ids
    (forward output ``top_ids_log_probs``) with the teacher's (``teacher_top_log_probs``); ``distill.use_policy_loss`` false drops the policy loss.

    Rollout correction (the policy loss's ``rollout_is`` / ``rollout_rs`` keys, verl's decoupled
    mode): importance weights between ``old_log_probs`` and ``rollout_log_probs`` multiply the
    policy loss per token, and rejected tokens leave every term and the global counts. The
    batch-normalised weights are divided by the mean of the mini-batch last passed to
    :meth:`counts` (the worker counts each mini-batch before computing its micro-batches).
    A loss marked ``corrects_rollout`` (``bypass_mode``) does its own. Without correction the
    mismatch metrics (``rollout_corr/kl``, ``log_ppl_diff``...) between ``old_log_probs`` and the
    engine's ``rollout_log_probs`` are reported all the same: a trainer and engine that disagree
    (a broken weight sync, a precision mismatch) show in every run.
    """

    summed = frozenset({"pg_loss", "entropy_loss", "kl_loss", "distill_loss", "router_aux_loss"})

    def __init__(self, options: Any, registry: Any) -> None:
        self.options = options
        self.policy_loss, self.policy_options = resolve_component(registry, "policy_loss", options.policy_loss)
        distill = options.distill
        self.distill = resolve_component(registry, "distill_loss", distill.loss) if distill.coef > 0 else None
        opts = self.policy_options
        corrected = isinstance(opts, RolloutCorrectionOptions) and opts.enabled
        corrects = registry.get("policy_loss", options.policy_loss.name).declared["corrects_rollout"]
        self.correction = opts if corrected and not corrects else None
        self.is_batch_mean: torch.Tensor | None = None
        self.kl = registry.get("kl", options.kl_loss_type).obj if options.use_kl_loss else None
        self.aux_coef = getattr(options, "router_aux_loss_coef", 0.0)
        self.outputs = (
            ("log_probs",)
            + ("entropy",) * (options.entropy_coeff != 0)
            + ("top_ids_log_probs",) * bool(self.distill)
            + ("router_aux_loss",) * (self.aux_coef > 0)
        )
        self.inputs = (
            ("responses", "response_mask", "old_log_probs", "advantages", "rollout_log_probs")
            + (("ref_log_probs",) if self.kl else ())
            + (("top_ids", "teacher_top_log_probs") if self.distill else ())
        )
        # without rollout correction, a one-step update may take the old log-probs from its own first
        # forward; the correction's weights and rejections need them before any forward (``counts``)
        self.first_forward = "old_log_probs" if self.correction is None else None

    def rows(self, batch: Batch) -> Batch:
        return batch

    def counts(self, batch: Batch) -> Aggregation:
        mask = batch["response_mask"]
        if self.correction is not None:
            old, rollout = batch["old_log_probs"], self._rollout_log_probs(batch)
            if self.correction.rollout_rs is not None:
                kept, _ = rejection_mask(old - rollout, mask, self.correction.rollout_rs, self.correction.rollout_rs_threshold)
                mask = kept
            if self.correction.rollout_is is not None and self.correction.rollout_is_batch_normalize:
                self.is_batch_mean = batch_normaliser(old, rollout, batch["response_mask"], self.correction)
        return aggregation_for(self.options.loss_agg_mode, mask, self.options.loss_norm_constant)

    @staticmethod
    def _rollout_log_probs(batch: Batch) -> torch.Tensor:
        if "rollout_log_probs" not in batch:
            raise ValueError(
                "rollout correction (actor.policy_loss.rollout_is / rollout_rs / log_metrics) needs the rollout "
                "engine's rollout_log_probs in the batch; this batch has none"
            )
        return batch["rollout_log_probs"]

    def loss(self, micro: Batch, outputs: dict[str, torch.Tensor], agg: Aggregation) -> tuple[torch.Tensor, dict[str, float]]:
        log_prob = outputs["log_probs"]
        device = log_prob.device
        mask = micro["response_mask"].to(device)
        old = micro["old_log_probs"].to(device)
        rollout = micro["rollout_log_probs"].to(device) if "rollout_log_probs" in micro else None
        weights, corr_metrics = None, {}
        if self.correction is not None:
            rollout = self._rollout_log_probs(micro).to(device)
            weights, mask, corr_metrics = rollout_correction(old, rollout, mask, self.correction, self.is_batch_mean)
        elif rollout is not None:  # always on: how far the engine that sampled is from the trainer
            corr_metrics = {f"rollout_corr/{k}": v for k, v in mismatch_metrics(old, rollout, mask).items()}
        data = PolicyLossInputs(
            log_prob=log_prob,
            old_log_prob=old,
            advantages=micro["advantages"].to(device),
            response_mask=mask,
            rollout_log_prob=rollout,
            rollout_is_weights=weights,
        )
        if self.options.distill.use_policy_loss:
            loss, metrics = self.policy_loss(data, agg, self.policy_options)
        else:
            loss, metrics = log_prob.new_zeros(()), {}
        metrics = {**metrics, **corr_metrics}
        if "entropy" in outputs:
            ent = entropy_loss(outputs["entropy"], mask, agg)
            loss = loss - self.options.entropy_coeff * ent
            metrics["entropy_loss"] = float(ent.detach())
        if self.kl is not None:
            kl, kl_metrics = kl_loss(log_prob, micro["ref_log_probs"].to(device), mask, agg, self.kl)
            loss = loss + self.options.kl_loss_coef * kl
            metrics.update(kl_metrics)
        if self.distill is not None:
            divergence = self._divergence(micro, outputs["top_ids_log_probs"])
            term = agg_loss(divergence, mask, agg)
            loss = loss + self.options.distill.coef * term
            metrics["distill_loss"] = float(term.detach())
        if "router_aux_loss" in outputs:
            # each row holds its micro-batch's load-balancing loss: summed over the mini-batch's sequences, their mean
            aux = outputs["router_aux_loss"].sum() / (agg.global_seqs or len(micro))
            loss = loss + self.aux_coef * aux
            metrics["router_aux_loss"] = float(aux.detach())
        return loss, metrics

    def _divergence(self, micro: Batch, student: torch.Tensor) -> torch.Tensor:
        """The registered divergence ``(batch, response_len)`` between the student's log-probs at
        the teacher's top ids and the teacher's own, ``(batch, response_len, k)`` each."""
        fn, options = self.distill
        teacher = micro["teacher_top_log_probs"].to(student.device)
        return fn(*top_k_buckets(student, teacher, whole_vocabulary=self.options.distill.top_k == 0), options)


class ValueObjective:
    """The critic's clipped value loss (``cliprange_value``), aggregated with ``loss_agg_mode``
    (``loss_norm_constant``: the ``seq-mean-token-sum-norm`` divisor, verl's ``loss_scale_factor``)."""

    summed = frozenset({"vf_loss"})
    outputs = ("values",)
    inputs = ("responses", "response_mask", "returns", "values")

    def __init__(self, options: Any, registry: Any) -> None:
        self.options = options

    def rows(self, batch: Batch) -> Batch:
        return batch

    def counts(self, batch: Batch) -> Aggregation:
        return aggregation_for(self.options.loss_agg_mode, batch["response_mask"], self.options.loss_norm_constant)

    def loss(self, micro: Batch, outputs: dict[str, torch.Tensor], agg: Aggregation) -> tuple[torch.Tensor, dict[str, float]]:
        vpreds = outputs["values"]
        device = vpreds.device
        return clipped_value_loss(
            vpreds,
            micro["returns"].to(device),
            micro["values"].to(device),
            micro["response_mask"].to(device),
            agg,
            self.options.cliprange_value,
        )


class SFTObjective:
    """A registered SFT loss (``loss``) over the label tokens where ``loss_mask`` is 1."""

    summed = frozenset({"loss"})
    outputs = ("label_log_probs",)
    inputs = ("loss_mask",)
    prefix = "sft"

    def __init__(self, options: Any, registry: Any) -> None:
        self.options = options
        self.sft_loss, self.loss_options = resolve_component(registry, "sft_loss", options.loss)

    def rows(self, batch: Batch) -> Batch:
        return batch

    def counts(self, batch: Batch) -> Aggregation:
        return aggregation_for(self.options.loss_agg_mode, batch["loss_mask"][:, 1:])

    def loss(self, micro: Batch, outputs: dict[str, torch.Tensor], agg: Aggregation) -> tuple[torch.Tensor, dict[str, float]]:
        token_log_probs = outputs["label_log_probs"]
        return self.sft_loss(token_log_probs, micro["loss_mask"][:, 1:].to(token_log_probs.device), agg, self.loss_options)


class PreferenceObjective:
    """A registered preference loss (``loss``, e.g. DPO ``sigmoid``, ``ipo``) on pairs.

    A pair batch (``trellis.interfaces.signatures.pair_batch``) holds per pair the chosen and
    rejected sample's fields prefixed ``chosen_`` / ``rejected_`` and the reference's summed
    response log-probs ``ref_chosen_log_prob``, ``ref_rejected_log_prob`` ``(pairs,)``. Each
    micro-batch of pairs is forwarded as one batch of its chosen rows then its rejected rows;
    the loss is the pairs' mean over the global mini-batch.
    """

    summed = frozenset({"loss"})
    outputs = ("log_probs",)
    inputs = (
        *(f"{side}_{k}" for side in ("chosen", "rejected") for k in PAIR_FIELDS),
        "ref_chosen_log_prob",
        "ref_rejected_log_prob",
    )

    def __init__(self, options: Any, registry: Any) -> None:
        self.preference_loss, self.loss_options = resolve_component(registry, "preference_loss", options.loss)

    def rows(self, batch: Batch) -> Batch:
        sides = []
        for side in ("chosen", "rejected"):
            prefix = f"{side}_"
            fields = {k[len(prefix) :]: batch[k] for k in batch.tensors.keys() if k.startswith(prefix)}
            fields["ref_log_prob"] = batch[f"ref_{side}_log_prob"]
            sides.append(Batch(fields, meta=batch.meta))
        return Batch.cat(sides, pad=True)

    def counts(self, batch: Batch) -> Aggregation:
        return Aggregation(mode="seq-mean-token-sum", global_seqs=float(len(batch)))

    def loss(self, micro: Batch, outputs: dict[str, torch.Tensor], agg: Aggregation) -> tuple[torch.Tensor, dict[str, float]]:
        log_probs = outputs["log_probs"]
        seq = (log_probs * micro["response_mask"].to(log_probs.device)).sum(-1)
        ref = micro["ref_log_prob"].to(seq.device)
        pairs = len(micro) // 2
        data = PreferenceInputs(chosen=seq[:pairs], rejected=seq[pairs:], ref_chosen=ref[:pairs], ref_rejected=ref[pairs:])
        mean, metrics = self.preference_loss(data, self.loss_options)
        share = mean * pairs / agg.global_seqs
        return share, {**metrics, "loss": float(share.detach())}


class BradleyTerryObjective:
    """A reward model's Bradley-Terry loss on preference pairs (a batch of
    ``trellis.SCORED_PAIR_FIELDS``): ``-log sigmoid(r_chosen - r_rejected - margin)``, the mean
    over the global mini-batch's pairs, each ``r`` the model's ``scores`` (its head at the
    sequence's last attended token). Each micro-batch of pairs is forwarded as one batch of its
    chosen rows then its rejected rows. Metrics (``rm/``): ``loss``, ``accuracy`` (the share of
    pairs with ``r_chosen > r_rejected``) and ``margin`` (the mean ``r_chosen - r_rejected``),
    each a share of the mini-batch's pairs, so exact however the pairs are cut."""

    summed = frozenset({"loss", "accuracy", "margin"})
    outputs = ("scores",)
    inputs = SCORED_PAIR_FIELDS
    prefix = "rm"

    def __init__(self, options: Any, registry: Any) -> None:
        self.options = options

    def rows(self, batch: Batch) -> Batch:
        sides = []
        for side in ("chosen", "rejected"):
            prefix = f"{side}_"
            fields = {k[len(prefix) :]: batch[k] for k in batch.tensors.keys() if k.startswith(prefix)}
            sides.append(Batch({**fields, "margin": batch["margin"]}, meta=batch.meta))
        return Batch.cat(sides, pad=True).trim_padding()

    def counts(self, batch: Batch) -> Aggregation:
        return Aggregation(mode="seq-mean-token-sum", global_seqs=float(len(batch)))

    def loss(self, micro: Batch, outputs: dict[str, torch.Tensor], agg: Aggregation) -> tuple[torch.Tensor, dict[str, float]]:
        scores = outputs["scores"]
        pairs = len(micro) // 2
        diff = scores[:pairs] - scores[pairs:]
        loss = -torch.nn.functional.logsigmoid(diff - micro["margin"][:pairs].to(diff.device)).sum() / agg.global_seqs
        diff = diff.detach()
        return loss, {
            "loss": float(loss.detach()),
            "accuracy": float((diff > 0).sum()) / agg.global_seqs,
            "margin": float(diff.sum()) / agg.global_seqs,
        }


class KLInReward:
    """KL in the reward (verl's ``use_kl_in_reward``): ``token_scores - beta * KL(old || ref)`` with
    a fixed or adaptive ``beta`` (the ``algorithm`` section's ``kl_*`` keys). Stateful: the
    adaptive coefficient is checkpointed through ``state_dict``."""

    def __init__(self, options: Any, registry: Any) -> None:
        self.estimator = registry.get("kl", options.kl_penalty).obj
        self.controller = make_kl_controller(
            KLControlOptions(type=options.kl_ctrl_type, kl_coef=options.kl_coef, target_kl=options.target_kl, horizon=options.kl_horizon)
        )

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Token rewards ``(batch, response_len)`` and metrics ``actor/reward_kl``, ``actor/reward_kl_coef``."""
        rewards, kl = apply_kl_penalty(
            batch["token_scores"], batch["old_log_probs"], batch["ref_log_probs"], batch["response_mask"], self.controller, self.estimator
        )
        return rewards, {"actor/reward_kl": kl["kl"], "actor/reward_kl_coef": kl["kl_coef"]}

    def state_dict(self) -> dict[str, Any]:
        return self.controller.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.controller.load_state_dict(state)


# name -> factory(options, registry); plugin.py registers these.
OBJECTIVES = {
    "policy": PolicyObjective,
    "value": ValueObjective,
    "sft": SFTObjective,
    "preference": PreferenceObjective,
    "bradley_terry": BradleyTerryObjective,
    "kl_in_reward": KLInReward,
}
