"""SPIN on the demo task: held-out greedy accuracy of the demo's SFT model and after each SPIN
iteration (online DPO of the model's own samples against the reference answers; the reference
takes the actor's weights at the end of every iteration), per seed.

    .venv/bin/python bench/spin.py [--seeds 0 1] [--iterations 3] [--steps-per-iteration 20] [--threads 1] [--out runs/bench-spin]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--steps-per-iteration", type=int, default=20)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--sft-steps", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="runs/bench-spin")
    args = parser.parse_args()

    from demo_start import demo_start

    from trellis.plot import plot_metrics, read_metrics
    from trellis.recipes.train import train

    out = Path(args.out)
    start, rl_data, test_data = demo_start(out, args.sft_steps, args.threads)
    k = args.steps_per_iteration
    curves: dict[int, list[float]] = {}
    for seed in args.seeds:
        run_dir = out / f"spin-seed{seed}"
        train(None, [
            "recipe=spin", f"seed={seed}", f"model.path={start}", f"data.train_path={rl_data}", f"data.val_path={test_data}",
            "data.max_prompt_length=32", "data.train_batch_prompts=16", "sampling.n=4", "sampling.max_new_tokens=12",
            "pairs=reference", f"ref_update_every={k}", f"train.optim.lr={args.lr}", "train.micro_batch_samples=128",
            f"trainer.total_steps={args.iterations * k}", f"trainer.val_every_steps={k}", f"trainer.threads={args.threads}",
            "trainer.trackers=[jsonl]", f"trainer.run_dir={run_dir}",
        ])  # fmt: skip
        val = {r["step"]: r["val/greedy_reward_mean"] for r in read_metrics(run_dir) if "val/greedy_reward_mean" in r}
        curves[seed] = [val[i * k] for i in range(args.iterations + 1)]
    panels = ["val/greedy_reward_mean", "actor/reward_margin", "actor/reward_accuracy", "spin/sample_reward"]
    plot_metrics([out / f"spin-seed{s}" for s in args.seeds], out / "spin.png", panels)

    print(f"\nheld-out greedy accuracy (200 prompts) per SPIN iteration ({k} steps each, reference <- actor after each)")
    print(f"{'seed':<8}" + "".join(f"{'SFT start' if i == 0 else f'iter {i}':>12}" for i in range(args.iterations + 1)))
    for seed, values in curves.items():
        print(f"{seed:<8}" + "".join(f"{v:>12.3f}" for v in values))
    means = [statistics.mean(c[i] for c in curves.values()) for i in range(args.iterations + 1)]
    print(f"{'mean':<8}" + "".join(f"{v:>12.3f}" for v in means))
    (out / "summary.json").write_text(json.dumps({"per_iteration": curves, "mean": means}, indent=2))
    print("RESULT " + " ".join(f"iter{i}={v:.3f}" for i, v in enumerate(means)) + f" gain={means[-1] - means[0]:+.3f} seeds={len(args.seeds)}")


if __name__ == "__main__":
    main()
