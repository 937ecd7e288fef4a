"""First-GPU smoke run: 3 GRPO steps of a ~0.5B Qwen2-shaped model, FSDP + vLLM colocated in bf16 on one GPU.

The model is built from a config (Qwen2.5-0.5B's shape, random weights, a tokenizer trained here:
nothing is downloaded). The ``rl`` recipe runs it with the vLLM rollout in the trainer's process
(sleep mode on: the engine sleeps after generating and wakes for the weight sync; ``--rollout hf``
or ``sglang`` for the others), FSDP on one rank with fp32 master weights, bf16 compute and fp32
gradient reduction.

A random model scores 0 on the task's own reward, and with every reward equal no gradient moves
a weight: a broken weight sync would go unseen. So the reward here is graded (the share of a
response's characters that are digits: a group's samples differ) and the learning rate (1e-4,
Adam: about 1e-4 per weight per step, the bf16 spacing of a 0.02 weight) changes the engine's
bf16 weights at every sync. Each step prints the trainer-vs-engine gap the rl recipe logs
(``actor/rollout_corr/kl``, ``log_ppl_diff``: near 0 when the engine generates from the weights
the trainer just sent, growing step by step when a sync is lost).

Then per stage the time, the peak memory torch allocated and the device memory in use at its
end, the step time, generated tokens per second, weight-sync time and a ``RESULT`` line. On a
machine without CUDA it says so and exits 0 (``--tiny --rollout hf`` runs the same flow with a
tiny model on CPU, to check the script itself). Meant to finish in well under 10 minutes on one GPU.

    python bench/gpu_smoke.py [--rollout vllm|hf|sglang] [--steps 3] [--prompts 16] [--n 8] [--length 256] [--lr 1e-4] [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

QWEN2_05B = {  # Qwen2.5-0.5B's shape (494M parameters with tied embeddings)
    "hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2, "intermediate_size": 4864,
    "vocab_size": 151936, "max_position_embeddings": 2048,
}  # fmt: skip
TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4}
STAGES = ("gen", "reward", "old_log_prob", "adv", "update_actor", "weight_sync")
TRAINER_GPU = ["backend.dtype=float32", "backend.param_dtype=bfloat16", "backend.reduce_dtype=float32", "rollout.dtype=bfloat16"]
ENGINE_GPU = {  # each engine's own keys (an engine refuses another's): its share of the GPU beside FSDP
    "vllm": ["rollout.enable_sleep_mode=true", "rollout.gpu_memory_utilization=0.3"],
    "sglang": ["rollout.enable_memory_saver=true", "rollout.mem_fraction_static=0.3"],
    "hf": [],
}
REWARD = '''def digit_share(data_source, solution_str, ground_truth, extra_info=None):
    """The share of the response's characters that are digits (graded: a group's samples differ)."""
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
'''
PER_STEP = {"reward": "reward/mean", "signal": "reward/groups_with_signal", "grad_norm": "actor/grad_norm",
            "corr_kl": "actor/rollout_corr/kl", "log_ppl_diff": "actor/rollout_corr/log_ppl_diff"}  # fmt: skip


def overrides(args: argparse.Namespace, model: Path, data: Path, reward: Path, work: Path, cuda: bool) -> list[str]:
    """The ``rl`` recipe's overrides for this run: the GPU precision keys and only this engine's own keys on CUDA."""
    return [
        "recipe=rl", f"model.path={model}", f"data.train_path={data}", f"data.train_batch_prompts={args.prompts}",
        "data.max_prompt_length=64", f"sampling.n={args.n}", f"sampling.max_new_tokens={args.length}",
        f"reward.path={reward}", "reward.name=digit_share",
        f"actor.micro_batch_samples={min(32, args.prompts * args.n)}", f"actor.optim.lr={args.lr}", f"rollout.name={args.rollout}",
        "validation.before_train=false", "trainer.val_every_steps=0", "trainer.keep_checkpoints=0",
        f"trainer.total_steps={args.steps}", "trainer.trackers=[jsonl]", f"trainer.run_dir={work / 'run'}",
        *((TRAINER_GPU + ENGINE_GPU[args.rollout]) if cuda else []), *args.overrides,
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--rollout", default="vllm", choices=tuple(ENGINE_GPU))
    parser.add_argument("--lr", type=float, default=1e-4, help="the actor's learning rate (large enough to change bf16 weights)")
    parser.add_argument("overrides", nargs="*", help="more key=value overrides, e.g. backend.padding_free=true")
    parser.add_argument("--tiny", action="store_true", help="a tiny model instead of the 0.5B one (checks the script on CPU)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        print("no CUDA device here: bench/gpu_smoke.py measures a GPU run; nothing to do (--tiny --rollout hf checks the script on CPU)")
        print("RESULT cuda=0")
        return

    from trellis.recipes.train import train
    from trellis_demo.tasks import make_arithmetic_split, task_texts, write_rows
    from trellis_demo.tiny import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="trellis-gpu-smoke-"))
    start = time.perf_counter()
    model = make_tiny_model(work / "model", task_texts(), seed=0, **(TINY if args.tiny else QWEN2_05B))
    data = write_rows(make_arithmetic_split(max(256, args.prompts * args.steps), 0), work / "train.parquet")
    build_s = time.perf_counter() - start
    reward = work / "reward.py"
    reward.write_text(REWARD)
    start = time.perf_counter()
    train(None, overrides(args, model, data, reward, work, cuda))
    run_s = time.perf_counter() - start
    rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing/step_s" in r]
    later = rows[1:] or rows  # the first step includes compilation and allocator warm-up

    def mean(key: str, among=later) -> float:
        values = [r[key] for r in among if key in r]
        return statistics.mean(values) if values else float("nan")

    print(f"\n{'step':<6}" + "".join(f"{name:>14}" for name in PER_STEP))
    for i, row in enumerate(rows, 1):  # the trainer-vs-engine gap per step: a lost sync grows it
        print(f"{i:<6}" + "".join(f"{row.get(key, float('nan')):>14.5f}" for key in PER_STEP.values()))
    device = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"\n{'0.5B' if not args.tiny else 'tiny'} Qwen2-shaped model on {device}: {args.prompts} prompts x {args.n} samples "
          f"x <= {args.length} tokens, {args.steps} steps (means over steps 2..; model build {build_s:.0f} s, run {run_s:.0f} s)")  # fmt: skip
    print(f"{'stage':<14}{'time s':>10}{'peak GiB':>10}{'used GiB':>10}")
    for stage in STAGES:
        if f"timing/{stage}_s" in rows[0]:
            print(f"{stage:<14}{mean(f'timing/{stage}_s'):>10.3f}"
                  f"{max((r.get(f'memory/{stage}_peak_gib', float('nan')) for r in rows), default=float('nan')):>10.2f}"
                  f"{mean(f'memory/{stage}_used_gib'):>10.2f}")  # fmt: skip
    tokens = mean("response/length_mean") * args.prompts * args.n
    tokens_per_s = tokens / mean("timing/gen_s")
    peak = max((v for r in rows for k, v in r.items() if k.endswith("_peak_gib")), default=float("nan"))
    print(f"step {mean('timing/step_s'):.2f} s, {tokens_per_s:.0f} generated tokens/s, weight sync {mean('timing/weight_sync_s'):.3f} s, "
          f"peak torch memory {peak:.2f} GiB")  # fmt: skip
    print(f"RESULT cuda={int(cuda)} step_s={mean('timing/step_s'):.3f} gen_tokens_per_s={tokens_per_s:.0f} "
          f"weight_sync_s={mean('timing/weight_sync_s'):.3f} peak_gib={peak:.2f} first_step_s={rows[0]['timing/step_s']:.2f} "
          f"max_corr_kl={max((abs(r[PER_STEP['corr_kl']]) for r in rows if PER_STEP['corr_kl'] in r), default=float('nan')):.5f}")  # fmt: skip


if __name__ == "__main__":
    main()
