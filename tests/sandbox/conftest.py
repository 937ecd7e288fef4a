"""Fixtures: a running sandbox server per isolation kind, and the check that a test left nothing behind."""

from __future__ import annotations

import os
import time

import pytest
from sandbox_server import foreign_pid_ns_processes, isolations, processes_of, start_server, stop


@pytest.fixture(scope="module", params=isolations())
def server(request, tmp_path_factory):
    """A running server per isolation kind (module scope); stopped and reaped afterwards."""
    srv = start_server(tmp_path_factory.mktemp("home"), "--isolation", request.param, "--workers", "2", "--output-cap-kb", "64")
    yield srv
    stop(srv.proc)


@pytest.fixture
def left_nothing(server):
    """After the test: the server still runs programs, no sandboxed process is alive (none in another PID
    namespace that was not there before, none with the workers' uids) and the work root is empty."""
    before = foreign_pid_ns_processes()
    yield
    assert server.proc.poll() is None, "the server died"
    assert server.run("print(6 * 7)")["run_result"]["stdout"] == "42\n"
    stats = server.stats()
    deadline = time.monotonic() + 5  # a killed namespace's processes may take a moment to go
    while (foreign_pid_ns_processes() - before or processes_of(stats["uids"])) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not foreign_pid_ns_processes() - before
    assert not processes_of(stats["uids"])
    assert os.listdir(stats["work_root"]) == []
