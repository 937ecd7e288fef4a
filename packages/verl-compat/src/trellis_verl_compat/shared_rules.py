"""Rules for the verl keys that the ``rl`` and ``sft`` conversions read alike: frequencies, data
files, schedules, the controller, trackers, resume, dtypes, the step count and the optimizer."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from trellis import DataError, load_rows
from trellis_verl_compat.features import sync_prompts
from trellis_verl_compat.rule import MODE, SKIP, Rule, Source, Unmapped


def freq(value: Any, src: Source) -> int:
    return max(int(value), 0)


def positive(value: Any, src: Source) -> Any:
    return value if value > 0 else SKIP


def data_files(value: Any, src: Source) -> Any:
    if isinstance(value, str) and value.strip().startswith("["):  # data.train_files="['a', 'b']" quoted on a shell line
        value = yaml.safe_load(value)
    return value


def schedule(value: Any, src: Source) -> str:
    if value not in ("constant", "cosine"):
        raise Unmapped(f"trellis schedules are constant and cosine, not {value!r}")
    return value


def controller(value: Any, src: Source) -> Any:
    return "ray" if int(value) * int(src.get("trainer.nnodes", 1)) > 1 else SKIP


def trackers(value: Any, src: Source) -> list[str]:
    names = [value] if isinstance(value, str) else list(value)
    unknown = [n for n in names if n not in ("console", "wandb", "tensorboard", "mlflow")]
    if unknown:
        raise Unmapped(f"trellis trackers are console, jsonl, tensorboard, wandb and mlflow; {', '.join(unknown)} is not one")
    return [*names, "jsonl"] if "jsonl" not in names else names


def resume(value: Any, src: Source) -> str:
    if value == "resume_path":
        if not src.get("trainer.resume_from_path"):
            raise Unmapped("resume_mode resume_path without trainer.resume_from_path")
        return str(src["trainer.resume_from_path"])
    if value not in ("auto", "disable"):
        raise Unmapped(f"resume modes are auto, disable and resume_path, not {value!r}")
    return "never" if value == "disable" else "auto"


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def dtype(value: Any, src: Source) -> str:
    if value not in DTYPES:
        raise Unmapped(f"trellis dtypes are {', '.join(DTYPES)}, not {value!r}")
    return DTYPES[value]


def total_steps(src: Source) -> int:
    """verl's step count: ``total_training_steps``, else ``total_epochs`` x (training rows //
    ``train_batch_size``), verl dropping an epoch's last partial batch. verl's fully-async trainer
    counts weight syncs: ``rollout.total_rollout_steps`` prompts // the prompts of one sync."""
    if src.get(MODE) == "fully_async":
        return int(src["rollout.total_rollout_steps"]) // sync_prompts(src)
    if src.get("trainer.total_training_steps"):
        return int(src["trainer.total_training_steps"])
    if not int(src["data.train_batch_size"]):
        raise Unmapped("data.train_batch_size is 0; give it (prompts per step) or trainer.total_training_steps")
    files = data_files(src.get("data.train_files"), src)
    try:
        paths = [str(files)] if isinstance(files, str) else [str(f) for f in files or ()]
        rows = _row_count(tuple((p, Path(p).stat().st_mtime_ns if Path(p).is_file() else None) for p in paths))
    except DataError as exc:
        raise Unmapped(f"steps per epoch need the training rows ({exc}); set trainer.total_steps = epochs x (rows // train_batch_size)") from None
    if not rows:
        raise Unmapped("steps per epoch need data.train_files; set trainer.total_steps = epochs x (rows // train_batch_size)")
    return int(src["trainer.total_epochs"]) * (rows // int(src["data.train_batch_size"]))


@functools.lru_cache(maxsize=8)
def _row_count(files: tuple[tuple[str, int | None], ...]) -> int:
    """The rows of the training files ``(path, modification time)``, read once while unchanged:
    several rules need the step count."""
    return len(load_rows([path for path, _ in files], required=())) if files else 0


def steps(value: Any, src: Source) -> Any:
    return total_steps(src) if value or src.get(MODE) == "fully_async" else SKIP


def epochs(value: Any, src: Source) -> Any:
    return SKIP if src.get("trainer.total_training_steps") or src.get(MODE) == "fully_async" else total_steps(src)


def warmup_ratio(prefix: str) -> Callable[[Any, Source], Any]:
    def convert(value: Any, src: Source) -> Any:
        if not value or (src.get(prefix + "optim.lr_warmup_steps") or -1) > 0:  # verl: explicit warm-up steps win
            return SKIP
        return int(float(value) * total_steps(src))

    return convert


def from_zero(prefix: str) -> Callable[[Any, Source], Any]:
    """verl's warm-up (torch LambdaLR stepped after each update) runs its first step at lr 0, but
    for a cosine schedule with ``zero_indexed_step`` false (then at 1 / warm-up steps, as trellis)."""

    def convert(value: Any, src: Source) -> Any:
        cosine = "cosine" in (src.get(prefix + "optim.lr_scheduler_type"), src.get(prefix + "optim.warmup_style"))
        if cosine and src.get(prefix + "optim.zero_indexed_step") is False:
            return SKIP
        steps = src.get(prefix + "optim.lr_warmup_steps") or -1
        ratio = src.get(prefix + "optim.lr_warmup_steps_ratio") or 0
        return True if steps > 0 or (steps <= 0 and ratio and int(float(ratio) * total_steps(src)) > 0) else SKIP

    return convert


def optim(verl_prefix: str, trellis_prefix: str) -> list[Rule]:
    return [
        Rule(verl_prefix + "optim.lr", trellis_prefix + "optim.lr"),
        Rule(verl_prefix + "optim.weight_decay", trellis_prefix + "optim.weight_decay"),
        Rule(verl_prefix + "optim.betas", trellis_prefix + "optim.betas"),
        Rule(verl_prefix + "optim.lr_warmup_steps", trellis_prefix + "optim.warmup_steps", positive, "-1: use the ratio"),
        Rule(verl_prefix + "optim.lr_warmup_steps_ratio", trellis_prefix + "optim.warmup_steps", warmup_ratio(verl_prefix), "x total steps"),
        *(
            Rule(verl_prefix + key, trellis_prefix + "optim.warmup_from_zero", from_zero(verl_prefix), "verl's first warm-up step at lr 0")
            for key in ("optim.lr_warmup_steps", "optim.lr_warmup_steps_ratio")
        ),
        Rule(verl_prefix + "optim.warmup_style", trellis_prefix + "optim.lr_schedule", schedule),
        Rule(verl_prefix + "optim.lr_scheduler_type", trellis_prefix + "optim.lr_schedule", schedule),
        Rule(verl_prefix + "optim.min_lr_ratio", trellis_prefix + "optim.min_lr_ratio"),
        Rule(verl_prefix + "grad_clip", trellis_prefix + "optim.grad_clip", note="older verl"),
        Rule(verl_prefix + "optim.clip_grad", trellis_prefix + "optim.grad_clip", note="what verl clips with; wins over grad_clip"),
    ]
