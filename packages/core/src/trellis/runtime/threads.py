"""Torch threads for this process: a fixed count, ``auto`` or ``follow``: the cores other processes leave free.

Oversubscribed cores make a step 10-30x slower (OpenMP threads wait on each other while a
neighbour holds their core). ``auto`` and ``follow`` measure, from ``/proc``, how many cores
processes outside this one's tree kept busy (the whole machine's busy time minus this process's
and its children's) and use the rest. ``auto`` decides once, when the run starts, and keeps that
count: the thread count can change torch's arithmetic (a reduction or a matrix product split
over 3 threads rounds differently than over 1), so a run's figures must not depend on when a
neighbour came. A resumed run takes the count its checkpoint recorded. ``follow`` re-checks after
every step, at most once a second, and follows a neighbour that starts or stops mid-run: faster
on a busy machine, but the figures may then depend on the load. Linux only: elsewhere both keep
every usable core.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("trellis")

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PROC = Path("/proc")
CHECK_EVERY_S = 1.0


MODES = ("auto", "follow")


def parse_threads(value: object) -> int | str:
    """``trainer.threads`` as a count (0: every usable core), ``"auto"`` or ``"follow"``."""
    text = str(value).strip().lower()
    if text in MODES:
        return text
    if text.isdigit():
        return int(text)
    raise ValueError(
        f"config key 'trainer.threads' is {value!r}; set trainer.threads to auto (the cores other processes "
        "leave free when the run starts, kept for the run), follow (re-checked every step; figures may then "
        "depend on the load), 0 (every usable core) or a number of threads"
    )


def usable_cores(ranks_here: int = 1) -> int:
    """The cores this process may run on, shared by the ``ranks_here`` ranks of this machine."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, ranks_here))


@dataclass(frozen=True)
class CpuSample:
    """Busy CPU time of the whole machine and of this process tree, in clock ticks, at ``wall``."""

    wall: float
    machine: int
    ours: int

    @classmethod
    def now(cls) -> CpuSample:
        return cls(time.monotonic(), machine_busy_ticks(), _tree_ticks(os.getpid()))


def others_busy(before: CpuSample, after: CpuSample) -> float:
    """Cores kept busy by processes outside this tree between two samples (0 when no time passed)."""
    seconds = after.wall - before.wall
    if seconds <= 0:
        return 0.0
    return max(0.0, ((after.machine - before.machine) - (after.ours - before.ours)) / TICKS / seconds)


def machine_busy_ticks() -> int:
    # /proc/stat's first line: cpu user nice system idle iowait irq softirq steal ...
    fields = [int(x) for x in (PROC / "stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields[:8]) - fields[3] - fields[4]


def _tree_ticks(root: int) -> int:
    """utime + stime of ``root`` and every live descendant (an engine's scheduler process, say)."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # after the ")" closing the command name: state ppid ... utime(12th) stime(13th)
            rest = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we looked
        pid = int(entry.name)
        children.setdefault(int(rest[1]), []).append(pid)
        ticks[pid] = int(rest[11]) + int(rest[12])
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo.extend(children.get(pid, ()))
    return total


class Threads:
    """Sets torch's thread count from ``trainer.threads``: under ``auto`` the cores other processes
    leave free when the run starts, under ``follow`` the cores they leave free now. ``start()`` once
    before work, ``check()`` after each step."""

    def __init__(self, setting: object, ranks_here: int = 1, probe_s: float = 0.25) -> None:
        parsed = parse_threads(setting)
        self.fixed = parsed if isinstance(parsed, int) else None
        self.cores = usable_cores(ranks_here)
        self.probe_s = probe_s
        self.others = 0.0
        self._last: CpuSample | None = None
        self.auto = self.fixed is None and (PROC / "stat").is_file()
        self.follow = self.auto and parsed == "follow"

    def start(self) -> int:
        """Pin the thread count; under ``auto`` after watching the machine for ``probe_s`` seconds."""
        if not self.auto:
            n = self.fixed or self.cores
            torch.set_num_threads(n)
            return n
        before = CpuSample.now()
        time.sleep(self.probe_s)
        self._last = CpuSample.now()
        self.others = others_busy(before, self._last)
        n = self._choose()
        torch.set_num_threads(n)
        mode = "follow" if self.follow else "auto, kept for the run"
        log.info("threads: %d of %d cores (%s: other processes kept %.1f busy)", n, self.cores, mode, self.others)
        return n

    def check(self) -> int:
        """Under ``follow``, re-measure the cores others used since the last check (at most once per
        ``CHECK_EVERY_S``) and follow them; returns the thread count in use."""
        current = torch.get_num_threads()
        if not self.follow or self._last is None:
            return current
        if time.monotonic() - self._last.wall < CHECK_EVERY_S:
            return current  # before reading /proc: most steps end here
        now = CpuSample.now()
        self.others, self._last = others_busy(self._last, now), now
        n = self._choose()
        if n != current:
            torch.set_num_threads(n)
            log.info("threads: %d -> %d of %d cores (follow: other processes kept %.1f busy)", current, n, self.cores, self.others)
        return n

    def _choose(self) -> int:
        # a neighbour using most of a core takes that core: the rounding leaves it alone
        return max(1, min(self.cores, round(self.cores - self.others)))
