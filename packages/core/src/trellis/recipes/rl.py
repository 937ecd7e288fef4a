"""The ``rl`` recipe: generate -> reward -> old log-prob -> ref -> values -> advantages ->
critic update -> actor update -> weight sync, with any registered estimator and policy loss."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
from omegaconf import DictConfig
from transformers import AutoTokenizer

from trellis.batch import Batch, last_valid_index
from trellis.config import ConfigError, choice, component, instantiate_options, ranged, resolve_component
from trellis.data import PromptDataset, PromptLoader, load_prompt_data, load_prompt_rows
from trellis.export import save_hf_folder
from trellis.interfaces.rollout import SamplingParams, pad_id, stop_ids
from trellis.interfaces.signatures import AdvantageInputs
from trellis.memory import check_activation_memory
from trellis.multiturn.checks import check_multi_turn
from trellis.multiturn.config import MultiTurnConfig
from trellis.multiturn.environment import agent_spec
from trellis.multiturn.rollout import AGENT_COLUMN, AgentRollout, agent_rollout
from trellis.multiturn.scoring import score_multiturn
from trellis.recipes.dynamic_sampling import DynamicSamplingConfig, fill, group_has_signal
from trellis.recipes.judge_engine import JudgedReward, check_judge_engine, start_judge, with_served_judges
from trellis.recipes.options import (
    ActorConfig,
    CriticConfig,
    PromptData,
    RecipeConfig,
    SamplingConfig,
    TrainerConfig,
    check_inputs,
    without_adapter,
)
from trellis.recipes.reward_model import ROLE as REWARD_MODEL
from trellis.recipes.reward_model import ModelReward, check_reward_model, reward_inputs
from trellis.recipes.streaming import generate_scored
from trellis.recipes.teacher import TEACHER_NEED, TeacherConfig, check_teacher, reverse_kl
from trellis.registry import RegistryError
from trellis.rewards import RewardConfig, RewardManager, RewardResult, add_overlong_penalty, check_reward, reward_figures, unknown_sources
from trellis.runtime.ahead import MODES, Producer, TrainedPosition, partial_chunk, staleness_bound, staleness_metrics
from trellis.runtime.controller import RolloutGroup
from trellis.runtime.harness import Run, RunContext, StageTimer, backend_mesh
from trellis.runtime.invariants import agreement_check, check_alignment, trainer_dtype
from trellis.runtime.partial import generate_in_chunks, version_span
from trellis.runtime.plan import Plan
from trellis.runtime.rollout_pool import check_rollout_pool
from trellis.runtime.sync_probe import SyncCheckConfig, SyncProbe

log = logging.getLogger("trellis")


# batch fields holding the reward's per-sample components, for estimators that need them (gdpo)
COMPONENT = "reward_component_"
# an estimator's need -> the AdvantageInputs field it fills and the batch field that holds it
ADVANTAGE_FIELDS = {
    "values": ("values", "values"),
    "greedy_baseline": ("baseline_rewards", "baseline_rewards"),
    "old_log_probs": ("old_log_probs", "old_log_probs"),
    "sum_sq_probs": ("sum_sq_probs", "sum_sq_probs"),
    TEACHER_NEED: ("teacher_log_probs", "teacher_log_probs"),
}


def needs(estimator) -> tuple[str, ...]:
    """What a registered advantage estimator declares in its ``needs`` attribute
    (``trellis.interfaces.signatures.AdvantageEstimator``)."""
    return tuple(getattr(estimator, "needs", ()))


@dataclass
class ValidationConfig:
    """Held-out evaluation: greedy reward and reward of ``n`` samples at ``temperature``."""

    before_train: bool = True
    n: int = ranged(1, ge=1)
    temperature: float = ranged(1.0, ge=0)


@dataclass
class AlgorithmConfig:
    """advantage: a registered estimator. KL in the reward (verl's ``use_kl_in_reward``): token
    rewards minus ``kl_coef`` x KL(actor || ref), with a fixed or adaptive coefficient.
    dynamic_sampling: drop prompt groups whose rewards are all equal and refill the batch
    (``trellis.recipes.dynamic_sampling``)."""

    advantage: dict = component("advantage", "grpo")
    use_kl_in_reward: bool = False
    kl_penalty: str = choice("k1", kind="kl")
    kl_ctrl_type: str = choice("fixed", ("fixed", "adaptive"))
    kl_coef: float = ranged(0.001, ge=0)
    target_kl: float = ranged(0.1, gt=0)
    kl_horizon: int = ranged(10000, ge=1)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)


@dataclass
class RLTrainerConfig(TrainerConfig):
    """async_mode: ``off`` (generate, then train), ``one_step`` (generate step k+1 while training
    step k) or ``fully_async`` (up to ``max_staleness`` steps ahead, default 1); see
    ``trellis.runtime.ahead``. Generation ahead needs an engine with weights of its own."""

    async_mode: str = choice("off", MODES)
    max_staleness: int | None = ranged(None, ge=0)
    # fully_async: a weight sync goes in between chunks of this many tokens of a generation running
    # ahead, which then continues under the new weights (trellis.runtime.partial; default 32)
    partial_rollout: bool = False
    rollout_chunk_tokens: int | None = ranged(None, ge=1)


@dataclass
class RLConfig(RecipeConfig):
    recipe: str = "rl"
    data: PromptData = field(default_factory=PromptData)
    rollout: dict = component("rollout", "hf")
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    sync_check: SyncCheckConfig = field(default_factory=SyncCheckConfig)
    trainer: RLTrainerConfig = field(default_factory=RLTrainerConfig)


def check(cfg: DictConfig, registry) -> None:
    """Errors a user can fix, found before any model is built (and, on CUDA, a warning when the
    actor's micro-batches cannot fit the device: ``trellis.memory``)."""
    check_judge_engine(cfg, registry)  # before the reward's checks, which call the judges' servers
    check_reward(cfg.reward, registry, cfg.recipe)
    check_inputs(cfg)
    staleness_bound(cfg.trainer)
    partial_chunk(cfg.trainer, cfg.multi_turn.enable)
    check_rollout_placement(cfg, registry)
    samples = cfg.data.train_batch_prompts * cfg.sampling.n
    world = backend_mesh(cfg, registry).dp
    if samples % world:
        raise ConfigError(
            f"a step has data.train_batch_prompts x sampling.n = {samples} samples, which {world} data-parallel ranks "
            f"(trainer.nnodes x trainer.procs_per_node, over the backend's tensor/pipeline groups) cannot share evenly; "
            f"make it a multiple of {world}"
        )
    for role in ("actor", "critic"):
        mini = cfg[role].mini_batch_samples
        if mini and mini % world:
            raise ConfigError(f"config key '{role}.mini_batch_samples' is {mini}; it must be a multiple of the {world} data-parallel ranks")
        if mini and samples % mini:
            raise ConfigError(
                f"config key '{role}.mini_batch_samples' is {mini}, but a step has data.train_batch_prompts x sampling.n = "
                f"{cfg.data.train_batch_prompts} x {cfg.sampling.n} = {samples} samples; choose a divisor of {samples}"
            )
    if cfg.algorithm.use_kl_in_reward:
        _lookup(registry, "objective", "kl_in_reward", "algorithm.use_kl_in_reward")
    if cfg.reward.name == "auto" and not cfg.reward.path:
        for key, rows in zip(("train_path", "val_path"), load_prompt_rows(cfg.data)):
            unknown = unknown_sources(row.get("data_source") for row in rows)
            if unknown:
                raise ConfigError(
                    f"config key 'reward.name' is auto, which has no reward for data_source {', '.join(map(repr, unknown))} "
                    f"(in data.{key} {cfg.data[key]!r}); name a reward, or give reward.path and reward.name of your own function"
                )
    check_multi_turn(cfg, registry)
    check_streaming(cfg)
    declared = needs(registry.get("advantage", cfg.algorithm.advantage.name).obj)
    check_length_shaping(cfg)
    check_teacher(cfg, declared)
    check_reward_model(cfg)
    if cfg.algorithm.dynamic_sampling.enable:
        check_dynamic_sampling(cfg, declared)
    if "on_policy_only" in declared:
        check_on_policy(cfg, samples)
    seq_len = longest_sequence(cfg)
    check_activation_memory(cfg, registry, "actor", seq_len, seq_len - cfg.data.max_prompt_length)
    if "groups" in declared and cfg.sampling.n < 2:
        log.warning("advantage %r compares samples of one prompt; with sampling.n=1 every advantage is 0", cfg.algorithm.advantage.name)


def check_dynamic_sampling(cfg: DictConfig, declared: tuple[str, ...]) -> None:
    """Dynamic sampling compares the samples of a prompt and regenerates prompts round by round."""
    if cfg.sampling.n < 2:
        raise ConfigError(
            f"config key 'algorithm.dynamic_sampling.enable' is true with sampling.n={cfg.sampling.n}: a group of one sample "
            "never varies, so every group would be dropped; set sampling.n to 2 or more"
        )
    if "greedy_baseline" in declared:
        raise ConfigError(
            f"config key 'algorithm.dynamic_sampling.enable' is true with advantage {cfg.algorithm.advantage.name!r}, whose greedy "
            "baseline is generated for one batch of prompts; set algorithm.dynamic_sampling.enable=false or choose another advantage"
        )


def check_streaming(cfg: DictConfig) -> None:
    """``reward.stream_prompts`` scores parts of a single-turn generation with reward functions."""
    size = cfg.reward.stream_prompts
    if not size:
        return
    for key, on, why in (
        ("multi_turn.enable", cfg.multi_turn.enable, "conversations are scored as a batch when they end"),
        ("reward.model.path", cfg.reward.model.path, "the reward model scores the whole batch in one pass"),
        ("trainer.partial_rollout", cfg.trainer.partial_rollout, "a generation cut in chunks is scored once whole"),
    ):
        if on:
            raise ConfigError(f"config key 'reward.stream_prompts' is {size} with {key} set: {why}; set reward.stream_prompts=0")


def check_length_shaping(cfg: DictConfig) -> None:
    """``reward.overlong`` needs a buffer within the response budget, and, like ``actor.mask_truncated``,
    reads a response's length against ``sampling.max_new_tokens``: single-turn runs only."""
    buffer = cfg.reward.overlong.buffer_len
    if buffer > cfg.sampling.max_new_tokens:
        raise ConfigError(
            f"config key 'reward.overlong.buffer_len' is {buffer}, longer than sampling.max_new_tokens={cfg.sampling.max_new_tokens}; "
            "choose a buffer within the response budget (DAPO used a quarter of it)"
        )
    for key, on in (("reward.overlong.buffer_len", buffer > 0), ("actor.mask_truncated", cfg.actor.mask_truncated)):
        if on and cfg.multi_turn.enable:
            raise ConfigError(
                f"config key '{key}' is set with multi_turn.enable=true: a conversation's length is not one response's "
                f"against sampling.max_new_tokens; unset {key} for multi-turn runs"
            )


def check_rollout_placement(cfg: DictConfig, registry) -> None:
    """Where the engines go: ``trainer.rollout_pool`` needs Ray, and a colocated engine under Ray
    cannot span several devices (see :func:`~trellis.runtime.rollout_pool.check_rollout_pool`)."""
    _, options = resolve_component(registry, "rollout", cfg.rollout)
    check_rollout_pool(cfg.trainer, getattr(options, "tensor_parallel_size", 1))


def on_policy_update(cfg: DictConfig, registry, estimator, samples: int) -> bool:
    """Whether the actor's update can take the old log-probs from its own first forward instead of
    a separate pass (exact): the policy objective declares it can (``first_forward``), one
    optimizer step per batch, and nothing before the update reads them (the in-reward KL, an
    estimator that needs them or a teacher's, which are compared with them)."""
    objective = registry.get("objective", "policy").obj(cfg.actor, registry)
    return (
        getattr(objective, "first_forward", None) == "old_log_probs"
        and Plan.of(cfg.actor).one_update(samples)  # the same rule the actor's worker checks the batch against
        and not cfg.algorithm.use_kl_in_reward
        and not {"old_log_probs", "sum_sq_probs", TEACHER_NEED} & set(needs(estimator))
    )


def check_on_policy(cfg: DictConfig, samples: int) -> None:
    """OPO is exact on-policy: each step's fresh samples get one optimizer step. Settings that
    would update on them again are refused, by name."""
    off = []
    if cfg.actor.ppo_epochs > 1:
        off.append(f"actor.ppo_epochs={cfg.actor.ppo_epochs} (use 1)")
    if cfg.actor.mini_batch_samples not in (0, samples):
        off.append(f"actor.mini_batch_samples={cfg.actor.mini_batch_samples} (use 0: the step's {samples} samples at once)")
    if off:
        raise ConfigError(
            f"advantage 'opo' is exact on-policy (one update per batch of fresh samples), but {' and '.join(off)} "
            "would update on samples after the policy moved; see trellis config init opo"
        )


def _lookup(registry, kind: str, name: str, key: str):
    try:
        return registry.get(kind, name)
    except RegistryError as exc:
        raise ConfigError(f"config key {key!r}: {exc}") from None


def load_data(cfg: DictConfig, registry, tokenizer) -> tuple[AgentRollout | None, PromptLoader, PromptDataset | None]:
    """The rollout function of conversations (multi-turn runs: the agent loops the rows pick), the
    training prompt loader and the held-out prompts."""
    if not cfg.multi_turn.enable:
        return (None, *load_prompt_data(cfg.data, tokenizer, cfg.seed))
    spec = agent_spec(cfg.multi_turn, registry, tokenizer)
    train, val = load_prompt_data(cfg.data, tokenizer, cfg.seed, spec.template_kwargs)
    names = {
        f"data.{key} {cfg.data[key]!r}": [(item["index"], item[AGENT_COLUMN]) for item in dataset.items]
        for key, dataset in (("train_path", train.dataset), ("val_path", val))
        if dataset is not None
    }
    return agent_rollout(spec, registry, names), train, val


def check_data(cfg: DictConfig, registry) -> str:
    """The prompts read and tokenized as training would (columns, chat template, lengths)."""
    _, train, val = load_data(cfg, registry, AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path))
    longest = max(len(item["input_ids"]) for item in train.dataset.items)
    held_out = f", {len(val)} held-out" if val is not None else ""
    return f"{len(train.dataset)} training prompts (longest {longest} tokens of data.max_prompt_length={cfg.data.max_prompt_length}){held_out}"


class RLRecipe:
    """PPO-family training of a policy with a rollout engine, from config alone."""

    Config = RLConfig
    check = staticmethod(check)
    check_data = staticmethod(check_data)
    resume_safe_keys = ("validation", "data.val_path", "data.val_max_prompts", "trainer.log_samples")

    def run(self, cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
        registry = ctx.registry
        estimator, estimator_options = resolve_component(registry, "advantage", cfg.algorithm.advantage)
        use_critic = "values" in needs(estimator)
        use_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
        with Run(cfg, ctx) as run:
            if run.finished:
                return run.finished_summary()
            kl_in_reward = registry.get("objective", "kl_in_reward").obj(cfg.algorithm, registry) if cfg.algorithm.use_kl_in_reward else None
            tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
            agent, train, val = load_data(cfg, registry, tokenizer)

            actor = run.spawn("actor", cfg.model.path, cfg.actor, objectives={"update": "policy"})
            # the reference: the actor with its adapter off (no second model), else a frozen copy with the actor's micro-batching
            adapter_ref = use_ref and cfg.actor.adapter.rank > 0
            ref = run.spawn("ref", cfg.model.path, cfg.actor) if use_ref and not adapter_ref else None
            critic_path = cfg.critic.model_path or cfg.model.path
            critic = run.spawn("critic", critic_path, cfg.critic, head="value", objectives={"update": "value"}) if use_critic else None
            teacher = run.spawn("teacher", cfg.teacher.path, without_adapter(cfg.actor)) if TEACHER_NEED in needs(estimator) else None
            # equal rewards within every group zero the advantages of group-relative estimators only
            # (a critic's values or a teacher's log-probs give advantages whatever the rewards)
            run.signals.watch_reward = "groups" in needs(estimator)
            reward_fn = make_reward(cfg, run, registry, tokenizer)
            bound = staleness_bound(cfg.trainer)  # None: generation inline (async_mode=off)
            if bound is not None:
                log.info("trainer.async_mode=%s: generation runs ahead of training (samples at most %d version(s) old) on an engine "
                         "with weights of its own", cfg.trainer.async_mode, bound)  # fmt: skip
            rollout = run.spawn_rollout(actor, tokenizer, max_len=longest_sequence(cfg), own_weights=bound is not None)
            sampling = SamplingParams(**cfg.sampling)
            sync_options = instantiate_options(cfg.sync_check, SyncCheckConfig)
            precision = trainer_dtype(resolve_component(registry, "backend", cfg.backend)[1])
            probe = SyncProbe(sync_options, rollout, sampling, precision)
            agreement = agreement_check(sync_options, rollout, sampling, precision)
            samples_per_step = cfg.data.train_batch_prompts * cfg.sampling.n
            on_policy = on_policy_update(cfg, registry, estimator, samples_per_step)
            validate = functools.partial(self.validate, rollout, val, reward_fn, cfg, agent) if val is not None else None
            # generating ahead, checkpoints keep the loader's position after the last trained step
            position = TrainedPosition(train) if bound is not None else train
            start = run.start(
                roles={"actor": actor, "critic": critic},
                state={"data": position, "kl": kl_in_reward},
                rollout=rollout,
                validate=validate,
                validate_before=cfg.validation.before_train,
                overlap=bound is not None,
            )
            dynamic = cfg.algorithm.dynamic_sampling
            overlong = cfg.reward.overlong
            multiple = group_multiple(cfg, registry, samples_per_step) if dynamic.enable else 1

            chunk = partial_chunk(cfg.trainer, cfg.multi_turn.enable)
            stops = stop_ids(cfg.model.path, tokenizer) if chunk is not None else set()  # where a chunked sample ends

            def generate(prompts: Batch, params: SamplingParams, timer: StageTimer) -> tuple[Batch, RewardResult]:
                if cfg.reward.stream_prompts:  # each part scored while the next generates
                    batch, scored = generate_scored(rollout, prompts, params, reward_fn, cfg.reward.stream_prompts, timer)
                else:
                    with timer("gen"):
                        if chunk is None:
                            batch = sample(rollout, prompts, params, agent)
                        else:  # a weight sync may go in between two chunks
                            every = stops | set(params.stop_token_ids)
                            batch = generate_in_chunks(rollout, prompts, params, chunk, every, pad_id(tokenizer), rollout.let_syncs_in)
                    with timer("reward"):
                        scored = score(batch, reward_fn, agent)
                if overlong.buffer_len:
                    scored = add_overlong_penalty(scored, batch["response_mask"], cfg.sampling.max_new_tokens, overlong.buffer_len, overlong.penalty)
                return batch, scored

            group_filters = [registry.get("group_filter", name).obj for name in dynamic.filters]
            carry: list[tuple[Batch, RewardResult]] = []  # kept groups a step ahead of training did not need

            def make_step(step: int, timer: StageTimer) -> StepSamples:
                """Step ``step``'s prompts, samples and rewards (the loader's next prompts)."""
                params = sampling.at_step(step, samples_per_step)
                if dynamic.enable:
                    # a round's seeds move on past every earlier round's, this step's and the steps' before it
                    def round_at(r: int) -> tuple[Batch, RewardResult]:
                        return generate(train.next_batch(), sampling.at_step((step - 1) * dynamic.max_rounds + r + 1, samples_per_step), timer)

                    # generating ahead, the groups an earlier step kept beyond its need come first while fresh enough
                    # (only runs that generate ahead carry any)
                    carried = [p for p in carry if int(p[0]["weight_version"].min()) >= step - 1 - bound]
                    stale = sum(_groups(b) for b, _ in carry) - sum(_groups(b) for b, _ in carried)
                    filled = fill(round_at, cfg.data.train_batch_prompts, dynamic, step, multiple, group_filters, carried)
                    carry[:] = filled.leftover if bound is not None else []
                    metrics = {**filled.metrics, **({"dynamic_sampling/stale_groups_dropped": float(stale)} if bound is not None else {})}
                    if filled.batch is None:  # nothing to train on
                        return StepSamples(None, params, filled.first, metrics)
                    batch, scored = filled.batch, RewardResult(filled.batch["token_scores"], {}, filled.scores, filled.components)
                    # carried groups alone filled the step: the reward figures describe them
                    first = filled.first or RewardResult(scored.token_scores, reward_figures(scored.scores), scored.scores, scored.components)
                    made = StepSamples(batch, params, first, metrics)
                else:
                    prompts = train.next_batch()
                    batch, scored = generate(prompts, params, timer)
                    batch["token_scores"] = scored.token_scores
                    made = StepSamples(batch, params, scored, {})
                if "reward_components" in needs(estimator):
                    for key, values in (scored.components or {}).items():
                        batch[COMPONENT + key] = values
                if "greedy_baseline" in needs(estimator):
                    with timer("gen_greedy"):
                        greedy = rollout.generate(prompts, SamplingParams(**{**params.__dict__, "n": 1, "greedy": True}))
                        by_uid = dict(zip(greedy["uid"], reward_fn.score(greedy).scores.tolist()))
                        batch["baseline_rewards"] = torch.tensor([by_uid[u] for u in batch["uid"]])
                return made

            timer = run.timer
            # a thread generates later steps while this one trains
            ahead = Producer(make_step, train, start + 1, cfg.trainer.total_steps, bound) if bound is not None else None

            def end_step(step: int, metrics: dict[str, float]) -> None:
                run.end_step(step, metrics)
                if ahead is not None:  # the producer may start the steps this one held back
                    ahead.finished(step)

            with ahead or contextlib.nullcontext():
                for step in run.steps(start):
                    if ahead is None:
                        with run.generating(rollout):
                            made = make_step(step, timer)
                        handover = {}
                    else:
                        produced, handover = ahead.take(step)
                        position.trained = produced.loader_state
                        made = produced.value
                        handover |= {**produced.timings, "timing/wait_trainer_s": produced.waited_s}
                    params, first, batch = made.params, made.first, made.batch
                    reward_metrics = {**first.metrics, **made.metrics, **handover}
                    if batch is None:  # dynamic sampling kept no group: the step is logged, the policy unchanged
                        end_step(step, {**reward_metrics, **groups_with_signal(first.scores, first_groups(first, params.n))})
                        continue
                    batch.meta["step"] = step
                    check_alignment(batch, step)
                    run.log_samples(step, batch, batch["token_scores"].sum(-1), tokenizer)
                    old = None  # on-policy: the actor's update computes them in its first forward
                    if not on_policy:
                        with timer("old_log_prob"):
                            old = actor.log_prob(batch, with_entropy=True, with_sum_sq_probs="sum_sq_probs" in needs(estimator))
                            batch["old_log_probs"] = old["log_probs"]
                            if "sum_sq_probs" in old:
                                batch["sum_sq_probs"] = old["sum_sq_probs"]
                    if use_ref:
                        with timer("ref"):
                            if adapter_ref:
                                batch["ref_log_probs"] = actor.forward(batch, ("base_log_probs",))["base_log_probs"]
                            else:
                                batch["ref_log_probs"] = ref.log_prob(batch)["log_probs"]
                    teacher_metrics = {}
                    if teacher is not None:
                        with timer("teacher"):
                            batch["teacher_log_probs"] = teacher.log_prob(batch)["log_probs"]
                            teacher_metrics = reverse_kl(batch["old_log_probs"], batch["teacher_log_probs"], batch["response_mask"])
                    if critic is not None:
                        with timer("values"):
                            batch["values"] = critic.values(batch)["values"]
                    with timer("adv"):
                        kl_metrics = self.compute_advantages(batch, estimator, estimator_options, kl_in_reward)
                    update_metrics: dict[str, float] = {}
                    if critic is not None:
                        with timer("update_critic"):
                            update_metrics.update(critic.update(batch))
                    with timer("update_actor"):
                        update_metrics.update(actor.update(without_truncated(batch, params, tokenizer) if cfg.actor.mask_truncated else batch))
                    with timer("weight_sync"):
                        rollout.sync_weights(version=step)
                    with timer("sync_check"):
                        gap = update_metrics.get("actor/rollout_corr/abs_diff")
                        sync_metrics = {**agreement.check(batch, step, batch.get("old_log_probs"), gap), **probe.check(actor, batch, step)}

                    mask = batch["response_mask"].float()
                    end_step(step, {
                        **reward_metrics,
                        **update_metrics,
                        **kl_metrics,
                        **teacher_metrics,
                        **sync_metrics,
                        **_kl_summary(update_metrics, kl_metrics),
                        **({"actor/entropy": float((old["entropy"] * mask).sum() / mask.sum().clamp(min=1))} if old is not None else {}),
                        **(groups_with_signal(first.scores, first_groups(first, params.n)) if params.n > 1 else {}),
                        **({"response/masked_truncated": float(truncated(batch, params, tokenizer).sum())} if cfg.actor.mask_truncated else {}),
                        "response/length_mean": float(mask.sum(-1).mean()),
                        "response/clip_frac": float((mask.sum(-1) >= params.max_new_tokens).float().mean()),
                        "critic/advantage_mean": float((batch["advantages"] * mask).sum() / mask.sum().clamp(min=1)),
                        **throughput(batch, reward_metrics.get("timing/gen_s", timer.times.get("timing/gen_s")), timer.times),
                        **(staleness_metrics(batch["weight_version"], step) if ahead is not None else {}),
                        **(version_span(batch) if chunk is not None else {}),
                    })
            if cfg.trainer.save_hf_model:
                save_hf_folder(cfg.model.path, chain.from_iterable(actor.export_weights()), tokenizer, ctx.run_dir / "hf_model")
        return run.summary

    def evaluate(self, cfg: DictConfig, ctx: RunContext) -> dict[str, float]:
        """Validation alone, once (``trellis eval``): the actor from ``model.path`` and its rollout,
        no optimizer, critic or reference, nothing written."""
        if not cfg.data.val_path:
            raise ConfigError("config key 'data.val_path' is not set; trellis eval scores the held-out prompts it names: set data.val_path=<file>")
        with Run(cfg, ctx) as run:
            tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
            agent, _, val = load_data(cfg, ctx.registry, tokenizer)
            rollout = run.spawn_rollout(run.spawn("actor", cfg.model.path, cfg.actor), tokenizer, max_len=longest_sequence(cfg))
            reward_fn = make_reward(cfg, run, ctx.registry, tokenizer)
            return self.validate(rollout, val, reward_fn, cfg, agent)

    @staticmethod
    def compute_advantages(batch: Batch, estimator, options, kl_in_reward) -> dict[str, float]:
        """Token rewards (minus the in-reward KL penalty when ``kl_in_reward`` is given), then the
        estimator's advantages and returns into ``batch``; samples are grouped by prompt ``uid``.
        The estimator gets the inputs it declares in ``needs`` and no others."""
        token_rewards, metrics = kl_in_reward(batch) if kl_in_reward is not None else (batch["token_scores"], {})
        declared = needs(estimator)
        fields = {field: batch.get(key) for need, (field, key) in ADVANTAGE_FIELDS.items() if need in declared}
        if "reward_components" in declared:
            fields["reward_components"] = {k.removeprefix(COMPONENT): batch[k] for k in batch.keys() if k.startswith(COMPONENT)} or None
        data = AdvantageInputs(token_rewards, batch["response_mask"], batch.group_index("uid"), **fields)
        advantages, returns = estimator(data, options)
        batch["advantages"] = advantages
        batch["returns"] = returns
        return metrics

    @staticmethod
    def validate(
        rollout: RolloutGroup,
        val: PromptDataset,
        reward_fn: RewardManager | ModelReward | JudgedReward,
        cfg: DictConfig,
        agent: AgentRollout | None = None,
    ) -> dict[str, float]:
        """Greedy and sampled reward on every held-out prompt (generated in one pass each); in
        multi-turn runs also the greedy reward of the first answer alone (without feedback)."""
        prompts = val.as_batch()
        base = SamplingParams(max_new_tokens=cfg.sampling.max_new_tokens, seed=cfg.sampling.seed)
        greedy = score(sample(rollout, prompts, SamplingParams(**{**base.__dict__, "greedy": True}), agent), reward_fn, agent)
        sampled_params = SamplingParams(**{**base.__dict__, "n": cfg.validation.n, "temperature": cfg.validation.temperature})
        sampled = score(sample(rollout, prompts, sampled_params, agent), reward_fn, agent)
        out = {"greedy_reward_mean": float(greedy.scores.mean()), "reward_mean": float(sampled.scores.mean())}
        if "reward/first_turn_mean" in greedy.metrics:
            out["greedy_first_turn_reward_mean"] = greedy.metrics["reward/first_turn_mean"]
            out["first_turn_reward_mean"] = sampled.metrics["reward/first_turn_mean"]
        return out


@dataclass
class StepSamples:
    """A step's samples: ``batch`` with ``token_scores`` (None when dynamic sampling kept no
    group), the sampling ``params`` of the step, the first generation round's reward result
    (``first``: the unfiltered draw the reward metrics describe) and dynamic sampling's metrics."""

    batch: Batch | None
    params: SamplingParams
    first: RewardResult
    metrics: dict[str, float]


def make_reward(cfg: DictConfig, run: Run, registry, tokenizer) -> RewardManager | ModelReward | JudgedReward:
    """The run's reward: the functions ``reward`` names, or with ``reward.model`` the frozen
    ``reward_model`` role (the actor's micro-batching), alone or added to ``reward.terms``, scoring
    the policy's token ids or re-tokenized samples when its tokenizer is another; with
    ``reward.judge.engine`` the judges that name no url go to the judge engine, served for the run."""
    reward = instantiate_options(cfg.reward, RewardConfig)
    server = run.closing(start_judge(reward.judge, registry, cfg.seed)) if reward.judge.engine else None
    if server is not None:
        reward = with_served_judges(reward, server)
    if not reward.model.path:
        scorer = RewardManager(reward, registry, tokenizer)
    else:
        role = run.spawn(REWARD_MODEL, reward.model.path, without_adapter(cfg.actor), head="reward")
        functions = RewardManager(reward, registry, tokenizer) if reward.terms else None
        scorer = ModelReward(role, reward.model.weight, reward.model.key, functions, reward_inputs(cfg, tokenizer))
    return scorer if server is None else JudgedReward(scorer, server)


def longest_sequence(cfg: DictConfig) -> int:
    """The longest prompt + response a run asks its rollout for: the engines' context length."""
    response = cfg.sampling.max_new_tokens
    if cfg.multi_turn.enable:  # every turn, model and environment, within the response budget
        response = cfg.multi_turn.max_response_tokens or response * cfg.multi_turn.max_assistant_turns
    return cfg.data.max_prompt_length + response


def sample(rollout: RolloutGroup, prompts: Batch, params: SamplingParams, agent: AgentRollout | None) -> Batch:
    """Single-turn generation, or conversations through the agent loops when ``agent`` is given."""
    return rollout.generate(prompts, params) if agent is None else rollout.rollout(prompts, params, agent)


def score(batch: Batch, reward_fn: RewardManager | ModelReward | JudgedReward, agent: AgentRollout | None) -> RewardResult:
    return reward_fn.score(batch) if agent is None else score_multiturn(batch, agent.spec.settings, reward_fn)


def _groups(batch: Batch) -> int:
    return int(batch.group_index("uid").max()) + 1


def groups_with_signal(scores: torch.Tensor, groups: torch.Tensor) -> dict[str, float]:
    """``reward/groups_with_signal``: the share of prompt groups whose samples differ in reward
    (``scores``, ``groups`` ``(batch,)``); 0 means no group-relative signal at all."""
    return {"reward/groups_with_signal": float(group_has_signal(scores, groups).float().mean())}


def first_groups(scored: RewardResult, n: int) -> torch.Tensor:
    """``(batch,)`` the prompt group of each sample of a generation round (prompt i's ``n``
    samples at rows i*n .. i*n+n-1)."""
    return torch.arange(len(scored.scores)) // n


def group_multiple(cfg: DictConfig, registry, samples_per_step: int) -> int:
    """The prompt groups a step's batch must be a multiple of: its samples shared evenly over the
    data-parallel ranks and cut into whole actor/critic mini-batches."""
    unit = math.lcm(backend_mesh(cfg, registry).dp, *(cfg[role].mini_batch_samples or 1 for role in ("actor", "critic")))
    return unit // math.gcd(unit, cfg.sampling.n)


def truncated(batch: Batch, params: SamplingParams, tokenizer) -> torch.Tensor:
    """``(batch,)`` bool: samples cut by the length limit (``max_new_tokens`` response tokens, the
    last neither the eos token nor a stop token)."""
    mask = batch["response_mask"]
    last = batch["responses"].gather(1, last_valid_index(mask).clamp(min=0)[:, None])[:, 0]
    stops = torch.tensor([tokenizer.eos_token_id, *params.stop_token_ids])
    return (mask.sum(-1) >= params.max_new_tokens) & ~torch.isin(last, stops)


def without_truncated(batch: Batch, params: SamplingParams, tokenizer) -> Batch:
    """``actor.mask_truncated``: a copy of ``batch`` whose truncated samples have a zero
    ``response_mask``, so they leave the actor's loss."""
    out = batch[torch.arange(len(batch))]
    out["response_mask"] = batch["response_mask"] * ~truncated(batch, params, tokenizer)[:, None]
    return out


def throughput(batch: Batch, gen_s: float | None, times: dict[str, float]) -> dict[str, float]:
    """``timing/gen_tokens_per_s`` (response tokens per second of this step's generation) and
    ``timing/update_tokens_per_s`` (prompt + response tokens per second of the actor's update):
    clock figures, kept with the timings."""
    out = {}
    if gen_s:
        out["timing/gen_tokens_per_s"] = float(batch["response_mask"].sum()) / gen_s
    if times.get("timing/update_actor_s"):
        out["timing/update_tokens_per_s"] = float(batch["attention_mask"].sum()) / times["timing/update_actor_s"]
    return out


def _kl_summary(update_metrics: dict[str, float], kl_metrics: dict[str, float]) -> dict[str, float]:
    """``actor/kl``: the KL to the reference in use (as a loss term, else in the reward), if any."""
    kl = update_metrics.get("actor/kl_loss", kl_metrics.get("actor/reward_kl"))
    return {} if kl is None else {"actor/kl": kl}
