"""Per-stage time of an RL step (GRPO, tiny model, local controller) and the framework overhead.

Runs the ``rl`` recipe for a fixed config, drops the first (warm-up) steps, and prints the mean
time of each stage, its share of the step, and the overhead: step time minus the sum of the
stages (batch plumbing, metrics, tracker writes), in milliseconds and as a percentage.

    python bench/rl_step.py [--steps 12] [--warmup 2] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from trellis.recipe import train
from trellis.tasks import make_arithmetic_split, task_texts, write_rows
from trellis.tiny import make_tiny_model

STAGES = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "weight_sync")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="trellis-bench-"))
    model = make_tiny_model(work / "model", task_texts(), hidden_size=64, num_layers=2, seed=0)
    data = write_rows(make_arithmetic_split(512, 0), work / "train.parquet")
    run_dir = work / "run"
    config = [
        "recipe=rl",
        f"model.path={model}",
        f"data.train_path={data}",
        "data.train_batch_prompts=8",
        "sampling.n=8",
        "sampling.max_new_tokens=64",
        "actor.micro_batch_samples=64",
        "actor.optim.lr=1e-4",
        f"trainer.total_steps={args.steps}",
        "trainer.trackers=[jsonl]",
        f"trainer.run_dir={run_dir}",
        *args.overrides,
    ]
    train(None, config)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing/step_s" in r][args.warmup :]
    step_ms = statistics.mean(r["timing/step_s"] for r in rows) * 1e3
    stage_ms = {s: statistics.mean(r.get(f"timing/{s}_s", 0.0) for r in rows) * 1e3 for s in STAGES}
    stage_ms = {s: v for s, v in stage_ms.items() if v > 0}
    overhead = step_ms - sum(stage_ms.values())
    tokens = statistics.mean(r["response/length_mean"] for r in rows) * 64
    print(f"\nRL step, GRPO, 8 prompts x 8 samples, <=64 new tokens, {len(rows)} steps after {args.warmup} warm-up")
    print(f"{'stage':<16}{'ms':>10}{'share':>9}")
    for s, v in stage_ms.items():
        print(f"{s:<16}{v:>10.1f}{v / step_ms:>9.1%}")
    print(f"{'overhead':<16}{overhead:>10.1f}{overhead / step_ms:>9.1%}")
    print(f"{'step':<16}{step_ms:>10.1f}{1:>9.0%}")
    print(f"generated tokens per step: {tokens:.0f}")
    fields = " ".join(f"{s}_ms={v:.1f}" for s, v in stage_ms.items())
    print(f"RESULT step_ms={step_ms:.1f} {fields} overhead_ms={overhead:.1f} overhead_pct={100 * overhead / step_ms:.2f}")


if __name__ == "__main__":
    main()
