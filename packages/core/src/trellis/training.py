"""Pieces every recipe uses: threads, trackers, stage timers, role workers, HF folder export."""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import MISSING, DictConfig

from trellis.config import ConfigError, component, instantiate_options
from trellis.controller import Controller, LocalController, WorkerGroup
from trellis.registry import Registry, RegistryError
from trellis.rollout import RolloutSpec
from trellis.workers import WorkerSpec

log = logging.getLogger("trellis")


@dataclass
class ModelConfig:
    """path: a Hugging Face model folder (any causal LM). tokenizer_path: None = the model's."""

    path: str = MISSING
    tokenizer_path: str | None = None


@dataclass
class TrainerConfig:
    """total_steps: optimizer-driving steps of the recipe. threads: torch threads in this process
    (0: the cores this process may use). controller: where roles run (``local``: this process)."""

    total_steps: int = 10
    run_dir: str | None = None
    trackers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    val_every_steps: int = 0  # 0: validate only before and after training
    threads: int = 0
    controller: str = "local"  # local | ray
    nnodes: int = 1  # ray: nodes
    procs_per_node: int = 1  # ray: ranks per node (GPUs, or CPU processes)
    separate_pools: list[str] = field(default_factory=list)  # ray: roles (critic, reward_model) on pools of their own
    ray_timeout_s: float = 120.0  # ray: placement must succeed within this
    ray_call_timeout_s: float = 3600.0  # ray: any one call to the ranks must finish within this
    save_hf_model: bool = False  # write the final policy as a Hugging Face folder in <run_dir>/hf_model
    save_every_steps: int = 0  # a checkpoint every N steps (0: only at the last step)
    keep_checkpoints: int = 2  # the latest complete checkpoints kept (0: write none)
    resume: str = "auto"  # auto (the latest complete checkpoint in run_dir, if any) | never | a checkpoint or run folder
    resume_allow_changes: list[str] = field(default_factory=list)  # dotted keys that may differ from the checkpoint's config


def check_inputs(cfg: DictConfig) -> None:
    """The model folder and the data files a recipe names must exist (checked before building)."""
    for key in ("train_path", "val_path"):
        path = cfg.data[key]
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"config key 'data.{key}': file {path!r} does not exist; give the path of a parquet or jsonl file")
    if not Path(cfg.model.path).exists():
        raise ConfigError(f"config key 'model.path': {cfg.model.path!r} does not exist; give a Hugging Face model folder")


def backend_field() -> Any:
    return component("backend", "fsdp")


def set_threads(trainer: DictConfig) -> int:
    """Pin torch to ``trainer.threads`` threads (0: the usable cores, shared by the ranks this
    machine runs); oversubscribing a few cores makes steps 10-30x slower."""
    n = trainer.threads or max(1, len(os.sched_getaffinity(0)) // (trainer.procs_per_node if trainer.controller == "ray" else 1))
    torch.set_num_threads(n)
    return n


def make_controller(trainer: DictConfig) -> Controller:
    """The controller ``trainer.controller`` names, with its placement options."""
    if trainer.controller == "local":
        return LocalController()
    if trainer.controller == "ray":
        from trellis.ray_controller import RayController

        return RayController(
            trainer.nnodes, trainer.procs_per_node, trainer.ray_timeout_s, trainer.ray_call_timeout_s, list(trainer.separate_pools)
        )
    raise ConfigError(f"config key 'trainer.controller' is {trainer.controller!r}; valid: local, ray")


def world_size(trainer: DictConfig) -> int:
    return 1 if trainer.controller == "local" else trainer.nnodes * trainer.procs_per_node


def spawn_role(
    controller: Controller, registry: Registry, cfg: DictConfig, role: str, model_path: str, role_options: Any, total_steps: int
) -> WorkerGroup:
    entry = registry.get("backend", cfg.backend.name)
    options = instantiate_options(cfg.backend, entry.options) if entry.options else None

    def make(dist):
        spec = WorkerSpec(role, model_path, options, role_options, dist=dist, registry=registry, seed=cfg.seed, total_steps=total_steps)
        return entry.obj(spec)

    return controller.spawn(role, make)


def rollout_factory(registry: Registry, node: DictConfig, model_path: str, tokenizer: Any, seed: int) -> Callable[[], Any]:
    """A picklable function that builds the rollout engine ``node.name`` (run where the engine lives)."""
    entry = registry.get("rollout", node.name)
    spec = RolloutSpec(model_path, instantiate_options(node, entry.options) if entry.options else None, tokenizer, seed=seed)
    return functools.partial(entry.obj, spec)


class Trackers:
    """Every tracker named in ``trainer.trackers``, fed together, closed together. A run resumed
    after ``start_step`` tells each tracker that has ``resume(step)`` to drop what came later."""

    def __init__(self, names: Iterable[str], registry: Registry, run_dir: Path, total_steps: int, start_step: int = 0) -> None:
        self.trackers = [registry.get("tracker", n).obj(run_dir, total_steps) for n in names]
        for t in self.trackers:
            if start_step and hasattr(t, "resume"):
                t.resume(start_step)

    @staticmethod
    def check(names: Iterable[str], registry: Registry) -> None:
        """Each tracker is installed and its library imports (``requires``: module, pip requirement),
        so a missing one fails at start-up, not at the first log."""
        for i, name in enumerate(names):
            key = f"trainer.trackers[{i}]"
            try:
                factory = registry.get("tracker", name).obj
            except RegistryError as exc:
                raise ConfigError(f"config key {key!r}: {exc}") from None
            module, requirement = getattr(factory, "requires", None) or (None, None)
            if module is not None:
                try:
                    importlib.import_module(module)
                except ImportError as exc:
                    raise ConfigError(f"config key {key!r}: tracker {name!r} needs {module} ({exc}): pip install '{requirement}'") from None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for t in self.trackers:
            t.log(step, metrics)

    def close(self) -> None:
        for t in self.trackers:
            t.close()


class StageTimer:
    """``with timer("gen"):`` adds ``timing/gen_s``; ``timer.metrics()`` returns and resets them."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[f"timing/{stage}_s"] = self.times.get(f"timing/{stage}_s", 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        out, self.times = self.times, {}
        return out


def save_hf_folder(config_source: str, weights: Iterable[tuple[str, torch.Tensor]], tokenizer: Any, out_dir: Path) -> Path:
    """Write a Hugging Face folder: the architecture of ``config_source`` with ``weights``.
    Written to a temporary folder and renamed, so a crash never leaves half a model."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(config_source)
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(dict(weights), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"exported weights do not fit {config_source}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    with contextlib.suppress(OSError):
        GenerationConfig.from_pretrained(config_source).save_pretrained(tmp)
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir
