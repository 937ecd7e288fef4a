"""GRPO vs DAPO from the demo's SFT model: held-out greedy accuracy against steps and against
training wall time, DAPO's generation rounds per step and the policy's entropy, per seed.

GRPO is the demo's RL stage (``demo_rl.yaml``: 16 prompts x 8 samples, 12 new tokens, lr 2e-4,
one update per batch). DAPO is the ``trellis config init dapo`` preset (``starter_dapo.yaml``:
clip-higher 0.2 / 0.28, token-mean loss, dynamic sampling, overlong shaping, no KL) with the
demo's data, prompt and response lengths, batch and learning rate; the preset's other sizes are
scaled to that batch: its 4 updates per batch (``actor.mini_batch_samples`` = 128 / 4) and its
overlong buffer's share of the response budget (12 of 64 tokens -> 2 of 12).

Equal wall time: each method runs a fixed number of steps (``--grpo-steps``, ``--dapo-steps``;
DAPO's steps cost more, as a step may take several generation rounds), and the held-out curves are
read against training seconds summed from ``timing/step_s`` less ``timing/val_s`` in each run's
``metrics.jsonl``. The table compares both at T, the shortest run's training time: each run's
accuracy at its last validation made by T. Writes ``dapo.png`` (accuracy against steps and
seconds), ``dapo_metrics.png`` (rounds, entropy, reward), ``summary.json``; ends with ``RESULT``.

    .venv/bin/python bench/dapo.py [--seeds 0 1 2] [--grpo-steps 150] [--dapo-steps 110] [--val-every 10]
        [--threads 1] [--out runs/bench-dapo]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

# What DAPO takes from the demo's RL stage so that only the method differs.
DEMO_KEYS = ("data.max_prompt_length", "data.train_batch_prompts", "sampling.n", "sampling.temperature", "sampling.max_new_tokens",
             "validation.n", "validation.temperature", "actor.optim.lr", "actor.optim.grad_clip")  # fmt: skip


def dapo_sizes() -> list[str]:
    """The preset's updates per batch and overlong buffer share, scaled to the demo's batch and response budget."""
    from omegaconf import OmegaConf

    from trellis.cli import STARTERS
    from trellis_demo.demo import config_path

    dapo, demo = OmegaConf.load(str(STARTERS["dapo"])), OmegaConf.load(config_path("demo_rl.yaml"))
    updates = dapo.data.train_batch_prompts * dapo.sampling.n // dapo.actor.mini_batch_samples
    mini = demo.data.train_batch_prompts * demo.sampling.n // updates
    buffer = round(dapo.reward.overlong.buffer_len * demo.sampling.max_new_tokens / dapo.sampling.max_new_tokens)
    return [f"actor.mini_batch_samples={mini}", f"actor.micro_batch_samples={mini}", f"reward.overlong.buffer_len={buffer}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--grpo-steps", type=int, default=150)
    parser.add_argument("--dapo-steps", type=int, default=110)
    parser.add_argument("--val-every", type=int, default=10)
    parser.add_argument("--sft-steps", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="runs/bench-dapo")
    args = parser.parse_args()

    from curves import SAMPLED, at_time, mean_std, plot_curves, val_curve
    from demo_start import demo_settings, demo_start

    from trellis.cli import STARTERS
    from trellis.plot import plot_metrics, read_metrics
    from trellis.recipes.train import train
    from trellis_demo.demo import config_path

    out = Path(args.out)
    start, rl_data, test_data = demo_start(out, args.sft_steps, args.threads)
    methods = {
        "GRPO": (config_path("demo_rl.yaml"), [], args.grpo_steps),
        "DAPO": (str(STARTERS["dapo"]), [*demo_settings(DEMO_KEYS), *dapo_sizes()], args.dapo_steps),
    }
    runs: dict[str, list[Path]] = {m: [] for m in methods}
    for method, (config, settings, steps) in methods.items():
        for seed in args.seeds:
            run_dir = out / f"{method.lower()}-seed{seed}"
            train(config, [*settings, f"model.path={start}", f"data.train_path={rl_data}", f"data.val_path={test_data}",
                f"seed={seed}", f"trainer.total_steps={steps}", f"trainer.val_every_steps={args.val_every}",
                f"trainer.threads={args.threads}", "trainer.trackers=[jsonl]", f"trainer.run_dir={run_dir}",
            ])  # fmt: skip
            runs[method].append(run_dir)
    curves = {m: [val_curve(d) for d in dirs] for m, dirs in runs.items()}
    sampled = {m: [val_curve(d, SAMPLED) for d in dirs] for m, dirs in runs.items()}
    plot_curves(curves, out / "dapo.png", "held-out greedy accuracy")
    # DAPO's runs first and a first panel every run has: a run keeps its colour in every panel and the legend names them all
    panels = ["actor/entropy", "reward/mean", "reward/groups_with_signal", "dynamic_sampling/rounds", "dynamic_sampling/dropped_groups"]
    plot_metrics([*runs["DAPO"], *runs["GRPO"]], out / "dapo_metrics.png", panels)

    def step_mean(method: str, key: str) -> float:
        """``key`` averaged over every training step of every seed of ``method``."""
        return statistics.mean(r[key] for d in runs[method] for r in read_metrics(d) if key in r)

    def last(method: str, key: str) -> list[float]:
        return [[r[key] for r in read_metrics(d) if key in r][-1] for d in runs[method]]

    t_equal = min(c[-1][1] for runs_ in curves.values() for c in runs_)
    print(f"\nheld-out greedy accuracy (200 prompts), mean ± std over seeds {args.seeds}, from the demo's SFT model")
    print(f"{'step':<6}" + "".join(f"{m + ' accuracy':>18}{'train s':>9}" for m in methods))
    for step in sorted({s for runs_ in curves.values() for c in runs_ for s, _, _ in c}):
        cells = ""
        for m in methods:
            points = [p for c in curves[m] for p in c if p[0] == step]
            cells += f"{mean_std([p[2] for p in points]):>18}{statistics.mean(p[1] for p in points):>9.0f}" if points else " " * 27
        print(f"{step:<6}{cells}")
    figures: dict[str, dict[str, float]] = {}
    for m in methods:
        figures[m] = {
            "final": statistics.mean(c[-1][2] for c in curves[m]),
            "at_equal_time": statistics.mean(at_time(c, t_equal) for c in curves[m]),
            "sampled_final": statistics.mean(c[-1][2] for c in sampled[m]),
            "sampled_at_equal_time": statistics.mean(at_time(c, t_equal) for c in sampled[m]),
            "train_s_per_step": statistics.mean(c[-1][1] for c in curves[m]) / methods[m][2],
            "entropy_mean": step_mean(m, "actor/entropy"),
            "entropy_last": statistics.mean(last(m, "actor/entropy")),
        }
        print(
            f"{m}: {figures[m]['train_s_per_step']:.2f} training s/step; at {t_equal:.0f} s greedy "
            f"{mean_std([at_time(c, t_equal) for c in curves[m]])}, sampled {mean_std([at_time(c, t_equal) for c in sampled[m]])} "
            f"(start {statistics.mean(c[0][2] for c in sampled[m]):.3f}, last step {mean_std([c[-1][2] for c in sampled[m]])}); "
            f"entropy mean {figures[m]['entropy_mean']:.3f}, last step {mean_std(last(m, 'actor/entropy'))}"
        )
    rounds = step_mean("DAPO", "dynamic_sampling/rounds")
    figures["DAPO"] |= {"rounds_per_step": rounds, "dropped_per_step": step_mean("DAPO", "dynamic_sampling/dropped_groups"),
                        "groups_with_signal": step_mean("DAPO", "reward/groups_with_signal")}  # fmt: skip
    print(
        f"DAPO: {rounds:.2f} generation rounds/step, {figures['DAPO']['dropped_per_step']:.1f} prompt groups dropped/step "
        f"(no reward variance); first-round groups with signal {figures['DAPO']['groups_with_signal']:.2f} (GRPO: "
        f"{step_mean('GRPO', 'reward/groups_with_signal'):.2f})"
    )
    (out / "summary.json").write_text(json.dumps({"equal_time_s": t_equal, "figures": figures, "greedy": curves, "sampled": sampled}, indent=2))
    fields = " ".join(f"{m.lower()}_{k}={v:.3f}" for m in methods for k, v in figures[m].items())
    print(f"RESULT {fields} equal_time_s={t_equal:.0f} seeds={len(args.seeds)} grpo_steps={args.grpo_steps} dapo_steps={args.dapo_steps}")


if __name__ == "__main__":
    main()
