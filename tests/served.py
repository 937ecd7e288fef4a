"""``trellis serve`` started for real: the installed command, a subprocess on a free loopback port,
serving model folders under names (the tests' tiny models as ``tiny`` and ``tiny-untied``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

TOKEN = "tml-trellis-test-token"
MODEL, UNTIED = "tiny", "tiny-untied"  # the second's unembedding is its own (a LoRA adapter may train it)


@dataclass
class Server:
    url: str
    root: Path
    log: Path
    process: subprocess.Popen

    def output(self) -> str:
        return self.log.read_text()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(models: dict[str, str], root: Path, port: int | None = None, extra: tuple[str, ...] = ()) -> Server:
    """``trellis serve`` of ``models`` (name -> folder) on ``port`` (a free one by default), waited
    for until it answers its health check."""
    port = port or free_port()
    log = root.parent / f"serve-{port}.log"
    named = [arg for name, folder in models.items() for arg in ("--model", f"{name}={folder}")]
    command = [os.path.join(os.path.dirname(sys.executable), "trellis"), "serve", *named, "--port", str(port), "--root", str(root), *extra]
    env = {**os.environ, "TRELLIS_SERVE_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"trellis serve exited with {process.returncode}:\n{log.read_text()}")
        try:
            urllib.request.urlopen(url + "/api/v1/healthz", timeout=1)
            return Server(url, root, log, process)
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"trellis serve did not answer within 60 s:\n{log.read_text()}")


def stop_server(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.process.kill()
