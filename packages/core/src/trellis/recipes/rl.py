"""The ``rl`` recipe: generate -> reward -> old log-prob -> ref -> values -> advantages ->
critic update -> actor update -> weight sync, with any registered estimator and policy loss."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
from omegaconf import DictConfig
from transformers import AutoTokenizer

from trellis.batch import Batch
from trellis.config import ConfigError, component, instantiate_options, ranged, resolve_component
from trellis.data import PromptDataset, PromptLoader, load_prompt_data, load_prompt_rows
from trellis.export import save_hf_folder
from trellis.interfaces.rollout import SamplingParams
from trellis.interfaces.signatures import AGG_MODES, AdvantageInputs
from trellis.multiturn.checks import check_multi_turn
from trellis.multiturn.config import MultiTurnConfig
from trellis.multiturn.environment import AgentSpec, agent_spec
from trellis.multiturn.scoring import score_multiturn
from trellis.recipes.options import ActorConfig, CriticConfig, ModelConfig, PromptData, SamplingConfig, TrainerConfig, backend_field, check_inputs
from trellis.registry import RegistryError
from trellis.rewards import RewardConfig, RewardError, RewardManager, RewardResult, resolve_reward, unknown_sources
from trellis.runtime.controller import RolloutGroup
from trellis.runtime.harness import Run, RunContext, backend_mesh
from trellis.runtime.plan import Plan

log = logging.getLogger("trellis")


# batch fields holding the reward's per-sample components, for estimators that need them (gdpo)
COMPONENT = "reward_component_"


def needs(estimator) -> tuple[str, ...]:
    """What a registered advantage estimator asks for beyond rewards: ``values`` (a critic),
    ``greedy_baseline`` (a greedy rollout per prompt), ``sum_sq_probs`` (from the old-log-prob
    forward) and/or ``reward_components`` (the reward's per-sample components), from its ``needs``
    attribute."""
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
    rewards minus ``kl_coef`` x KL(actor || ref), with a fixed or adaptive coefficient."""

    advantage: dict = component("advantage", "grpo")
    use_kl_in_reward: bool = False
    kl_penalty: str = "k1"
    kl_ctrl_type: str = "fixed"  # fixed | adaptive
    kl_coef: float = ranged(0.001, ge=0)
    target_kl: float = ranged(0.1, gt=0)
    kl_horizon: int = ranged(10000, ge=1)


@dataclass
class RLConfig:
    recipe: str = "rl"
    seed: int = ranged(0, ge=0)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: PromptData = field(default_factory=PromptData)
    backend: dict = backend_field()
    rollout: dict = component("rollout", "hf")
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def check(cfg: DictConfig, registry) -> None:
    """Errors a user can fix, found before any model is built."""
    for key, name in (("actor.kl_loss_type", cfg.actor.kl_loss_type), ("algorithm.kl_penalty", cfg.algorithm.kl_penalty)):
        _lookup(registry, "kl", name, key)
    try:
        resolve_reward(instantiate_options(cfg.reward, RewardConfig), registry)
    except (RewardError, RegistryError) as exc:
        raise ConfigError(f"config key 'reward': {exc}") from None
    check_inputs(cfg)
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
        if cfg[role].loss_agg_mode not in AGG_MODES:
            raise ConfigError(f"config key '{role}.loss_agg_mode' is {cfg[role].loss_agg_mode!r}; valid: {', '.join(AGG_MODES)}")
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
    if cfg.algorithm.advantage.name == "opo":
        check_on_policy(cfg, samples)
    if cfg.algorithm.advantage.name in ("grpo", "rloo", "opo", "reinforce_plus_plus_baseline") and cfg.sampling.n < 2:
        log.warning("advantage %r compares samples of one prompt; with sampling.n=1 every advantage is 0", cfg.algorithm.advantage.name)


def check_rollout_placement(cfg: DictConfig, registry) -> None:
    """Under Ray every rank holds one device and builds its own engine beside its actor shard, so
    an engine cannot span several devices (tensor parallel): refused here, with the ways out."""
    _, options = resolve_component(registry, "rollout", cfg.rollout)
    tp = getattr(options, "tensor_parallel_size", 1)
    if cfg.trainer.controller == "ray" and tp > 1:
        raise ConfigError(
            f"config key 'rollout.tensor_parallel_size' is {tp} with trainer.controller=ray: each Ray rank holds one device "
            f"and builds its own rollout engine, so an engine cannot span {tp} devices; set rollout.tensor_parallel_size=1 "
            "(one data-parallel engine per rank), or trainer.controller=local, where the engine spans the machine's devices itself"
        )


def on_policy_update(cfg: DictConfig, estimator, samples: int) -> bool:
    """Whether the actor's update can take the old log-probs from its own first forward instead of
    a separate pass (exact): one optimizer step per batch, and nothing before the update reads
    them (the in-reward KL, an estimator using ``sum_sq_probs``, rollout-correction weights)."""
    corrects = any(cfg.actor.policy_loss.get(k) for k in ("rollout_is", "rollout_rs", "log_metrics"))
    return (
        Plan.of(cfg.actor).one_update(samples)  # the same rule the actor's worker checks the batch against
        and not cfg.algorithm.use_kl_in_reward
        and "sum_sq_probs" not in needs(estimator)
        and not corrects
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


def load_data(cfg: DictConfig, registry, tokenizer) -> tuple[AgentSpec | None, PromptLoader, PromptDataset | None]:
    """The agent (multi-turn runs), the training prompt loader and the held-out prompts."""
    agent = agent_spec(cfg.multi_turn, registry, tokenizer) if cfg.multi_turn.enable else None
    train, val = load_prompt_data(cfg.data, tokenizer, cfg.seed, agent.template_kwargs if agent else None)
    return agent, train, val


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
            reward_fn = RewardManager(instantiate_options(cfg.reward, RewardConfig), registry, tokenizer)

            actor = run.spawn("actor", cfg.model.path, cfg.actor, objectives={"update": "policy"})
            ref = run.spawn("ref", cfg.model.path, cfg.actor) if use_ref else None  # the actor's micro-batching, no optimizer
            critic = run.spawn("critic", cfg.critic.model_path or cfg.model.path, cfg.critic, objectives={"update": "value"}) if use_critic else None
            rollout = run.spawn_rollout(actor, tokenizer, max_len=longest_sequence(cfg))
            sampling = SamplingParams(**cfg.sampling)
            samples_per_step = cfg.data.train_batch_prompts * cfg.sampling.n
            on_policy = on_policy_update(cfg, estimator, samples_per_step)
            roles = [r for r in (actor, ref, critic) if r is not None]
            start = run.start(roles={"actor": actor, "critic": critic}, state={"data": train, "kl": kl_in_reward})
            if start:
                rollout.sync_weights(version=start)
            timer = run.timer
            summary: dict[str, Any] = {}
            if val is not None and cfg.validation.before_train and not start and cfg.trainer.total_steps:  # else val_after alone
                summary["val_before"] = self.validate(rollout, val, reward_fn, cfg, agent)
                run.log(0, {f"val/{k}": v for k, v in summary["val_before"].items()})
            for step in run.steps(start):
                prompts = train.next_batch()
                params = sampling.at_step(step, samples_per_step)

                with timer("gen"):
                    for role in roles:  # optimizer state / params to host memory if the backend is asked to
                        role.offload()
                    batch = sample(rollout, prompts, params, agent)
                    batch.meta["step"] = step
                with timer("reward"):
                    scored = score(batch, reward_fn, agent)
                    batch["token_scores"], reward_metrics = scored.token_scores, scored.metrics
                    if "reward_components" in needs(estimator):
                        for key, values in (scored.components or {}).items():
                            batch[COMPONENT + key] = values
                run.log_samples(step, batch, batch["token_scores"].sum(-1), tokenizer)
                if "greedy_baseline" in needs(estimator):
                    with timer("gen_greedy"):
                        greedy = rollout.generate(prompts, SamplingParams(**{**params.__dict__, "n": 1, "greedy": True}))
                        by_uid = dict(zip(greedy["uid"], reward_fn.score(greedy).scores.tolist()))
                        batch["baseline_rewards"] = torch.tensor([by_uid[u] for u in batch["uid"]])
                rollout.sleep()  # the engines' memory goes to training until the weight sync wakes them
                for role in roles:
                    role.onload()
                old = None  # on-policy: the actor's update computes them in its first forward
                if not on_policy:
                    with timer("old_log_prob"):
                        old = actor.log_prob(batch, with_entropy=True, with_sum_sq_probs="sum_sq_probs" in needs(estimator))
                        batch["old_log_probs"] = old["log_probs"]
                        if "sum_sq_probs" in old:
                            batch["sum_sq_probs"] = old["sum_sq_probs"]
                if ref is not None:
                    with timer("ref"):
                        batch["ref_log_probs"] = ref.log_prob(batch)["log_probs"]
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
                    update_metrics.update(actor.update(batch))
                with timer("weight_sync"):
                    rollout.sync_weights(version=step)

                mask = batch["response_mask"].float()
                metrics = {
                    **reward_metrics,
                    **update_metrics,
                    **kl_metrics,
                    **_kl_summary(update_metrics, kl_metrics),
                    **({"actor/entropy": float((old["entropy"] * mask).sum() / mask.sum().clamp(min=1))} if old is not None else {}),
                    "response/length_mean": float(mask.sum(-1).mean()),
                    "response/clip_frac": float((mask.sum(-1) >= params.max_new_tokens).float().mean()),
                    "critic/advantage_mean": float((batch["advantages"] * mask).sum() / mask.sum().clamp(min=1)),
                }
                if val is not None and run.due(step) and step < cfg.trainer.total_steps:
                    metrics.update({f"val/{k}": v for k, v in self.validate(rollout, val, reward_fn, cfg, agent).items()})
                run.end_step(step, metrics)
            if val is not None:
                summary["val_after"] = self.validate(rollout, val, reward_fn, cfg, agent)
                run.metrics.update({f"val/{k}": v for k, v in summary["val_after"].items()})
                run.log(cfg.trainer.total_steps, {f"val/{k}": v for k, v in summary["val_after"].items()})
            if cfg.trainer.save_hf_model:
                save_hf_folder(cfg.model.path, chain.from_iterable(actor.export_weights()), tokenizer, ctx.run_dir / "hf_model")
        return summary

    def evaluate(self, cfg: DictConfig, ctx: RunContext) -> dict[str, float]:
        """Validation alone, once (``trellis eval``): the actor from ``model.path`` and its rollout,
        no optimizer, critic or reference, nothing written."""
        if not cfg.data.val_path:
            raise ConfigError("config key 'data.val_path' is not set; trellis eval scores the held-out prompts it names: set data.val_path=<file>")
        with Run(cfg, ctx) as run:
            tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
            agent, _, val = load_data(cfg, ctx.registry, tokenizer)
            reward_fn = RewardManager(instantiate_options(cfg.reward, RewardConfig), ctx.registry, tokenizer)
            rollout = run.spawn_rollout(run.spawn("actor", cfg.model.path, cfg.actor), tokenizer, max_len=longest_sequence(cfg))
            return self.validate(rollout, val, reward_fn, cfg, agent)

    @staticmethod
    def compute_advantages(batch: Batch, estimator, options, kl_in_reward) -> dict[str, float]:
        """Token rewards (minus the in-reward KL penalty when ``kl_in_reward`` is given), then the
        estimator's advantages and returns into ``batch``; samples are grouped by prompt ``uid``."""
        token_rewards, metrics = kl_in_reward(batch) if kl_in_reward is not None else (batch["token_scores"], {})
        data = AdvantageInputs(
            token_rewards=token_rewards,
            response_mask=batch["response_mask"],
            group_ids=batch.group_index("uid"),
            values=batch.get("values"),
            baseline_rewards=batch.get("baseline_rewards"),
            old_log_probs=batch.get("old_log_probs"),
            sum_sq_probs=batch.get("sum_sq_probs"),
            reward_components={k.removeprefix(COMPONENT): batch[k] for k in batch.keys() if k.startswith(COMPONENT)} or None,
        )
        advantages, returns = estimator(data, options)
        batch["advantages"] = advantages
        batch["returns"] = returns
        return metrics

    @staticmethod
    def validate(
        rollout: RolloutGroup, val: PromptDataset, reward_fn: RewardManager, cfg: DictConfig, agent: AgentSpec | None = None
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


def longest_sequence(cfg: DictConfig) -> int:
    """The longest prompt + response a run asks its rollout for: the engines' context length."""
    response = cfg.sampling.max_new_tokens
    if cfg.multi_turn.enable:  # every turn, model and environment, within the response budget
        response = cfg.multi_turn.max_response_tokens or response * cfg.multi_turn.max_assistant_turns
    return cfg.data.max_prompt_length + response


def sample(rollout: RolloutGroup, prompts: Batch, params: SamplingParams, agent: AgentSpec | None) -> Batch:
    """Single-turn generation, or conversations with the environment when ``agent`` is given."""
    return rollout.generate(prompts, params) if agent is None else rollout.generate_multiturn(prompts, params, agent)


def score(batch: Batch, reward_fn: RewardManager, agent: AgentSpec | None) -> RewardResult:
    return reward_fn.score(batch) if agent is None else score_multiturn(batch, agent.settings, reward_fn)


def _kl_summary(update_metrics: dict[str, float], kl_metrics: dict[str, float]) -> dict[str, float]:
    """``actor/kl``: the KL to the reference in use (as a loss term, else in the reward), if any."""
    kl = update_metrics.get("actor/kl_loss", kl_metrics.get("actor/reward_kl"))
    return {} if kl is None else {"actor/kl": kl}
