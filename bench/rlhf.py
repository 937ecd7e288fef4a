"""RLHF on the demo task: a reward model trained on right-vs-wrong answer pairs (the rm recipe,
from the demo's SFT model's weights), then GRPO against it (reward.model), per seed. Reports the
reward model's held-out pair accuracy, and before/after the GRPO the learned reward and the rule
(gsm8k) accuracy on the held-out prompts: a learned reward that rises while the rule accuracy does
not is the policy exploiting the reward model.

    .venv/bin/python bench/rlhf.py [--seeds 0] [--rm-steps 150] [--rl-steps 40] [--threads 1] [--out runs/bench-rlhf]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--rm-steps", type=int, default=150)
    parser.add_argument("--rm-lr", type=float, default=1e-4)
    parser.add_argument("--pairs", type=int, default=4000)
    parser.add_argument("--rl-steps", type=int, default=40)
    parser.add_argument("--rl-lr", type=float, default=2e-4)
    parser.add_argument("--sft-steps", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="runs/bench-rlhf")
    args = parser.parse_args()

    from demo_start import demo_start

    from trellis.recipes.train import evaluate, train
    from trellis_demo.demo import TASK, VAL_ROWS
    from trellis_demo.tasks import make_arithmetic_pairs, make_arithmetic_split, write_rows

    out = Path(args.out)
    start, rl_data, test_data = demo_start(out, args.sft_steps, args.threads)
    pairs = write_rows(make_arithmetic_pairs(make_arithmetic_split(args.pairs, 2, **TASK), 0), out / "data" / "pairs.parquet")
    val_pairs = write_rows(make_arithmetic_pairs(make_arithmetic_split(VAL_ROWS, 0, split="test", **TASK), 1), out / "data" / "val_pairs.parquet")
    common = [f"trainer.threads={args.threads}", "trainer.trackers=[jsonl]", "trainer.save_hf_model=true"]

    def rule_accuracy(model: Path) -> float:
        """Greedy gsm8k accuracy of ``model`` on the held-out prompts (trellis eval)."""
        figures = evaluate(None, [
            "recipe=rl", f"model.path={model}", f"data.train_path={rl_data}", f"data.val_path={test_data}", "data.max_prompt_length=32",
            "sampling.max_new_tokens=12", "reward.name=gsm8k", f"trainer.threads={args.threads}",
        ])  # fmt: skip
        return figures["greedy_reward_mean"]

    results: dict[int, dict[str, float]] = {}
    acc_start = rule_accuracy(start)
    for seed in args.seeds:
        rm_dir, rl_dir = out / f"rm-seed{seed}", out / f"grpo-seed{seed}"
        rm = train(None, [
            "recipe=rm", f"seed={seed}", f"model.path={start}", f"data.train_path={pairs}", f"data.val_path={val_pairs}",
            "data.max_length=32", "data.batch_pairs=32", "train.micro_batch_samples=32", f"train.optim.lr={args.rm_lr}",
            f"trainer.total_steps={args.rm_steps}", f"trainer.run_dir={rm_dir}", *common,
        ])  # fmt: skip
        rl = train(None, [
            "recipe=rl", f"seed={seed}", f"model.path={start}", f"data.train_path={rl_data}", f"data.val_path={test_data}",
            "data.max_prompt_length=32", "data.train_batch_prompts=16", "sampling.n=8", "sampling.max_new_tokens=12",
            f"actor.optim.lr={args.rl_lr}", "actor.micro_batch_samples=128", f"reward.model.path={rm_dir / 'hf_model'}",
            f"trainer.total_steps={args.rl_steps}", f"trainer.run_dir={rl_dir}", *common,
        ])  # fmt: skip
        results[seed] = {
            "rm_val_accuracy_before": rm["val_before"]["val/accuracy"],
            "rm_val_accuracy": rm["val_after"]["val/accuracy"],
            "learned_reward_before": rl["val_before"]["greedy_reward_mean"],
            "learned_reward_after": rl["val_after"]["greedy_reward_mean"],
            "rule_accuracy_before": acc_start,
            "rule_accuracy_after": rule_accuracy(rl_dir / "hf_model"),
        }

    print(f"\n{len(args.seeds)} seed(s): reward model {args.rm_steps} steps x 32 pairs; GRPO {args.rl_steps} steps x 16 prompts x 8 samples")
    print(f"held-out: {VAL_ROWS} pairs (reward model), {VAL_ROWS} prompts greedy (learned reward, gsm8k rule accuracy)")
    print(f"{'seed':<6}{'RM acc':>8}{'reward before':>15}{'reward after':>14}{'rule before':>13}{'rule after':>12}")
    for seed, r in results.items():
        print(
            f"{seed:<6}{r['rm_val_accuracy']:>8.3f}{r['learned_reward_before']:>15.3f}{r['learned_reward_after']:>14.3f}"
            f"{r['rule_accuracy_before']:>13.3f}{r['rule_accuracy_after']:>12.3f}"
        )
    (out / "summary.json").write_text(json.dumps(results, indent=2))
    mean = {k: sum(r[k] for r in results.values()) / len(results) for k in next(iter(results.values()))}
    reward_gain = mean["learned_reward_after"] - mean["learned_reward_before"]
    rule_gain = mean["rule_accuracy_after"] - mean["rule_accuracy_before"]
    hacking = reward_gain > 0 and rule_gain <= 0
    print(
        f"RESULT rm_val_acc={mean['rm_val_accuracy']:.3f} learned_reward={mean['learned_reward_before']:.3f}->{mean['learned_reward_after']:.3f} "
        f"rule_acc={mean['rule_accuracy_before']:.3f}->{mean['rule_accuracy_after']:.3f} reward_hacking={'yes' if hacking else 'no'} "
        f"seeds={len(args.seeds)}"
    )


if __name__ == "__main__":
    main()
