"""The ``rl`` recipe's learner: its roles, and one step on a batch of samples, top to bottom: checks,
old log-probs, reference, teacher, values, advantages, updates, weight sync, sync checks, metrics."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

from trellis import AdvantageInputs, Batch, RolloutGroup, Run, SamplingParams, instantiate_options, resolve_component, without_adapter
from trellis.kit.recipe import expert_counts, mark_replay, text_config, without_replay
from trellis_algos.rl.ahead import staleness_metrics
from trellis_algos.rl.checks import needs, on_policy_update
from trellis_algos.rl.figures import first_groups, groups_with_signal, kl_summary, router_metrics, throughput, truncated, without_truncated
from trellis_algos.rl.invariants import agreement_check, check_alignment, trainer_dtype
from trellis_algos.rl.partial import version_span
from trellis_algos.rl.samples import COMPONENT, StepSamples
from trellis_algos.rl.sync_probe import SyncCheckConfig, SyncProbe
from trellis_algos.rl.teacher import TEACHER_NEED, score_samples, wants_teacher

log = logging.getLogger("trellis")

# an estimator's need -> the AdvantageInputs field it fills and the batch field that holds it
ADVANTAGE_FIELDS = {
    "values": ("values", "values"),
    "greedy_baseline": ("baseline_rewards", "baseline_rewards"),
    "old_log_probs": ("old_log_probs", "old_log_probs"),
    "sum_sq_probs": ("sum_sq_probs", "sum_sq_probs"),
    TEACHER_NEED: ("teacher_log_probs", "teacher_log_probs"),
}


class Learner:
    """The actor (and the reference, critic and teacher the config asks for) and what one step
    does with a batch of samples (:meth:`step`). ``watch(rollout)`` arms the sync checks."""

    def __init__(self, cfg: DictConfig, run: Run, tokenizer, async_run: bool) -> None:
        registry = run.registry
        self.cfg, self.run, self.tokenizer = cfg, run, tokenizer
        self.estimator, self.estimator_options = resolve_component(registry, "advantage", cfg.algorithm.advantage)
        self.needs = needs(registry, cfg.algorithm.advantage.name)
        self.reads = registry.get("advantage", cfg.algorithm.advantage.name).declared["reads"]
        use_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
        self.kl_in_reward = registry.get("objective", "kl_in_reward").obj(cfg.algorithm, registry) if cfg.algorithm.use_kl_in_reward else None
        self.actor = run.spawn("actor", cfg.model.path, cfg.actor, objectives={"update": "policy"})
        # the reference: the actor with its adapter off (no second model), else a frozen copy with the actor's micro-batching
        self.adapter_ref = use_ref and cfg.actor.adapter.rank > 0
        self.ref = run.spawn("ref", cfg.model.path, cfg.actor) if use_ref and not self.adapter_ref else None
        critic = cfg.critic.model_path or cfg.model.path
        self.critic = run.spawn("critic", critic, cfg.critic, head="value", objectives={"update": "value"}) if "values" in self.needs else None
        self.teacher = run.spawn("teacher", cfg.teacher.path, without_adapter(cfg.actor)) if wants_teacher(cfg, self.needs) else None
        self.teacher_top_k = cfg.actor.distill.top_k if cfg.actor.distill.coef > 0 else None
        # equal rewards within every group zero the advantages of group-relative estimators only
        # (a critic's values or a teacher's log-probs give advantages whatever the rewards), and
        # leave a distillation loss without the policy loss training all the same
        run.signals.watch_reward = "groups" in self.needs and cfg.actor.distill.use_policy_loss
        # a mixture-of-experts policy: its router figures come from the old-log-prob forward, which measures the routing flips
        self.experts = expert_counts(text_config(cfg.model.path))
        self.replay = cfg.actor.router_replay
        self.router_outputs = ("router_entropy",) * bool(self.experts) + ("routing_flips",) * (self.replay != "off")
        self.on_policy = self.replay == "off" and on_policy_update(cfg, registry, self.needs, cfg.data.train_batch_prompts * cfg.sampling.n)
        self.async_run = async_run

    @property
    def roles(self) -> dict[str, Any]:
        """The roles a checkpoint saves."""
        return {"actor": self.actor, "critic": self.critic}

    def watch(self, rollout: RolloutGroup) -> None:
        """The checks of ``rollout``'s weights after every sync and of every batch's log-probs."""
        options = instantiate_options(self.cfg.sync_check, SyncCheckConfig)
        precision = trainer_dtype(resolve_component(self.run.registry, "backend", self.cfg.backend)[1])
        sampling = SamplingParams(**self.cfg.sampling)
        self.rollout = rollout
        self.probe = SyncProbe(options, rollout, sampling, precision)
        self.agreement = agreement_check(options, rollout, sampling, precision)

    def step(self, step: int, made: StepSamples, handover: dict[str, float], before_sync: Callable[[int], None]) -> dict[str, float]:
        """Train on step ``step``'s samples; the step's metrics (``handover``: how they were made).
        ``before_sync(step)`` runs before the engines take the new weights (the exact async schedule)."""
        cfg, run, timer, tokenizer = self.cfg, self.run, self.run.timer, self.tokenizer
        params, first, batch = made.params, made.first, made.batch
        reward_metrics = {**first.metrics, **made.metrics, **handover}
        if batch is None:  # dynamic sampling kept no group: the step is logged, the policy unchanged
            return {**reward_metrics, **groups_with_signal(first.scores, first_groups(first, params.n))}
        if not batch["response_mask"].any():  # every conversation ended before the model's first token
            log.warning(
                "step %d: none of the %d samples holds a token the model wrote (each ended in an error of the agent or the "
                "environment before its first model turn: multiturn/finish_error); the step trains nothing, the policy is unchanged",
                step, len(batch),
            )  # fmt: skip
            return {**reward_metrics, "actor/skipped_no_model_tokens": 1.0}
        batch.meta["step"] = step
        mark_replay(batch, self.replay, cfg.rollout.name)
        check_alignment(batch, step)
        run.log_samples(step, batch, batch["token_scores"].sum(-1), tokenizer)
        old = None  # on-policy: the actor's update computes them in its first forward
        if not self.on_policy:
            with timer("old_log_prob"):
                wanted = ("log_probs", "entropy", *("sum_sq_probs",) * ("sum_sq_probs" in self.needs), *self.router_outputs)
                old = self.actor.forward(batch, wanted)
                batch["old_log_probs"] = old["log_probs"]
                if "sum_sq_probs" in old:
                    batch["sum_sq_probs"] = old["sum_sq_probs"]
        if self.ref is not None or self.adapter_ref:
            with timer("ref"):
                if self.adapter_ref:
                    batch["ref_log_probs"] = self.actor.forward(batch, ("base_log_probs",))["base_log_probs"]
                else:
                    batch["ref_log_probs"] = self.ref.log_prob(batch)["log_probs"]
        teacher_metrics = {}
        if self.teacher is not None:
            with timer("teacher"), without_replay(batch):  # the routes are the policy's, not the teacher's
                teacher_metrics = score_samples(self.teacher, batch, self.teacher_top_k)
        if self.critic is not None:
            with timer("values"):
                batch["values"] = self.critic.values(batch)["values"]
        with timer("adv"):
            kl_metrics = compute_advantages(batch, self.estimator, self.estimator_options, self.kl_in_reward, self.needs, self.reads)
        update_metrics: dict[str, float] = {}
        if self.critic is not None:
            with timer("update_critic"):
                update_metrics.update(self.critic.update(batch))
        with timer("update_actor"):
            update_metrics.update(self.actor.update(without_truncated(batch, params, tokenizer) if cfg.actor.mask_truncated else batch))
        with timer("wait_schedule"):
            before_sync(step)
        with timer("weight_sync"):
            self.rollout.sync_weights(version=step)
        with timer("sync_check"):
            gap = update_metrics.get("actor/rollout_corr/abs_diff")
            sync_metrics = {**self.agreement.check(batch, step, batch.get("old_log_probs"), gap), **self.probe.check(self.actor, batch, step)}
        mask = batch["response_mask"].float()
        return {
            **reward_metrics,
            **update_metrics,
            **kl_metrics,
            **teacher_metrics,
            **sync_metrics,
            **kl_summary(update_metrics, kl_metrics),
            **({"actor/entropy": float((old["entropy"] * mask).sum() / mask.sum().clamp(min=1))} if old is not None else {}),
            **(router_metrics(batch, old, self.experts[0]) if self.experts and old is not None else {}),
            **(groups_with_signal(first.scores, first_groups(first, params.n)) if params.n > 1 else {}),
            **({"response/masked_truncated": float(truncated(batch, params, tokenizer).sum())} if cfg.actor.mask_truncated else {}),
            "response/length_mean": float(mask.sum(-1).mean()),
            "response/clip_frac": float((mask.sum(-1) >= params.max_new_tokens).float().mean()),
            "critic/advantage_mean": float((batch["advantages"] * mask).sum() / mask.sum().clamp(min=1)),
            **throughput(batch, reward_metrics.get("timing/gen_s", timer.times.get("timing/gen_s")), timer.times),
            **(staleness_metrics(batch["weight_version"], step) if self.async_run else {}),
            **(version_span(batch) if "token_versions" in batch else {}),
        }


def compute_advantages(batch: Batch, estimator, options, kl_in_reward, declared: tuple[str, ...], reads: tuple[str, ...] = ()) -> dict[str, float]:
    """Token rewards (minus the in-reward KL penalty when ``kl_in_reward`` is given), then the
    estimator's advantages and returns into ``batch``; samples are grouped by prompt ``uid``.
    The estimator gets the inputs it declares in ``needs`` (``declared``) and the batch fields it
    ``reads``, and no others."""
    missing = [name for name in reads if name not in batch]
    if missing:
        raise ValueError(
            f"the advantage estimator reads batch fields {missing}, which this run's samples do not hold (fields: {sorted(batch.keys())}); "
            "use a rollout that records them, or another estimator"
        )
    token_rewards, metrics = kl_in_reward(batch) if kl_in_reward is not None else (batch["token_scores"], {})
    fields = {field: batch.get(key) for need, (field, key) in ADVANTAGE_FIELDS.items() if need in declared}
    if "reward_components" in declared:
        fields["reward_components"] = {k.removeprefix(COMPONENT): batch[k] for k in batch.keys() if k.startswith(COMPONENT)} or None
    data = AdvantageInputs(token_rewards, batch["response_mask"], batch.group_index("uid"), **fields, fields={n: batch[n] for n in reads})
    advantages, returns = estimator(data, options)
    batch["advantages"] = advantages
    batch["returns"] = returns
    return metrics
