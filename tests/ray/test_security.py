"""What a Ray run opens to the network: the private cluster Trellis starts refuses clients without
its token, and what Trellis itself opens (the process group's rendezvous and transport, in the
driver and in every rank) listens on loopback only. Real clusters on this machine, real sockets
(``ss``)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from omegaconf import OmegaConf

from trellis.batch import Batch
from trellis.config import validate
from trellis.plugins import load_plugins
from trellis.runtime.worker import RoleWorker, WorkerSpec
from trellis_algos import ActorConfig
from trellis_fsdp.backend import FSDPBackend, FSDPOptions

ray = pytest.importorskip("ray")

HEAD = textwrap.dedent(
    """
    import os, stat, sys
    from trellis_ray.controller import RayController
    c = RayController(nnodes=1, procs_per_node=1, timeout_s=60, call_timeout_s=60)
    token = os.environ["RAY_AUTH_TOKEN_PATH"]
    print(c.ray.get_runtime_context().gcs_address, token, oct(stat.S_IMODE(os.stat(token).st_mode)), flush=True)
    sys.stdin.readline()  # the test says when to stop
    c.shutdown()
    print("token file left:", os.path.exists(token), "| RAY_AUTH_TOKEN_PATH left:", "RAY_AUTH_TOKEN_PATH" in os.environ, flush=True)
    """
)
CLIENT = textwrap.dedent(
    """
    import sys, ray
    try:
        ray.init(address=sys.argv[1], log_to_driver=False)
        print("joined", flush=True)
    except ConnectionError as exc:
        print("refused:", exc, flush=True)
    """
)


def clean_env(home, **extra):
    """This environment without Ray's address and token settings, with a HOME of its own (Ray
    also looks for a token in ~/.ray)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return {**env, "HOME": str(home), "OMP_NUM_THREADS": "1", **extra}


def test_the_private_cluster_refuses_clients_without_its_token(tmp_path):
    head = subprocess.Popen(
        [sys.executable, "-c", HEAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env=clean_env(tmp_path / "head"),
    )  # fmt: skip
    try:
        address, token, mode = head.stdout.readline().split()
        assert mode == "0o600" and token.endswith("auth_token")
        clients = {
            "none": clean_env(tmp_path / "c1"),
            "wrong": clean_env(tmp_path / "c2", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64),
            "right": clean_env(tmp_path / "c3", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token),
        }
        running = {
            name: subprocess.Popen([sys.executable, "-c", CLIENT, address], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
            for name, env in clients.items()
        }  # side by side: a refused client waits out Ray's connection retries
        said = {name: p.communicate(timeout=120)[0] for name, p in running.items()}
        assert said["none"].startswith("refused: Failed to connect to Ray cluster"), said
        assert said["wrong"].startswith("refused:"), said
        assert said["right"].strip() == "joined", said
        out, _ = head.communicate("stop\n", timeout=120)
        assert "token file left: False | RAY_AUTH_TOKEN_PATH left: False" in out
    finally:
        head.kill()


def test_joining_a_cluster_that_refuses_says_how_to_pass_the_token(tmp_path):
    script = "from trellis_ray.controller import RayController\nRayController(1, 1, 30, 30)\n"
    head = subprocess.Popen(
        [sys.executable, "-c", HEAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env=clean_env(tmp_path / "head"),
    )  # fmt: skip
    try:
        address = head.stdout.readline().split()[0]
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=clean_env(tmp_path / "c", RAY_ADDRESS=address)
        )
        assert out.returncode != 0
        assert f"could not join the Ray cluster at RAY_ADDRESS='{address}'" in out.stderr
        assert "RAY_AUTH_TOKEN_PATH=<its token file>" in out.stderr
    finally:
        head.communicate("stop\n", timeout=120)


def listening(pids: set[int]) -> set[tuple[int, str]]:
    """``(pid, local address)`` of every listening TCP socket of ``pids``."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = set()
    for line in out.splitlines():
        local = line.split()[3]
        for pid in pids:
            if f"pid={pid}," in line:
                found.add((pid, local))
    return found


def on_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    return host.startswith("127.") or host == "::1"


def test_what_trellis_opens_listens_on_loopback_only(tiny_model_path):
    """A 2-rank training step on a private cluster: every socket that appears once the ranks form
    their process group (rendezvous, gloo) is on loopback, in the ranks and in the driver. The
    sockets Ray itself opens are listed, not judged (docs/security.md)."""
    from trellis_ray.controller import RayController

    registry = load_plugins().registry
    options = validate(OmegaConf.create({"optim": {"lr": 1e-2}, "micro_batch_samples": 4}), ActorConfig, registry)
    spec = WorkerSpec("actor", tiny_model_path, FSDPBackend, FSDPOptions(), options, {"update": "policy"}, registry=registry)
    ctrl = RayController(nnodes=1, procs_per_node=2, timeout_s=60, call_timeout_s=120)
    try:
        pool = ctrl._pool("actor")
        assert pool.rendezvous.startswith("file://")  # one machine: the ranks meet through a file
        pids = {os.getpid(), *ray.get([r.__ray_call__.remote(lambda self: os.getpid()) for r in pool.ranks])}
        before = listening(pids)
        actor = ctrl.spawn("actor", lambda dist: RoleWorker(dataclasses.replace(spec, dist=dist)))
        n, p, r = 4, 3, 2
        mask = torch.ones(n, p + r, dtype=torch.long)
        batch = Batch(
            {
                "input_ids": torch.randint(3, 20, (n, p + r)),
                "attention_mask": mask,
                "position_ids": mask.cumsum(-1) - 1,
                "responses": torch.randint(3, 20, (n, r)),
                "response_mask": torch.ones(n, r, dtype=torch.long),
                "advantages": torch.randn(n, r),
            },
            meta={"temperature": 1.0},
        )
        batch["old_log_probs"] = actor.log_prob(batch)["log_probs"]
        actor.update(batch)
        opened = listening(pids) - before
        assert opened, "the process group opened no socket at all: the measurement sees nothing"
        assert all(on_loopback(address) for _, address in opened), sorted(opened)
        print("Ray's own listening sockets in these processes:", sorted(before))
    finally:
        ctrl.shutdown()
    assert "RAY_AUTH_TOKEN_PATH" not in os.environ
