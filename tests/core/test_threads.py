"""``trainer.threads``: parsing, the CPU accounting ``auto`` and ``follow`` rest on (real processes,
real /proc), how ``follow`` follows what other processes use and how ``auto`` keeps its first count."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from trellis.config import ConfigError
from trellis.runtime import threads as threads_mod
from trellis.runtime.harness import make_threads
from trellis.runtime.threads import CpuSample, Threads, others_busy, parse_threads

pytestmark = pytest.mark.skipif(not os.path.isfile("/proc/stat"), reason="auto threads read /proc (Linux)")

SPIN = "import time\nend = time.time() + {s}\nwhile time.time() < end: pass"


def test_parse_threads_and_the_error_that_names_the_key() -> None:
    assert parse_threads("auto") == "auto" and parse_threads("AUTO") == "auto" and parse_threads("follow") == "follow"
    assert parse_threads(0) == 0 and parse_threads("3") == 3
    with pytest.raises(ValueError, match=r"'trainer.threads' is 'many'; set trainer.threads to auto"):
        parse_threads("many")


def test_a_bad_setting_is_a_config_error_before_the_run() -> None:
    from omegaconf import OmegaConf

    from trellis.plugins import load_plugins

    with pytest.raises(ConfigError, match="trainer.threads"):
        make_threads(load_plugins(entry_points=False).registry, OmegaConf.create({"threads": "-1", "controller": "local"}))


def test_a_child_process_counts_as_ours_not_as_a_neighbour() -> None:
    """An engine's scheduler subprocess is this run's work: its CPU time is in our tree's ticks."""
    before = threads_mod._tree_ticks(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", SPIN.format(s=1.0)])
    time.sleep(0.5)
    with open(f"/proc/{child.pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    child_ticks = int(rest[11]) + int(rest[12])
    during = threads_mod._tree_ticks(os.getpid())
    child.wait()
    assert child_ticks > 0
    assert during - before >= child_ticks


def test_a_detached_spinning_process_is_seen_as_a_busy_neighbour() -> None:
    """A process outside our tree (reparented away from us) spinning for a second shows up as
    (at least) half a busy core, whatever else the machine runs."""
    launcher = subprocess.run(
        ["sh", "-c", f"{sys.executable} -c '{SPIN.format(s=1.5)}' >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True
    )
    pid = int(launcher.stdout)
    assert pid not in _descendants(os.getpid())
    time.sleep(0.2)
    before = CpuSample.now()
    time.sleep(1.0)
    after = CpuSample.now()
    time.sleep(0.5)  # let it finish
    assert others_busy(before, after) >= 0.5


def test_follow_follows_the_cores_others_leave_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """With /proc readings made up (4 cores, a neighbour using 0, then 2.6, then 0 cores), ``follow``
    starts on all 4 cores, drops to 1 (4 - 2.6 rounds to 1) and comes back to 4."""
    ticks = threads_mod.TICKS
    readings = iter([
        CpuSample(0.0, 0, 0), CpuSample(1.0, 3 * ticks, 3 * ticks),  # start: we use 3 cores, nobody else
        CpuSample(2.0, 6 * ticks + int(2.6 * ticks), 6 * ticks),  # a neighbour takes 2.6 cores
    ])  # fmt: skip
    clock = [1.0]  # the time check() sees, matching the readings' walls
    monkeypatch.setattr(threads_mod.CpuSample, "now", classmethod(lambda cls: next(readings)))
    monkeypatch.setattr(threads_mod, "time", SimpleNamespace(monotonic=lambda: clock[0], sleep=lambda s: None))
    monkeypatch.setattr(threads_mod, "usable_cores", lambda ranks_here=1: 4)
    old = torch.get_num_threads()
    try:
        governor = Threads("follow")
        assert governor.start() == 4 and torch.get_num_threads() == 4
        clock[0] = 2.0
        assert governor.check() == 1 and torch.get_num_threads() == 1
        assert governor.others == pytest.approx(2.6, abs=0.02)
        clock[0] = 2.5
        monkeypatch.setattr(threads_mod.CpuSample, "now", classmethod(lambda cls: pytest.fail("read /proc within CHECK_EVERY_S")))
        assert governor.check() == 1  # within CHECK_EVERY_S of the last reading: unchanged, /proc not read
        clock[0] = 3.0
        monkeypatch.setattr(threads_mod.CpuSample, "now", classmethod(lambda cls: CpuSample(3.0, 9 * ticks + int(2.6 * ticks), 9 * ticks)))
        assert governor.check() == 4
    finally:
        torch.set_num_threads(old)


def test_auto_keeps_the_count_it_chose_at_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` measures once (nobody else busy on 4 cores: 4 threads); a neighbour taking 2.6 cores
    later changes nothing, and /proc is not read again."""
    ticks = threads_mod.TICKS
    readings = iter([CpuSample(0.0, 0, 0), CpuSample(1.0, 3 * ticks, 3 * ticks)])
    monkeypatch.setattr(threads_mod.CpuSample, "now", classmethod(lambda cls: next(readings)))
    monkeypatch.setattr(threads_mod, "time", SimpleNamespace(monotonic=lambda: 100.0, sleep=lambda s: None))
    monkeypatch.setattr(threads_mod, "usable_cores", lambda ranks_here=1: 4)
    old = torch.get_num_threads()
    try:
        governor = Threads("auto")
        assert governor.start() == 4 and governor.auto and not governor.follow
        assert governor.check() == 4 and torch.get_num_threads() == 4  # the readings are used up: no /proc read
    finally:
        torch.set_num_threads(old)


def test_a_fixed_count_is_pinned_and_never_changed() -> None:
    old = torch.get_num_threads()
    try:
        governor = Threads("1")
        assert governor.start() == 1 and governor.check() == 1 and not governor.auto
    finally:
        torch.set_num_threads(old)


def _descendants(root: int) -> set[int]:
    out = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == root:
                        out |= {int(pid)} | _descendants(int(pid))
            except OSError:
                pass
    return out
