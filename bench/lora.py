"""LoRA against full fine-tuning in the rl recipe: what it costs (peak RSS, step time, checkpoint
size) on the 10M and 50M models, and what it gains (held-out accuracy) in the demo's RL stage.

Cost: ``bench/rl_step.py``'s Trellis cell (its models, prompts x samples per size, sampling at
temperature 1, token-budget micro-batches, AdamW) for ``--steps`` steps with full fine-tuning and
with a LoRA adapter of each ``--ranks`` on every linear layer (alpha = 2 x rank), each cell in its
own process so that its peak RSS is its own; step time is the median after ``--warmup`` steps;
the checkpoint is the one written after the last step, its ``checkpoint-N/actor`` folder (weights
or adapter, optimizer state) measured on disk.

Gain: the demo's RL stage (``demo_rl.yaml``, GRPO, 16 prompts x 8 samples, 12 new tokens) from
the demo's SFT model for ``--rl-steps`` steps per seed, full fine-tuning at ``--full-lr`` (the demo's) against
a LoRA adapter of rank ``--gain-rank`` (alpha = 2 x rank) whose lr is picked on seed 0 from
``--lora-lrs`` by the mean of its last two held-out validations. Held-out greedy accuracy on the
200 test prompts before and after. Ends with ``RESULT``.

    nice python bench/lora.py [--sizes 10M,50M] [--ranks 8 16] [--steps 8] [--warmup 2] [--length 32]
        [--seeds 0 1 2] [--rl-steps 100] [--val-every 20] [--lora-lrs 1e-3 3e-3 1e-2] [--threads 1] [--out runs/bench-lora]
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def adapter_overrides(rank: int) -> list[str]:
    """The actor's adapter settings for ``rank`` (0: full fine-tuning)."""
    return [f"actor.adapter.rank={rank}", f"actor.adapter.alpha={2 * rank}"] if rank else []


def folder_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def child(size: str, rank: int, length: int, steps: int, work: Path, threads: int) -> None:
    """One cost cell: ``steps`` rl steps, then its timings, peak RSS, checkpoint size and trained share as JSON."""
    from rl_step import WORK, trellis_steps

    counts: list[tuple[int, int]] = []

    class Trained(logging.Handler):  # the backend logs "<role>: <trained> of <total> parameters train"
        def emit(self, record: logging.LogRecord) -> None:
            if "parameters train" in str(record.msg) and record.args[0] == "actor":
                counts.append(record.args[1:3])

    logging.getLogger("trellis").addHandler(Trained())
    logging.getLogger("trellis").setLevel(logging.INFO)
    prompts, n = WORK[size]
    run_dir = work / "runs" / f"{size}-r{rank}"
    extra = ("trainer.keep_checkpoints=1", *adapter_overrides(rank))
    result = trellis_steps(work / size, work / "train.parquet", prompts, n, length, steps, run_dir, threads, extra=extra)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["checkpoint_mb"] = folder_mb(run_dir / f"checkpoint-{steps}" / "actor")
    result["trained"], result["total"] = counts[0]
    print("RESULT-JSON " + json.dumps(result))


def run_child(size: str, rank: int, length: int, steps: int, work: Path, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--child", size, str(rank), str(length), str(steps), str(work), str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{size} rank {rank} failed:\n{proc.stderr[-3000:]}")
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT-JSON "))[12:])


def cost(args: argparse.Namespace) -> list[str]:
    """The cost table; its RESULT fields."""
    from rl_step import SIZES, WORK

    from trellis.examples.tasks import make_arithmetic_split, task_texts, write_rows
    from trellis.examples.tiny import make_tiny_model

    sizes, ranks = args.sizes.split(","), [0, *args.ranks]
    cells: dict[tuple[str, int], dict] = {}
    with tempfile.TemporaryDirectory(prefix="trellis-lora-") as tmp:
        work = Path(tmp)
        for size in sizes:
            make_tiny_model(work / size, task_texts(), seed=0, **SIZES[size])
        write_rows(make_arithmetic_split(max(512, max(WORK[s][0] for s in sizes) * (args.steps + 1)), 0), work / "train.parquet")
        for size in sizes:
            for rank in ranks:
                cells[size, rank] = run_child(size, rank, args.length, args.steps, work, args.threads)
                print(f"{size} {'full' if rank == 0 else f'LoRA r{rank}'} done", file=sys.stderr, flush=True)

    def median(cell: dict, stage: str | None = None) -> float:
        return statistics.median((cell["stages"][stage] if stage else cell["steps"])[args.warmup :]) * 1e3

    print(f"\nrl step, {args.length} new tokens, {args.steps} steps per cell ({args.warmup} warm-up dropped), median ms; "
          "LoRA on every linear layer, alpha = 2 x rank; ratio = LoRA / full")  # fmt: skip
    head = ("size", "prompts x n", "actor", "trained", "peak RSS MB", "ratio", "RSS end MB", "step ms", "ratio", "gen ms", "update ms",
            "ckpt MB", "ratio")  # fmt: skip
    print("".join(f"{h:>12}" for h in head))
    fields = []
    for size in sizes:
        full = cells[size, 0]
        for rank in ranks:
            c, name = cells[size, rank], "full" if rank == 0 else f"r{rank}"
            row = [size, "x".join(map(str, WORK[size])), name, f"{100 * c['trained'] / c['total']:.2f}%",
                   f"{c['peak_rss_mb']:.0f}", f"{c['peak_rss_mb'] / full['peak_rss_mb']:.2f}", f"{c['rss'][-1]:.0f}", f"{median(c):.0f}",
                   f"{median(c) / median(full):.2f}", f"{median(c, 'gen'):.0f}", f"{median(c, 'update_actor'):.0f}",
                   f"{c['checkpoint_mb']:.2f}", f"{c['checkpoint_mb'] / full['checkpoint_mb']:.3f}"]  # fmt: skip
            print("".join(f"{x:>12}" for x in row))
            fields += [f"{size}_{name}_rss_mb={c['peak_rss_mb']:.0f}", f"{size}_{name}_step_ms={median(c):.0f}",
                       f"{size}_{name}_ckpt_mb={c['checkpoint_mb']:.2f}"]  # fmt: skip
    print("model parameters: " + ", ".join(f"{s} {cells[s, 0]['total'] / 1e6:.1f}M" for s in sizes))
    return fields


