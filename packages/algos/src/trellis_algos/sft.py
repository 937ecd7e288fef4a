"""The ``sft`` recipe: supervised fine-tuning with a registered SFT loss, held-out loss, HF export."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from omegaconf import MISSING, DictConfig

from trellis import RecipeConfig, Run, RunContext, TrainerConfig, load_rows, ranged, save_hf_folder
from trellis_algos.prompts import prompt_images
from trellis_algos.sections import SFTTrainConfig, check_inputs
from trellis_algos.sft_data import SFTDataset, SFTLoader, sft_batches
from trellis_algos.tokenizers import policy_tokenizer


@dataclass
class SFTData:
    """Rows with chat ``messages``, or a ``prompt`` plus a target column (``response_key``)."""

    train_path: str | list[str] = MISSING  # a file, or a list of files read one after another
    val_path: str | list[str] | None = None
    response_key: str | None = None  # None: extra_info.answer when present, else response
    max_length: int = ranged(256, ge=2)
    batch_samples: int = ranged(32, ge=1)
    pack: bool = False
    shuffle: bool = True
    image_key: str = "images"  # the column of a row's images, for a vision-language model (trellis-vision)


@dataclass
class SFTConfig(RecipeConfig):
    recipe: str = "sft"
    data: SFTData = field(default_factory=SFTData)
    train: SFTTrainConfig = field(default_factory=SFTTrainConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def check(cfg: DictConfig, registry) -> None:
    check_inputs(cfg)


SFT_SCHEMA = "the sft recipe's rows: chat messages (loss on the assistant turns), or a prompt plus its target in data.response_key"


def load_data(cfg: DictConfig, tokenizer, registry) -> tuple[SFTLoader, SFTDataset | None]:
    """The training loader and the held-out samples (None without ``data.val_path``)."""
    data = cfg.data
    encoder = prompt_images(cfg.model.path, data, registry, tokenizer)

    def dataset(path: str | list[str]) -> SFTDataset:
        rows = load_rows(path, schema=SFT_SCHEMA)
        return SFTDataset(rows, tokenizer, max_length=data.max_length, response_key=data.response_key, image_key=data.image_key, encoder=encoder)

    train = SFTLoader(dataset(data.train_path), data.batch_samples, seed=cfg.seed, shuffle=data.shuffle, pack=data.pack)
    return train, dataset(data.val_path) if data.val_path else None


def check_data(cfg: DictConfig, registry) -> str:
    """The samples read and tokenized as training would (columns, responses, lengths)."""
    train, val = load_data(cfg, policy_tokenizer(cfg), registry)
    held_out = f", {len(val)} held-out" if val is not None else ""
    return f"{len(train.dataset)} training samples{held_out}"


class SFTRecipe:
    """Minimise the SFT loss on response tokens; report the held-out loss; optionally save HF."""

    Config = SFTConfig
    check = staticmethod(check)
    check_data = staticmethod(check_data)
    resume_safe_keys = ("data.val_path",)
    policy = "train"  # the section the actor is built from
    exports = {"actor": "lm"}  # what trellis export writes

    def run(self, cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
        with Run(cfg, ctx) as run:
            if run.finished:
                return run.finished_summary()
            tokenizer = policy_tokenizer(cfg)
            train, val_set = load_data(cfg, tokenizer, ctx.registry)
            val = sft_batches(val_set, cfg.data.batch_samples) if val_set is not None else None
            model = run.spawn("actor", cfg.model.path, cfg.train, objectives={"sft_update": "sft"})
            start = run.start(roles={"actor": model}, state={"data": train})
            for step in run.steps(start):
                batch = train.next_batch()
                with run.timer("update"):
                    metrics = {**model.sft_update(batch), "sft/epoch": float(batch.meta["epoch"])}
                if val is not None and (step == cfg.trainer.total_steps or run.due(step)):
                    with run.timer("val"):
                        metrics.update(_held_out_loss(model, val))
                run.end_step(step, metrics)
            if cfg.trainer.save_hf_model:
                save_hf_folder(cfg.model.path, chain.from_iterable(model.export_weights()), tokenizer, ctx.run_dir / "hf_model")
            return {"final": run.metrics}


def _held_out_loss(model, batches) -> dict[str, float]:
    """Token-weighted mean of the per-batch held-out losses (each batch's loss is a token mean)."""
    total = tokens = 0.0
    for batch in batches:
        n = float(batch["loss_mask"][:, 1:].sum())
        total += model.evaluate("sft_update", batch)["val/loss"] * n
        tokens += n
    return {"val/loss": total / max(tokens, 1.0)}
