"""The Megatron tests' multi-process drivers: a function on N gloo ranks (spawned processes with
the CPU shim installed), and the environment of a recipe process whose Ray ranks get the shim."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from trellis.interfaces.backend import DistInfo
from trellis.interfaces.dispatch import Mesh


def _main(rank: int, fn, world: int, mesh: Mesh, folder: str, args: tuple) -> None:
    import cpu_shim

    cpu_shim.install()
    torch.set_num_threads(1)
    info = DistInfo(rank, world, mesh=mesh, init_method=f"file://{folder}/rendezvous")
    result = fn(info, *args)
    torch.save(result, f"{folder}/rank{rank}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def run_ranks(fn, mesh: Mesh, *args) -> list:
    """``fn(dist_info, *args)`` on every rank of ``mesh`` (a picklable, module-level ``fn``);
    returns the ranks' results in rank order."""
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_main, args=(fn, mesh.world_size, mesh, folder, args), nprocs=mesh.world_size, join=True)
        return [torch.load(Path(folder) / f"rank{r}.pt", weights_only=False) for r in range(mesh.world_size)]


def boot_env() -> dict:
    """This process's environment plus what puts the CPU shim (test scaffolding) into every
    Python process a recipe starts, Ray's rank processes included (``boot/sitecustomize.py``)."""
    here = Path(__file__).parent
    path = os.pathsep.join([str(here / "boot"), str(here), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "TRELLIS_TEST_MEGATRON_CPU_SHIM": "1", "OMP_NUM_THREADS": "1"}
