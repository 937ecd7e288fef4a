"""Sandbox server throughput and the reward stage it serves, on loopback.

1. 1000 requests of a trivial Python program at concurrency 32: lost requests, p50/p99 latency, runs/s;
   then the same runs on the server's own ``Runner`` in this process (its slots, no HTTP, no client):
   the runs/s the runs themselves allow on this machine, and the server's runs/s as a ratio of it.
2. A reward stage of 256 code samples (one stdin/stdout case each; a third right, a third wrong, a
   third crashing) scored by the reward manager with ``reward.max_concurrency`` 1 (serial) and 32.

    python bench/sandbox.py [--workers N] [--requests 1000] [--samples 256]   # --samples 0 skips 2.
        [--program print|stdin] [--hostile ROUNDS] [--isolation auto|bwrap|unshare] [--url URL]

``--url`` loads a server that is already running (say upstream Sandbox Fusion on the same machine)
instead of starting trellis-sandbox; its CPU per run is then not known (nan), and the Runner line is
left out.

Load patterns (each figure says its own): ``print``, the one-line ``print(i)``; ``stdin``, a short
solution reading its case from stdin (the shape of a code-reward run); ``--hostile N`` first runs N
rounds of the hostile programs of tests/sandbox/test_hostile.py at once (fork bomb, memory bomb,
infinite loop, busy child, daemon, output flood), so the load meets a server that has cleaned up
after them. The issue's pattern is ``--samples 0 --program stdin --hostile 1``. The table adds
``machine busy %`` over the load (all processes, from /proc/stat): under 100 means the CPUs waited
on the server, and more slots or less waiting raise runs/s; at ~97% only less CPU per run does. A
line under the table splits a run's CPU: the server's own thread, its runs (every process it
started and reaped), this bench's client, and the whole machine's busy time per run. At concurrency
32 a request waits for the ~31 ahead of it, so p50 is about 32 / (runs/s): the Runner line says what
that wait is with the HTTP server and client taken away.

Figures (this 2-core VM, bwrap, as root, quiet) are in docs/speed.md#sandbox with their conditions,
beside upstream Sandbox Fusion run on the same VM (``--url``).

Needs trellis-sandbox (and bubblewrap or unshare).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from trellis.batch import Batch
from trellis.plugins import load_plugins
from trellis.runtime.threads import TICKS, machine_busy_ticks
from trellis_algos import RewardConfig, RewardManager
from trellis_demo.tasks import task_texts
from trellis_demo.tiny import make_tiny_tokenizer
from trellis_sandbox.api import RunRequest
from trellis_sandbox.cli import default_workers, runs_root, watch_children_by_pidfd
from trellis_sandbox.client import SandboxClient
from trellis_sandbox.isolation import detect
from trellis_sandbox.languages import available_languages, default_python
from trellis_sandbox.runner import Runner, RunnerConfig

# what the server meets before the load with --hostile: the kinds tests/sandbox/test_hostile.py runs
HOSTILE = [
    ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", 2.0),  # fork bomb
    ("x = bytearray(2 * 2**30)\nprint('allocated')", 10.0),  # memory bomb
    ("while True:\n    pass", 1.0),  # infinite loop
    ("import subprocess\nsubprocess.Popen(['python3', '-c', 'while True: pass'])\nprint('parent done')", 10.0),  # busy child left behind
    (  # daemon
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        os.closerange(0, 3)\n        time.sleep(60)\n    os._exit(0)\n",
        10.0,
    ),
    ("import sys\nwhile True:\n    sys.stdout.write('x' * 4096)", 20.0),  # output flood
]
# the load's program per --program: a one-line print, or a short solution that reads its case from stdin
LOAD = {
    "print": lambda i: RunRequest(f"print({i})", "python"),
    "stdin": lambda i: RunRequest("n = int(input())\nprint(sum(k * k for k in range(n)) % 1000)", "python", stdin=f"{i}\n"),
}
EXPECTED = {"print": lambda i: f"{i}\n", "stdin": lambda i: f"{sum(k * k for k in range(i)) % 1000}\n"}

PROGRAMS = [
    "```python\na, b = map(int, input().split())\nprint(a + b)\n```",
    "```python\na, b = map(int, input().split())\nprint(a - b)\n```",
    "```python\nraise RuntimeError('no')\n```",
]


@contextlib.contextmanager
def trellis_server(workers: int, isolation: str = "auto") -> Iterator[tuple[str, int]]:
    """A trellis-sandbox server on a free port: (its URL, its pid); stopped on the way out."""
    cmd = [sys.executable, "-m", "trellis_sandbox.cli", "serve", "--port", "0", "--workers", str(workers), "--isolation", isolation]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        if "serving " not in line:
            raise SystemExit(f"the server did not start: {line!r}")
        print(line.strip())
        yield line.split("serving ", 1)[1].split(" ", 1)[0], proc.pid
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()


async def hostile(client: SandboxClient, rounds: int) -> None:
    """Every hostile program ``rounds`` times, all at once."""
    await asyncio.gather(*(client.run(RunRequest(code, "python", run_timeout=t)) for _ in range(rounds) for code, t in HOSTILE))


async def load(client: SandboxClient, n: int, concurrency: int, program: str = "print") -> tuple[list[float], int, float]:
    """Latencies (s) of the requests that succeeded, the number lost, the wall time."""
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one(i: int) -> bool:
        async with gate:
            t = time.perf_counter()
            resp = await client.run(LOAD[program](i))
            ok = resp.status == "Success" and resp.run_result.stdout == EXPECTED[program](i)
            if ok:
                latencies.append(time.perf_counter() - t)
            return ok

    start_t = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(n)))
    return latencies, results.count(False), time.perf_counter() - start_t


async def runner_alone(n: int, workers: int, isolation: str, program: str) -> tuple[int, float]:
    """The same runs on the server's own ``Runner`` in this process, ``workers`` slots each taking the next
    request as soon as it is free: no HTTP, no client. The number lost and the wall time."""
    watch_children_by_pidfd()
    root = runs_root()  # as the server's
    try:
        config = RunnerConfig()
        as_root = os.geteuid() == 0
        runner = Runner(detect(isolation, config.uid_base if as_root else None, root), available_languages(default_python()), root, config)
        todo = iter(range(n))
        lost = 0

        async def slot(k: int) -> None:
            nonlocal lost
            while (i := next(todo, None)) is not None:
                resp = await runner.execute(LOAD[program](i), k)
                lost += not (resp.status == "Success" and resp.run_result.stdout == EXPECTED[program](i))

        start_t = time.perf_counter()
        await asyncio.gather(*(slot(k) for k in range(workers)))
        return lost, time.perf_counter() - start_t
    finally:
        shutil.rmtree(root, ignore_errors=True)


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


def reward_stage(url: str, samples: int, concurrency: int) -> str:
    """Scores the reward batch serially and at ``concurrency``; prints the table, returns the RESULT fields."""
    tok = make_tiny_tokenizer(task_texts(200, seed=0))
    registry = load_plugins().registry
    batch = reward_batch(tok, samples)
    times, means = {}, {}
    for label, limit in (("serial", 1), ("concurrent", concurrency)):
        manager = RewardManager(RewardConfig(name="sandbox_fusion", kwargs={"url": url}, max_concurrency=limit), registry, tok)
        t = time.perf_counter()
        result = manager.score(batch)
        times[label], means[label] = time.perf_counter() - t, result.metrics["reward/mean"]
    ratio = times["serial"] / times["concurrent"]
    print(f"\nreward stage, {samples} samples x 1 case (a third pass), reward.max_concurrency 1 vs {concurrency}")
    print(f"{'mode':<12} {'seconds':>8} {'reward/mean':>12}")
    for label in times:
        print(f"{label:<12} {times[label]:>8.2f} {means[label]:>12.3f}")
    print(f"concurrent / serial time: {1 / ratio:.2f} (serial is {ratio:.2f}x slower)")
    return f" reward_serial_s={times['serial']:.2f} reward_concurrent_s={times['concurrent']:.2f} reward_speedup={ratio:.2f}"


def server_cpu_s(pid: int | None) -> tuple[float, float]:
    """CPU seconds of the server process ``pid`` itself and of the children it has reaped (as root, every
    process of every run: launchers, bwrap, the programs); nan for a server this bench did not start."""
    if pid is None:
        return math.nan, math.nan
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS, (int(fields[13]) + int(fields[14])) / TICKS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=default_workers(), help="the server's slots (default: the server's own, CPUs + 1)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--program", choices=tuple(LOAD), default="print", help="the load's program (see LOAD)")
    p.add_argument("--hostile", type=int, default=0, help="rounds of the hostile programs before the load (0: none)")
    p.add_argument("--isolation", choices=("auto", "bwrap", "unshare"), default="auto")
    p.add_argument("--url", help="load a server already running at URL (say upstream Sandbox Fusion) instead of starting one")
    args = p.parse_args()
    if args.url and args.hostile:
        p.error("--hostile with --url: the hostile programs (a fork bomb among them) would run on a server this bench did not start")
    with contextlib.ExitStack() as stack:
        url, pid = (args.url, None) if args.url else stack.enter_context(trellis_server(args.workers, args.isolation))
        client = SandboxClient(url, max_concurrency=args.concurrency)
        stack.callback(client.close)
        if args.hostile:
            t = time.perf_counter()
            asyncio.run(hostile(client, args.hostile))
            print(f"{args.hostile} round(s) of {len(HOSTILE)} hostile programs: {time.perf_counter() - t:.1f} s")
        asyncio.run(load(client, 20, args.concurrency, args.program))  # warm-up
        cpu0, client0, busy0 = server_cpu_s(pid), time.process_time(), machine_busy_ticks()
        latencies, lost, wall = asyncio.run(load(client, args.requests, args.concurrency, args.program))
        per_run = 1e3 / args.requests
        server_ms, runs_ms = ((after - before) * per_run for after, before in zip(server_cpu_s(pid), cpu0))
        client_ms = (time.process_time() - client0) * per_run  # this process: the client's thread and the load's loop
        machine_s = (machine_busy_ticks() - busy0) / TICKS
        machine_ms, busy = machine_s * per_run, 100 * machine_s / wall / (os.cpu_count() or 1)
        cpu_ms = server_ms + runs_ms
        latencies.sort()
        p50, p99 = (latencies[len(latencies) // 2] * 1e3, latencies[int(len(latencies) * 0.99) - 1] * 1e3) if latencies else (math.nan, math.nan)
        rate = args.requests / wall
        after = f", after {args.hostile} round(s) of hostile programs" if args.hostile else ""
        server = args.url or f"trellis-sandbox, {args.workers} workers"
        print(f"\n{args.requests} requests of the {args.program} program, concurrency {args.concurrency}, {server}{after}")
        print(f"{'lost':>6} {'p50 ms':>8} {'p99 ms':>8} {'runs/s':>8} {'server+runs CPU ms/run':>23} {'machine busy %':>15}")
        print(f"{lost:>6} {p50:>8.1f} {p99:>8.1f} {rate:>8.1f} {cpu_ms:>23.1f} {busy:>15.0f}")
        print(
            f"CPU ms a run: server's own thread {server_ms:.1f}, its runs (launchers, bwrap, program) {runs_ms:.1f}, "
            f"this bench's client {client_ms:.1f}, the whole machine {machine_ms:.1f}"
        )
        setup = f"url={args.url}" if args.url else f"isolation={args.isolation} workers={args.workers}"
        result = (
            f"RESULT program={args.program} hostile={args.hostile} {setup} requests={args.requests} "
            f"lost={lost} p50_ms={p50:.1f} p99_ms={p99:.1f} runs_per_s={rate:.1f} cpu_ms_per_run={cpu_ms:.1f} busy_pct={busy:.0f} "
            f"server_ms_per_run={server_ms:.1f} runs_ms_per_run={runs_ms:.1f} client_ms_per_run={client_ms:.1f} machine_ms_per_run={machine_ms:.1f}"
        )
        if not args.url:
            busy0 = machine_busy_ticks()
            runner_lost, runner_wall = asyncio.run(runner_alone(args.requests, args.workers, args.isolation, args.program))
            runner_rate, runner_ms = args.requests / runner_wall, (machine_busy_ticks() - busy0) / TICKS * per_run
            print(
                f"the same {args.requests} runs on the server's Runner in this process ({args.workers} slots, no HTTP): "
                f"{runner_rate:.1f} runs/s ({runner_lost} lost), the whole machine {runner_ms:.1f} ms a run;\n  at concurrency "
                f"{args.concurrency} a request would wait {args.concurrency / runner_rate * 1e3:.0f} ms on average ({args.concurrency} / runs/s); "
                f"the server over HTTP ran {rate / runner_rate:.2f}x its runs/s"
            )
            result += f" runner_runs_per_s={runner_rate:.1f} runner_machine_ms_per_run={runner_ms:.1f} server_vs_runner={rate / runner_rate:.2f}"
        if args.samples:
            result += reward_stage(url, args.samples, args.concurrency)
        print(result)


if __name__ == "__main__":
    main()
