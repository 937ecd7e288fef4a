"""Sandbox server throughput and the reward stage it serves, on loopback.

1. 1000 requests of a trivial Python program at concurrency 32: lost requests, p50/p99 latency, runs/s.
2. A reward stage of 256 code samples (one stdin/stdout case each; a third right, a third wrong, a
   third crashing) scored by the reward manager with ``reward.max_concurrency`` 1 (serial) and 32.

    python bench/sandbox.py [--workers N] [--requests 1000] [--samples 256]

Needs trellis-sandbox (and bubblewrap or unshare). For scale: the upstream Sandbox Fusion server,
default install, on a 2-core machine: p50 398 ms, p99 432 ms.

Measured here (bwrap, 2 workers, root so one uid per slot; a 2-core VM shared with other jobs, load
average 4-5, before and after run back to back, twice), the same isolation both times:

    before (asyncio.Queue slots, fork of the server per run)  p50 864 / 625 ms, p99 1274 / 1187 ms, 41 / 52 runs/s
    after  (FIFO slot handoff, vfork + setpriv)               p50 416 / 567 ms, p99  591 /  657 ms, 70 / 56 runs/s

p99 is now about 1.1-1.4x p50 (was 1.5-2x): at concurrency 32 a request waits for the ~31 ahead of
it, so p50 is 32 / (runs/s) and only throughput lowers it. Whole-tree CPU per run (a cpuacct cgroup, back
to back): 20.6 / 22.5 ms before, 19.2 / 20.9 ms after, of which the program's own python3 start ~9 ms, bwrap ~3.7 ms, setpriv + prlimit execs ~2.5 ms
(each exec pays glibc's cpuid probing, slow in a VM), the server ~4 ms, this client ~0.8 ms; so an idle
2-core machine should top out near 100 runs/s (p50 ~320 ms; an estimate, not measured), and on a
shared one the p99 follows the others' load.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time

import torch

from trellis.batch import Batch
from trellis.examples.tasks import task_texts
from trellis.examples.tiny import make_tiny_tokenizer
from trellis.plugins import load_plugins
from trellis.rewards import RewardConfig, RewardManager
from trellis_sandbox.api import RunRequest
from trellis_sandbox.client import SandboxClient

PROGRAMS = [
    "```python\na, b = map(int, input().split())\nprint(a + b)\n```",
    "```python\na, b = map(int, input().split())\nprint(a - b)\n```",
    "```python\nraise RuntimeError('no')\n```",
]


def start(workers: int) -> tuple[str, subprocess.Popen]:
    cmd = [sys.executable, "-m", "trellis_sandbox.cli", "serve", "--port", "0", "--workers", str(workers)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    line = proc.stdout.readline()
    if "serving " not in line:
        raise SystemExit(f"the server did not start: {line!r}")
    print(line.strip())
    return line.split("serving ", 1)[1].split(" ", 1)[0], proc


async def load(client: SandboxClient, n: int, concurrency: int) -> tuple[list[float], int, float]:
    """Latencies (s) of the requests that succeeded, the number lost, the wall time."""
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one(i: int) -> bool:
        async with gate:
            t = time.perf_counter()
            resp = await client.run(RunRequest(f"print({i})", "python"))
            ok = resp.status == "Success" and resp.run_result.stdout == f"{i}\n"
            if ok:
                latencies.append(time.perf_counter() - t)
            return ok

    start_t = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(n)))
    return latencies, results.count(False), time.perf_counter() - start_t


def reward_batch(tok, n: int) -> Batch:
    texts = [PROGRAMS[i % 3] for i in range(n)]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, ids))
    responses = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.long)
    for i, x in enumerate(ids):
        responses[i, : len(x)], mask[i, : len(x)] = torch.tensor(x), 1
    truths = [f'{{"inputs": ["{i} 3\\n"], "outputs": ["{i + 3}\\n"]}}' for i in range(n)]
    return Batch({"responses": responses, "response_mask": mask}, {"data_source": ["code"] * n, "ground_truth": truths})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--samples", type=int, default=256)
    args = p.parse_args()
    url, proc = start(args.workers)
    try:
        client = SandboxClient(url, max_concurrency=args.concurrency)
        asyncio.run(load(client, 20, args.concurrency))  # warm-up
        latencies, lost, wall = asyncio.run(load(client, args.requests, args.concurrency))
        latencies.sort()
        p50, p99 = latencies[len(latencies) // 2] * 1e3, latencies[int(len(latencies) * 0.99) - 1] * 1e3
        rate = args.requests / wall
        print(f"\n{args.requests} requests of print(i), concurrency {args.concurrency}, {args.workers} workers")
        print(f"{'lost':>6} {'p50 ms':>8} {'p99 ms':>8} {'runs/s':>8}")
        print(f"{lost:>6} {p50:>8.1f} {p99:>8.1f} {rate:>8.1f}")
        client.close()

        tok = make_tiny_tokenizer(task_texts(200, seed=0))
        registry = load_plugins().registry
        batch = reward_batch(tok, args.samples)
        times, means = {}, {}
        for label, limit in (("serial", 1), ("concurrent", args.concurrency)):
            manager = RewardManager(RewardConfig(name="sandbox_fusion", kwargs={"url": url}, max_concurrency=limit), registry, tok)
            t = time.perf_counter()
            result = manager.score(batch)
            times[label], means[label] = time.perf_counter() - t, result.metrics["reward/mean"]
        ratio = times["serial"] / times["concurrent"]
        print(f"\nreward stage, {args.samples} samples x 1 case (a third pass), reward.max_concurrency 1 vs {args.concurrency}")
        print(f"{'mode':<12} {'seconds':>8} {'reward/mean':>12}")
        for label in times:
            print(f"{label:<12} {times[label]:>8.2f} {means[label]:>12.3f}")
        print(f"concurrent / serial time: {1 / ratio:.2f} (serial is {ratio:.2f}x slower)")
        print(
            f"RESULT requests={args.requests} lost={lost} p50_ms={p50:.1f} p99_ms={p99:.1f} runs_per_s={rate:.1f} "
            f"reward_serial_s={times['serial']:.2f} reward_concurrent_s={times['concurrent']:.2f} reward_speedup={ratio:.2f}"
        )
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()


if __name__ == "__main__":
    main()
