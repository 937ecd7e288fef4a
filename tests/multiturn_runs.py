"""The config of a short multi-turn rl run on the tiny model, which the multi-turn tests vary."""

from __future__ import annotations


def multi_turn_run(model, train_path, run_dir, *more: str, val_path=None) -> list[str]:
    """2 steps of 4 prompts x 2 samples of 6 tokens a turn, multi-turn on; ``more`` picks the loop."""
    return [
        "recipe=rl",
        f"model.path={model}",
        f"data.train_path={train_path}",
        f"data.val_path={val_path or 'null'}",
        "data.train_batch_prompts=4",
        "sampling.n=2",
        "sampling.max_new_tokens=6",
        "trainer.total_steps=2",
        "trainer.trackers=[jsonl]",
        f"trainer.run_dir={run_dir}",
        "multi_turn.enable=true",
        *more,
    ]
