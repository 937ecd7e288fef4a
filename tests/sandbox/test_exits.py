"""The clean-up's wait for a run's last processes: it ends at their exit, or at the deadline for one
that does not exit, with pidfds and (on kernels without them) by polling."""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import time

import pytest

from trellis_sandbox import runner


def no_pidfds(pid: int) -> int:
    """pidfd_open as a kernel before 5.3 answers it."""
    raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))


@pytest.fixture(params=["pidfd", "polling"])
def wait_kind(request, monkeypatch):
    runner.pidfds_work.cache_clear()
    if request.param == "polling":
        monkeypatch.setattr(os, "pidfd_open", no_pidfds)
    yield request.param
    runner.pidfds_work.cache_clear()


def timed_exits(pids: list[int], grace: float) -> float:
    start = time.monotonic()
    asyncio.run(runner._exits(pids, start + grace))
    return time.monotonic() - start


def test_the_wait_ends_when_the_last_process_exits(wait_kind):
    procs = [subprocess.Popen(["sleep", s]) for s in ("0.1", "0.3")]
    try:
        took = timed_exits([p.pid for p in procs], grace=5.0)
        assert 0.3 <= took < 1.5, took  # the slower one's exit, far from the deadline
        assert runner.pidfds_work() == (wait_kind == "pidfd")
    finally:
        for p in procs:
            p.wait()


def test_the_wait_gives_up_at_the_deadline_and_skips_the_gone(wait_kind):
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process now
    stuck = subprocess.Popen(["sleep", "30"])
    try:
        took = timed_exits([gone.pid, stuck.pid], grace=0.3)
        assert 0.3 <= took < 1.5, took
        assert stuck.poll() is None
    finally:
        stuck.kill()
        stuck.wait()
