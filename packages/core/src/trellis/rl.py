"""The ``rl`` recipe: generate -> reward -> old log-prob -> ref -> values -> advantages ->
critic update -> actor update -> weight sync, with any registered estimator and policy loss."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
from omegaconf import MISSING, DictConfig
from transformers import AutoTokenizer

from trellis.batch import Batch
from trellis.checkpoint import Checkpointer
from trellis.config import ConfigError, component, instantiate_options
from trellis.data import PROMPT_COLUMNS, PromptDataset, PromptLoader, load_rows
from trellis.recipe import RunContext
from trellis.registry import RegistryError
from trellis.rewards import RewardConfig, RewardError, RewardManager, resolve_reward
from trellis.role_config import AGG_MODES, ActorConfig, CriticConfig
from trellis.rollout import SamplingParams
from trellis.signatures import AdvantageInputs
from trellis.training import (
    ModelConfig,
    StageTimer,
    Trackers,
    TrainerConfig,
    backend_field,
    check_inputs,
    make_controller,
    rollout_factory,
    save_hf_folder,
    set_threads,
    spawn_role,
    world_size,
)

log = logging.getLogger("trellis")



def needs(estimator) -> tuple[str, ...]:
    """What a registered advantage estimator asks for beyond rewards: ``values`` (a critic) and/or
    ``greedy_baseline`` (a greedy rollout per prompt), from its ``needs`` attribute."""
    return tuple(getattr(estimator.obj, "needs", ()))


@dataclass
class RLData:
    train_path: str = MISSING
    val_path: str | None = None
    max_prompt_length: int = 256
    train_batch_prompts: int = 8
    val_max_prompts: int = 0  # 0: every held-out prompt
    shuffle: bool = True


@dataclass
class SamplingConfig:
    """Rollout sampling for training: ``n`` samples per prompt."""

    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64


@dataclass
class ValidationConfig:
    """Held-out evaluation: greedy reward and reward of ``n`` samples at ``temperature``."""

    before_train: bool = True
    n: int = 1
    temperature: float = 1.0


@dataclass
class AlgorithmConfig:
    """advantage: a registered estimator. KL in the reward (verl's ``use_kl_in_reward``): token
    rewards minus ``kl_coef`` x KL(actor || ref), with a fixed or adaptive coefficient."""

    advantage: dict = component("advantage", "grpo")
    use_kl_in_reward: bool = False
    kl_penalty: str = "k1"
    kl_ctrl_type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    target_kl: float = 0.1
    kl_horizon: int = 10000


@dataclass
class RLConfig:
    recipe: str = "rl"
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    data: RLData = field(default_factory=RLData)
    backend: dict = backend_field()
    rollout: dict = component("rollout", "hf")
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def check(cfg: DictConfig, registry) -> None:
    """Errors a user can fix, found before any model is built."""
    Trackers.check(cfg.trainer.trackers, registry)
    for key, name in (("actor.kl_loss_type", cfg.actor.kl_loss_type), ("algorithm.kl_penalty", cfg.algorithm.kl_penalty)):
        _lookup(registry, "kl", name, key)
    try:
        resolve_reward(instantiate_options(cfg.reward, RewardConfig), registry)
    except (RewardError, RegistryError) as exc:
        raise ConfigError(f"config key 'reward': {exc}") from None
    check_inputs(cfg)
    samples = cfg.data.train_batch_prompts * cfg.sampling.n
    world = world_size(cfg.trainer)
    if samples % world:
        raise ConfigError(
            f"a step has data.train_batch_prompts x sampling.n = {samples} samples, which {world} data-parallel ranks "
            f"(trainer.nnodes x trainer.procs_per_node) cannot share evenly; make it a multiple of {world}"
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
    if cfg.algorithm.advantage.name in ("grpo", "rloo", "opo", "reinforce_plus_plus_baseline") and cfg.sampling.n < 2:
        log.warning("advantage %r compares samples of one prompt; with sampling.n=1 every advantage is 0", cfg.algorithm.advantage.name)


def _lookup(registry, kind: str, name: str, key: str):
    try:
        return registry.get(kind, name)
    except RegistryError as exc:
        raise ConfigError(f"config key {key!r}: {exc}") from None


class RLRecipe:
    """PPO-family training of a policy with a rollout engine, from config alone."""

    Config = RLConfig

    def run(self, cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
        registry = ctx.registry
        check(cfg, registry)
        ckpt = Checkpointer(cfg, ctx)  # where to resume from; a changed config is refused here, before any model is built
        if ckpt.finished:
            return {"finished_at_step": ckpt.start_step}
        set_threads(cfg.trainer)
        torch.manual_seed(cfg.seed)
        estimator = registry.get("advantage", cfg.algorithm.advantage.name)
        estimator_options = instantiate_options(cfg.algorithm.advantage, estimator.options) if estimator.options else None
        use_critic = "values" in needs(estimator)
        use_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
        kl_ctrl = _kl_controller(cfg) if cfg.algorithm.use_kl_in_reward else None
        kl_penalty = registry.get("kl", cfg.algorithm.kl_penalty).obj

        tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
        train = PromptLoader(
            PromptDataset(load_rows(cfg.data.train_path, required=PROMPT_COLUMNS), tokenizer, cfg.data.max_prompt_length),
            cfg.data.train_batch_prompts,
            seed=cfg.seed,
            shuffle=cfg.data.shuffle,
        )
        val_rows = load_rows(cfg.data.val_path, required=PROMPT_COLUMNS) if cfg.data.val_path else []
        if cfg.data.val_max_prompts:
            val_rows = val_rows[: cfg.data.val_max_prompts]
        val = PromptDataset(val_rows, tokenizer, cfg.data.max_prompt_length) if val_rows else None
        reward_fn = RewardManager(instantiate_options(cfg.reward, RewardConfig), registry, tokenizer)

        steps = cfg.trainer.total_steps
        controller = make_controller(cfg.trainer)
        actor = spawn_role(controller, registry, cfg, "actor", cfg.model.path, cfg.actor, steps)
        ref = spawn_role(controller, registry, cfg, "ref", cfg.model.path, None, steps) if use_ref else None
        critic = spawn_role(controller, registry, cfg, "critic", cfg.critic.model_path or cfg.model.path, cfg.critic, steps) if use_critic else None
        rollout = controller.spawn_rollout(rollout_factory(registry, cfg.rollout, cfg.model.path, tokenizer, cfg.seed), actor)
        sampling = SamplingParams(
            n=cfg.sampling.n,
            temperature=cfg.sampling.temperature,
            top_p=cfg.sampling.top_p,
            top_k=cfg.sampling.top_k,
            max_new_tokens=cfg.sampling.max_new_tokens,
        )
        resumed = ckpt.restore(roles={"actor": actor, "critic": critic}, state={"data": train, "kl": kl_ctrl})  # 0: a fresh run
        if resumed:
            rollout.sync_weights()
        trackers = Trackers(cfg.trainer.trackers, registry, ctx.run_dir, steps, start_step=resumed)
        ctx.hook.trellis_train_start(config=cfg, run_dir=ctx.run_dir)
        timer = StageTimer()
        metrics: dict[str, float] = {}
        summary: dict[str, Any] = {}
        try:
            if val is not None and cfg.validation.before_train and not resumed:
                summary["val_before"] = self.validate(rollout, val, reward_fn, cfg)
                trackers.log(0, {f"val/{k}": v for k, v in summary["val_before"].items()})
            for step in range(resumed + 1, steps + 1):
                start = time.perf_counter()
                prompts = train.next_batch()
                params = SamplingParams(**{**sampling.__dict__, "seed": cfg.seed * 100003 + step})

                with timer("gen"):
                    batch = rollout.generate(prompts, params)
                with timer("reward"):
                    token_scores, reward_metrics = reward_fn(batch)
                    batch["token_scores"] = token_scores
                if "greedy_baseline" in needs(estimator):
                    with timer("gen_greedy"):
                        greedy = rollout.generate(prompts, SamplingParams(**{**params.__dict__, "n": 1, "greedy": True}))
                        batch["baseline_rewards"] = reward_fn.score(greedy).scores.repeat_interleave(params.n)
                with timer("old_log_prob"):
                    old = actor.log_prob(batch, with_entropy=True)
                    batch["old_log_probs"] = old["log_probs"]
                if ref is not None:
                    with timer("ref"):
                        batch["ref_log_probs"] = ref.log_prob(batch)["log_probs"]
                if critic is not None:
                    with timer("values"):
                        batch["values"] = critic.values(batch)["values"]
                with timer("adv"):
                    kl_metrics = self.compute_advantages(batch, estimator, estimator_options, kl_ctrl, kl_penalty, params.n)
                update_metrics: dict[str, float] = {}
                if critic is not None:
                    with timer("update_critic"):
                        update_metrics.update(critic.update(batch))
                with timer("update_actor"):
                    update_metrics.update(actor.update(batch))
                with timer("weight_sync"):
                    rollout.sync_weights()

                mask = batch["response_mask"].float()
                metrics = {
                    **reward_metrics,
                    **update_metrics,
                    **kl_metrics,
                    **_kl_summary(update_metrics, kl_metrics),
                    "actor/entropy": float((old["entropy"] * mask).sum() / mask.sum().clamp(min=1)),
                    "response/length_mean": float(mask.sum(-1).mean()),
                    "response/clip_frac": float((mask.sum(-1) >= params.max_new_tokens).float().mean()),
                    "critic/advantage_mean": float((batch["advantages"] * mask).sum() / mask.sum().clamp(min=1)),
                    **timer.metrics(),
                    "timing/dispatch_s": controller.dispatch_seconds(),
                }
                if val is not None and cfg.trainer.val_every_steps and step % cfg.trainer.val_every_steps == 0 and step < steps:
                    metrics.update({f"val/{k}": v for k, v in self.validate(rollout, val, reward_fn, cfg).items()})
                metrics["timing/step_s"] = time.perf_counter() - start
                trackers.log(step, metrics)
                ctx.hook.trellis_step_end(step=step, metrics=metrics)
                ckpt.after_step(step)
            if val is not None:
                summary["val_after"] = self.validate(rollout, val, reward_fn, cfg)
                metrics.update({f"val/{k}": v for k, v in summary["val_after"].items()})
                trackers.log(steps, {f"val/{k}": v for k, v in summary["val_after"].items()})
            if cfg.trainer.save_hf_model:
                save_hf_folder(cfg.model.path, chain.from_iterable(actor.export_weights()), tokenizer, ctx.run_dir / "hf_model")
        finally:
            trackers.close()
            controller.shutdown()
            ctx.hook.trellis_train_end(run_dir=ctx.run_dir, metrics=metrics)
        return summary

    @staticmethod
    def compute_advantages(batch: Batch, estimator, options, kl_ctrl, kl_penalty, n: int) -> dict[str, float]:
        """Token rewards (minus ``kl_ctrl.value`` x ``kl_penalty`` when KL is in the reward), then the
        estimator's advantages and returns into ``batch``."""
        token_rewards = batch["token_scores"]
        metrics: dict[str, float] = {}
        if kl_ctrl is not None:
            from trellis_algos.kl import apply_kl_penalty

            token_rewards, kl = apply_kl_penalty(
                token_rewards,
                batch["old_log_probs"],
                batch["ref_log_probs"],
                batch["response_mask"],
                kl_ctrl,
                kl_penalty,
            )
            metrics = {"actor/reward_kl": kl["kl"], "actor/reward_kl_coef": kl["kl_coef"]}
        data = AdvantageInputs(
            token_rewards=token_rewards,
            response_mask=batch["response_mask"],
            group_ids=torch.arange(len(batch)) // n,
            values=batch.get("values"),
            baseline_rewards=batch.get("baseline_rewards"),
        )
        advantages, returns = estimator.obj(data, options)
        batch["advantages"] = advantages
        batch["returns"] = returns
        return metrics

    @staticmethod
    def validate(rollout, val: PromptDataset, reward_fn: RewardManager, cfg: DictConfig) -> dict[str, float]:
        """Greedy and sampled reward on every held-out prompt (generated in one pass each)."""
        prompts = val.as_batch()
        base = SamplingParams(max_new_tokens=cfg.sampling.max_new_tokens, seed=cfg.seed)
        greedy = rollout.generate(prompts, SamplingParams(**{**base.__dict__, "greedy": True}))
        sampled = rollout.generate(
            prompts, SamplingParams(**{**base.__dict__, "n": cfg.validation.n, "temperature": cfg.validation.temperature})
        )
        return {
            "greedy_reward_mean": float(reward_fn.score(greedy).scores.mean()),
            "reward_mean": float(reward_fn.score(sampled).scores.mean()),
        }


def _kl_summary(update_metrics: dict[str, float], kl_metrics: dict[str, float]) -> dict[str, float]:
    """``actor/kl``: the KL to the reference in use (as a loss term, else in the reward), if any."""
    kl = update_metrics.get("actor/kl_loss", kl_metrics.get("actor/reward_kl"))
    return {} if kl is None else {"actor/kl": kl}


def _kl_controller(cfg: DictConfig):
    try:
        from trellis_algos.kl import KLControlOptions, make_kl_controller
    except ImportError:
        raise ConfigError("config key 'algorithm.use_kl_in_reward' needs trellis-algos: pip install trellis-algos") from None
    a = cfg.algorithm
    return make_kl_controller(KLControlOptions(type=a.kl_ctrl_type, kl_coef=a.kl_coef, target_kl=a.target_kl, horizon=a.kl_horizon))
