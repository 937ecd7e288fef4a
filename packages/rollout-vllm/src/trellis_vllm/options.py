"""Options of the ``vllm`` rollout (the ``rollout`` section of a run config). No vLLM import here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trellis import choice, ranged

DTYPES = ("float32", "bfloat16", "float16", "auto")
EXECUTORS = ("uni", "mp", "ray", "external_launcher")


@dataclass
class VLLMRolloutOptions:
    """How the vLLM engine is set up. Sampling itself (n, temperature, ...) comes from the recipe.

    dtype: weights and compute (None: bfloat16 on a GPU, float32 on CPU; ``auto``: the model config's, which vLLM turns into float16 for a
        float32 checkpoint on GPU).
    max_model_len: longest prompt + response in tokens (0: the recipe's ``data.max_prompt_length`` +
        response length, else the model's ``max_position_embeddings``).
    gpu_memory_utilization: GPU only: share of GPU memory for weights, activations and KV cache.
        The default leaves room for the actor colocated in the same process.
    kv_cache_gib: KV-cache size in GiB (0: on GPU from ``gpu_memory_utilization``; on CPU 1 GiB, or
        ``VLLM_CPU_KVCACHE_SPACE`` when that is set; the variable wins over this option on CPU).
    tensor_parallel_size: GPUs per engine; above 1 needs ``executor`` ``mp`` or ``ray``.
    enforce_eager: no CUDA graphs / torch.compile (None: True on CPU, False on GPU).
    seed: engine seed (None: the run's seed).
    executor: vLLM's ``distributed_executor_backend``; ``uni`` runs the model in this process.
    in_process: run vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so
        weight sync hands tensors over in memory. ``false`` is refused: the sync hands vLLM a
        stream of the trainer's tensors, which cannot be sent to an engine core in another process.
    enable_sleep_mode: GPU only: allow ``sleep``/``wake`` to free the KV cache and weights.
    sleep_level: 2 (default) drops the weights and KV cache: the rl recipe sends the weights again
        at every sync anyway; 1 offloads the weights to CPU memory instead (keeps them for an engine
        woken without a sync).
    max_num_seqs: most sequences per engine step (0: vLLM's default).
    adapter_sync: when the policy trains a LoRA adapter, build the engine with vLLM's LoRA support
        and send it the adapter alone at each sync (the base weights load once and stay; with sleep
        mode they are offloaded, never dropped); false: merged full weights at each sync.
    engine_kwargs: any other ``vllm.LLM`` keyword arguments, passed through unchanged.
    """

    dtype: str | None = choice(None, DTYPES)
    max_model_len: int = ranged(0, ge=0)
    gpu_memory_utilization: float = ranged(0.5, gt=0, le=1)
    kv_cache_gib: float = ranged(0.0, ge=0)
    tensor_parallel_size: int = ranged(1, ge=1)
    enforce_eager: bool | None = None
    seed: int | None = ranged(None, ge=0)
    executor: str = choice("uni", EXECUTORS)
    in_process: bool = True
    enable_sleep_mode: bool = True
    sleep_level: int = ranged(2, ge=1, le=2)
    max_num_seqs: int = ranged(0, ge=0)
    adapter_sync: bool = True
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        """Raise ``ValueError`` naming the option for a value that cannot work."""
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"rollout.dtype={self.dtype!r} is not a dtype; valid: {', '.join(DTYPES)} (or null: by device)")
        if self.executor not in EXECUTORS:
            raise ValueError(f"rollout.executor={self.executor!r}; valid: {', '.join(EXECUTORS)}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"rollout.tensor_parallel_size={self.tensor_parallel_size} must be at least 1")
        if self.tensor_parallel_size > 1 and self.executor == "uni":
            raise ValueError(
                f"rollout.tensor_parallel_size={self.tensor_parallel_size} needs more than one worker; "
                "set rollout.executor=mp (or ray); the single-process executor 'uni' runs exactly one"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"rollout.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.kv_cache_gib < 0:
            raise ValueError(f"rollout.kv_cache_gib={self.kv_cache_gib} must be 0 (automatic) or positive")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"rollout.sleep_level={self.sleep_level}; valid: 1 (offload weights), 2 (drop weights)")
        if not self.in_process:
            raise ValueError(
                "rollout.in_process=false: the weight sync hands vLLM's reload_weights a stream of the trainer's tensors, "
                "which cannot be pickled into an engine core in another process, and no cross-process transport exists; "
                "set rollout.in_process=true"
            )
        if self.max_model_len < 0 or self.max_num_seqs < 0:
            raise ValueError("rollout.max_model_len and rollout.max_num_seqs must be 0 (vLLM's default) or positive")
