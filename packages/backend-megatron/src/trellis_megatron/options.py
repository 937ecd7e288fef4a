"""The ``backend`` section of a run on the megatron backend, and its rank layout; importable
without Megatron (the plugin registers it at start-up)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trellis import Mesh, choice, ranged

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class MegatronOptions:
    """tensor_parallel / pipeline_parallel: ranks a model is split over (the rest are data
    parallel). dtype: weights and compute (``auto``: bfloat16 on CUDA, with Megatron's optimizer
    keeping float32 master weights; float32 on CPU). sequence_parallel, distributed_optimizer:
    Megatron's features of those names (CUDA only: they fail on gloo/CPU)."""

    tensor_parallel: int = ranged(1, ge=1)
    pipeline_parallel: int = ranged(1, ge=1)
    dtype: str = choice("auto", (*DTYPES, "auto"))
    sequence_parallel: bool = False
    distributed_optimizer: bool = False

    def activation_dtype(self, device_type: str) -> str:
        """The dtype the model is kept and computes in on ``device_type`` (``cuda`` or ``cpu``),
        ``auto`` resolved."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if device_type == "cuda" else "float32"

    def mesh(self, world_size: int) -> Mesh:
        """tp x pp ranks per model replica, the rest data parallel. One process (``trellis
        export``, a notebook) runs the whole model: Megatron's checkpoints reshard on load."""
        if world_size == 1:
            return Mesh()
        per_model = self.tensor_parallel * self.pipeline_parallel
        if world_size % per_model:
            raise ValueError(
                f"backend.tensor_parallel={self.tensor_parallel} x backend.pipeline_parallel={self.pipeline_parallel} = {per_model} "
                f"does not divide the {world_size} ranks; set trainer.procs_per_node (x nnodes) to a multiple of {per_model}"
            )
        return Mesh(dp=world_size // per_model, tp=self.tensor_parallel, pp=self.pipeline_parallel)
