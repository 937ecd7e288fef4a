"""Config sections shared by recipes: model, trainer, prompts, sampling, and the roles' optimizer, LoRA adapter and batching."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from trellis.config import ConfigError, choice, component, ranged, switch
from trellis.interfaces.optim import LR_SCHEDULES


@dataclass
class ModelConfig:
    """path: a Hugging Face model folder (any causal LM). tokenizer_path: None = the model's."""

    path: str = MISSING
    tokenizer_path: str | None = None


@dataclass
class TrainerConfig:
    """total_steps: optimizer-driving steps of the recipe. threads: torch threads in this process:
    ``auto`` (the cores other processes leave free when the run starts, kept for the run and its
    resumes), ``follow`` (re-checked every step; the figures may then depend on the load), 0 (every
    core this process may use) or a count. controller: where roles run (``local``: this process; ``ray``: trellis-ray)."""

    total_steps: int = ranged(10, ge=0)
    run_dir: str | None = None
    trackers: list[str] = choice(kind="tracker", default_factory=lambda: ["console", "jsonl"])
    val_every_steps: int = ranged(0, ge=0)  # 0: validate only before and after training
    log_samples: int = ranged(0, ge=0)  # decoded prompt/response/reward rows per step in <run_dir>/samples.jsonl
    threads: str = "auto"
    controller: str = choice("local", kind="controller")
    nnodes: int = ranged(1, ge=1)  # ray: nodes
    procs_per_node: int = ranged(1, ge=1)  # ray: ranks per node (GPUs, or CPU processes)
    separate_pools: list[str] = choice(values=("critic", "reward_model"), default_factory=list)  # ray: roles on pools of their own
    rollout_pool: int = ranged(0, ge=0)  # ray: 0 = engines colocated in the actor's ranks (today), N = N engine processes of their own
    # ray with a rollout pool: how weights reach its engines (Ray's object store, or a gloo/NCCL broadcast group), in buckets of MB
    weight_transport: str = choice("object_store", ("object_store", "broadcast"))
    transport_bucket_mb: float = ranged(64.0, gt=0)
    ray_timeout_s: float = ranged(120.0, gt=0)  # ray: placement must succeed within this
    ray_call_timeout_s: float = ranged(3600.0, gt=0)  # ray: any one call to the ranks must finish within this
    ray_network: str = choice("private", ("private", "host"))  # ray, CLI: a private one-machine cluster in a loopback-only network namespace
    save_hf_model: bool = False  # write the final policy as a Hugging Face folder in <run_dir>/hf_model
    save_every_steps: int = ranged(0, ge=0)  # a checkpoint every N steps (0: only at the last step)
    keep_checkpoints: int | None = ranged(2, ge=0)  # the latest complete checkpoints kept (0: write none; None: keep all)
    resume: str = "auto"  # auto (the latest complete checkpoint in run_dir, if any) | never | a checkpoint or run folder
    resume_allow_changes: list[str] = field(default_factory=list)  # dotted keys that may differ from the checkpoint's config


@dataclass
class PromptData:
    """Prompts in verl's schema for recipes that generate: ``train_batch_prompts`` per step,
    held-out prompts (the first ``val_max_prompts``; 0: all) for validation. A path may be a list
    of files (verl's ``train_files``), read one after another."""

    train_path: str | list[str] = MISSING
    val_path: str | list[str] | None = None
    max_prompt_length: int = ranged(256, ge=1)
    train_batch_prompts: int = ranged(8, ge=1)
    val_max_prompts: int = ranged(0, ge=0)  # 0: every held-out prompt
    shuffle: bool = True
    image_key: str = "images"  # the column of a row's images (verl's data.image_key), for a vision-language model


@dataclass
class SamplingConfig:
    """Rollout sampling for training: ``n`` samples per prompt (``SamplingParams(**cfg.sampling)``).
    seed: opt-in per-request seeds (None: each engine samples from its generator, seeded from the
    run's seed; vLLM in the trainer's process samples from torch's, the trainer's); a number seeds
    every sample with it plus the sample's index in the run, the same however the samples are dealt
    over engines, but vLLM's GPU sampler then takes a slow path."""

    n: int = ranged(4, ge=1)
    temperature: float = ranged(1.0, ge=0)
    top_p: float = ranged(1.0, gt=0, le=1)
    top_k: int = ranged(-1, ge=-1)  # -1: no top-k
    max_new_tokens: int = ranged(64, ge=1)
    seed: int | None = ranged(None, ge=0)


