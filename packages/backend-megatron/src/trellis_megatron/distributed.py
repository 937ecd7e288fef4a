"""Process groups for Megatron-Core: the default group (gloo on CPU, nccl on CUDA) and Megatron's
tensor/pipeline/data-parallel groups laid out as the role's ``Mesh`` (tp fastest, then cp, dp, pp:
the same order as Megatron's ``tp-cp-ep-dp-pp``)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from trellis.interfaces.backend import DistInfo


def device_for(info: DistInfo) -> torch.device:
    """The rank's device: its local CUDA device when CUDA is asked for or available, else the CPU."""
    if info.device == "cuda" or (info.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", info.rank % max(torch.cuda.device_count(), 1))))
    return torch.device("cpu")


def init_parallel(info: DistInfo, device: torch.device) -> None:
    """Join the default process group (or reuse it) and build Megatron's groups for ``info.mesh``.

    One rank meets itself in an in-memory store; several meet at ``info.init_method`` (a
    ``file://`` rendezvous keeps gloo on the loopback interface). A process already holding
    Megatron groups of another layout is refused: colocated roles must share one mesh."""
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if info.world_size == 1:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            url = info.init_method or f"tcp://{info.master_addr}:{info.master_port}"
            if url.startswith("file://"):
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            dist.init_process_group(backend, init_method=url, rank=info.rank, world_size=info.world_size)
    mesh = info.mesh
    if mpu.model_parallel_is_initialized():
        have = (mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size(), mpu.get_data_parallel_world_size())
        if have != (mesh.tp, mesh.pp, mesh.dp):
            raise RuntimeError(
                f"this process already holds Megatron groups tp,pp,dp={have}, but a role asks for {mesh}; colocated roles must share one mesh"
            )
        return
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=mesh.tp,
        pipeline_model_parallel_size=mesh.pp,
        context_parallel_size=mesh.cp,
        create_gloo_process_groups=device.type == "cpu",
    )


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Each float summed over the data-parallel group (unchanged on one data-parallel rank)."""
    group = mpu.get_data_parallel_group()
    if dist.get_world_size(group) == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return t.tolist()
