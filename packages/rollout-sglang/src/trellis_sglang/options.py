"""Options of the ``sglang`` rollout (the ``rollout`` section of a run config). No SGLang import here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trellis import choice, ranged

DTYPES = ("float32", "bfloat16", "float16", "auto")
SYNC_METHODS = ("tensor", "distributed")


@dataclass
class SGLangRolloutOptions:
    """How the SGLang engine is set up. Sampling itself (n, temperature, ...) comes from the recipe.

    dtype: weights and compute (None: bfloat16 on a GPU, float32 on CPU; ``auto``: the model config's).
    context_length: longest prompt + response in tokens (0: the recipe's ``data.max_prompt_length`` +
        response length, else the model's ``max_position_embeddings``).
    mem_fraction_static: GPU only: share of GPU memory for weights and KV cache. The default leaves
        room for the actor colocated on the same GPU.
    max_total_tokens: KV-cache size in tokens (0: SGLang's default from ``mem_fraction_static``;
        on CPU 65536, a fixed size instead of a share of the machine's memory).
    tensor_parallel_size: devices one engine spans (SGLang's ``tp_size``), under the local
        controller; needs CUDA (SGLang's NCCL communicator). Under Ray each rank has one device
        and its own engine, so the rl recipe refuses more than 1 there.
    seed: engine seed (None: the run's seed).
    attention_backend: SGLang's attention backend (empty: ``torch_native`` on CPU, SGLang's choice on GPU).
    disable_cuda_graph: no CUDA graphs (None: True on CPU, False on GPU).
    sync_bucket_mb: a weight sync hands the engine its tensors in buckets of about this many MiB,
        so at most one bucket is in transit to the engine at a time.
    sync_method: how a weight sync reaches the engine's processes: ``tensor`` (each bucket
        serialised through SGLang's ``update_weights_from_tensor``) or ``distributed`` (broadcast
        over a process group shared with the engine, ``update_weights_from_distributed``: gloo on
        CPU, NCCL on GPU, no serialisation). ``distributed`` is refused when the engine takes the
        GPU of the process that builds it (colocated): NCCL refuses two ranks on one GPU.
    enable_memory_saver: GPU only: let ``sleep``/``wake`` release and resume the weights and KV cache.
    log_level: SGLang's log level.
    engine_kwargs: any other ``sglang.Engine`` keyword arguments (``ServerArgs`` fields), passed through.
    """

    dtype: str | None = choice(None, DTYPES)
    context_length: int = ranged(0, ge=0)
    mem_fraction_static: float = ranged(0.5, gt=0, le=1)
    max_total_tokens: int = ranged(0, ge=0)
    tensor_parallel_size: int = ranged(1, ge=1)
    seed: int | None = ranged(None, ge=0)
    attention_backend: str = ""
    disable_cuda_graph: bool | None = None
    sync_bucket_mb: float = ranged(512.0, gt=0)
    sync_method: str = choice("tensor", SYNC_METHODS)
    enable_memory_saver: bool = True
    log_level: str = "error"
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def check(self, trainer_gpu: int | None = None) -> None:
        """Raise ``ValueError`` naming the option for a value that cannot work. ``trainer_gpu``: the
        CUDA device of the process that builds the engine (None on CPU)."""
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"rollout.dtype={self.dtype!r} is not a dtype; valid: {', '.join(DTYPES)} (or null: by device)")
        if self.sync_method not in SYNC_METHODS:
            raise ValueError(f"rollout.sync_method={self.sync_method!r}; valid: {', '.join(SYNC_METHODS)}")
        if self.sync_bucket_mb <= 0:
            raise ValueError(f"rollout.sync_bucket_mb={self.sync_bucket_mb} must be positive (MiB per weight-sync bucket)")
        if self.sync_method == "distributed" and trainer_gpu is not None and trainer_gpu in self.engine_gpus():
            raise ValueError(
                f"rollout.sync_method=distributed with the engine on GPU {trainer_gpu}, this process's own (colocated): "
                "the weight broadcast would put two NCCL ranks on one GPU, which NCCL refuses ('Duplicate GPU detected'); "
                "set rollout.sync_method=tensor"
            )

    def engine_gpus(self) -> range:
        """The CUDA devices the engine's tensor-parallel ranks take (SGLang's ``base_gpu_id`` and
        ``gpu_id_step``, 0 and 1 unless ``engine_kwargs`` sets them)."""
        base, step = self.engine_kwargs.get("base_gpu_id", 0), self.engine_kwargs.get("gpu_id_step", 1)
        return range(base, base + step * self.tensor_parallel_size, step)
