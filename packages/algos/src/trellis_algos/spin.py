"""The ``spin`` recipe: self-play fine-tuning (Chen et al., arXiv:2401.01335) as online DPO.

Each step the current policy samples ``n`` responses per prompt; pairs are made either from the
dataset's reference answer (chosen) against each sample (rejected), as in the SPIN paper, or from
the samples themselves ranked by a reward (best against worst of each prompt); the actor takes a
preference step (``sigmoid`` or ``ipo``) against the reference model, and the reference takes the
actor's weights, in memory, every ``ref_update_every`` steps (the paper's iterations).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
from omegaconf import DictConfig

from trellis import (
    Batch,
    ConfigError,
    PromptData,
    RecipeConfig,
    Run,
    RunContext,
    SamplingConfig,
    SamplingParams,
    TrainerConfig,
    choice,
    component,
    encode_response,
    instantiate_options,
    pair_batch,
    ranged,
    rollout_batch,
    save_hf_folder,
    without_adapter,
)
from trellis_algos.preference import make_pairs
from trellis_algos.prompts import PromptDataset, load_prompt_data
from trellis_algos.rewards import RewardConfig, RewardManager, check_reward
from trellis_algos.sections import PreferenceTrainConfig, check_inputs
from trellis_algos.tokenizers import policy_tokenizer

PAIR_SOURCES = ("reference", "ranked")


@dataclass
class SPINConfig(RecipeConfig):
    recipe: str = "spin"
    data: PromptData = field(default_factory=PromptData)  # with pairs: reference, each row's answer in extra_info.answer
    rollout: dict = component("rollout", "hf")
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    pairs: str = choice("reference", PAIR_SOURCES)  # reference: dataset answer vs each sample; ranked: best vs worst sample by reward
    reward: RewardConfig = field(default_factory=RewardConfig)  # ranks samples (ranked) and scores held-out prompts
    ref_update_every: int = ranged(1, ge=0)  # steps between reference <- actor (0: never)
    train: PreferenceTrainConfig = field(default_factory=PreferenceTrainConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def check(cfg: DictConfig, registry: Any) -> None:
    """What a user can fix, before anything is written or built."""
    check_inputs(cfg)
    if cfg.pairs == "ranked" and cfg.sampling.n < 2:
        raise ConfigError(f"config key 'sampling.n' is {cfg.sampling.n}; pairs: ranked compares samples of a prompt, so it needs at least 2")
    check_reward(cfg.reward, registry, cfg.recipe)


def check_answers(prompts: PromptDataset) -> None:
    """``pairs: reference`` needs every prompt's reference answer in ``extra_info.answer``."""
    missing = [item["index"] for item in prompts.items if (item["extra_info"] or {}).get("answer") is None]
    if missing:
        raise ConfigError(
            f"pairs: reference needs each prompt's reference answer in extra_info.answer; {len(missing)} rows of "
            f"data.train_path have none (first: row {missing[0]}); add it, or use pairs: ranked to pair the model's own samples"
        )


def reference_answers(prompts: Batch, tokenizer: Any, params: SamplingParams) -> Batch:
    """The prompts' reference answers (``extra_info.answer``) laid out as a rollout of one sample
    per prompt: ``responses``, ``response_mask`` and prompt + response model inputs."""
    answers = [encode_response(tokenizer, str(info["answer"])) for info in prompts["extra_info"]]
    width = max(map(len, answers))
    responses = torch.tensor([a + [tokenizer.pad_token_id or 0] * (width - len(a)) for a in answers])
    mask = torch.tensor([[1] * len(a) + [0] * (width - len(a)) for a in answers])
    return rollout_batch(prompts, SamplingParams(n=1, temperature=params.temperature), responses, mask, torch.zeros(mask.shape))


def summed_log_probs(ref, rows: Batch) -> torch.Tensor:
    """The reference model's log-probability of each row's response, ``(rows,)``."""
    return (ref.log_prob(rows)["log_probs"] * rows["response_mask"]).sum(-1)


