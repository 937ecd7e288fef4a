"""Asynchronous RL on CPU under Ray: samples/s and held-out reward against wall time for
``trainer.async_mode`` off / one_step / fully_async (max_staleness 1 and 2).

The trainer (one Ray rank) and the rollout engine (``trainer.rollout_pool=1``, a process of its
own) share the node's cores (the controller gives each process cores / (ranks + engine processes)
threads), so on a 2-core machine each holds a core: ``off`` leaves the
engine idle while the trainer trains and the trainer idle while the engine generates, the async
modes overlap the two. A random tiny Qwen2 (built locally) answers the arithmetic prompts; its
``generation_config.json`` lists 8 more end-of-sequence ids besides ``<|im_end|>``, so a response
ends with a small probability per token: lengths are geometric (a long tail, as in reasoning
runs) up to ``sampling.max_new_tokens``, and every batch waits for its longest sample.

The reward is the share of ASCII letters and digits in the response (about 0.3 for the random
model), which GRPO raises within a few dozen steps. 2 of the 62 letters and digits end a response,
and 6 of the other ~215 tokens: the same share (~3%) on both sides, so moving probability towards
the rewarded characters leaves the stop probability, hence the lengths and the cost of a step,
about where they were (a reward on digits alone made the responses 2-5x longer as it rose, and
the faster-learning runs slower). Held-out reward is ``val/reward_mean`` (``validation.n``
samples per held-out prompt) every ``--val-every`` steps.

Wall time is training time: ``timing/step_s`` less ``timing/val_s`` summed over steps (see
``curves.train_seconds``); "at equal wall time" reads every run's last validation made by the
time the fastest run finished. Prints the length distribution of the initial policy, a table
and a ``RESULT`` line; ``--plot PATH`` saves held-out reward against steps and wall time.

    python bench/async.py [--steps 24] [--plot async.png]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from curves import SAMPLED, at_time, plot_curves, train_seconds, val_curve  # noqa: E402

MODES = {  # name -> overrides
    "off": ["trainer.async_mode=off"],
    "one_step": ["trainer.async_mode=one_step"],
    "async1": ["trainer.async_mode=fully_async", "trainer.max_staleness=1"],
    "async2": ["trainer.async_mode=fully_async", "trainer.max_staleness=2"],
    # the sync goes in as training finishes instead of once the steps before it were generated (the exact schedule)
    "async2_opportunistic": ["trainer.async_mode=fully_async", "trainer.max_staleness=2", "trainer.async_schedule=opportunistic"],
    # a weight sync no longer waits for the generation in flight: it goes in between two chunks
    "async1_partial": [
        "trainer.async_mode=fully_async",
        "trainer.max_staleness=1",
        "trainer.async_schedule=opportunistic",
        "trainer.partial_rollout=true",
    ],
}
ALNUM_SHARE = """
def alnum_share(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isascii() and c.isalnum() for c in solution_str) / max(1, len(solution_str))
"""
# single-character tokens made end-of-sequence ids: 2 rewarded (letters), 6 not (punctuation)
STOP_CHARS = "QZ~`^|{}"


def add_stops(model: Path) -> None:
    """Make ``STOP_CHARS`` end-of-sequence ids of ``model`` (its generation config, which the engines read)."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model)
    config = GenerationConfig.from_pretrained(model)
    config.eos_token_id = [tokenizer.eos_token_id, *(tokenizer.convert_tokens_to_ids(c) for c in STOP_CHARS)]
    config.save_pretrained(model)


def length_distribution(model: Path, prompts: list[list[dict]], n: int, max_new: int) -> list[int]:
    """Response lengths (tokens, the end-of-sequence token included) of the initial policy on the
    HF engine the runs use: ``n`` samples of each chat prompt ``prompts``."""
    from transformers import AutoTokenizer

    from trellis.batch import Batch, position_ids
    from trellis.data import left_pad
    from trellis.interfaces.rollout import RolloutSpec, SamplingParams
    from trellis_hf.engine import make_engine

    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = make_engine(RolloutSpec(str(model), None, tokenizer))
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
    ids, mask, _ = left_pad([tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts], tokenizer.pad_token_id)
    out = engine.generate(Batch({"input_ids": ids, "attention_mask": mask, "position_ids": position_ids(mask)}),
                          SamplingParams(n=n, max_new_tokens=max_new, seed=7))  # fmt: skip
    return out["response_mask"].sum(-1).tolist()


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_mode(name: str, common: list[str], work: Path) -> Path:
    from trellis.recipes.train import train

    run_dir = work / name
    train(None, [*common, *MODES[name], f"trainer.run_dir={run_dir}"])
    return run_dir


