"""The default process group every distributed backend joins: the rank's device, gloo on CPU or
nccl on CUDA, one group per process (shared by the roles colocated in it), left at exit."""

from __future__ import annotations

import atexit
import os
import socket

import torch
import torch.distributed as dist

from trellis.interfaces.backend import DistInfo


def device_for(info: DistInfo) -> torch.device:
    """The rank's device: its local CUDA device when CUDA is asked for or available, else the CPU."""
    if info.device == "cuda" or (info.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", info.rank % max(torch.cuda.device_count(), 1))))
    return torch.device("cpu")


def loopback_interface() -> str | None:
    """The name of this machine's loopback network interface (``lo`` on Linux), if it has one."""
    return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)


def join_process_group(info: DistInfo) -> torch.device:
    """Join the default process group, or check the one this process is in; returns the device.

    Nothing listens beyond loopback unless the ranks span machines: one rank meets itself in an
    in-memory store; ranks on one machine meet through a file (``DistInfo.init_method``
    ``file://``) and keep gloo's and NCCL's sockets on the loopback interface."""
    device = device_for(info)
    if dist.is_initialized():
        if dist.get_world_size() != info.world_size:
            raise RuntimeError(
                f"this process already belongs to a process group of {dist.get_world_size()} ranks, "
                f"but a worker asks for {info.world_size}; colocated roles must share one world size"
            )
        return device
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if info.world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        url = info.init_method or f"tcp://{info.master_addr}:{info.master_port}"
        loopback = loopback_interface()
        if url.startswith("file://") and loopback:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback)
        dist.init_process_group(backend, init_method=url, rank=info.rank, world_size=info.world_size)
    # a process that ends without a backend's close() still leaves the group (NCCL warns otherwise)
    atexit.register(leave_process_group)
    return device


def leave_process_group() -> None:
    """``destroy_process_group`` if this process is still in one (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()
