"""The real sandbox server as a subprocess (own session, free port, killed and reaped at the end), raw
HTTP helpers to talk to it, and checks that a run left no process behind."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

SECRET = "trellis-sandbox-test-secret-5b1f"


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    home: Path
    token: str | None = None  # sent by post() and stats() as the bearer token

    def headers(self, token: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"} if token else {}

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def post(self, body, *, raw: bytes | None = None, timeout: float = 60.0, headers: dict | None = None) -> tuple[int, dict]:
        """POST /run_code with ``headers`` (default: the server's token); returns (HTTP status, JSON body)."""
        data = raw if raw is not None else json.dumps(body).encode()
        headers = self.headers(self.token) if headers is None else headers
        req = urllib.request.Request(f"{self.url}/run_code", data=data, headers={"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def run(self, code: str, **fields) -> dict:
        status, body = self.post({"code": code, "language": fields.pop("language", "python"), **fields})
        assert status == 200, body
        return body

    def stats(self) -> dict:
        req = urllib.request.Request(f"{self.url}/stats", headers=self.headers(self.token))
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())


def start_server(home: Path, *args: str, env: dict | None = None, check: bool = True) -> Server | subprocess.Popen:
    """``trellis-sandbox serve --port 0 ARGS`` with HOME=home and a secret in its environment; waits for
    its URL line. With ``check=False`` returns the process as soon as it prints or exits. The server's
    token is ``TRELLIS_SANDBOX_TOKEN`` of ``env`` (or ours), as the server reads it."""
    home.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, "HOME": str(home), "TRELLIS_SANDBOX_TEST_SECRET": SECRET, **(env or {})}
    cmd = [sys.executable, "-m", "trellis_sandbox.cli", "serve", "--host", "127.0.0.1", "--port", "0", *args]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, start_new_session=True, preexec_fn=_die_with_parent
    )
    if not check:
        return proc
    line = proc.stdout.readline()
    if "serving http://" not in line:
        stop(proc)
        raise RuntimeError(f"the server did not start: {line!r} {proc.communicate()[1]}")
    return Server(line.split("serving ", 1)[1].split(" ", 1)[0], proc, home, full_env.get("TRELLIS_SANDBOX_TOKEN") or None)


def _die_with_parent() -> None:
    """SIGTERM the server if the test process dies first (a killed pytest leaves no server behind)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's session, SIGKILL after 10 s; always reaped."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def isolations() -> list:
    marks = {"bwrap": [pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")]}
    return [pytest.param(kind, marks=marks.get(kind, []), id=kind) for kind in ("bwrap", "unshare")]


def foreign_pid_ns_processes() -> set[int]:
    """Live processes in a PID namespace other than ours (the sandboxes' children)."""
    own = os.readlink("/proc/self/ns/pid")
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
            if stat[stat.rindex(")") + 2] != "Z" and os.readlink(f"/proc/{entry.name}/ns/pid") != own:
                found.add(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass
    return found


def processes_of(uids: list[int], zombies: bool = False) -> list[int]:
    """The live processes of ``uids`` (the zombies with ``zombies=True``)."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
                if entry.stat().st_uid in uids and (stat[stat.rindex(")") + 2] == "Z") == zombies:
                    pids.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return pids