def summarize(run_dir: Path, samples_per_step: int) -> dict[str, float]:
    from trellis.plot import read_metrics

    rows = [r for r in read_metrics(run_dir) if "timing/step_s" in r]
    wall = train_seconds(run_dir)[rows[-1]["step"]]
    out = {"steps": len(rows), "wall": wall, "sps": len(rows) * samples_per_step / wall}
    for key in ("rollout/staleness_mean", "rollout/staleness_max", "timing/wait_gen_s", "timing/wait_trainer_s", "timing/gen_s",
                "timing/update_actor_s", "timing/weight_sync_s", "response/length_mean"):  # fmt: skip
        values = [r[key] for r in rows if key in r]
        out[key] = (max if key.endswith("_max") else statistics.mean)(values) if values else float("nan")
    out["length_first"], out["length_last"] = rows[0]["response/length_mean"], rows[-1]["response/length_mean"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--val-every", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (data.train_batch_prompts)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()

    import ray

    from trellis_demo.tasks import make_arithmetic_split, task_texts, write_rows
    from trellis_demo.tiny import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="trellis-bench-async-"))
    model = make_tiny_model(work / "model", task_texts(), hidden_size=args.hidden, num_layers=args.layers, seed=0)
    train_rows = make_arithmetic_split(args.prompts * args.steps, 0)
    val_rows = make_arithmetic_split(16, 0, split="test")
    train_data, val_data = write_rows(train_rows, work / "train.parquet"), write_rows(val_rows, work / "val.parquet")
    reward = work / "alnum_share.py"
    reward.write_text(ALNUM_SHARE)
    add_stops(model)

    lengths = length_distribution(model, [r["prompt"] for r in train_rows[: args.prompts]], args.n, args.max_new_tokens)
    print(f"\nresponse lengths of the initial policy ({len(lengths)} samples, cap {args.max_new_tokens}): mean {statistics.mean(lengths):.1f} "
          f"p50 {percentile(lengths, 0.5):.0f} p90 {percentile(lengths, 0.9):.0f} max {max(lengths)}; "
          f"a batch generates for its longest sample")  # fmt: skip

    common = [
        "recipe=rl", f"model.path={model}", f"data.train_path={train_data}", f"data.val_path={val_data}",
        f"data.train_batch_prompts={args.prompts}", f"sampling.n={args.n}", f"sampling.max_new_tokens={args.max_new_tokens}",
        "sampling.seed=7", f"reward.path={reward}", "reward.name=alnum_share",
        f"actor.optim.lr={args.lr}", f"actor.micro_batch_samples={args.prompts * args.n}", "validation.n=4",
        f"trainer.total_steps={args.steps}", f"trainer.val_every_steps={args.val_every}", "trainer.trackers=[jsonl]",
        "trainer.controller=ray", "trainer.procs_per_node=1", "trainer.rollout_pool=1", "trainer.threads=1",
    ]  # fmt: skip
    modes = args.modes.split(",")
    from trellis_ray.controller import WORKER_NICENESS

    os.environ.update(WORKER_NICENESS)  # the ranks and engine at the default niceness, as in a cluster trellis starts
    ray.init(num_cpus=3, include_dashboard=False, _temp_dir=str(work / "ray"), log_to_driver=False)
    try:
        runs = {m: run_mode(m, common, work) for m in modes}
    finally:
        ray.shutdown()
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()

    samples = args.prompts * args.n
    figures = {m: summarize(d, samples) for m, d in runs.items()}
    curves = {m: val_curve(d, SAMPLED) for m, d in runs.items()}
    equal = min(f["wall"] for f in figures.values())  # the fastest run's end
    base = figures[modes[0]]["sps"]
    print(f"\n{samples} samples/step ({args.prompts} prompts x {args.n}), {args.steps} steps, Qwen2 {args.hidden}x{args.layers}, "
          f"1 trainer rank + 1 engine process, 1 thread each; held-out = {SAMPLED} on {len(val_rows)} prompts")  # fmt: skip
    header = ("mode", "steps", "wall s", "samples/s", f"x {modes[0]}", "stale mean", "stale max", "wait gen s", "wait train s",
              "gen s", "update s", "sync s", "len first/last", "val end", f"val @{equal:.0f}s")  # fmt: skip
    print("".join(f"{h:>15}" for h in header))
    for m in modes:
        f = figures[m]
        cells = (m, f["steps"], f"{f['wall']:.1f}", f"{f['sps']:.1f}", f"{f['sps'] / base:.2f}", f"{f['rollout/staleness_mean']:.2f}",
                 f"{f['rollout/staleness_max']:.0f}", f"{f['timing/wait_gen_s']:.2f}", f"{f['timing/wait_trainer_s']:.2f}",
                 f"{f['timing/gen_s']:.2f}", f"{f['timing/update_actor_s']:.2f}", f"{f['timing/weight_sync_s']:.2f}",
                 f"{f['length_first']:.0f}/{f['length_last']:.0f}",
                 f"{curves[m][-1][2]:.3f}", f"{at_time(curves[m], equal):.3f}")  # fmt: skip
        print("".join(f"{c:>15}" for c in cells))
    print("per-step means: wait gen = the trainer waiting for samples, wait train = the producer waiting for the trainer (the bound),")
    print("sync = the weight sync, which waits for a generation in flight (the rollout's lock; with partial rollouts only for a chunk)")
    print(f"load: {load}")
    if args.plot:
        plot_curves({m: [c] for m, c in curves.items()}, args.plot, "held-out share of letters and digits")
        print(f"plot: {args.plot}")
    result = [f"{m}_sps={figures[m]['sps']:.2f}" for m in modes]
    result += [f"speedup_{m}={figures[m]['sps'] / base:.2f}" for m in modes[1:]]
    result += [f"val_{m}={at_time(curves[m], equal):.3f}" for m in modes]
    result += [f"stale_max_{m}={figures[m]['rollout/staleness_max']:.0f}" for m in modes[1:]]
    result += [f"equal_wall_s={equal:.1f}", f"load1={os.getloadavg()[0]:.2f}"]
    print("RESULT " + " ".join(result))


if __name__ == "__main__":
    main()
