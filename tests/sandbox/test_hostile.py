"""Hostile programs against the real server, under each isolation: each one is contained, the server keeps
serving afterwards, and no process or file of the run is left on the host (fixture ``left_nothing``)."""

from __future__ import annotations

import concurrent.futures
import os
import uuid
from pathlib import Path

import pytest
from sandbox_server import SECRET, processes_of

pytestmark = pytest.mark.usefixtures("left_nothing")


def test_fork_bomb_is_bounded_and_cleaned_up(server):
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    body = server.run(code, run_timeout=2)
    assert body["status"] == "Failed" and body["run_result"]["status"] == "TimeLimitExceeded"


def test_memory_bomb_hits_the_requested_limit(server):
    code = "x = bytearray(512 * 2**20)\nprint('allocated')"
    body = server.run(code, memory_limit_MB=256)
    assert body["run_result"]["return_code"] != 0 and "MemoryError" in body["run_result"]["stderr"]
    assert server.run(code, memory_limit_MB=768)["run_result"]["stdout"] == "allocated\n"  # the limit is the request's


def test_memory_bomb_without_a_limit_gets_the_server_default(server):
    """The official client drops memory_limit_MB: the server's default (1024 MB) still applies."""
    body = server.run("x = bytearray(2 * 2**30)\nprint('allocated')")
    assert "MemoryError" in body["run_result"]["stderr"] and body["run_result"]["stdout"] == ""


def test_infinite_loop_times_out(server):
    body = server.run("while True:\n    pass", run_timeout=1)
    run = body["run_result"]
    assert run["status"] == "TimeLimitExceeded" and run["return_code"] is None and 1.0 <= run["execution_time"] < 5.0


def test_busy_child_left_behind_is_killed(server):
    code = "import subprocess\nsubprocess.Popen(['python3', '-c', 'while True: pass'])\nprint('parent done')"
    body = server.run(code)
    assert body["status"] == "Success" and body["run_result"]["stdout"] == "parent done\n"


def test_daemon_does_not_outlive_the_run(server):
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.closerange(0, 3)\n"
        "        time.sleep(60)\n"
        "    os._exit(0)\n"
        "print('daemonised')\n"
    )
    assert server.run(code)["run_result"]["stdout"] == "daemonised\n"


def test_no_network_loopback_server_port_or_outside(server):
    """Outside: a UDP connect() sends no packet; it only asks for a route, which an empty network namespace lacks."""
    code = f"""
import socket
def tcp(port):
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect(("127.0.0.1", port))
        return "connected"
    except OSError as e:
        return type(e).__name__
def route():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 53))
        return "routed"
    except OSError as e:
        return type(e).__name__
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen()
print(tcp({server.port}), tcp(srv.getsockname()[1]), route(), *sorted(name for _, name in socket.if_nameindex()))
"""
    before = server.stats()["requests"]
    out = server.run(code)["run_result"]["stdout"].split()
    assert out[0] in ("ConnectionRefusedError", "OSError") and out[2] == "OSError"  # the server's port: not there; no route out
    assert out[1] == "connected"  # its own loopback works, inside its own namespace
    assert out[3:] == ["lo"]  # no interface but its own loopback
    assert server.stats()["requests"] == before + 1  # only our request reached the server


def test_files_outside_the_work_dir_are_out_of_reach(server, tmp_path):
    token = uuid.uuid4().hex
    canaries = [server.home / f"canary-{token}", tmp_path.parent / f"canary-{token}", f"/tmp/canary-{token}"]
    for c in canaries:
        with open(c, "w") as f:
            f.write("secret canary")
        os.chmod(c, 0o644)
    targets = [f"/tmp/evil-{token}", str(server.home / f"evil-{token}"), f"/etc/evil-{token}", f"/var/tmp/evil-{token}", f"../evil-{token}"]
    code = f"""
import os
for path in {[str(c) for c in canaries]!r}:
    try:
        print("READ", open(path).read())
    except OSError as e:
        print("no read", type(e).__name__)
for path in {targets!r}:
    try:
        open(path, "w").write("x")
        print("wrote", path)
    except OSError as e:
        print("no write", type(e).__name__)
for path in {[str(c) for c in canaries]!r}:
    try:
        os.remove(path)
        print("REMOVED", path)
    except OSError as e:
        print("no remove", type(e).__name__)
open("inside.txt", "w").write("fine")
print("work dir ok", open("inside.txt").read())
"""
    out = server.run(code)["run_result"]["stdout"]
    assert "READ" not in out and "REMOVED" not in out and "work dir ok fine" in out
    for c in canaries:
        assert Path(c).read_text() == "secret canary"
        os.remove(c)
    for t in targets[:-1]:
        assert not os.path.exists(t), t  # ../evil landed in the run's own /tmp, gone with it (the work root is checked empty)


def test_scratch_folders_are_fresh_writable_and_private_per_run(server):
    """/tmp, /var/tmp and /dev/shm take writes in a run and start empty in the next (in the same slots),
    and none shows the host's own: the host's /dev/shm holds the runs' work dirs."""
    token = uuid.uuid4().hex
    canary = Path("/dev/shm") / f"canary-{token}"
    canary.write_text("host")
    code = f"""
import multiprocessing, os
for d in ("/tmp", "/var/tmp", "/dev/shm"):
    print(d, sorted(set(os.listdir(d)) - {{"work"}}))  # /tmp/work: the run's work dir
    open(os.path.join(d, "left-{token}"), "w").write("x")
multiprocessing.Lock()  # a POSIX semaphore in /dev/shm
print("lock ok")
"""
    try:
        for _ in range(3 * server.stats()["workers"]):  # every slot, each more than once
            out = server.run(code)["run_result"]["stdout"]
            assert out == "/tmp []\n/var/tmp []\n/dev/shm []\nlock ok\n"
    finally:
        canary.unlink()


