"""The ``rl`` recipe: PPO-family training of a policy with a rollout engine, from config alone.
Its parts: ``config`` (the sections), ``checks`` (before anything is built), ``samples`` (where a
step's samples come from), ``learner`` (what a step does with them); the loop is :meth:`RLRecipe.run`."""

from __future__ import annotations

import functools
import logging
from itertools import chain
from typing import Any

from omegaconf import DictConfig

from trellis import ConfigError, RolloutGroup, Run, RunContext, SamplingParams, Scorer, save_hf_folder
from trellis_algos.rl.ahead import staleness_bound
from trellis_algos.rl.checks import check, check_data, load_data, longest_sequence
from trellis_algos.rl.config import AlgorithmConfig, RLConfig, RLTrainerConfig, ValidationConfig
from trellis_algos.rl.figures import groups_with_signal, truncated, without_truncated
from trellis_algos.rl.learner import Learner, compute_advantages
from trellis_algos.rl.samples import SampleSource, make_reward, sample, scorer_of
from trellis_algos.tokenizers import policy_tokenizer

__all__ = [
    "AlgorithmConfig", "RLConfig", "RLRecipe", "RLTrainerConfig", "ValidationConfig",
    "compute_advantages", "groups_with_signal", "truncated", "without_truncated",
]  # fmt: skip

log = logging.getLogger("trellis")


class RLRecipe:
    """PPO-family training of a policy with a rollout engine, from config alone."""

    Config = RLConfig
    check = staticmethod(check)
    check_data = staticmethod(check_data)
    resume_safe_keys = ("validation", "data.val_path", "data.val_max_prompts", "trainer.log_samples")
    policy = "actor"  # the section the actor is built from
    exports = {"actor": "lm"}  # what trellis export writes

    def run(self, cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
        with Run(cfg, ctx) as run:
            if run.finished:
                return run.finished_summary()
            tokenizer = policy_tokenizer(cfg)
            agent, train, val = load_data(cfg, ctx.registry, tokenizer)
            bound = staleness_bound(cfg.trainer)  # None: generation inline (async_mode=off)
            learner = Learner(cfg, run, tokenizer, async_run=bound is not None)
            reward_fn = make_reward(cfg, run, ctx.registry, tokenizer)
            if bound is not None:
                log.info("trainer.async_mode=%s: generation runs ahead of training (samples at most %d version(s) old) on an engine "
                         "with weights of its own", cfg.trainer.async_mode, bound)  # fmt: skip
            rollout = run.spawn_rollout(learner.actor, tokenizer, max_len=longest_sequence(cfg), own_weights=bound is not None)
            learner.watch(rollout)
            samples = SampleSource(cfg, run, rollout, train, agent, reward_fn, tokenizer, learner.needs, bound)
            start = run.start(
                roles=learner.roles,
                state={"data": samples.position, "kl": learner.kl_in_reward, "sync_probe": learner.probe},
                rollout=rollout,
                validate=functools.partial(
                    self.validate, rollout, val, reward_fn, cfg, agent, functools.partial(run.log_validation, tokenizer=tokenizer)
                )
                if val is not None
                else None,
                validate_before=cfg.validation.before_train,
                overlap=bound is not None,
            )
            with samples.from_step(start + 1):
                for step in run.steps(start):
                    made, handover = samples.take(step)
                    run.end_step(step, learner.step(step, made, handover, samples.before_sync))
                    samples.finished(step)
            if cfg.trainer.save_hf_model:
                save_hf_folder(cfg.model.path, chain.from_iterable(learner.actor.export_weights()), tokenizer, ctx.run_dir / "hf_model")
        return run.summary

    def evaluate(self, cfg: DictConfig, ctx: RunContext) -> dict[str, float]:
        """Validation alone, once (``trellis eval``): the actor from ``model.path`` and its rollout,
        no optimizer, critic or reference, nothing written."""
        if not cfg.data.val_path:
            raise ConfigError("config key 'data.val_path' is not set; trellis eval scores the held-out prompts it names: set data.val_path=<file>")
        with Run(cfg, ctx) as run:
            tokenizer = policy_tokenizer(cfg)
            agent, _, val = load_data(cfg, ctx.registry, tokenizer)
            rollout = run.spawn_rollout(run.spawn("actor", cfg.model.path, cfg.actor), tokenizer, max_len=longest_sequence(cfg))
            reward_fn = make_reward(cfg, run, ctx.registry, tokenizer)
            return self.validate(rollout, val, reward_fn, cfg, agent)

    @staticmethod
    def validate(rollout: RolloutGroup, val, reward_fn: Scorer, cfg: DictConfig, agent=None, log=None) -> dict[str, float]:
        """Greedy and sampled reward on every held-out prompt (generated in one pass each); in
        multi-turn runs also the greedy reward of the first answer alone (without feedback).
        ``log(batch, scores)`` receives the greedy generations and their rewards."""
        prompts, scorer = val.as_batch(), scorer_of(reward_fn, agent, cfg.reward.max_error_rate)
        base = SamplingParams(max_new_tokens=cfg.sampling.max_new_tokens, seed=cfg.sampling.seed)
        answers = sample(rollout, prompts, SamplingParams(**{**base.__dict__, "greedy": True}), agent)
        greedy = scorer.score(answers)
        if log is not None:
            log(answers, greedy.scores)
        sampled_params = SamplingParams(**{**base.__dict__, "n": cfg.validation.n, "temperature": cfg.validation.temperature})
        sampled = scorer.score(sample(rollout, prompts, sampled_params, agent))
        out = {"greedy_reward_mean": float(greedy.scores.mean()), "reward_mean": float(sampled.scores.mean())}
        if "reward/first_turn_mean" in greedy.metrics:
            out["greedy_first_turn_reward_mean"] = greedy.metrics["reward/first_turn_mean"]
            out["first_turn_reward_mean"] = sampled.metrics["reward/first_turn_mean"]
        return out
