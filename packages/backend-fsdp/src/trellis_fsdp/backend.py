"""FSDP2 backend: any Hugging Face model fully sharded per decoder layer, for every role.

Only the model: build, forwards, backward, optimizer step, checkpoints and weights. Losses come
from the objective layer through ``trellis.runtime.worker.RoleWorker``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from trellis.batch import Batch
from trellis.config import ranged
from trellis.interfaces.backend import Backend, BackendSpec, LossFn, WeightBucket, backward_each
from trellis.interfaces.hf import forward_outputs, load_hf_model
from trellis.interfaces.optim import clipped_step, make_optimizer, schedule_step
from trellis.runtime.rng import get_rng_state, set_rng_state
from trellis_fsdp.distributed import all_reduce_sum, device_for, ensure_process_group

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class FSDPOptions:
    """dtype: the weights' dtype. param_dtype / reduce_dtype: FSDP2 mixed precision (compute and
    gradient-reduction dtypes; None = the weights' dtype). entropy_chunk_size: rows of logits per
    chunk when computing entropy (bounds memory for large vocabularies)."""

    dtype: str = "float32"
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    activation_checkpointing: bool = False
    entropy_chunk_size: int | None = ranged(2048, ge=1)


class FSDPBackend(Backend):
    """One role's model on one rank, fully sharded over the data-parallel ranks."""

    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec
        self.opts: FSDPOptions = spec.options if spec.options is not None else FSDPOptions()
        self.device = device_for(spec.dist)

    # -- set-up -----------------------------------------------------------------------------
    def build(self) -> None:
        for name in ("dtype", "param_dtype", "reduce_dtype"):
            value = getattr(self.opts, name)
            if value is not None and value not in DTYPES:
                raise ValueError(f"backend.{name}={value!r} is not a dtype; valid: {', '.join(DTYPES)}")
        self.mesh = ensure_process_group(self.spec.dist)
        torch.manual_seed(self.spec.seed)
        self.model = load_hf_model(self.spec.model_path, self.spec.head, DTYPES[self.opts.dtype]).to(self.device)
        if self.opts.activation_checkpointing and self.spec.trainable:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self._shard()
        self.optimizer = self.scheduler = None
        if self.spec.trainable:
            self.optimizer, self.scheduler = make_optimizer(self.model.parameters(), self.spec.optim, self.spec.total_steps)
            self.model.train()
        else:
            self.model.eval()

    def _shard(self) -> None:
        mp = MixedPrecisionPolicy(
            param_dtype=DTYPES[self.opts.param_dtype] if self.opts.param_dtype else None,
            reduce_dtype=DTYPES[self.opts.reduce_dtype] if self.opts.reduce_dtype else None,
        )
        # Decoder layers are the classes a model declares it must not split across devices.
        layer_classes = tuple(getattr(self.model, "_no_split_modules", None) or ())
        for module in self.model.modules():
            if type(module).__name__ in layer_classes:
                fully_shard(module, mesh=self.mesh, mp_policy=mp)
        fully_shard(self.model, mesh=self.mesh, mp_policy=mp)

    # -- forward and backward -------------------------------------------------------------------
    def _outputs(self, micro: Batch, outputs: tuple[str, ...]) -> dict[str, torch.Tensor]:
        return forward_outputs(self.model, micro, outputs, self.spec.head, self.opts.entropy_chunk_size)

    def forward(self, micros: list[Batch], outputs: tuple[str, ...]) -> list[dict[str, torch.Tensor]]:
        with torch.no_grad():
            results = [{k: v.cpu() for k, v in self._outputs(m, outputs).items()} for m in micros]
        # After a no_grad forward FSDP2 leaves the root unsharded; reshard so memory and later
        # state-dict calls see the sharded layout.
        self.model.reshard()
        return results

    def forward_backward(self, micros: list[Batch], outputs: tuple[str, ...], loss_fn: LossFn) -> list[dict[str, float]]:
        # FSDP averages gradients over ranks; the loss is this rank's share of the global
        # mini-batch, so scale by the world size to get the gradient of the sum.
        return backward_each(micros, lambda micro: self._outputs(micro, outputs), loss_fn, self.spec.dist.world_size)

    def optimizer_step(self) -> dict[str, float]:
        return clipped_step(list(self.model.parameters()), self.optimizer, self.spec.optim.grad_clip)

    def lr_step(self) -> float:
        return schedule_step(self.scheduler)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        return all_reduce_sum(values, self.device)

    # -- weights ---------------------------------------------------------------------------------------
    def export_weights(self, bucket_bytes: int = 64 << 20, all_ranks: bool = False) -> Iterator[WeightBucket]:
        """Full tensors under Hugging Face names, in buckets of about ``bucket_bytes``. Every rank
        takes part in the gather; ranks other than 0 get an empty iterator unless ``all_ranks``."""
        # cpu_offload gathers to rank 0 only; without it every rank receives the full tensors.
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=not all_ranks))
        if dist.get_rank() != 0 and not all_ranks:
            return iter(())
        return _buckets(state.items(), bucket_bytes)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Full tensors (every rank gets all of them) into this rank's shards."""
        self.model.reshard()
        state = dict(weights)
        if self.spec.head == "lm" and getattr(self.model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # tied: the embedding is the head
        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True, strict=True))

    # -- checkpoints ------------------------------------------------------------------------------------
    def _sharded_state(self) -> dict:
        self.model.reshard()  # set_model_state_dict needs the sharded layout, which a no_grad forward leaves behind
        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def save(self, path: Path) -> None:
        """Model and optimizer through ``torch.distributed.checkpoint`` (each rank writes its own
        shard into ``path``), plus ``rank<r>.pt``: this rank's LR scheduler and RNG states."""
        path = Path(path)
        dcp.save(self._sharded_state(), checkpoint_id=path)
        extra = {"scheduler": self.scheduler.state_dict() if self.scheduler else None, "rng": get_rng_state()}
        torch.save(extra, path / f"rank{self.spec.dist.rank}.pt")

    def load(self, path: Path) -> None:
        """Restore what :meth:`save` wrote (any number of ranks may have written it: DCP reshards).
        A role without an optimizer (``ref``) loads the model weights alone."""
        path = Path(path)
        state = self._sharded_state()
        dcp.load(state, checkpoint_id=path)
        if self.optimizer is None:
            set_model_state_dict(self.model, state["model"])
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        extra_file = path / f"rank{self.spec.dist.rank}.pt"
        if extra_file.is_file():
            extra = torch.load(extra_file, weights_only=True)
            if self.scheduler is not None and extra["scheduler"] is not None:
                self.scheduler.load_state_dict(extra["scheduler"])
            set_rng_state(extra["rng"])


def _buckets(items, bucket_bytes: int) -> Iterator[WeightBucket]:
    bucket: WeightBucket = []
    size = 0
    for name, tensor in items:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket
