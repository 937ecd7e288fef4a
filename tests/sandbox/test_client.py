"""The client against the real server: the API round trip, retries only on infrastructure errors, an
unreachable server reported once by URL; and the server's own start-up checks."""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from sandbox_server import start_server, stop

from trellis_sandbox import cli
from trellis_sandbox.api import RunRequest
from trellis_sandbox.client import SandboxClient, get_client, normalize_url


def test_api_round_trip_with_files_stdin_and_cpp(server):
    client = SandboxClient(server.url)
    code = "import sys\ndata = open('in.txt').read()\nopen('out.txt', 'w').write(data.upper())\nprint(sys.stdin.read().strip()[::-1])"
    resp = client.run_sync(RunRequest(code, "python", stdin="abc\n", files={"in.txt": base64.b64encode(b"hi").decode()}, fetch_files=["out.txt"]))
    assert (resp.status, resp.run_result.stdout, resp.run_result.return_code) == ("Success", "cba\n", 0)
    assert base64.b64decode(resp.files["out.txt"]) == b"HI"
    cpp = "#include <iostream>\nint main(){long a,b;std::cin>>a>>b;std::cout<<a*b<<std::endl;}"
    resp = client.run_sync(RunRequest(cpp, "cpp", stdin="6 7"))
    assert resp.compile_result.return_code == 0 and resp.run_result.stdout == "42\n"
    resp = client.run_sync(RunRequest("int main( {", "cpp"))
    assert resp.status == "Failed" and resp.run_result is None and "error" in resp.compile_result.stderr
    client.close()


def test_failed_and_timed_out_programs_are_never_rerun(server):
    client = SandboxClient(server.url, backoff_s=0.01)
    runs = server.stats()["runs"]
    assert client.run_sync(RunRequest("raise SystemExit(3)", "python")).run_result.return_code == 3
    assert client.run_sync(RunRequest("import os; os.kill(os.getpid(), 9)", "python")).status == "Failed"
    assert client.run_sync(RunRequest("while True: pass", "python", run_timeout=0.5)).run_result.status == "TimeLimitExceeded"
    assert server.stats()["runs"] == runs + 3 and client.requests == 3
    resp = client.run_sync(RunRequest("print(1)", "brainfuck"))  # refused (400): not retried either
    assert resp.status == "SandboxError" and "HTTP 400" in resp.message and "not run by this server" in resp.message
    assert client.requests == 4
    client.close()


def test_a_busy_server_answers_503_and_the_client_retries_until_it_gets_in(tmp_path):
    srv = start_server(tmp_path / "home", "--workers", "1", "--queue-size", "0")
    try:
        slow = SandboxClient(srv.url)
        eager = SandboxClient(srv.url, retries=6, backoff_s=0.2)
        blocker = threading.Thread(target=slow.run_sync, args=(RunRequest("import time; time.sleep(1.5)", "python"),))
        blocker.start()
        deadline = time.monotonic() + 10
        while srv.stats()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        resp = eager.run_sync(RunRequest("print('in')", "python"))
        blocker.join()
        assert resp.run_result.stdout == "in\n"
        assert srv.stats()["rejected_busy"] >= 1 and eager.requests == 1 + srv.stats()["rejected_busy"]
        assert srv.stats()["runs"] == 2
        slow.close()
        eager.close()
    finally:
        stop(srv.proc)


def test_an_unreachable_server_is_reported_once_by_url(caplog):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = SandboxClient(f"http://127.0.0.1:{port}/run_code", retries=2, backoff_s=0.01)
    with caplog.at_level(logging.ERROR, logger="trellis.sandbox"):
        first = client.run_sync(RunRequest("print(1)", "python"))
        second = asyncio.run(client.run(RunRequest("print(1)", "python")))
    for resp in (first, second):
        assert resp.status == "SandboxError" and f"cannot reach the sandbox at http://127.0.0.1:{port}" in resp.message
    assert client.requests == 3 + 1  # three tries, then one while it stays down
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and f"http://127.0.0.1:{port}" in errors[0]
    client.close()


