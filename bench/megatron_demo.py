"""The demo's RL stage on the Megatron backend learns: TP=2 on 2 CPU ranks under the Ray controller,
from the demo's SFT warm start (FSDP, as the demo runs it); the training reward of the last window
of steps against the first, and the held-out figures before and after.

A learning benchmark (about 9 minutes at 80 steps), not a check: the Megatron tests show its update
equals FSDP's step by step (``tests/megatron/test_training.py``) and its Ray TP=2 recipe resumes
bit-exactly (``test_recipes.py``); this shows the whole run moving. On a machine without CUDA it
runs in the environment of ``nox -s megatron`` with the tests' CPU shim put into every process
(``tests/megatron/ranks.boot_env``):

    .nox/megatron/bin/python bench/megatron_demo.py [--steps 80] [--window 20] [--out runs/bench-megatron-demo]

Measured on the 2-core machine (80 steps): training reward 0.266 -> 0.304; held-out 0.210 / 0.480
(sampled / greedy) -> 0.385 / 0.465.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = "import sys; from trellis.cli import main; sys.exit(main(['demo', *sys.argv[1:]]))"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--window", type=int, default=20, help="steps averaged at each end of the training-reward curve")
    parser.add_argument("--out", default="runs/bench-megatron-demo")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT / "tests" / "megatron"))
    from ranks import boot_env

    out = Path(args.out)
    rl = [
        "backend.name=megatron",
        "backend.tensor_parallel=2",
        "trainer.controller=ray",
        "trainer.procs_per_node=2",
        "trainer.threads=1",
        f"trainer.total_steps={args.steps}",
        f"trainer.val_every_steps={args.steps}",
    ]
    command = [sys.executable, "-c", DEMO, "--out", str(out), "--sft", "trainer.threads=1", "--rl", *rl]
    subprocess.run(command, env=boot_env(), check=True)

    rows = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    reward = [r["reward/mean"] for r in rows if "reward/mean" in r]
    first, last = sum(reward[: args.window]) / args.window, sum(reward[-args.window :]) / args.window
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["after_sft"], summary["after_rl"]
    print(f"training reward, mean of the first {args.window} steps {first:.3f}, of the last {args.window} {last:.3f}")
    print("held-out (sampled / greedy): after SFT {sampled_reward:.3f} / {greedy_accuracy:.3f}".format(**before))
    print("held-out (sampled / greedy): after RL  {sampled_reward:.3f} / {greedy_accuracy:.3f}".format(**after))
    print(
        f"RESULT steps={len(reward)} train_first={first:.3f} train_last={last:.3f} train_gain={last - first:+.3f} "
        f"sft_greedy={before['greedy_accuracy']:.3f} rl_greedy={after['greedy_accuracy']:.3f}"
    )


if __name__ == "__main__":
    main()
