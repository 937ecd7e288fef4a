"""The reward stage hidden behind generation (``reward.stream_prompts``): rl steps on a random model
of the demo's size with a reward that waits a fixed time per sample (as a call to a code sandbox or a
judge does), scored after generation (``after``), part by part while the next part generates
(``streamed``), and after generation but on the thread that generates ahead of training
(``ahead``: ``trainer.async_mode=one_step``, where generation and reward both overlap the update).

    python bench/stream_reward.py [--steps 4] [--wait-ms 5] [--parts 2] [--out runs/bench-stream-reward]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

WAITING_REWARD = """
import time


def waits(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep({seconds})
    return len(solution_str) / 100
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--wait-ms", type=float, default=5.0)
    parser.add_argument("--parts", type=int, default=2, help="prompts per part when streamed")
    parser.add_argument("--out", default="runs/bench-stream-reward")
    args = parser.parse_args()

    from trellis.plot import read_metrics
    from trellis.recipes.train import train
    from trellis_demo.tasks import make_arithmetic_split, task_texts, write_rows
    from trellis_demo.tiny import make_tiny_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=out))
    model = work / "model"
    make_tiny_model(model, task_texts(), hidden_size=128, num_layers=4, num_heads=4, seed=0)  # the demo's size
    data = write_rows(make_arithmetic_split(64, 0, max_value=50), work / "train.parquet")
    (work / "waits.py").write_text(WAITING_REWARD.format(seconds=args.wait_ms / 1000))
    base = [
        "recipe=rl", f"model.path={model}", f"data.train_path={data}", "data.train_batch_prompts=8", "sampling.n=4",
        "sampling.max_new_tokens=64", "actor.micro_batch_samples=16", f"reward.path={work / 'waits.py'}", "reward.name=waits",
        f"trainer.total_steps={args.steps}", "trainer.trackers=[jsonl]", "trainer.threads=1", "validation.before_train=false",
    ]  # fmt: skip
    rows = {}
    runs = {"after": [], "streamed": [f"reward.stream_prompts={args.parts}"], "ahead": ["trainer.async_mode=one_step"]}
    for name, overrides in runs.items():
        train(None, [*base, *overrides, f"trainer.run_dir={work / name}"])
        steps = [r for r in read_metrics(work / name) if "reward/mean" in r][1:]  # the first step warms up
        rows[name] = {k: statistics.mean(r.get(f"timing/{k}", 0.0) for r in steps) for k in ("gen_s", "reward_s", "reward_hidden_s", "step_s")}

    print(f"{'scoring':>10} {'gen s':>8} {'reward s':>9} {'hidden s':>9} {'step s':>8}")
    for name, r in rows.items():
        print(f"{name:>10} {r['gen_s']:>8.3f} {r['reward_s']:>9.3f} {r['reward_hidden_s']:>9.3f} {r['step_s']:>8.3f}")
    after, streamed, ahead = rows["after"], rows["streamed"], rows["ahead"]
    samples = 8 * 4
    print(f"reward stage: {samples} samples x {args.wait_ms:g} ms = {samples * args.wait_ms / 1000:.2f} s of scoring per step")
    print(
        f"RESULT reward_after_s={after['reward_s']:.3f} reward_streamed_s={streamed['reward_s']:.3f} "
        f"hidden_s={streamed['reward_hidden_s']:.3f} step_after_s={after['step_s']:.3f} step_streamed_s={streamed['step_s']:.3f} "
        f"step_ratio={streamed['step_s'] / after['step_s']:.3f} step_ahead_s={ahead['step_s']:.3f} "
        f"ahead_ratio={ahead['step_s'] / after['step_s']:.3f}"
    )


if __name__ == "__main__":
    main()
