"""The starting point several benches share: the demo's data and its SFT model, built once per folder."""

from __future__ import annotations

from pathlib import Path


def demo_start(out: Path, sft_steps: int, threads: int, stage: str = "sft") -> tuple[Path, Path, Path]:
    """``(sft model folder, rl prompts, held-out prompts)`` of the demo (seed 0) under ``out``; the
    SFT stage (``sft_steps`` steps from the demo's initial tiny model, in ``out/stage``) runs only
    when ``out/stage/hf_model`` is missing (a link to another run's works too)."""
    from trellis.recipes.train import train
    from trellis_demo.demo import NOISY_ANSWER, RL_ROWS, SFT_ROWS, TASK, VAL_ROWS, config_path
    from trellis_demo.tasks import make_arithmetic_split, task_texts, write_rows
    from trellis_demo.tiny import make_tiny_model

    data = out / "data"
    write_rows(make_arithmetic_split(SFT_ROWS, 0, noisy_answer=NOISY_ANSWER, **TASK), data / "sft.parquet")
    rl = write_rows(make_arithmetic_split(RL_ROWS, 1, **TASK), data / "rl.parquet")
    test = write_rows(make_arithmetic_split(VAL_ROWS, 0, split="test", **TASK), data / "test.parquet")
    start = out / stage / "hf_model"
    if not start.is_dir():
        model = make_tiny_model(out / "model", task_texts(ops=TASK["ops"]), hidden_size=128, num_layers=4, num_heads=4, seed=0)
        train(config_path("demo_sft.yaml"), [
            f"model.path={model}", f"data.train_path={data / 'sft.parquet'}", f"data.val_path={test}",
            f"trainer.total_steps={sft_steps}", f"trainer.threads={threads}", f"trainer.run_dir={out / stage}",
        ])  # fmt: skip
    return start, rl, test


def demo_settings(keys: tuple[str, ...]) -> list[str]:
    """The demo RL stage's values of ``keys`` (``demo_rl.yaml``) as overrides, for a run from
    another preset that must match the demo on them."""
    from omegaconf import OmegaConf

    from trellis_demo.demo import config_path

    demo = OmegaConf.load(config_path("demo_rl.yaml"))
    return [f"{key}={OmegaConf.select(demo, key)}" for key in keys]
