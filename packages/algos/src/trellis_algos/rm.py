"""The ``rm`` recipe: a reward model trained with the Bradley-Terry loss on preference pairs,
held-out pair accuracy, export as an ``AutoModelForSequenceClassification`` folder."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from omegaconf import MISSING, DictConfig

from trellis import OptimConfig, RecipeConfig, Run, RunContext, TrainerConfig, load_rows, ranged, save_hf_folder
from trellis_algos.pairs import PAIR_SCHEMA, SIDES, PairDataset, PairLoader
from trellis_algos.sections import check_inputs
from trellis_algos.tokenizers import policy_tokenizer

ROLE = "reward_model"  # the role's name: trellis export writes a checkpoint's reward_model as a sequence-classification folder


@dataclass
class PairData:
    """Preference pairs (verl's / TRL's format): ``chosen`` and ``rejected`` chat messages, or
    answer strings after a shared ``prompt``; an optional ``margin`` column."""

    train_path: str | list[str] = MISSING  # a file, or a list of files read one after another
    val_path: str | list[str] | None = None  # held-out pairs: val/accuracy, val/loss, val/margin
    max_length: int = ranged(256, ge=2)  # tokens per side; longer pairs are dropped
    batch_pairs: int = ranged(32, ge=1)  # pairs per optimizer step
    shuffle: bool = True


@dataclass
class RMTrainConfig:
    """The reward model's update: the ``bradley_terry`` objective over batches of pairs."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    micro_batch_samples: int = ranged(8, ge=1)  # pairs per forward/backward (each forwards both sides)


@dataclass
class RMConfig(RecipeConfig):
    recipe: str = "rm"
    data: PairData = field(default_factory=PairData)
    train: RMTrainConfig = field(default_factory=RMTrainConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def check(cfg: DictConfig, registry) -> None:
    check_inputs(cfg)


def load_data(cfg: DictConfig, tokenizer) -> tuple[PairLoader, PairDataset | None]:
    """The training loader and the held-out pairs (None without ``data.val_path``)."""
    data = cfg.data

    def dataset(path: str | list[str]) -> PairDataset:
        return PairDataset(load_rows(path, required=SIDES, schema=PAIR_SCHEMA), tokenizer, data.max_length)

    train = PairLoader(dataset(data.train_path), data.batch_pairs, seed=cfg.seed, shuffle=data.shuffle)
    return train, dataset(data.val_path) if data.val_path else None


def check_data(cfg: DictConfig, registry) -> str:
    """The pairs read and tokenized as training would (columns, chat template, lengths)."""
    train, val = load_data(cfg, policy_tokenizer(cfg))
    held_out = f", {len(val)} held-out" if val is not None else ""
    return f"{len(train.dataset)} training pairs{held_out}"


class RMRecipe:
    """Train a scalar reward head on preference pairs; report held-out pair accuracy; optionally
    save a sequence-classification folder."""

    Config = RMConfig
    check = staticmethod(check)
    check_data = staticmethod(check_data)
    resume_safe_keys = ("data.val_path",)
    exports = {"reward_model": "reward"}  # what trellis export writes

    def run(self, cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
        with Run(cfg, ctx) as run:
            if run.finished:
                return run.finished_summary()
            tokenizer = policy_tokenizer(cfg)
            train, val = load_data(cfg, tokenizer)
            held_out = val.as_batch() if val is not None else None
            model = run.spawn(ROLE, cfg.model.path, cfg.train, head="reward", objectives={"rm_update": "bradley_terry"})
            start = run.start(roles={ROLE: model}, state={"data": train})
            if held_out is not None and not start and cfg.trainer.total_steps:
                run.summary["val_before"] = model.evaluate("rm_update", held_out)
                run.log(0, run.summary["val_before"])
            for step in run.steps(start):
                batch = train.next_batch()
                batch.meta["step"] = step
                with run.timer("update"):
                    metrics = {**model.rm_update(batch), "rm/epoch": float(batch.meta["epoch"])}
                if held_out is not None and (step == cfg.trainer.total_steps or run.due(step)):
                    with run.timer("val"):
                        metrics.update(model.evaluate("rm_update", held_out))
                run.end_step(step, metrics)
            if held_out is not None and cfg.trainer.total_steps:
                run.summary["val_after"] = {k: v for k, v in run.metrics.items() if k.startswith("val/")}
            if cfg.trainer.save_hf_model:
                weights = chain.from_iterable(model.export_weights())
                save_hf_folder(cfg.model.path, weights, tokenizer, ctx.run_dir / "hf_model", head="reward")
            return {**run.summary, "final": run.metrics}
