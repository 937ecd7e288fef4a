"""The ``sft`` recipe: supervised fine-tuning with a registered SFT loss, held-out loss, HF export."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
from omegaconf import MISSING, DictConfig
from transformers import AutoTokenizer

from trellis.checkpoint import Checkpointer
from trellis.config import ConfigError
from trellis.data import SFTDataset, SFTLoader, load_rows, sft_batches
from trellis.recipe import RunContext
from trellis.role_config import AGG_MODES, SFTTrainConfig
from trellis.training import (
    ModelConfig,
    StageTimer,
    Trackers,
    TrainerConfig,
    backend_field,
    check_inputs,
    make_controller,
    save_hf_folder,
    set_threads,
    spawn_role,
)


@dataclass
class SFTData:
    """Rows with chat ``messages``, or a ``prompt`` plus a target column (``response_key``)."""

    train_path: str = MISSING
    val_path: str | None = None
    response_key: str | None = None  # None: extra_info.answer when present, else response
    max_length: int = 256
    batch_samples: int = 32
    pack: bool = False
    shuffle: bool = True


@dataclass
class SFTConfig:
    recipe: str = "sft"
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    data: SFTData = field(default_factory=SFTData)
    backend: dict = backend_field()
    train: SFTTrainConfig = field(default_factory=SFTTrainConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def check(cfg: DictConfig, registry) -> None:
    Trackers.check(cfg.trainer.trackers, registry)
    check_inputs(cfg)
    if cfg.train.loss_agg_mode not in AGG_MODES:
        raise ConfigError(f"config key 'train.loss_agg_mode' is {cfg.train.loss_agg_mode!r}; valid: {', '.join(AGG_MODES)}")


class SFTRecipe:
    """Minimise the SFT loss on response tokens; report the held-out loss; optionally save HF."""

    Config = SFTConfig

    def run(self, cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
        check(cfg, ctx.registry)
        ckpt = Checkpointer(cfg, ctx)  # where to resume from; a changed config is refused here, before any model is built
        if ckpt.finished:
            return {"finished_at_step": ckpt.start_step}
        set_threads(cfg.trainer)
        torch.manual_seed(cfg.seed)
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
        data = cfg.data
        train = SFTLoader(
            SFTDataset(load_rows(data.train_path), tokenizer, max_length=data.max_length, response_key=data.response_key),
            data.batch_samples,
            seed=cfg.seed,
            shuffle=data.shuffle,
            pack=data.pack,
        )
        val = None
        if data.val_path:
            val_set = SFTDataset(load_rows(data.val_path), tokenizer, max_length=data.max_length, response_key=data.response_key)
            val = sft_batches(val_set, data.batch_samples)
        steps = cfg.trainer.total_steps
        controller = make_controller(cfg.trainer)
        model = spawn_role(controller, ctx.registry, cfg, "actor", cfg.model.path, cfg.train, steps)
        resumed = ckpt.restore(roles={"actor": model}, state={"data": train})  # 0: a fresh run
        trackers = Trackers(cfg.trainer.trackers, ctx.registry, ctx.run_dir, steps, start_step=resumed)
        ctx.hook.trellis_train_start(config=cfg, run_dir=ctx.run_dir)
        timer = StageTimer()
        metrics: dict[str, float] = {}
        try:
            for step in range(resumed + 1, steps + 1):
                start = time.perf_counter()
                batch = train.next_batch()
                with timer("update"):
                    metrics = {**model.sft_update(batch), "sft/epoch": float(batch.meta["epoch"])}
                last = step == steps
                if val is not None and (last or (cfg.trainer.val_every_steps and step % cfg.trainer.val_every_steps == 0)):
                    with timer("val"):
                        metrics.update(_held_out_loss(model, val))
                metrics.update(timer.metrics())
                metrics["timing/step_s"] = time.perf_counter() - start
                trackers.log(step, metrics)
                ctx.hook.trellis_step_end(step=step, metrics=metrics)
                ckpt.after_step(step)
            if cfg.trainer.save_hf_model:
                save_hf_folder(cfg.model.path, chain.from_iterable(model.export_weights()), tokenizer, ctx.run_dir / "hf_model")
        finally:
            trackers.close()
            controller.shutdown()
            ctx.hook.trellis_train_end(run_dir=ctx.run_dir, metrics=metrics)
        return {"final": metrics}


def _held_out_loss(model, batches) -> dict[str, float]:
    """Token-weighted mean of the per-batch held-out losses (each batch's loss is a token mean)."""
    total = tokens = 0.0
    for batch in batches:
        n = float(batch["loss_mask"][:, 1:].sum())
        total += model.sft_eval(batch)["val/loss"] * n
        tokens += n
    return {"val/loss": total / max(tokens, 1.0)}
