"""SFT (cross-entropy) vs DFT (cross-entropy x detached token probability) on a task with several
valid solution paths, same data, steps and seeds; held-out accuracy in distribution and on longer
operands.

The task is addition. Each training answer is written in one of three formats, drawn per row:
``#### 46``, ``12+34=46 #### 46`` and the column-wise ``10+30=40 2+4=6 40+6=46 #### 46``; every
format ends in the verl GSM8K answer, which the reward reads. Training operands are 0..99; the
harder split takes operands 100..999. A tiny model (random init, tokenizer trained on the task)
is fine-tuned once per loss and seed, from scratch, or with ``--warmup-steps W`` from a shared
cross-entropy warm-up of W steps (DFT's paper fine-tunes pretrained models: from scratch each
token's weight, its own probability, starts near 1/vocab); accuracy is greedy, on held-out
questions, through the HF rollout and the ``gsm8k`` reward. Prints a table (mean and spread over seeds),
writes ``sft_vs_dft.png`` (held-out loss curves) and ends with a ``RESULT`` line.

    .venv/bin/python bench/sft_vs_dft.py [--seeds 0 1 2] [--steps 600] [--warmup-steps 0] [--threads 1] [--out runs/bench-dft]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

LOSSES = ("cross_entropy", "dft")


def answer(a: int, b: int, style: int) -> str:
    total = a + b
    if style == 0:
        return f"#### {total}"
    if style == 1:
        return f"{a}+{b}={total} #### {total}"
    tens, ones = (a // 10) * 10 + (b // 10) * 10, a % 10 + b % 10
    return f"{(a // 10) * 10}+{(b // 10) * 10}={tens} {a % 10}+{b % 10}={ones} {tens}+{ones}={total} #### {total}"


def rows(n: int, seed: int, low: int, high: int, split: str, styled: bool) -> list[dict]:
    """``n`` addition rows in verl's schema; ``extra_info.answer`` in a random format when ``styled``."""
    from trellis_demo.tasks import in_test_split

    rng = random.Random(f"dft:{split}:{seed}:{low}")
    out = []
    while len(out) < n:
        a, b = rng.randint(low, high), rng.randint(low, high)
        question = f"{a}+{b}="
        if low == 0 and in_test_split(question, 0.1) != (split == "test"):
            continue
        out.append({
            "data_source": "arithmetic",
            "prompt": [{"role": "user", "content": question}],
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"answer": answer(a, b, rng.randrange(3) if styled else 0)},
        })  # fmt: skip
    return out


def accuracy(model_dir: Path, test_rows: list[dict]) -> float:
    """Greedy accuracy (the ``gsm8k`` reward) on ``test_rows``."""
    from transformers import AutoTokenizer

    from trellis.interfaces.rollout import RolloutSpec, SamplingParams
    from trellis.plugins import load_plugins
    from trellis_algos import PromptDataset, RewardConfig, RewardManager
    from trellis_hf.engine import make_engine

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = make_engine(RolloutSpec(str(model_dir), None, tokenizer))
    prompts = PromptDataset(test_rows, tokenizer, 64).as_batch()
    out = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=40))
    out.update(prompts.select("data_source", "ground_truth"))
    return float(RewardManager(RewardConfig(name="gsm8k"), load_plugins().registry, tokenizer).score(out).scores.mean())


def sft(loss: str, start: Path, files: tuple[Path, Path], seed: int, steps: int, threads: int, run_dir: Path) -> Path:
    """Fine-tune ``start`` with ``loss`` on ``files`` (train, held-out); returns the saved model folder."""
    from trellis.recipes.train import train

    train(None, [
        "recipe=sft", f"seed={seed}", f"model.path={start}", f"data.train_path={files[0]}", f"data.val_path={files[1]}",
        "data.max_length=64", "data.batch_samples=64", f"train.loss.name={loss}", "train.optim.lr=3e-3",
        "train.optim.warmup_steps=20", "train.optim.lr_schedule=cosine", "train.optim.weight_decay=0.0",
        "train.micro_batch_samples=64", f"trainer.total_steps={steps}", f"trainer.val_every_steps={max(steps // 6, 1)}",
        f"trainer.threads={threads}", "trainer.trackers=[jsonl]", "trainer.save_hf_model=true", f"trainer.run_dir={run_dir}",
    ])  # fmt: skip
    return run_dir / "hf_model"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--warmup-steps", type=int, default=0, help="shared cross-entropy steps before the losses part (0: from scratch)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="runs/bench-dft")
    args = parser.parse_args()

    from trellis.plot import plot_metrics
    from trellis_demo.tasks import write_rows
    from trellis_demo.tiny import make_tiny_model

    out = Path(args.out)
    test_in = rows(200, 0, 0, 99, "test", styled=False)
    test_hard = rows(200, 0, 100, 999, "hard", styled=False)
    results: dict[str, list[tuple[float, float]]] = {loss: [] for loss in LOSSES}
    run_dirs = []
    for seed in args.seeds:
        data = write_rows(rows(4000, seed, 0, 99, "train", styled=True), out / f"data-{seed}" / "train.parquet")
        val = write_rows(rows(200, seed, 0, 99, "test", styled=True), out / f"data-{seed}" / "val.parquet")
        texts = [r["prompt"][0]["content"] + " " + r["extra_info"]["answer"] for r in rows(2000, seed, 0, 99, "train", styled=True)]
        model = make_tiny_model(out / f"model-{seed}", texts, hidden_size=96, num_layers=3, num_heads=4, seed=seed)

        files = (data, val)
        if args.warmup_steps:
            model = sft("cross_entropy", model, files, seed, args.warmup_steps, args.threads, out / f"warmup-seed{seed}")
        for loss in LOSSES:
            run_dir = out / f"{loss}-seed{seed}"
            sft(loss, model, files, seed, args.steps, args.threads, run_dir)
            results[loss].append((accuracy(run_dir / "hf_model", test_in), accuracy(run_dir / "hf_model", test_hard)))
            run_dirs.append(run_dir)
    plot_metrics(run_dirs, out / "sft_vs_dft.png", ["val/loss", "sft/loss"])

    def summary(values: list[float]) -> str:
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{statistics.mean(values):.3f} ± {spread:.3f}"

    start = f"after {args.warmup_steps} shared cross-entropy steps" if args.warmup_steps else "from scratch"
    print(f"\nheld-out greedy accuracy, {len(args.seeds)} seeds x {args.steps} steps {start} (mean ± std over seeds)")
    print(f"{'loss':<15}{'in distribution (0..99)':>26}{'longer operands (100..999)':>30}")
    for loss in LOSSES:
        print(f"{loss:<15}{summary([r[0] for r in results[loss]]):>26}{summary([r[1] for r in results[loss]]):>30}")
    (out / "summary.json").write_text(json.dumps(results, indent=2))
    means = {loss: [statistics.mean(r[i] for r in results[loss]) for i in (0, 1)] for loss in LOSSES}
    print(f"RESULT sft_in={means['cross_entropy'][0]:.3f} dft_in={means['dft'][0]:.3f} "
          f"sft_hard={means['cross_entropy'][1]:.3f} dft_hard={means['dft'][1]:.3f} seeds={len(args.seeds)} steps={args.steps} "
          f"warmup_steps={args.warmup_steps}")  # fmt: skip


if __name__ == "__main__":
    main()
