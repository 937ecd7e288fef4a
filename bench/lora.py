"""LoRA against full fine-tuning in the rl recipe: what it costs (peak RSS, step time, checkpoint
size) on the 10M and 50M models, and what it gains (held-out accuracy) in the demo's RL stage.

Cost: ``bench/rl_step.py``'s Trellis cell (its models, prompts x samples per size, sampling at
temperature 1, token-budget micro-batches, AdamW) for ``--steps`` steps with full fine-tuning and
with a LoRA adapter of each ``--ranks`` on every linear layer (alpha = 2 x rank), each cell in its
own process so that its peak RSS is its own; step time is the median after ``--warmup`` steps;
the checkpoint is the one written after the last step, its ``checkpoint-N/actor`` folder (weights
or adapter, optimizer state) measured on disk.

Gain: the demo's RL stage (``demo_rl.yaml``, GRPO, 16 prompts x 8 samples, 12 new tokens) from
the demo's SFT model for ``--rl-steps`` steps per seed, full fine-tuning at ``--full-lr`` (the
demo's) against a LoRA adapter of rank ``--gain-rank`` (alpha = 2 x rank) whose lr is picked on
seed 0 from ``--lora-lrs`` by the mean of its last two held-out greedy validations. Held-out
accuracy on the 200 test prompts before and after, greedy and sampled (temperature 1: the demo's
RL raises it well before the greedy one). Ends with ``RESULT``.

    nice python bench/lora.py [--sizes 10M,50M] [--ranks 8 16] [--steps 8] [--warmup 2] [--length 32]
        [--seeds 0 1 2] [--rl-steps 100] [--val-every 20] [--lora-lrs 3e-4 1e-3 3e-3 1e-2] [--threads 1] [--out runs/bench-lora]
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

    from trellis_demo.tasks import make_arithmetic_split, task_texts, write_rows
    from trellis_demo.tiny import make_tiny_model

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
    """The demo RL stage with full fine-tuning and with LoRA: lr sweep, curves, before/after table; its RESULT fields."""
    from curves import GREEDY, SAMPLED, mean_std, plot_curves, val_curve
    from demo_start import demo_start

    from trellis.recipes.train import train
    from trellis_demo.demo import config_path

    out = Path(args.out)
    start, rl_data, test_data = demo_start(out, args.sft_steps, args.threads)

    def run(name: str, seed: int, settings: list[str]) -> Path:
        run_dir = out / f"{name}-seed{seed}"
        train(config_path("demo_rl.yaml"), [*settings, f"model.path={start}", f"data.train_path={rl_data}",
            f"data.val_path={test_data}", f"seed={seed}", f"trainer.total_steps={args.rl_steps}",
            f"trainer.val_every_steps={args.val_every}", f"trainer.threads={args.threads}", "trainer.trackers=[jsonl]",
            f"trainer.run_dir={run_dir}",
        ])  # fmt: skip
        return run_dir

    def lora(lr: float, seed: int) -> Path:
        return run(f"lora-r{args.gain_rank}-lr{lr:g}", seed, [*adapter_overrides(args.gain_rank), f"actor.optim.lr={lr}"])

    sweep = {lr: lora(lr, args.seeds[0]) for lr in args.lora_lrs}
    best = max(args.lora_lrs, key=lambda lr: statistics.mean(v for _, _, v in val_curve(sweep[lr])[-2:]))
    runs = {
        "full": [run("full", seed, [f"actor.optim.lr={args.full_lr}"]) for seed in args.seeds],
        f"LoRA r{args.gain_rank}": [sweep[best], *(lora(best, seed) for seed in args.seeds[1:])],  # seed 0's is the sweep's
    }
    curves = {key: {m: [val_curve(d, key) for d in dirs] for m, dirs in runs.items()} for key in (GREEDY, SAMPLED)}
    others = {f"LoRA lr {lr:g} (seed {args.seeds[0]})": [val_curve(d)] for lr, d in sweep.items() if lr != best}
    plot_curves({**curves[GREEDY], **others}, out / "lora.png", "held-out greedy accuracy")

    steps = [s for s, _, _ in val_curve(sweep[best])]
    print(f"\nLoRA r{args.gain_rank} lr sweep on seed {args.seeds[0]}, held-out accuracy (200 prompts) per validation, greedy | sampled")
    print(f"{'lr':<8}" + "".join(f"{'step ' + str(s):>9}" for s in steps) + " |" + "".join(f"{'step ' + str(s):>9}" for s in steps))
    for lr, d in sweep.items():
        greedy, sampled = ("".join(f"{v:>9.3f}" for _, _, v in val_curve(d, key)) for key in (GREEDY, SAMPLED))
        print(f"{lr:<8g}{greedy} |{sampled}" + ("  <- picked (greedy, mean of last two)" if lr == best else ""))
    print(f"\nheld-out accuracy, mean ± std over seeds {args.seeds}, {args.rl_steps} steps from the demo's SFT model "
          f"(full lr {args.full_lr:g}, LoRA lr {best:g})")  # fmt: skip
    print(f"{'step':<6}" + "".join(f"{m + ' ' + k:>20}" for k in ("greedy", "sampled") for m in runs))
    for i, step in enumerate(steps):
        print(f"{step:<6}" + "".join(f"{mean_std([c[i][2] for c in cs]):>20}" for key in (GREEDY, SAMPLED) for cs in curves[key].values()))
    fields = [f"lora_lr={best:g}"]
    for m in runs:
        per_step = statistics.mean(c[-1][1] for c in curves[GREEDY][m]) / args.rl_steps
        line = f"{m}:"
        for key, kind in ((GREEDY, "greedy"), (SAMPLED, "sampled")):
            before, after = [c[0][2] for c in curves[key][m]], [c[-1][2] for c in curves[key][m]]
            change = statistics.mean(after) - statistics.mean(before)
            line += (f" {kind} {statistics.mean(before):.3f} -> {mean_std(after)} ({change:+.3f}; per seed "
                     f"{', '.join(f'{a - b:+.3f}' for a, b in zip(after, before))});")  # fmt: skip
            prefix = f"{m.split()[0].lower()}_{kind}"
            fields += [f"{prefix}_before={statistics.mean(before):.3f}", f"{prefix}_after={statistics.mean(after):.3f}",
                       f"{prefix}_gain={change:+.3f}"]  # fmt: skip
        print(f"{line} {per_step:.2f} training s/step")
        fields.append(f"{m.split()[0].lower()}_s_per_step={per_step:.3f}")
    (out / "summary.json").write_text(json.dumps({"lora_lr": best, "runs": {m: [str(d) for d in ds] for m, ds in runs.items()}, **curves}, indent=2))
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
    parser.add_argument("--lora-lrs", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3, 1e-2])
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