def check_not_a_run(model: Path, key: str = "model.path") -> None:
    """A trellis run folder or checkpoint given as a model folder (config key ``key``) is refused
    with the command that turns it into one (its sharded weights and missing tokenizer would fail
    to load). A Hugging Face folder named ``checkpoint-N`` (the Trainer's, TRL's) is a model folder."""
    from trellis.runtime import provenance
    from trellis.runtime.checkpoint import MANIFEST, PREFIX, checkpoint_step

    hf_folder = (model / "config.json").is_file()
    checkpoint = (model / MANIFEST).is_file() or (checkpoint_step(model) is not None and not hf_folder)
    if not checkpoint and not any(model.glob(PREFIX + "*")) and not (model / provenance.FILE).is_file():
        return
    run = model.parent if checkpoint else model
    out = run.with_name(run.name + "-hf")
    final = run / "hf_model"
    also = f" (or set {key}={final}, the model the run saved at its end)" if (final / "config.json").is_file() else ""
    raise ConfigError(
        f"config key {key!r}: {str(model)!r} is a trellis {'checkpoint' if checkpoint else 'run folder'}, not a Hugging Face "
        f"model folder; export it first: trellis export {model} {out}, then set {key}={out}{also}"
    )


def backend_field() -> Any:
    return component("backend", "fsdp")


@dataclass
class RecipeConfig:
    """The header every recipe's config starts with: which recipe, the seed, the model and the
    backend that runs its roles. A recipe's config adds its own sections after these (and
    restates ``recipe`` with its own name as the default)."""

    recipe: str = MISSING
    seed: int = ranged(0, ge=0)
    model: ModelConfig = field(default_factory=ModelConfig)
    backend: dict = backend_field()


@dataclass
class OptimConfig:
    """AdamW with warm-up then a constant or cosine schedule; the scheduler steps once per
    trainer step (as verl does), so ``warmup_steps`` counts trainer steps. Warm-up step ``s``
    (0-based) runs at ``(s + 1) / warmup_steps`` of ``lr``, or with ``warmup_from_zero`` at
    ``s / warmup_steps`` (Hugging Face's and verl's schedules: the first step at lr 0)."""

    lr: float = ranged(1e-5, gt=0)
    weight_decay: float = ranged(0.0, ge=0)
    betas: list[float] = ranged(default_factory=lambda: [0.9, 0.999], ge=0, lt=1)
    eps: float = ranged(1e-8, gt=0)
    warmup_steps: int = ranged(0, ge=0)
    warmup_from_zero: bool = False
    lr_schedule: str = choice("constant", LR_SCHEDULES)
    min_lr_ratio: float = ranged(0.0, ge=0, le=1)  # cosine floor, as a fraction of lr
    grad_clip: float = ranged(1.0, ge=0)  # max global grad norm; 0 disables clipping


@dataclass
class BatchingConfig:
    """How one step's samples are cut for a role's update.

    mini_batch_samples: samples per optimizer step (0: the whole step's batch in one step).
    micro_batch_samples: samples per forward/backward (gradient accumulation within a mini-batch).
    max_tokens_per_micro_batch: if > 0, micro-batches are cut by this padded-token budget
        instead (dynamic batching); ``micro_batch_samples`` is then ignored.
    """

    ppo_epochs: int = ranged(1, ge=1)
    mini_batch_samples: int = ranged(0, ge=0)
    micro_batch_samples: int = ranged(8, ge=1)
    max_tokens_per_micro_batch: int = ranged(0, ge=0)
    shuffle: bool = False


# how a LoRA adapter starts; each starts with B = 0, so the adapted model is the base model at step 0
ADAPTER_INITS = ("default", "gaussian")


@dataclass
class AdapterConfig:
    """A LoRA adapter trained instead of the full weights (rank 0: off, every weight trains).
    Each targeted linear layer computes ``W x + (alpha / rank) * B A x`` with ``A`` ``(rank, in)``
    and ``B`` ``(out, rank)``; only ``A`` and ``B`` get gradients and optimizer state.
    target_modules: module-name suffixes (``q_proj``...) or ``all-linear`` (every linear layer
    but the LM head). init: ``default`` (A Kaiming-uniform) or ``gaussian`` (A normal, std
    1/rank); B starts at 0 either way."""

    rank: int = switch(ranged(0, ge=0), off=0, turn_on="above 0 (e.g. 8) to train a LoRA adapter")
    alpha: float = ranged(16.0, gt=0)
    dropout: float = ranged(0.0, ge=0, lt=1)
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    init: str = choice("default", ADAPTER_INITS)


def without_adapter(section: DictConfig) -> DictConfig:
    """A role section with its adapter off: a frozen role (reference, teacher) built from a trained
    role's batching trains nothing, so it must not get an adapter of its own."""
    return OmegaConf.merge(section, {"adapter": {"rank": 0}}) if "adapter" in section else section
