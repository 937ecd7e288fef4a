"""Test-only backend ``plain``: a Hugging Face model in plain PyTorch, one process, no FSDP, no
loss code. It implements only the backend verbs, and the ``rl`` and ``sft`` recipes train with it
as they do with FSDP: the proof that losses, batching and the loop live outside backends."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

import trellis
from trellis import Batch
from trellis.kit.backend import (
    Backend,
    BackendSpec,
    LossFn,
    WeightBucket,
    backward_each,
    clipped_step,
    forward_outputs,
    get_rng_state,
    load_hf_model,
    make_optimizer,
    schedule_step,
    set_rng_state,
)

STATE_FILE = "plain.pt"


class PlainBackend(Backend):
    """One role's model in this process, float32, on the CPU."""

    def __init__(self, spec: BackendSpec) -> None:
        if spec.dist.world_size != 1:
            raise ValueError(f"backend 'plain' runs one process; this run has {spec.dist.world_size} ranks")
        self.spec = spec
        self.optimizer = self.scheduler = None

    def build(self) -> None:
        torch.manual_seed(self.spec.seed)
        self.model = load_hf_model(self.spec.model_path, self.spec.head, torch.float32)
        if self.spec.trainable:
            self.optimizer, self.scheduler = make_optimizer(self.model.parameters(), self.spec.optim, self.spec.total_steps)
        self.model.train(self.spec.trainable)

    def forward(self, micros: list[Batch], outputs: tuple[str, ...]) -> list[dict[str, torch.Tensor]]:
        with torch.no_grad():
            return [forward_outputs(self.model, m, outputs, self.spec.head) for m in micros]

    def forward_backward(self, micros: list[Batch], outputs: tuple[str, ...], loss_fn: LossFn) -> list[dict[str, float]]:
        return backward_each(micros, lambda micro: forward_outputs(self.model, micro, outputs, self.spec.head), loss_fn)

    def optimizer_step(self) -> dict[str, float]:
        return clipped_step(list(self.model.parameters()), self.optimizer, self.spec.optim.grad_clip)

    def lr_step(self) -> float:
        return schedule_step(self.scheduler)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        return list(values)

    def export_weights(self, bucket_bytes: int = 64 << 20, all_ranks: bool = False, dtype: torch.dtype | None = None) -> Iterator[WeightBucket]:
        yield [(name, tensor.detach().to(dtype or tensor.dtype, copy=True)) for name, tensor in self.model.state_dict().items()]

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(tensor.shape) for name, tensor in self.model.state_dict().items()}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            state = self.model.state_dict()
            for name, tensor in weights:
                state[name].copy_(tensor)

    def save(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        state = {"model": self.model.state_dict(), "rng": get_rng_state()}
        if self.optimizer is not None:
            state |= {"optim": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        torch.save(state, path / STATE_FILE)

    def load(self, path: Path) -> None:
        state = torch.load(path / STATE_FILE, weights_only=False)
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optim"])
            self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])


@trellis.hookimpl
def trellis_register(registry):
    registry.add("backend", "plain", PlainBackend)
