"""Mixture-of-experts routing replay on CPU: how often a bfloat16 engine routes tokens to other experts
than the float32 trainer, the log-prob gap between them, and what replaying the engine's experts
(``actor.router_replay: rollout``, R3) changes, over training steps; plus the step-time cost.

GRPO on the arithmetic task with a tiny Qwen3-MoE (4 experts per layer, top 2, built locally), FSDP
on one rank beside an HF engine holding its own bfloat16 copy of the weights. Two models: the random
tiny MoE as built, and the same with each router's experts 2 and 3 nearly tied (expert 3's router
row = expert 2's + 1e-4 x noise), the near ties a trained router has and a random tiny one lacks:
there, bfloat16 rounding decides which of the two a token goes to. Modes: ``off`` (nothing
recorded), ``measure`` (the engine's experts recorded, the trainer's flips counted, not replayed),
``rollout`` (replayed in every forward of the policy). Per run, over its steps: the mean
``moe/routing_flip_rate`` (recorded token-layer pairs the trainer's own routing sends elsewhere),
the mean and max of ``actor/rollout_corr/abs_diff`` (mean |log p_trainer - log p_engine| over
response tokens) and the mean step time. Ends with a ``RESULT`` line.

    python bench/moe.py [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from trellis.interfaces.hf import load_hf_model
from trellis.interfaces.moe import routers
from trellis.recipes.train import train
from trellis_demo.tasks import make_arithmetic_split, task_texts, write_rows
from trellis_demo.tiny import make_tiny_model

MODES = ("off", "measure", "rollout")


def near_tie(path: Path, out: Path, nudge: float = 1e-4) -> Path:
    """``path``'s model with expert 3's router row ``nudge`` x noise away from expert 2's, in every layer."""
    model = load_hf_model(str(path), "lm", torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for router in routers(model):
            router.weight[3] = router.weight[2] + nudge * torch.randn(router.weight.shape[1], generator=generator)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (path / name).exists():
            (out / name).write_bytes((path / name).read_bytes())
    return out


def run(model: Path, mode: str, data: dict[str, Path], steps: int, work: Path) -> dict[str, float]:
    run_dir = work / f"{model.name}-{mode}"
    overrides = [
        "recipe=rl", f"model.path={model}", f"data.train_path={data['train']}", "data.train_batch_prompts=8", "sampling.n=4",
        "sampling.max_new_tokens=12", "actor.micro_batch_samples=32", "actor.optim.lr=1e-3", f"trainer.total_steps={steps}",
        "trainer.trackers=[jsonl]", f"trainer.run_dir={run_dir}", "rollout.dtype=bfloat16", "rollout.share_actor_weights=false",
        "sync_check.max_gap=100", "validation.before_train=false", f"actor.router_replay={mode}",
    ]  # fmt: skip
    train(None, overrides)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    gaps = [r["actor/rollout_corr/abs_diff"] for r in rows]
    return {
        "flip_rate": statistics.mean(r.get("moe/routing_flip_rate", float("nan")) for r in rows),
        "gap_mean": statistics.mean(gaps),
        "gap_max": max(gaps),
        "step_s": statistics.mean(r["timing/step_s"] for r in rows[1:] or rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="trellis-bench-moe-"))
    data = {"train": write_rows(make_arithmetic_split(256, 0, max_value=50), work / "train.parquet")}
    base = make_tiny_model(work / "tiny-moe", task_texts(), hidden_size=64, num_layers=2, moe=True)
    models = {"random": base, "near_tie": near_tie(base, work / "near-tie")}
    results = {(name, mode): run(path, mode, data, args.steps, work) for name, path in models.items() for mode in MODES}
    header = ("model", "router_replay", "flip rate", "|dlogp| mean", "|dlogp| max", "step s", "step / off")
    print(f"\nGRPO, {args.steps} steps, 8 prompts x 4 samples, Qwen3-MoE 64x2 (4 experts, top 2); bf16 HF engine, fp32 FSDP trainer")
    print("".join(f"{h:>15}" for h in header))
    for (name, mode), r in results.items():
        ratio = r["step_s"] / results[(name, "off")]["step_s"]
        cells = (name, mode, f"{r['flip_rate']:.4f}", f"{r['gap_mean']:.2e}", f"{r['gap_max']:.2e}", f"{r['step_s']:.3f}", f"{ratio:.2f}")
        print("".join(f"{c:>15}" for c in cells))
    print("flip rate: recorded (token, layer) pairs the trainer's own routing sends to other experts (nan: nothing recorded, mode off)")
    result = []
    for (name, mode), r in results.items():
        if mode != "off":
            result.append(f"{name}_{mode}_flip_rate={r['flip_rate']:.4f}")
        result += [f"{name}_{mode}_gap_mean={r['gap_mean']:.3e}", f"{name}_{mode}_step_s={r['step_s']:.3f}"]
    print("RESULT " + " ".join(result))


if __name__ == "__main__":
    main()
