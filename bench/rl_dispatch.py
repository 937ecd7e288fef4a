"""Per-stage time of an RL step (GRPO, tiny model) under the local and the Ray controller.

Runs the ``rl`` recipe for one fixed config three times: local controller, Ray with one rank
(the same compute, so any difference is Ray's dispatch and gather), Ray with two ranks. Drops
warm-up steps and prints, per stage, the mean milliseconds side by side; then the framework
overhead (step time minus the sum of the stages: batch plumbing, metrics, tracker writes),
Ray's per-step dispatch/gather overhead (Ray 1-rank step minus local step), and the megabytes
of batches shipped to the ranks per step: what each verb reads (sent) beside what shipping the
whole batch to every verb would be (before each verb declared its inputs).

    python bench/rl_dispatch.py [--steps 12] [--warmup 2] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from trellis.recipes.train import train
from trellis_demo.tasks import make_arithmetic_split, task_texts, write_rows
from trellis_demo.tiny import make_tiny_model

STAGES = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "weight_sync")


def run(work: Path, model: Path, data: Path, name: str, steps: int, warmup: int, overrides: list[str]) -> dict[str, float]:
    run_dir = work / name
    config = [
        "recipe=rl",
        f"model.path={model}",
        f"data.train_path={data}",
        "data.train_batch_prompts=8",
        "sampling.n=8",
        "sampling.max_new_tokens=64",
        "actor.micro_batch_samples=64",
        "actor.optim.lr=1e-4",
        f"trainer.total_steps={steps}",
        "trainer.trackers=[jsonl]",
        f"trainer.run_dir={run_dir}",
        *overrides,
    ]
    train(None, config)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing/step_s" in r][warmup:]
    out = {s: statistics.mean(r.get(f"timing/{s}_s", 0.0) for r in rows) * 1e3 for s in STAGES}
    out = {s: v for s, v in out.items() if v > 0}
    out["step"] = statistics.mean(r["timing/step_s"] for r in rows) * 1e3
    out["overhead"] = out["step"] - sum(v for k, v in out.items() if k in STAGES)
    out["dispatch"] = statistics.mean(r.get("timing/dispatch_s", 0.0) for r in rows) * 1e3
    out["sent_mb"] = statistics.mean(r.get("dispatch/sent_mb", 0.0) for r in rows)
    out["batch_mb"] = statistics.mean(r.get("dispatch/batch_mb", 0.0) for r in rows)
    out["tokens"] = statistics.mean(r["response/length_mean"] for r in rows) * 64
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="trellis-bench-"))
    model = make_tiny_model(work / "model", task_texts(), hidden_size=64, num_layers=2, seed=0)
    data = write_rows(make_arithmetic_split(512, 0), work / "train.parquet")
    columns = {
        "local": [],
        "ray x1": ["trainer.controller=ray", "trainer.procs_per_node=1"],
        "ray x2": ["trainer.controller=ray", "trainer.procs_per_node=2"],
    }
    results = {
        name: run(work, model, data, name.replace(" ", ""), args.steps, args.warmup, [*extra, *args.overrides]) for name, extra in columns.items()
    }
    print(f"\nRL step, GRPO, 8 prompts x 8 samples, <=64 new tokens, {args.steps - args.warmup} steps after {args.warmup} warm-up (ms)")
    print(f"{'stage':<16}" + "".join(f"{name:>12}" for name in results))
    for stage in [*STAGES, "overhead", "step", "dispatch", "tokens"]:
        if any(stage in r for r in results.values()):
            label = {"dispatch": "  of which Ray", "tokens": "gen. tokens"}.get(stage, stage)
            print(f"{label:<16}" + "".join(f"{r.get(stage, 0.0):>12.1f}" for r in results.values()))
    local, ray1, ray2 = results["local"], results["ray x1"], results["ray x2"]
    print("'of which Ray': time inside the stages spent moving calls and results to and from the ranks (not computing).")
    print("Generation lengths differ between columns (each rank samples its own tokens): compare per-stage rows with care.")
    print(f"framework overhead (local): {local['overhead']:.1f} ms = {local['overhead'] / local['step']:.1%} of the step")
    for name, r in (("ray x1", ray1), ("ray x2", ray2)):
        print(f"Ray dispatch + gather per step ({name}): {r['dispatch']:.1f} ms = {r['dispatch'] / r['step']:.1%} of its step")
        share = r["sent_mb"] / r["batch_mb"]
        print(f"batches shipped per step ({name}): {r['sent_mb']:.3f} MB sent, {r['batch_mb']:.3f} MB as whole batches ({share:.0%})")
    print(
        f"RESULT local_step_ms={local['step']:.1f} local_overhead_ms={local['overhead']:.1f} "
        f"local_overhead_pct={100 * local['overhead'] / local['step']:.2f} ray1_step_ms={ray1['step']:.1f} "
        f"ray1_dispatch_ms={ray1['dispatch']:.1f} ray2_step_ms={ray2['step']:.1f} ray2_dispatch_ms={ray2['dispatch']:.1f} "
        f"ray2_sent_mb={ray2['sent_mb']:.3f} ray2_whole_batch_mb={ray2['batch_mb']:.3f}"
    )


if __name__ == "__main__":
    main()