def gain(args: argparse.Namespace) -> list[str]:
    """The demo RL stage with full fine-tuning and with LoRA: curves, lr sweep, before/after table; its RESULT fields."""
    from curves import mean_std, plot_curves, val_curve
    from demo_start import demo_start

    from trellis.examples.demo import config_path
    from trellis.recipes.train import train

    out = Path(args.out)
    start, rl_data, test_data = demo_start(out, args.sft_steps, args.threads)

    def run(name: str, seed: int, settings: list[str]) -> list[tuple[int, float, float]]:
        run_dir = out / f"{name}-seed{seed}"
        train(config_path("demo_rl.yaml"), [*settings, f"model.path={start}", f"data.train_path={rl_data}",
            f"data.val_path={test_data}", f"seed={seed}", f"trainer.total_steps={args.rl_steps}",
            f"trainer.val_every_steps={args.val_every}", f"trainer.threads={args.threads}", "trainer.trackers=[jsonl]",
            f"trainer.run_dir={run_dir}",
        ])  # fmt: skip
        return val_curve(run_dir)

    def lora(lr: float, seed: int) -> list[tuple[int, float, float]]:
        return run(f"lora-r{args.gain_rank}-lr{lr:g}", seed, [*adapter_overrides(args.gain_rank), f"actor.optim.lr={lr}"])

    sweep = {lr: lora(lr, args.seeds[0]) for lr in args.lora_lrs}
    best = max(args.lora_lrs, key=lambda lr: statistics.mean(v for _, _, v in sweep[lr][-2:]))
    curves = {
        "full": [run("full", seed, [f"actor.optim.lr={args.full_lr}"]) for seed in args.seeds],
        f"LoRA r{args.gain_rank}": [sweep[best], *(lora(best, seed) for seed in args.seeds[1:])],  # seed 0's is the sweep's
    }
    plot_curves({**curves, **{f"LoRA lr {lr:g} (seed {args.seeds[0]})": [c] for lr, c in sweep.items() if lr != best}},
                out / "lora.png", "held-out greedy accuracy")  # fmt: skip

    print(f"\nLoRA r{args.gain_rank} lr sweep on seed {args.seeds[0]}, held-out greedy accuracy (200 prompts) per validation")
    steps = [s for s, _, _ in sweep[best]]
    print(f"{'lr':<10}" + "".join(f"{'step ' + str(s):>10}" for s in steps))
    for lr, c in sweep.items():
        print(f"{lr:<10g}" + "".join(f"{v:>10.3f}" for _, _, v in c) + ("   <- picked (mean of last two)" if lr == best else ""))
    print(f"\nheld-out greedy accuracy, seeds {args.seeds}, {args.rl_steps} steps from the demo's SFT model "
          f"(full lr {args.full_lr:g} = the demo's, LoRA lr {best:g})")  # fmt: skip
    print(f"{'step':<6}" + "".join(f"{m:>18}" for m in curves))
    for i, step in enumerate(steps):
        print(f"{step:<6}" + "".join(f"{mean_std([c[i][2] for c in cs]):>18}" for cs in curves.values()))
    fields = [f"lora_lr={best:g}"]
    for m, cs in curves.items():
        before, after = [c[0][2] for c in cs], [c[-1][2] for c in cs]
        per_step = statistics.mean(c[-1][1] for c in cs) / args.rl_steps
        print(f"{m}: before {mean_std(before)}, after {mean_std(after)}, gain {statistics.mean(after) - statistics.mean(before):+.3f} "
              f"(per seed {', '.join(f'{a - b:+.3f}' for a, b in zip(after, before))}); {per_step:.2f} training s/step")  # fmt: skip
        key = m.split()[0].lower()
        fields += [f"{key}_before={statistics.mean(before):.3f}", f"{key}_after={statistics.mean(after):.3f}",
                   f"{key}_gain={statistics.mean(after) - statistics.mean(before):+.3f}", f"{key}_s_per_step={per_step:.3f}"]  # fmt: skip
    (out / "summary.json").write_text(json.dumps({"lora_lr": best, "sweep": {f"{lr:g}": c for lr, c in sweep.items()}, "curves": curves}, indent=2))
    return fields


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10M,50M")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--steps", type=int, default=8, help="steps per cost cell")
    parser.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of each cost cell")
    parser.add_argument("--length", type=int, default=32, help="new tokens per sample in the cost cells")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rl-steps", type=int, default=100)
    parser.add_argument("--val-every", type=int, default=20)
    parser.add_argument("--gain-rank", type=int, default=8)
    parser.add_argument("--lora-lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--full-lr", type=float, default=2e-4, help="full fine-tuning's lr (demo_rl.yaml's)")
    parser.add_argument("--sft-steps", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip", choices=("cost", "gain"), help="run only the other part")
    parser.add_argument("--out", default="runs/bench-lora")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        size, rank, length, steps, work, threads = args.child
        child(size, int(rank), int(length), int(steps), Path(work), int(threads))
        return
    fields = []
    if args.skip != "cost":
        fields += cost(args)
    if args.skip != "gain":
        fields += gain(args)
    print("RESULT " + " ".join(fields))


if __name__ == "__main__":
    main()
