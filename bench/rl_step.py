"""A Trellis GRPO step beside a bare-PyTorch step doing the same work, per model size and response length.

The bare step (written here, the floor): one model in one process; HF ``generate`` of n samples per
prompt at temperature 1; verl's GSM8K rule; group-normalised advantages; one forward and backward
of the clipped policy loss over the response tokens (on-policy: the old log-probs are that
forward's, detached); grad-norm clip 1.0; AdamW. Trellis runs the ``rl`` recipe on the same model,
prompts, sampling and optimizer with one update per batch (HF rollout, FSDP backend on one rank),
its micro-batches cut by a token budget of ``TOKEN_BUDGET`` padded tokens, longest samples first
(the floor runs the batch padded to its longest response in one forward), with its defaults: each
prompt prefilled once for its n samples in generation (``rollout.share_prompts``) and run once per
micro-batch in the update where that is less work (``backend.share_prompts``), and on CPU grouped-query
attention in one sdpa call (core's ``grouped_query_sdpa``; the floor runs transformers' default);
``--override backend.share_prompts=off --override rollout.share_prompts=false`` runs it without the
first two, ``TRANSFORMERS_SDPA_FORCE_GQA=0`` in the environment without the third.
Each (framework, size, length) runs in its own process, interleaved over ``--rounds`` rounds;
a cell is the median step time after ``--warmup`` steps of every round, with the lowest and highest
ratio of a single round beside it (the spread this machine shows between processes). Peak RSS is that
process's. ``--growth-steps`` runs Trellis that many steps on the tiny model and compares RSS
early and late. On a CUDA machine both run on the GPU.

    python bench/rl_step.py [--sizes tiny,10M,50M] [--lengths 8,64,256] [--rounds 3] [--steps 6] [--override KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {  # name -> make_tiny_model kwargs
    "tiny": {"hidden_size": 128, "num_layers": 4, "num_heads": 4},  # the demo's
    "10M": {"hidden_size": 256, "num_layers": 10, "num_heads": 8, "num_kv_heads": 4},
    "50M": {"hidden_size": 512, "num_layers": 12, "num_heads": 8, "num_kv_heads": 4},
}
# (prompts, samples per prompt) by size: the larger models get less work per step so a cell stays short
WORK = {"tiny": (16, 8), "10M": (8, 8), "50M": (4, 4)}
LR, CLIP, EPS_CLIP = 1e-5, 1.0, 0.2
TOKEN_BUDGET = 2048  # Trellis's actor.max_tokens_per_micro_batch


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def trellis_steps(
    model: Path,
    data: Path,
    prompts: int,
    n: int,
    length: int,
    steps: int,
    run_dir: Path,
    threads: int,
    rollout: str = "hf",
    extra: tuple[str, ...] = (),
) -> dict:
    """The rl recipe for ``steps`` with the ``rollout`` engine (``extra`` overrides last); its
    per-step timings and RSS after each step (a plugin's hook)."""
    from trellis import hookimpl
    from trellis.plugins import load_plugins
    from trellis.recipes.train import train

    rss: list[float] = []

    class RSS:
        @hookimpl
        def trellis_step_end(self) -> None:
            rss.append(rss_mb())

    config = [
        "recipe=rl", f"model.path={model}", f"data.train_path={data}", f"data.train_batch_prompts={prompts}",
        "data.max_prompt_length=64", f"sampling.n={n}", f"sampling.max_new_tokens={length}",
        f"actor.max_tokens_per_micro_batch={TOKEN_BUDGET}", f"actor.optim.lr={LR}", f"actor.optim.grad_clip={CLIP}",
        "validation.before_train=false", "trainer.val_every_steps=0", "trainer.keep_checkpoints=0",
        f"trainer.total_steps={steps}", f"trainer.threads={threads}", "trainer.trackers=[jsonl]", f"trainer.run_dir={run_dir}",
        f"rollout.name={rollout}", *extra,
    ]  # fmt: skip
    train(None, config, plugins=load_plugins(extra=[("rss", RSS())]))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing/step_s" in r]
    stages = sorted({k for r in rows for k in r if k.startswith("timing/") and k.endswith("_s") and k != "timing/step_s"})
    return {
        "steps": [r["timing/step_s"] for r in rows],
        "stages": {k[7:-2]: [r.get(k, 0.0) for r in rows] for k in stages},
        "tokens": [r["response/length_mean"] for r in rows],
        "rss": rss,
    }


def floor_steps(model_path: Path, data: Path, prompts: int, n: int, length: int, steps: int, threads: int) -> dict:
    """The bare GRPO step, ``steps`` times, on consecutive batches of ``prompts`` prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trellis.data import load_rows
    from trellis_algos import PromptDataset, gsm8k_score

    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    dataset = PromptDataset(load_rows(data), tokenizer, 64)
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id
    out: dict = {"steps": [], "stages": {"gen": [], "reward": [], "update_actor": []}, "tokens": [], "rss": []}
    for step in range(steps):
        batch = dataset.collate(range(step * prompts, (step + 1) * prompts)).repeat_interleave(n)
        start = time.perf_counter()
        with torch.no_grad():
            model.eval()
            seqs = model.generate(
                batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device), do_sample=True, temperature=1.0,
                top_k=0, top_p=1.0, max_new_tokens=length, eos_token_id=eos, pad_token_id=pad,
            )  # fmt: skip
        width = batch["input_ids"].shape[1]
        responses = seqs[:, width:]
        done = (responses == eos).int().cumsum(-1)
        mask = ((done == 0) | ((done == 1) & (responses == eos))).float()  # through the first EOS
        t_gen = time.perf_counter()
        texts = tokenizer.batch_decode(responses * mask.long() + pad * (1 - mask.long()), skip_special_tokens=True)
        rewards = torch.tensor([gsm8k_score("openai/gsm8k", t, g) for t, g in zip(texts, batch["ground_truth"])])
        groups = rewards.view(prompts, n)
        adv = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).view(-1, 1).to(device)
        t_reward = time.perf_counter()
        model.train()
        attention = torch.cat([batch["attention_mask"].to(device), mask.long()], dim=1)
        logits = model(
            input_ids=seqs, attention_mask=attention, position_ids=(attention.cumsum(-1) - 1).clamp(min=0), logits_to_keep=length + 1
        ).logits[:, :-1]  # fmt: skip
        logits = logits[:, -responses.shape[1] :]
        log_probs = torch.log_softmax(logits.float(), -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(log_probs - log_probs.detach())
        loss = -(torch.minimum(ratio * adv, ratio.clamp(1 - EPS_CLIP, 1 + EPS_CLIP) * adv) * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end = time.perf_counter()
        for k, v in (("gen", t_gen - start), ("reward", t_reward - t_gen), ("update_actor", end - t_reward)):
            out["stages"][k].append(v)
        out["steps"].append(end - start)
        out["tokens"].append(float(mask.sum(1).mean()))
        out["rss"].append(rss_mb())
    return out


def child(framework: str, size: str, length: int, steps: int, work: Path, threads: int, tag: str, overrides: tuple[str, ...]) -> None:
    prompts, n = WORK[size]
    model, data = work / size, work / "train.parquet"
    if framework == "trellis":
        result = trellis_steps(model, data, prompts, n, length, steps, work / "runs" / f"{size}-{length}-{tag}", threads, extra=overrides)
    else:
        result = floor_steps(model, data, prompts, n, length, steps, threads)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT-JSON " + json.dumps(result))


def run_child(framework: str, size: str, length: int, steps: int, work: Path, threads: int, tag: str, overrides: tuple[str, ...] = ()) -> dict:
    cmd = [sys.executable, __file__, "--child", framework, size, str(length), str(steps), str(work), str(threads), tag, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{framework} {size} {length} failed:\n{proc.stderr[-3000:]}")
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT-JSON "))[12:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,10M,50M")
    parser.add_argument("--lengths", default="8,64,256")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="steps per round (per process)")
    parser.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of each round")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: every usable core)")
    parser.add_argument("--growth-steps", type=int, default=500, help="Trellis steps on the tiny model for the RSS-growth check (0: skip)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="a Trellis config override (repeatable)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        framework, size, length, steps, work, threads, tag, *overrides = args.child
        child(framework, size, int(length), int(steps), Path(work), int(threads), tag, tuple(overrides))
        return

    from trellis_demo.tasks import make_arithmetic_split, task_texts, write_rows
    from trellis_demo.tiny import make_tiny_model

    sizes, lengths = args.sizes.split(","), [int(x) for x in args.lengths.split(",")]
    work = Path(tempfile.mkdtemp(prefix="trellis-rlstep-"))
    for size in sizes:
        make_tiny_model(work / size, task_texts(), seed=0, **SIZES[size])
    rounds_needed = max(WORK[s][0] for s in sizes) * (args.steps + 1)
    write_rows(make_arithmetic_split(max(512, rounds_needed), 0), work / "train.parquet")

    cells: dict[tuple[str, int, str], list[dict]] = {}
    for r in range(args.rounds):
        for size in sizes:
            for length in lengths:
                for framework in ("floor", "trellis") if r % 2 == 0 else ("trellis", "floor"):
                    result = run_child(framework, size, length, args.steps, work, args.threads, f"r{r}", tuple(args.override))
                    cells.setdefault((size, length, framework), []).append(result)
                    print(f"round {r + 1}/{args.rounds} {size} {length} {framework} done", file=sys.stderr, flush=True)

    def median(results: list[dict], key: str, stage: str | None = None) -> float:
        values = [v for res in results for v in (res["stages"].get(stage, []) if stage else res[key])[args.warmup :]]
        return statistics.median(values) if values else 0.0

    def round_spread(floor: list[dict], trellis: list[dict]) -> str:
        """The lowest and highest ratio of one round's two processes: how far one run can stray."""
        ratios = [median([t], "steps") / median([f], "steps") for f, t in zip(floor, trellis)]
        return f"{min(ratios):.2f}-{max(ratios):.2f}"

    print(f"\nGRPO step, one update per batch, {args.rounds} interleaved rounds x {args.steps} steps ({args.warmup} warm-up dropped), median (ms)")
    if args.override:
        print("Trellis overrides: " + " ".join(args.override))
    head = ("size", "tokens", "prompts x n", "floor", "trellis", "ratio", "by round", "floor gen", "trellis gen", "tr. old_lp",
            "tr. update", "floor upd", "tr. sync", "tr. resp len", "RSS fl MB", "RSS tr MB")  # fmt: skip
    print("".join(f"{h:>13}" for h in head))
    result = []
    for size in sizes:
        for length in lengths:
            fl, tr = cells[size, length, "floor"], cells[size, length, "trellis"]
            f_step, t_step = median(fl, "steps") * 1e3, median(tr, "steps") * 1e3
            row = [size, length, "x".join(map(str, WORK[size])), f"{f_step:.1f}", f"{t_step:.1f}", f"{t_step / f_step:.2f}x",
                   round_spread(fl, tr), f"{median(fl, '', 'gen') * 1e3:.1f}", f"{median(tr, '', 'gen') * 1e3:.1f}",
                   f"{median(tr, '', 'old_log_prob') * 1e3:.1f}",
                   f"{median(tr, '', 'update_actor') * 1e3:.1f}", f"{median(fl, '', 'update_actor') * 1e3:.1f}",
                   f"{median(tr, '', 'weight_sync') * 1e3:.1f}", f"{median(tr, 'tokens'):.1f}",
                   f"{max(x['peak_rss_mb'] for x in fl):.0f}", f"{max(x['peak_rss_mb'] for x in tr):.0f}"]  # fmt: skip
            print("".join(f"{c:>13}" for c in row))
            result.append(f"ratio_{size}_{length}={t_step / f_step:.3f}")
    print("ratio = trellis / floor; 'by round': the lowest and highest ratio of one round's pair of processes (the spread one run can show);")
    print("'tr. resp len' is Trellis's mean response length (the floor samples the same model).")
    if args.growth_steps:
        growth = run_child("trellis", "tiny", 8, args.growth_steps, work, args.threads, "growth", tuple(args.override))
        rss = growth["rss"]
        early, late = statistics.mean(rss[40:60]), statistics.mean(rss[-20:])
        print(f"RSS over {args.growth_steps} Trellis steps (tiny, 8 tokens): steps 41-60 {early:.1f} MB, "
              f"last 20 {late:.1f} MB ({late - early:+.1f} MB)")  # fmt: skip
        result.append(f"rss_growth_mb={late - early:.1f}")
    print("RESULT " + " ".join(result))


if __name__ == "__main__":
    main()
