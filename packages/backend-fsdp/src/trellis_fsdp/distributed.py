"""The FSDP backend's data-parallel mesh over the default process group, and its one collective."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trellis.kit.backend import DistInfo, join_process_group


def ensure_process_group(info: DistInfo) -> DeviceMesh:
    """Join (or reuse) the default process group and return a 1-D data-parallel mesh over it."""
    device = join_process_group(info)
    return init_device_mesh(device.type, (info.world_size,), mesh_dim_names=("dp",))


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Each float summed over the ranks (unchanged on one rank), in one collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()
