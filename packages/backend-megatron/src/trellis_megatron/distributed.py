"""Process groups for Megatron-Core: the default group (gloo on CPU, nccl on CUDA) and Megatron's
tensor/pipeline/data-parallel groups laid out as the role's ``Mesh`` (tp fastest, then cp, dp, pp:
the same order as Megatron's ``tp-cp-ep-dp-pp``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from trellis.kit.backend import DistInfo, join_process_group


def init_parallel(info: DistInfo) -> None:
    """Join the default process group (core's: gloo on CPU, nccl on CUDA, loopback for ranks on one
    machine) and build Megatron's groups for ``info.mesh``, gloo twins included on either device:
    Megatron's optimizer builder asks for the gloo data-parallel group even when the default group
    is NCCL. A process already holding Megatron groups of another layout is refused: colocated
    roles must share one mesh."""
    join_process_group(info)
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
        create_gloo_process_groups=True,
    )


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Each float summed over the data-parallel group (unchanged on one data-parallel rank)."""
    group = mpu.get_data_parallel_group()
    if dist.get_world_size(group) == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return t.tolist()
