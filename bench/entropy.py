"""GRPO vs Clip-Cov vs KL-Cov: policy entropy and held-out reward over training, same task, start,
seeds and steps; then R = -a * exp(H) + b fitted on GRPO's (entropy, held-out reward) points.

The start is the demo's SFT model (tiny Qwen2, addition, a quarter of the taught answers wrong), trained
once. Each method then runs the demo's RL stage (GRPO advantages, 16 prompts x 8 samples) with its
policy loss (``vanilla``, ``clip_cov``, ``kl_cov``) for each seed, validating every
``--val-every`` steps. Prints a table (final entropy and held-out sampled reward, mean and spread
over seeds), the fit (a, b, R^2 over every validation point of every GRPO seed), writes
``entropy.png`` and ends with a ``RESULT`` line.

    .venv/bin/python bench/entropy.py [--seeds 0 1 2] [--steps 60] [--val-every 10] [--cov-ratio R]
        [--mini-batch-samples M] [--threads 1] [--out runs/bench-entropy]

``--cov-ratio`` sets ``clip_cov_ratio`` / ``kl_cov_ratio`` (default: the losses' own, 2e-4, chosen
for batches of millions of tokens: on this bench's ~800 tokens per step it selects none).
``--mini-batch-samples`` splits each step's 128 samples into several optimizer steps: with one
step per batch the policy equals the old one at the update, so KL-Cov's penalty and its gradient
are zero and it equals GRPO exactly.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

METHODS = ("vanilla", "clip_cov", "kl_cov")


def points(run_dir: Path) -> list[tuple[int, float, float]]:
    """``(step, entropy, held-out sampled reward)`` at each validation after step 0: the entropy is
    the training batch's at that step (the policy the validation sampled from)."""
    from trellis.plot import read_metrics

    rows = read_metrics(run_dir)
    entropy = {r["step"]: r["actor/entropy"] for r in rows if "actor/entropy" in r}
    return [(r["step"], entropy[r["step"]], r["val/reward_mean"]) for r in rows if "val/reward_mean" in r and r["step"] in entropy]


def fit(pairs: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Least squares of R = -a * exp(H) + b (linear in x = exp(H)); returns (a, b, R^2)."""
    xs = [2.718281828459045**h for h, _ in pairs]
    ys = [r for _, r in pairs]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    b = my - slope * mx
    ss_res = sum((y - (slope * x + b)) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return -slope, b, 1 - ss_res / ss_tot if ss_tot else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--val-every", type=int, default=10)
    parser.add_argument("--sft-steps", type=int, default=2000)
    parser.add_argument("--cov-ratio", type=float, default=None, help="clip_cov_ratio / kl_cov_ratio (default: the losses' own)")
    parser.add_argument("--mini-batch-samples", type=int, default=0, help="samples per optimizer step (0: the whole step)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="runs/bench-entropy")
    args = parser.parse_args()

    from demo_start import demo_start

    from trellis.plot import plot_metrics
    from trellis.recipes.train import train
    from trellis_demo.demo import config_path

    out = Path(args.out)
    start, rl_data, test_data = demo_start(out, args.sft_steps, args.threads)
    runs: dict[str, list[Path]] = {m: [] for m in METHODS}
    for method in METHODS:
        for seed in args.seeds:
            run_dir = out / f"{method}-seed{seed}"
            ratio = [f"actor.policy_loss.{method}_ratio={args.cov_ratio}"] if args.cov_ratio and method != "vanilla" else []
            train(config_path("demo_rl.yaml"), [*ratio, f"actor.mini_batch_samples={args.mini_batch_samples}",
                f"model.path={start}", f"data.train_path={rl_data}", f"data.val_path={test_data}",
                f"seed={seed}", f"actor.policy_loss.name={method}", f"trainer.total_steps={args.steps}",
                f"trainer.val_every_steps={args.val_every}", f"trainer.threads={args.threads}", "trainer.trackers=[jsonl]",
                f"trainer.run_dir={run_dir}",
            ])  # fmt: skip
            runs[method].append(run_dir)
    plot_metrics([d for m in METHODS for d in runs[m]], out / "entropy.png", ["actor/entropy", "val/reward_mean", "reward/mean"])

    def spread(values: list[float]) -> str:
        return f"{statistics.mean(values):.3f} ± {statistics.stdev(values) if len(values) > 1 else 0.0:.3f}"

    finals = {m: [points(d)[-1] for d in runs[m]] for m in METHODS}
    print(f"\n{len(args.seeds)} seeds x {args.steps} steps from the same SFT model (mean ± std over seeds, at the last step)")
    print(f"{'policy loss':<13}{'entropy':>18}{'held-out reward':>20}")
    for m in METHODS:
        print(f"{m:<13}{spread([p[1] for p in finals[m]]):>18}{spread([p[2] for p in finals[m]]):>20}")
    pairs = [(h, r) for d in runs["vanilla"] for _, h, r in points(d)]
    a, b, r2 = fit(pairs)
    print(f"GRPO fit of R = -a * exp(H) + b over {len(pairs)} (entropy, held-out reward) points: a = {a:.3f}, b = {b:.3f}, R^2 = {r2:.3f}")
    summary = {d.name: [{"step": s, "entropy": h, "val_reward": r} for s, h, r in points(d)] for m in METHODS for d in runs[m]}
    (out / "summary.json").write_text(json.dumps({"fit": {"a": a, "b": b, "r2": r2}, "runs": summary}, indent=2))
    fields = " ".join(f"{m}_entropy={statistics.mean(p[1] for p in finals[m]):.3f} {m}_reward={statistics.mean(p[2] for p in finals[m]):.3f}"
                      for m in METHODS)  # fmt: skip
    print(
        f"RESULT {fields} fit_a={a:.4f} fit_b={b:.4f} fit_r2={r2:.3f} seeds={len(args.seeds)} steps={args.steps} cov_ratio={args.cov_ratio} "
        f"mini_batch_samples={args.mini_batch_samples}"
    )


if __name__ == "__main__":
    main()