def test_one_limit_per_url_for_the_whole_process(server):
    a = get_client(server.url + "/run_code", 3)
    assert get_client(server.url, 3) is a and a.url == server.url
    with pytest.raises(ValueError, match=r"already allows 3 requests at once, not 5: one limit holds for the whole run"):
        get_client(server.url, 5)


def test_the_limit_bounds_requests_in_flight(server):
    """12 requests that each sleep 0.3 s through a client limited to 2: the server never sees more than 2 at once."""
    client = SandboxClient(server.url, max_concurrency=2)
    peak = []

    def watch(stop_event):
        while not stop_event.is_set():
            stats = server.stats()
            peak.append(stats["running"] + stats["waiting"])

    done = threading.Event()
    watcher = threading.Thread(target=watch, args=(done,))
    watcher.start()
    responses = client.run_many_sync([RunRequest(f"import time; time.sleep(0.3); print({i})", "python") for i in range(12)])
    done.set()
    watcher.join()
    assert [r.run_result.stdout for r in responses] == [f"{i}\n" for i in range(12)]
    assert max(peak) == 2
    client.close()


def test_bad_urls_say_what_to_give():
    with pytest.raises(ValueError, match=r"sandbox url='localhost:8080'; give the server's address, e.g. http://127.0.0.1:8080"):
        normalize_url("localhost:8080")


def test_refuses_to_start_without_isolation(tmp_path):
    """PATH without bwrap or unshare: no isolation can work, so the server refuses, naming the fixes."""
    proc = start_server(tmp_path / "home", env={"PATH": str(tmp_path)}, check=False)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "refusing to start" in err and "bwrap: `bwrap` is not installed" in err and "unshare: `unshare` is not installed" in err
    assert "apt-get install bubblewrap" in err and "--unsafe-no-isolation" in err


def test_unsafe_no_isolation_starts_with_a_warning_and_keeps_rlimits(tmp_path):
    srv = start_server(tmp_path / "home", "--unsafe-no-isolation")
    try:
        assert srv.stats()["isolation"] == "none"
        assert "MemoryError" in srv.run("x = bytearray(2**31)", memory_limit_MB=256)["run_result"]["stderr"]
        assert srv.run("while True: pass", run_timeout=0.5)["run_result"]["status"] == "TimeLimitExceeded"
    finally:
        stop(srv.proc)
    assert "WARNING: --unsafe-no-isolation" in srv.proc.stderr.read()


def test_a_busy_or_invalid_port_is_one_line_without_traceback(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        for args, line in (
            (["--port", str(port)], f"cannot listen on 127.0.0.1:{port}: address already in use; choose another --port (0 picks a free one)"),
            (["--port", "70000"], "--port=70000; give a port in 0..65535 (0 picks a free one)"),
        ):
            proc = subprocess.run(
                [sys.executable, "-m", "trellis_sandbox.cli", "serve", "--unsafe-no-isolation", *args], capture_output=True, text=True, timeout=60
            )
            assert proc.returncode == 2
            assert proc.stderr.splitlines()[-1].startswith(f"trellis-sandbox: {line}") and "Traceback" not in proc.stderr, proc.stderr
    finally:
        taken.close()


def test_work_dirs_go_to_dev_shm_only_where_it_has_room(server, monkeypatch):
    """The server keeps its runs' work dirs on /dev/shm when that has SHM_MIN_FREE free (a tmpfs: cheap
    to make and remove); with less (a container's default 64 MB) or none, in the temp dir."""
    room = os.path.isdir(cli.SHM) and shutil.disk_usage(cli.SHM).free >= cli.SHM_MIN_FREE
    assert os.path.dirname(server.stats()["work_root"]) == (cli.SHM if room else tempfile.gettempdir())
    if room:
        monkeypatch.setattr(cli, "SHM_MIN_FREE", shutil.disk_usage(cli.SHM).free * 2)
        assert cli.scratch_dir() is None
    monkeypatch.setattr(cli, "SHM", "/no-such-shm")
    assert cli.scratch_dir() is None
