"""Single-machine Ray runs inside a network namespace that has only loopback: Ray's servers bind
every interface (Ray 2.x cannot bind loopback alone), so ``trellis train`` relaunches itself in a
fresh user + network namespace where nothing can listen beyond this machine (the controller's
``enter``). Where the run needs the network, or the kernel allows no user namespaces, it says so in
one line and keeps token auth."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket
import struct
import subprocess
import sys
from typing import Any

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("trellis")

INSIDE = "TRELLIS_PRIVATE_NETWORK"  # set in the relaunched process
UNSHARE = ["unshare", "--user", "--map-root-user", "--net"]
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
IFREQ = "16sh22x"  # struct ifreq: the interface name, its flags, padding to 40 bytes


def inside() -> bool:
    """True in the relaunched process (the namespace exists and loopback is up)."""
    return os.environ.get(INSIDE) == "1"


def needs_network(cfg: DictConfig) -> str | None:
    """Why this run must reach beyond loopback-only (a URL in the config, an online tracker), or None."""
    for key, value in _strings(OmegaConf.to_container(cfg, resolve=True)):
        if "://" in value and not value.startswith("file://"):
            return f"config key '{key}' names a network endpoint ({value})"
    trackers = set(cfg.get("trainer", {}).get("trackers") or ())
    if "wandb" in trackers and os.environ.get("WANDB_MODE") not in ("offline", "disabled"):
        return "the wandb tracker logs online (WANDB_MODE=offline keeps it local)"
    if "mlflow" in trackers and "://" in os.environ.get("MLFLOW_TRACKING_URI", "") and not os.environ["MLFLOW_TRACKING_URI"].startswith("file:"):
        return f"the mlflow tracker logs to MLFLOW_TRACKING_URI={os.environ['MLFLOW_TRACKING_URI']}"
    return None


def relaunch_command(cfg: DictConfig, argv: list[str]) -> list[str] | None:
    """The command that runs ``trellis <argv>`` in a loopback-only namespace, when ``cfg`` starts a
    private single-machine Ray cluster and ``trainer.ray_network`` is ``private``; None to run here
    (said in one line when the private network was wanted but cannot be had)."""
    t = cfg.get("trainer") or {}  # a plugin recipe's trainer section may lack the Ray keys
    if inside() or t.get("ray_network", "private") != "private":
        return None
    if os.environ.get("RAY_ADDRESS") or t.get("nnodes", 1) > 1:
        why = "it joins the cluster at RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else f"trainer.nnodes={t.nnodes} needs the network"
        return _fallback(why)
    why = needs_network(cfg) or _no_user_namespaces()
    if why:
        return _fallback(why)
    log.info("ray: the private cluster runs in a network namespace with loopback only: nothing it starts listens beyond this machine")
    return [*UNSHARE, sys.executable, "-m", "trellis.cli", *argv]


def run(command: list[str]) -> int:
    """Run the relaunched command to its end; Ctrl-C reaches it (same process group), which then
    stops as an interrupted run does, so this process waits instead of dying first."""
    import signal

    child = subprocess.Popen(command, env={**os.environ, INSIDE: "1"})
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return child.wait()
    finally:
        signal.signal(signal.SIGINT, previous)


def loopback_up() -> None:
    """Bring ``lo`` up in this (new) network namespace, where it starts down."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack(IFREQ, fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack(IFREQ, b"lo", 0)))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack(IFREQ, b"lo", flags | IFF_UP))


def _no_user_namespaces() -> str | None:
    if shutil.which("unshare") is None:
        return "the unshare command (util-linux) is not installed"
    probe = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True)
    if probe.returncode:
        return f"this kernel refuses an unprivileged user namespace ({probe.stderr.strip() or probe.returncode})"
    return None


def _fallback(why: str) -> None:
    log.info(
        "ray: private cluster on the host's network with token auth (not in a loopback-only namespace: %s); "
        "trainer.ray_network=host says this is intended",
        why,
    )
    return None


def _strings(node: Any, prefix: str = "") -> list[tuple[str, str]]:
    """Every string value of a config container, with its dotted key."""
    if isinstance(node, dict):
        return [kv for k, v in node.items() for kv in _strings(v, f"{prefix}{k}.")]
    if isinstance(node, list):
        return [kv for i, v in enumerate(node) for kv in _strings(v, f"{prefix[:-1]}[{i}].")]
    return [(prefix[:-1], node)] if isinstance(node, str) else []