class SPINRecipe:
    """Self-play fine-tuning: online DPO of the policy's own samples against reference answers
    (or against each other, ranked by a reward), the reference refreshed from the policy."""

    Config = SPINConfig
    check = staticmethod(check)
    resume_safe_keys = ("data.val_path", "data.val_max_prompts")
    policy = "train"  # the section the actor is built from
    exports = {"actor": "lm"}  # what trellis export writes

    def run(self, cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
        with Run(cfg, ctx) as run:
            if run.finished:
                return run.finished_summary()
            tokenizer = policy_tokenizer(cfg)
            train, val = load_prompt_data(cfg.data, tokenizer, cfg.seed)
            if cfg.pairs == "reference":
                check_answers(train.dataset)
            reward = RewardManager(instantiate_options(cfg.reward, RewardConfig), ctx.registry, tokenizer)

            actor = run.spawn("actor", cfg.model.path, cfg.train, objectives={"preference_update": "preference"})
            ref = run.spawn("ref", cfg.model.path, without_adapter(cfg.train))  # frozen: takes the actor's merged weights
            rollout = run.spawn_rollout(actor, tokenizer, max_len=cfg.data.max_prompt_length + cfg.sampling.max_new_tokens)
            validate = functools.partial(self.validate, rollout, val, reward, cfg) if val is not None else None
            start = run.start(roles={"actor": actor, "ref": ref}, state={"data": train}, rollout=rollout, validate=validate)
            sampling = SamplingParams(**cfg.sampling)
            for step in run.steps(start):
                prompts = train.next_batch()
                params = sampling.at_step(step, cfg.data.train_batch_prompts * sampling.n)
                with run.generating(rollout):
                    with run.timer("gen"):
                        samples = rollout.generate(prompts, params)
                    with run.timer("pairs"):
                        scored = reward.score(samples)
                        chosen, rejected, metrics = self.pairs(cfg, prompts, samples, scored, tokenizer, params, actor.mesh.dp)
                run.log_samples(step, samples, scored.scores, tokenizer)
                if len(chosen):
                    with run.timer("ref"):
                        ref_chosen, ref_rejected = summed_log_probs(ref, chosen), summed_log_probs(ref, rejected)
                    pairs = pair_batch(chosen, rejected, ref_chosen, ref_rejected)
                    pairs.meta["step"] = step
                    with run.timer("update_actor"):
                        metrics.update(actor.preference_update(pairs))
                    with run.timer("weight_sync"):
                        rollout.sync_weights(version=step)
                if cfg.ref_update_every and step % cfg.ref_update_every == 0:
                    with run.timer("ref_update"):
                        run.controller.copy_weights(actor, ref)
                run.end_step(step, metrics)
            if cfg.trainer.save_hf_model:
                save_hf_folder(cfg.model.path, chain.from_iterable(actor.export_weights()), tokenizer, ctx.run_dir / "hf_model")
        return run.summary

    @staticmethod
    def pairs(cfg: DictConfig, prompts: Batch, samples: Batch, scored: Any, tokenizer: Any, params: SamplingParams, dp: int):
        """``(chosen, rejected, metrics)`` from ``samples`` and their rewards ``scored``: two row
        batches of equal length in the rollout layout, as many as the ``dp`` data-parallel ranks can
        share evenly, log-probs at temperature 1."""
        metrics = {**scored.metrics, "spin/sample_reward": float(scored.scores.mean())}
        if cfg.pairs == "reference":
            chosen, rejected = reference_answers(prompts, tokenizer, params).repeat_interleave(params.n), samples
        else:
            best, worst, ties = make_pairs(scored.scores, list(samples["uid"]))
            chosen, rejected = samples[best], samples[worst]
            metrics["spin/tied_prompts"] = float(ties)
        keep = torch.arange(len(chosen) - len(chosen) % dp)
        chosen, rejected = chosen[keep], rejected[keep]
        for rows in (chosen, rejected):
            rows.meta = {**rows.meta, "temperature": 1.0}  # DPO compares the models' own log-probs
        return chosen, rejected, {**metrics, "spin/pairs": float(len(keep))}

    @staticmethod
    def validate(rollout, val: PromptDataset, reward: RewardManager, cfg: DictConfig) -> dict[str, float]:
        """Greedy reward on every held-out prompt."""
        greedy = rollout.generate(val.as_batch(), SamplingParams(max_new_tokens=cfg.sampling.max_new_tokens, greedy=True, seed=cfg.sampling.seed))
        return {"greedy_reward_mean": float(reward.score(greedy).scores.mean())}
