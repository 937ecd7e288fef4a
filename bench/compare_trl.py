"""Trellis's GRPO step beside TRL's GRPOTrainer on the same model, prompts and work, interleaved.

Both: the same tiny Qwen2 model and arithmetic prompts (chat template), n samples per prompt at
temperature 1 with at most ``--length`` new tokens, verl's GSM8K rule as the reward, group-normalised
advantages, one optimizer step per batch of fresh samples (TRL ``num_iterations=1``, so it skips
the old-log-prob pass), no reference model (TRL ``beta=0``), AdamW with grad-norm clip 1.0, HF
``generate`` as the rollout, the same thread count. Trellis cuts its update into micro-batches of
at most ``rl_step.TOKEN_BUDGET`` padded tokens, longest samples first; TRL runs the batch in one
forward padded to its longest completion (its default). Trellis runs with its defaults, which
prefill each prompt once for its n samples and run it once per micro-batch in the update where
that is less work (``rollout.share_prompts``, ``backend.share_prompts``), and on CPU run grouped-query
attention in one sdpa call (core's ``grouped_query_sdpa``). Each framework runs in its own process per
round, alternating which goes first; a cell is the median step time after the warm-up steps.

TRL lives in its own venv (``--venv``, made on first use: torch==2.13.0, trl==1.16.0 and the Trellis
packages this bench needs, editable from this checkout); the bench re-runs itself inside it.
``--rollout vllm --trellis-python .nox/vllm/bin/python`` runs Trellis with the vLLM rollout from
the venv that ``nox -s vllm`` made (TRL keeps HF generate).

    python bench/compare_trl.py [--length 8] [--size tiny] [--rounds 3] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["packages/core", "packages/algos", "packages/backend-fsdp", "packages/rollout-hf", "packages/demo"]
REQUIREMENTS = ["torch==2.13.0", "trl==1.16.0"]


def ensure_venv(venv: Path) -> Path:
    """The venv's python, after making the venv and installing TRL and Trellis into it if needed."""
    python = venv / "bin" / "python"
    if not (venv / ".complete").is_file():
        print(f"making {venv} (torch, trl, trellis packages)...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, REQUIREMENTS[0]], check=True)  # torch first: nothing below may pull another build
        # editable: the bench always measures this checkout's code
        subprocess.run([*pip, *REQUIREMENTS[1:], *[a for p in PACKAGES for a in ("-e", str(ROOT / p))]], check=True)
        (venv / ".complete").touch()
    return python


def trl_steps(model: Path, data: Path, prompts: int, n: int, length: int, steps: int, threads: int) -> dict:
    """TRL's GRPOTrainer for ``steps`` steps; wall time per step from a callback."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trellis.data import load_rows
    from trellis_algos import gsm8k_score

    torch.set_num_threads(threads)
    rows = load_rows(data)
    dataset = Dataset.from_list([{"prompt": list(r["prompt"]), "ground_truth": str(r["reward_model"]["ground_truth"])} for r in rows])

    def reward(completions, ground_truth, **_):
        return [gsm8k_score("openai/gsm8k", c[0]["content"], g) for c, g in zip(completions, ground_truth)]

    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.start)

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-"), per_device_train_batch_size=prompts * n, num_generations=n,
        max_completion_length=length, temperature=1.0, learning_rate=1e-5, max_grad_norm=1.0, beta=0.0, num_iterations=1,
        max_steps=steps, logging_steps=1, save_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available(),
        bf16=False, seed=0, dataloader_num_workers=0, disable_dropout=True,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(model)
    trainer = GRPOTrainer(
        model=str(model), reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[StepTimer()]
    )
    trainer.train()
    return {"steps": times}


def child(framework: str, length: int, steps: int, work: Path, threads: int, tag: str, size: str, rollout: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from rl_step import WORK, trellis_steps

    prompts, n = WORK[size]
    if framework == "trl":
        result = trl_steps(work / size, work / "train.parquet", prompts, n, length, steps, threads)
    else:
        result = trellis_steps(work / size, work / "train.parquet", prompts, n, length, steps, work / "runs" / tag, threads, rollout)
    print("RESULT-JSON " + json.dumps({"steps": result["steps"]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", help="a size of bench/rl_step.py (tiny, 10M, 50M)")
    parser.add_argument("--length", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv-bench-trl")
    parser.add_argument("--rollout", default="hf", help="Trellis's rollout engine")
    parser.add_argument("--trellis-python", default=None, help="the python that runs Trellis (default: the bench venv's)")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        framework, steps, work, threads, tag = args.child
        child(framework, args.length, int(steps), Path(work), int(threads), tag, args.size, args.rollout)
        return
    if not args.inner:
        python = ensure_venv(args.venv)
        sys.exit(subprocess.run([str(python), __file__, "--inner", *sys.argv[1:]]).returncode)

    sys.path.insert(0, str(Path(__file__).parent))
    from rl_step import SIZES, WORK

    from trellis_demo.tasks import make_arithmetic_split, task_texts, write_rows
    from trellis_demo.tiny import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="trellis-vs-trl-"))
    make_tiny_model(work / args.size, task_texts(), seed=0, **SIZES[args.size])
    write_rows(make_arithmetic_split(max(512, WORK[args.size][0] * (args.steps + 1)), 0), work / "train.parquet")
    steps: dict[str, list[float]] = {"trl": [], "trellis": []}
    common = ["--size", args.size, "--length", str(args.length), "--rollout", args.rollout]
    python = {"trl": sys.executable, "trellis": args.trellis_python or sys.executable}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}  # vLLM in-process on CPU
    for r in range(args.rounds):
        for framework in ("trl", "trellis") if r % 2 == 0 else ("trellis", "trl"):
            cmd = [python[framework], __file__, *common, "--child", framework, str(args.steps), str(work), str(args.threads), f"r{r}"]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode:
                raise RuntimeError(f"{framework} failed:\n{proc.stderr[-3000:]}")
            result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT-JSON "))[12:])
            steps[framework] += result["steps"][args.warmup :]
            print(f"round {r + 1}/{args.rounds} {framework} done", file=sys.stderr, flush=True)
    trl, trellis = statistics.median(steps["trl"]) * 1e3, statistics.median(steps["trellis"]) * 1e3
    prompts, n = WORK[args.size]
    print(f"\nGRPO step, {args.size} model, {prompts} prompts x {n} samples x <= {args.length} new tokens, {args.threads} threads, "
          f"{args.rounds} interleaved rounds, median of {len(steps['trl'])} steps each (ms)")  # fmt: skip
    for label, ms in (("TRL 1.16 GRPOTrainer", trl), (f"Trellis ({args.rollout})", trellis)):
        print(f"{label:<24}{ms:>10.1f}")
    print(f"{'Trellis / TRL':<24}{trellis / trl:>10.2f}x")
    print(f"RESULT size={args.size} length={args.length} rollout={args.rollout} trl_ms={trl:.1f} trellis_ms={trellis:.1f} ratio={trellis / trl:.3f}")


if __name__ == "__main__":
    main()