def test_the_server_environment_is_invisible(server):
    code = f"""
import os
seen = dict(os.environ)
for pid in [p for p in os.listdir("/proc") if p.isdigit()] + ["{server.proc.pid}", "1"]:
    try:
        seen[pid] = open(f"/proc/{{pid}}/environ", "rb").read().decode(errors="replace")
    except OSError:
        pass
print(seen)
"""
    out = server.run(code)["run_result"]["stdout"]
    assert SECRET not in out and "TRELLIS_SANDBOX_TEST_SECRET" not in out
    assert "PATH" in out  # it did print an environment: the scrubbed one


def test_the_program_gets_the_scrubbed_environment_and_the_requests_limits(server):
    """Whichever side of the sandbox the launcher applies the rlimits on, the program runs under them, with
    the scrubbed environment (its UTF-8 locale included) and not the launcher's."""
    code = """
import os, resource as r
print(sorted(k for k in os.environ if k != "PWD"), os.environ["LANG"], os.environ["HOME"])
print([r.getrlimit(getattr(r, "RLIMIT_" + k)) for k in ("AS", "CPU", "NPROC", "FSIZE", "NOFILE", "CORE")])
"""
    out = server.run(code, memory_limit_MB=300, run_timeout=4)["run_result"]["stdout"].splitlines()
    assert out[0] == "['HOME', 'LANG', 'PATH', 'PYTHONDONTWRITEBYTECODE'] C.UTF-8 /tmp/work"
    mb = 2**20
    assert out[1] == str([(300 * mb, 300 * mb), (5, 5), (64, 64), (64 * mb, 64 * mb), (256, 256), (0, 0)])


def test_killing_the_server_or_its_parent_fails(server):
    code = f"""
import os, signal
for target in ({server.proc.pid}, {os.getpid()}, os.getppid(), 1, -1):
    try:
        os.kill(target, signal.SIGKILL)
        print("sent", target)
    except OSError as e:
        print("refused", target, type(e).__name__)
"""
    server.run(code)  # it may kill its own namespace (pid 1 / -1 there are its own processes): any outcome is fine
    assert server.proc.poll() is None and os.getpid() > 0


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_output_flood_is_cut_and_says_so(server, stream):
    body = server.run(f"import sys\nwhile True:\n    sys.{stream}.write('x' * 4096)", run_timeout=20)
    run = body["run_result"]
    assert run["status"] == "Error" and run["execution_time"] < 10  # stopped at the cap, not at the timeout
    assert run[stream].startswith("x" * 1000) and f"{stream} truncated: the program wrote more than 65536 bytes" in run[stream]
    assert len(run[stream]) < 65536 + 200


def test_five_megabytes_of_code_run(server):
    """5 MB of source: a comment block and a long literal (750k statements would need more than the
    default 1 GB of address space just to compile, and fail with MemoryError: the limit at work)."""
    code = "# filler\n" * (2 * 2**20 // 9) + "s = '" + "y" * (3 * 2**20) + "'\nprint(len(s))"
    assert len(code) > 5 * 10**6
    assert server.run(code, run_timeout=30)["run_result"]["stdout"] == f"{3 * 2**20}\n"


def test_a_request_over_the_size_limit_is_refused(server):
    status, body = server.post({"code": "#" * (17 * 2**20), "language": "python"})
    assert status == 413 and "larger than the server's limit of 16 MB" in body["message"]


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"{not json", "the body is not valid JSON"),
        (b"[1, 2]", "the body is JSON list, not an object"),
        (b'{"language": "python"}', "missing field 'code'"),
        (b'{"code": "print(1)"}', "missing field 'language'"),
        (b'{"code": "print(1)", "language": "cobol"}', "language='cobol' is not run by this server; use one of"),
        (b'{"code": 5, "language": "python"}', "code='5' is int; give a string"),
        (b'{"code": "", "language": "python", "run_timeout": -1}', "run_timeout=-1; give seconds as a number in (0, 60]"),
        (b'{"code": "", "language": "python", "memory_limit_mb": 5}', "unknown field(s) ['memory_limit_mb']"),
        (b'{"code": "", "language": "python", "files": {"../x": "eA=="}}', "file path '../x' leaves the work dir"),
        (b'{"code": "", "language": "python", "files": {"x": "***"}}', "files['x'] is not base64"),
    ],
)
def test_bad_requests_get_400_naming_the_problem(server, raw, message):
    status, body = server.post(None, raw=raw)
    assert status == 400 and body["status"] == "SandboxError" and message in body["message"], body


def test_a_burst_of_runs_leaves_no_zombies_on_the_host(server):
    """bwrap's PID 1 inside the sandbox outlives the process the server waits on; the server reaps it
    (left to the machine's init, such zombies piled up by the dozen where init reaps lazily)."""
    uids = server.stats()["uids"]
    if not uids:
        pytest.skip("one uid per slot only when the server runs as root")
    before = set(processes_of(uids, zombies=True))  # the start-up probe's, say: reaped by init, maybe lazily
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        assert all(b["status"] == "Success" for b in pool.map(lambda _: server.run("pass"), range(100)))
    assert set(processes_of(uids, zombies=True)) - before == set()
