"""What the always-on run invariants cost: the fixed-probe check after every weight sync
(``sync_check``) against the rl step it follows, the checks every batch passes (alignment and the
trainer-vs-engine log-prob agreement, ``trellis_algos.rl.invariants``) and the multi-turn
sampled-ids check per conversation. The demo's RL settings on a random model of the demo's size, the HF engine holding
weights of its own (``rollout.share_actor_weights=false``: the probe runs; an engine sharing the
actor's module has nothing to check).

    python bench/sync_check.py [--steps 12] [--threads 1] [--out runs/bench-sync-check]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="runs/bench-sync-check")
    parser.add_argument("overrides", nargs="*", help="more config overrides, e.g. sync_check.tokens=4")
    args = parser.parse_args()

    from trellis.plot import read_metrics
    from trellis.recipes.train import train
    from trellis_demo.demo import RL_ROWS, TASK, config_path
    from trellis_demo.tasks import make_arithmetic_split, task_texts, write_rows
    from trellis_demo.tiny import make_tiny_model

    out = Path(args.out)
    model = out / "model"
    if not model.is_dir():
        make_tiny_model(model, task_texts(ops=TASK["ops"]), hidden_size=128, num_layers=4, num_heads=4, seed=0)
    data = write_rows(make_arithmetic_split(RL_ROWS, 1, **TASK), out / "rl.parquet")
    run_dir = Path(tempfile.mkdtemp(dir=out, prefix="run-"))  # a fresh run each time; earlier ones stay
    train(config_path("demo_rl.yaml"), [
        f"model.path={model}", f"data.train_path={data}", "data.val_path=null", "rollout.share_actor_weights=false",
        f"trainer.total_steps={args.steps}", f"trainer.threads={args.threads}", "trainer.trackers=[jsonl]",
        f"trainer.run_dir={run_dir}", *args.overrides,
    ])  # fmt: skip
    rows = [r for r in read_metrics(run_dir) if "timing/sync_check_s" in r][1:]  # the first step warms up
    check = statistics.median(r["timing/sync_check_s"] for r in rows)
    step = statistics.median(r["timing/step_s"] for r in rows)
    gap = max(r["sync/probe_gap"] for r in rows)

    per_conversation = multiturn_check_seconds()
    batch_checks = batch_checks_seconds()
    print(f"\nthe demo's rl step (16 prompts x 8 samples, 12 new tokens), {len(rows)} steps after warm-up, medians")
    print(f"{'step':>10} {'sync check':>12} {'share':>8} {'largest probe gap':>19}")
    print(f"{step:>9.3f}s {check * 1000:>10.1f}ms {check / step:>8.2%} {gap:>19.2e}")
    print(f"batch checks (alignment + agreement) on the step's 128 samples: {batch_checks * 1e3:.2f} ms, {batch_checks / step:.2%} of the step")
    print(f"multi-turn sampled-ids check: {per_conversation * 1e6:.1f} us per conversation of 4 turns, 512 tokens")
    print(f"RESULT sync_check_share={check / step:.4f} sync_check_ms={check * 1000:.1f} step_s={step:.3f} probe_gap_max={gap:.2e} "
          f"batch_checks_ms={batch_checks * 1e3:.3f} batch_checks_share={batch_checks / step:.5f} "
          f"multiturn_check_us={per_conversation * 1e6:.1f}")  # fmt: skip


def batch_checks_seconds(repeats: int = 200) -> float:
    """Seconds the per-batch checks take on a batch of the demo's size: 128 samples of prompts of
    8-16 tokens and 12 response tokens (alignment, then the agreement of fresh samples' log-probs)."""
    import torch

    from trellis.batch import Batch
    from trellis.data import left_pad
    from trellis.interfaces.rollout import SamplingParams, samples_batch
    from trellis_algos.rl.invariants import AgreementCheck, check_alignment

    ids, mask, pos = left_pad([list(range(8 + i % 9)) for i in range(16)], 0)
    params = SamplingParams(n=8, max_new_tokens=12)
    batch = samples_batch(Batch({"input_ids": ids, "attention_mask": mask, "position_ids": pos}), params, [[5] * 12] * 128, [[-0.5] * 12] * 128, 0)
    batch["weight_version"] = torch.zeros(128, dtype=torch.long)
    old = batch["rollout_log_probs"] + 1e-6
    check = AgreementCheck(1e-3, "", True)
    start = time.perf_counter()
    for _ in range(repeats):
        check_alignment(batch, 1)
        check.check(batch, 1, old)
    return (time.perf_counter() - start) / repeats


def multiturn_check_seconds(repeats: int = 200) -> float:
    """Seconds ``check_sampled`` takes on one conversation: 4 model turns of 96 tokens, environment turns between."""
    from trellis.interfaces.agents import Trajectory
    from trellis.interfaces.rollout import Generation
    from trellis_multiturn.sampled import check_sampled

    turns = [Generation(list(range(t, t + 96)), [-0.5] * 96, "stop") for t in range(4)]
    traj = Trajectory()
    for gen in turns:
        traj.add_model(gen)
        traj.add_environment([7] * 32)
    start = time.perf_counter()
    for _ in range(repeats):
        check_sampled(traj, turns, "tool_agent", None)
    return (time.perf_counter() - start) / repeats


if __name__ == "__main__":
    main()
