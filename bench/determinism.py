"""Which conditions change the demo's arithmetic: N of its SFT steps (and a few RL steps) per variant.

Each variant runs in a fresh process (torch and MKL read their environment when they load) from
the same data and tiny model: thread counts 1, 2 and 3, torch's kernels for a CPU without AVX-512
(``ATEN_CPU_CAPABILITY=avx2``, what such a CPU gets) and MKL's reproducible mode
(``MKL_CBWR=COMPATIBLE``, another GEMM code path, as a CPU of another kind would take). Prints,
per variant, a hash of every logged figure, a hash of the final weights, the last SFT loss and
gradient norm, and whether all of it equals the first variant's bit for bit.

    python bench/determinism.py [--sft-steps 100] [--rl-steps 10]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {  # name -> (trainer.threads, extra environment)
    "1 thread": ("1", {}),
    "2 threads": ("2", {}),
    "3 threads": ("3", {}),
    "1 thread, AVX2 kernels": ("1", {"ATEN_CPU_CAPABILITY": "avx2"}),
    "1 thread, MKL_CBWR": ("1", {"MKL_CBWR": "COMPATIBLE"}),
}


def prepare(work: Path) -> None:
    """The demo's data and tiny model (seed 0), once for every variant."""
    from trellis_demo import demo
    from trellis_demo.tasks import make_arithmetic_split, task_texts, write_rows
    from trellis_demo.tiny import make_tiny_model

    data = work / "data"
    write_rows(make_arithmetic_split(demo.SFT_ROWS, 0, noisy_answer=demo.NOISY_ANSWER, **demo.TASK), data / "sft.parquet")
    write_rows(make_arithmetic_split(demo.RL_ROWS, 1, **demo.TASK), data / "rl.parquet")
    write_rows(make_arithmetic_split(demo.VAL_ROWS, 0, split="test", **demo.TASK), data / "test.parquet")
    make_tiny_model(work / "model", task_texts(seed=0, ops=demo.TASK["ops"]), hidden_size=128, num_layers=4, num_heads=4, seed=0)


def child(threads: str, sft_steps: int, rl_steps: int, work: Path, out: Path) -> None:
    """SFT then RL from its model; prints the hashes as one JSON line."""
    from trellis.recipes.train import train
    from trellis_demo.demo import config_path

    data = work / "data"
    common = [f"trainer.threads={threads}", "trainer.trackers=[jsonl]", "trainer.val_every_steps=0", "trainer.save_hf_model=true"]
    train(config_path("demo_sft.yaml"), [f"model.path={work / 'model'}", f"data.train_path={data / 'sft.parquet'}",
          f"data.val_path={data / 'test.parquet'}", f"trainer.run_dir={out / 'sft'}", f"trainer.total_steps={sft_steps}", *common])  # fmt: skip
    train(config_path("demo_rl.yaml"), [f"model.path={out / 'sft' / 'hf_model'}", f"data.train_path={data / 'rl.parquet'}",
          f"data.val_path={data / 'test.parquet'}", f"trainer.run_dir={out / 'rl'}", f"trainer.total_steps={rl_steps}",
          "data.val_max_prompts=16", *common])  # fmt: skip
    sft = _rows(out / "sft")
    print(json.dumps({"sft": _digest(out / "sft"), "rl": _digest(out / "rl"), "loss": sft[-1]["sft/loss"], "grad_norm": sft[-1]["sft/grad_norm"]}))


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _digest(run: Path) -> str:
    """One hash over every logged figure but wall times and the thread count, and the final weights."""
    from safetensors.torch import load_file

    figures = [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/"))} for r in _rows(run)]
    weights = load_file(str(run / "hf_model" / "model.safetensors"))
    h = hashlib.sha256(json.dumps(figures, sort_keys=True).encode())
    for name in sorted(weights):
        h.update(weights[name].numpy().tobytes())
    return h.hexdigest()[:12]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-steps", type=int, default=100)
    parser.add_argument("--rl-steps", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prepare(work)
        first = None
        print(f"{'variant':<24}{'SFT bits':>14}{'RL bits':>14}{'SFT loss':>20}{'grad norm':>20}   same as first")
        for name, (threads, env) in VARIANTS.items():
            steps = [str(args.sft_steps), str(args.rl_steps)]
            out = subprocess.run(
                [sys.executable, __file__, "--child", threads, *steps, str(work), str(work / name.replace(" ", "_"))],
                env={**os.environ, **env}, capture_output=True, text=True, check=True,
            )  # fmt: skip
            r = json.loads(out.stdout.strip().splitlines()[-1])
            first = first or r
            same = r["sft"] == first["sft"] and r["rl"] == first["rl"]
            print(f"{name:<24}{r['sft']:>14}{r['rl']:>14}{r['loss']:>20.17g}{r['grad_norm']:>20.17g}   {'yes' if same else 'NO'}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]), Path(sys.argv[6]))
    else:
        main()
