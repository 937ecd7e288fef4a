"""Test-only plugins that open the spine from outside core: a ``teacher_distill`` recipe (a
``teacher`` role from another model folder, a training verb ``distill``, a registry kind
``teacher_loss`` of its own), and stand-ins that make the generation choreography (and a sync that
silently drops the weights) visible on CPU.

Nothing here is imported by trellis: the tests load it with ``load_plugins(extra=...)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import MISSING, DictConfig
from transformers import AutoTokenizer

from trellis import (
    Batch,
    PromptData,
    RecipeConfig,
    RolloutEngine,
    Run,
    RunContext,
    SamplingConfig,
    SamplingParams,
    SFTTrainConfig,
    TrainerConfig,
    aggregation_for,
    component,
    hookimpl,
    load_prompt_data,
)
from trellis.interfaces.rollout import ALL_MEMORY, WEIGHTS
from trellis_fsdp.backend import FSDPBackend, FSDPOptions
from trellis_hf.engine import HFRolloutOptions
from trellis_hf.engine import make_engine as make_hf_engine

EVENTS: list[str] = []  # what the stand-ins saw, in order
LAST_METRICS: dict[str, float] = {}  # run.metrics as trellis_train_end received them


# -- a teacher role, a verb and a kind that core never names ---------------------------------------
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


# -- stand-ins that make the choreography visible ---------------------------------------------------
class StrictSleepEngine(RolloutEngine):
    """Stand-in for an engine with a real sleep mode (vLLM's and SGLang's, which need a GPU): the
    HF engine does the work, and this enforces their rules on CPU. Generating on a sleeping
    engine raises, as theirs do; loading weights needs the weights awake; it keeps weights of
    its own (never adopts the actor's module), so every update must arrive by a weight sync."""

    def __init__(self, spec) -> None:
        self.inner = make_hf_engine(spec)
        self.awake = set(ALL_MEMORY)

    def _awake(self, what: str) -> None:
        if self.awake != set(ALL_MEMORY):
            raise RuntimeError(f"{what} on a sleeping engine (awake: {sorted(self.awake)}): wake it first")
        EVENTS.append(what)

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        self._awake("generate")
        return self.inner.generate(prompts, params)

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams):
        self._awake("generate")
        return await self.inner.agenerate(prompt_ids, params)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], shapes: Mapping[str, Sequence[int]] | None = None) -> None:
        if WEIGHTS not in self.awake:
            raise RuntimeError("load_weights with the weights asleep: wake them first")
        EVENTS.append("load_weights")
        self.inner.load_weights(weights, shapes=shapes)

    def sleep(self) -> None:
        self.awake.clear()
        EVENTS.append("sleep")

    def wake(self, tags=ALL_MEMORY) -> None:
        self.awake |= set(tags)
        EVENTS.append("wake")

    def close(self) -> None:
        self.inner.close()


class SkipSyncEngine(RolloutEngine):
    """Stand-in for a weight sync that silently keeps the old weights (verl #7495, TRL #5312): the
    HF engine with weights of its own, whose ``load_weights`` reads the update and drops it."""

    def __init__(self, spec) -> None:
        self.inner = make_hf_engine(spec)
        self.weight_dtype = self.inner.weight_dtype

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        return self.inner.generate(prompts, params)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], shapes: Mapping[str, Sequence[int]] | None = None) -> None:
        for _ in weights:
            pass

    def close(self) -> None:
        self.inner.close()


class RecordingBackend:
    """The FSDP backend, recording when its role offloads and onloads (which the real one does
    only as its options ask, invisibly on CPU)."""

    def __init__(self, spec) -> None:
        self._inner = FSDPBackend(spec)
        self._role = spec.role

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_inner"], name)

    def offload(self) -> None:
        EVENTS.append(f"offload {self._role}")
        self._inner.offload()

    def onload(self) -> None:
        EVENTS.append(f"onload {self._role}")
        self._inner.onload()


class SpinePlugin:
    """Registers the above; a plain object, as any third-party plugin module would be."""

    @hookimpl
    def trellis_add_kinds(self, registry):
        registry.add_kind("teacher_loss")

    @hookimpl
    def trellis_register(self, registry):
        registry.add("teacher_loss", "k2", k2)
        registry.add("objective", "teacher_kl", TeacherKL)
        registry.add("recipe", "teacher_distill", TeacherDistill(), options=DistillConfig)
        registry.add("rollout", "strict_sleep", StrictSleepEngine, options=HFRolloutOptions)
        registry.add("rollout", "skip_sync", SkipSyncEngine, options=HFRolloutOptions)
        registry.add("backend", "recording", RecordingBackend, options=FSDPOptions)

    @hookimpl
    def trellis_train_end(self, run_dir, metrics):
        LAST_METRICS.clear()
        LAST_METRICS.update(metrics)
