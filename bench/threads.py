"""The demo's SFT and RL step times on a quiet machine and beside one busy process, per thread setting.

Each (setting, machine state, stage) runs in a fresh process (OpenMP reads its wait policy when
torch loads): ``trainer.threads`` 0 (every core, the old default), 1, 0 with
``OMP_WAIT_POLICY=PASSIVE``, ``auto`` (decided when the run starts) and ``follow`` (re-checked
every step). "busy" starts one process spinning on a core next to the run. Prints the median
step time after warm-up, per cell, and the busy/quiet ratio of each setting (the cost of the
neighbour). Meaningful only on an otherwise idle machine.

    python bench/threads.py [--sft-steps 60] [--rl-steps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SETTINGS = {  # name -> (trainer.threads, extra environment)
    "all cores": ("0", {}),
    "1 thread": ("1", {}),
    "all, PASSIVE": ("0", {"OMP_WAIT_POLICY": "PASSIVE"}),
    "auto": ("auto", {}),
    "follow": ("follow", {}),
}


def child(stage: str, threads: str, steps: int, work: Path, run_dir: Path) -> None:
    """Run ``stage`` (sft from the base model, rl from the SFT model) for ``steps``; print the step times."""
    from trellis.recipes.train import train
    from trellis_demo.demo import config_path

    data = work / "data"
    common = [f"trainer.total_steps={steps}", f"trainer.threads={threads}", f"trainer.run_dir={run_dir}", "trainer.trackers=[jsonl]"]
    if stage == "sft":
        overrides = [f"model.path={work / 'model'}", f"data.train_path={data / 'sft.parquet'}", f"data.val_path={data / 'test.parquet'}",
                     "trainer.val_every_steps=0", "trainer.save_hf_model=false", *common]  # fmt: skip
    else:
        overrides = [f"model.path={work / 'sft' / 'hf_model'}", f"data.train_path={data / 'rl.parquet'}", f"data.val_path={data / 'test.parquet'}",
                     "validation.before_train=false", "trainer.val_every_steps=0", "data.val_max_prompts=16", *common]  # fmt: skip
    train(config_path(f"demo_{stage}.yaml"), overrides)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print(json.dumps([(r["timing/step_s"], r.get("timing/threads", 0.0)) for r in rows if "timing/step_s" in r]))


def measure(stage: str, setting: str, busy: bool, steps: int, warmup: int, work: Path) -> tuple[float, float]:
    """Median step seconds after ``warmup`` and the mean thread count, in a fresh process."""
    threads, env = SETTINGS[setting]
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        run_dir = work / "runs" / f"{stage}-{threads}-{len(env)}-{int(busy)}"
        out = subprocess.run(
            [sys.executable, __file__, "--child", stage, threads, str(steps), str(work), str(run_dir)],
            env={**os.environ, **env}, capture_output=True, text=True, check=True,
        )  # fmt: skip
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    times = json.loads(out.stdout.strip().splitlines()[-1])[warmup:]
    return statistics.median(t for t, _ in times), statistics.mean(n for _, n in times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-steps", type=int, default=60)
    parser.add_argument("--rl-steps", type=int, default=10)
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        stage, threads, steps, work, run_dir = args.child
        child(stage, threads, int(steps), Path(work), Path(run_dir))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from demo_start import demo_start

    work = Path(tempfile.mkdtemp(prefix="trellis-threads-"))
    demo_start(work, sft_steps=60, threads=1)  # data/{sft,rl,test}.parquet, model/, sft/hf_model/
    steps = {"sft": (args.sft_steps, 10), "rl": (args.rl_steps, 3)}
    table = {(stage, s, busy): measure(stage, s, busy, *steps[stage], work) for stage in steps for s in SETTINGS for busy in (False, True)}
    print(f"\nDemo step times on {os.cpu_count()} cores, median after warm-up (s); busy = one process spinning beside the run")
    print(f"{'setting':<14}" + "".join(f"{h:>13}" for h in ("SFT quiet", "SFT busy", "ratio", "RL quiet", "RL busy", "ratio", "threads busy")))
    for s in SETTINGS:
        cells = []
        for stage in steps:
            quiet, busy = table[stage, s, False][0], table[stage, s, True][0]
            cells += [f"{quiet:>13.3f}", f"{busy:>13.3f}", f"{busy / quiet:>12.2f}x"]
        print(f"{s:<14}" + "".join(cells) + f"{table['sft', s, True][1]:>13.1f}")
    ratio = {stage: table[stage, "auto", True][0] / table[stage, "auto", False][0] for stage in steps}
    old = {stage: table[stage, "all cores", True][0] / table[stage, "all cores", False][0] for stage in steps}
    print(
        f"RESULT auto_sft_busy_ratio={ratio['sft']:.2f} auto_rl_busy_ratio={ratio['rl']:.2f} "
        f"allcores_sft_busy_ratio={old['sft']:.2f} allcores_rl_busy_ratio={old['rl']:.2f} "
        f"auto_sft_quiet_s={table['sft', 'auto', False][0]:.3f} auto_rl_quiet_s={table['rl', 'auto', False][0]:.3f}"
    )


if __name__ == "__main__":
    main()
