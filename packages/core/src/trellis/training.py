"""Pieces every recipe uses: threads, trackers, stage timers, role workers, HF folder export."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import MISSING, DictConfig

from trellis.config import ConfigError, component, instantiate_options
from trellis.controller import Controller, LocalController, WorkerGroup
from trellis.registry import Registry
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
    controller: str = "local"
    save_hf_model: bool = False  # write the final policy as a Hugging Face folder in <run_dir>/hf_model


def backend_field() -> Any:
    return component("backend", "fsdp")


def set_threads(n: int) -> int:
    """Pin torch to ``n`` threads (0: the usable cores); oversubscribing a few cores costs 10-30x."""
    n = n or len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    return n


def make_controller(name: str) -> Controller:
    if name == "local":
        return LocalController()
    raise ConfigError(f"config key 'trainer.controller' is {name!r}; valid: local (the ray controller arrives with trellis-core[ray])")


def spawn_role(
    controller: Controller, registry: Registry, cfg: DictConfig, role: str, model_path: str, role_options: Any, total_steps: int
) -> WorkerGroup:
    entry = registry.get("backend", cfg.backend.name)
    options = instantiate_options(cfg.backend, entry.options) if entry.options else None

    def make(dist):
        spec = WorkerSpec(role, model_path, options, role_options, dist=dist, registry=registry, seed=cfg.seed, total_steps=total_steps)
        return entry.obj(spec)

    return controller.spawn(role, make)


class Trackers:
    """Every tracker named in ``trainer.trackers``, fed together, closed together."""

    def __init__(self, names: Iterable[str], registry: Registry, run_dir: Path, total_steps: int) -> None:
        self.trackers = [registry.get("tracker", n).obj(run_dir, total_steps) for n in names]

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
