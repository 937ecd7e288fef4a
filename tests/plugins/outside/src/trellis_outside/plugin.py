"""A third party's plugin on public names only: a group filter with options, an agent loop with an
environment of its own, and a ``teacher_distill`` recipe with a role, a verb and a kind core never names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import MISSING, DictConfig
from transformers import AutoTokenizer

import trellis
from trellis import Batch, PromptData, RecipeConfig, Run, RunContext, SamplingConfig, SamplingParams, TrainerConfig, aggregation_for, component
from trellis_algos import SFTTrainConfig, load_prompt_data
from trellis_multiturn import ChatDeltas


# -- a group filter with options ---------------------------------------------------------------------
@dataclass
class SpreadOptions:
    min_spread: float = trellis.ranged(0.0, ge=0)  # a kept group's best and worst sample differ by more than this


def spread(values: torch.Tensor, groups: torch.Tensor, options: SpreadOptions) -> torch.Tensor:
    """Keep the prompt groups ``(groups,)`` whose values ``(batch,)`` spread by more than ``options.min_spread``."""
    n = int(groups.max()) + 1
    best = torch.full((n,), float("-inf")).scatter_reduce(0, groups, values.float(), "amax")
    worst = torch.full((n,), float("inf")).scatter_reduce(0, groups, values.float(), "amin")
    return best - worst > options.min_spread


# -- an agent loop that brings its own environment ---------------------------------------------------
class Retell:
    """The loop's environment: after the model's answer it asks for the answer again, and scores
    the retelling by the share of its tokens the first answer held (0 for an empty retelling)."""

    ask = {"role": "user", "content": "Say that again."}

    @staticmethod
    def score(first: list[int], again: list[int]) -> float:
        held = set(first)
        return sum(t in held for t in again) / len(again) if again else 0.0


class RetellLoop(trellis.AgentLoop):
    """Two model turns around the environment's request to retell; the sample's score is the
    environment's (``multi_turn.score=last``). Reads the prompt only: no data column of its own."""

    brings_environment = True  # no interaction, tool or environment class in the config

    @classmethod
    def check(cls, settings: Any) -> None:
        if settings.max_assistant_turns < 2:
            raise trellis.ConfigError(
                f"config key 'multi_turn.max_assistant_turns' is {settings.max_assistant_turns}; the outside_retell loop takes "
                "two model turns: set it to 2 or more"
            )

    def __init__(self, engine, spec, env) -> None:
        super().__init__(engine, spec, env)
        self.chat, self.retell = ChatDeltas(spec.tokenizer, spec.template_kwargs), Retell()

    async def sample(self, prompt_ids, raw_prompt, extra_info, params) -> trellis.Trajectory:
        traj = trellis.Trajectory()
        first = await self.engine.agenerate(prompt_ids, params)
        traj.add_model(first)
        traj.add_environment(self.chat.after_model(first.token_ids, [self.retell.ask]))
        traj.user_turns += 1
        budget = self.settings.response_budget(params.max_new_tokens)
        room = min(params.max_new_tokens, budget - len(traj.response_ids))
        if room <= 0:
            traj.finish = "max_response_tokens"
            return traj
        again = await self.engine.agenerate(prompt_ids + traj.response_ids, dataclasses.replace(params, max_new_tokens=room))
        traj.add_model(again)
        traj.turn_scores.append(self.retell.score(first.token_ids, again.token_ids))
        traj.finish = "retold"
        return traj


# -- a recipe with a teacher role, a verb and a kind that core never names ---------------------------
def k2(gap: torch.Tensor) -> torch.Tensor:
    """Per-token ``0.5 * (log p_student - log p_teacher)^2`` at the sampled tokens."""
    return 0.5 * gap.square()


class TeacherKL:
    """Objective of the ``distill`` verb: the student's log-probs pulled to the teacher's on the
    student's own samples, per token by the ``teacher_loss`` the options name, token-mean."""

    outputs = ("log_probs",)
    inputs = ("responses", "response_mask", "teacher_log_probs")
    summed = frozenset({"loss"})
    prefix = "distill"

    def __init__(self, options: Any, registry: Any) -> None:
        self.per_token = registry.get("teacher_loss", options.loss.name).obj

    def rows(self, batch: Batch) -> Batch:
        return batch

    def counts(self, batch: Batch):
        return aggregation_for("token-mean", batch["response_mask"])

    def loss(self, micro: Batch, outputs: dict[str, torch.Tensor], agg) -> tuple[torch.Tensor, dict[str, float]]:
        log_probs = outputs["log_probs"]
        mask = micro["response_mask"].to(log_probs.device)
        per_token = self.per_token(log_probs - micro["teacher_log_probs"].to(log_probs.device))
        loss = (per_token * mask).sum() / agg.global_tokens
        return loss, {"loss": float(loss.detach())}


@dataclass
class DistillTrain(SFTTrainConfig):
    loss: dict = component("teacher_loss", "k2")


@dataclass
class DistillConfig(RecipeConfig):
    recipe: str = "teacher_distill"
    data: PromptData = field(default_factory=PromptData)
    rollout: dict = component("rollout", "hf")
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    teacher_path: str = MISSING
    train: DistillTrain = field(default_factory=DistillTrain)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


class TeacherDistill:
    """The student samples; a frozen teacher (another model folder) scores the student's tokens;
    the student trains on them by the ``distill`` verb."""

    Config = DistillConfig
    policy = "train"  # the student (actor) is built from the train section
    exports = {"actor": "lm"}  # trellis export writes the student

    def run(self, cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
        with Run(cfg, ctx) as run:
            tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
            train, _ = load_prompt_data(cfg.data, tokenizer, cfg.seed)
            student = run.spawn("actor", cfg.model.path, cfg.train, objectives={"distill": "teacher_kl"})
            teacher = run.spawn("teacher", cfg.teacher_path, cfg.train)
            rollout = run.spawn_rollout(student, tokenizer, max_len=cfg.data.max_prompt_length + cfg.sampling.max_new_tokens)
            start = run.start(roles={"actor": student}, state={"data": train}, rollout=rollout)
            sampling = SamplingParams(**cfg.sampling)
            for step in run.steps(start):
                with run.generating(rollout):
                    batch = rollout.generate(train.next_batch(), sampling.at_step(step, cfg.data.train_batch_prompts * sampling.n))
                batch.meta["step"] = step
                batch["teacher_log_probs"] = teacher.log_prob(batch)["log_probs"]
                metrics = student.distill(batch)
                rollout.sync_weights(version=step)
                run.end_step(step, metrics)
        return {"teacher_routes": sorted(teacher.routes), "student_routes": sorted(student.routes), "final": run.metrics}


@trellis.hookimpl
def trellis_add_kinds(registry):
    registry.add_kind("teacher_loss")


@trellis.hookimpl
def trellis_register(registry):
    registry.add("group_filter", "outside_spread", spread, options=SpreadOptions)
    registry.add("agent_loop", "outside_retell", RetellLoop)
    registry.add("teacher_loss", "k2", k2)
    registry.add("objective", "teacher_kl", TeacherKL)
    registry.add("recipe", "teacher_distill", TeacherDistill(), options=DistillConfig)
