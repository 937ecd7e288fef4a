"""Interface of a training-backend worker: one role (actor, critic, ref, reward_model) on one rank.

A backend plugin registers (kind ``backend``) a factory ``make_worker(spec: WorkerSpec) -> Worker``.
Controllers call workers only through the methods below; ``DISPATCH`` tells a multi-rank
controller how to route each call, so the same worker code runs under the local controller
(one rank) and under Ray (N ranks) unchanged.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from trellis.batch import Batch

ROLES = ("actor", "critic", "ref", "reward_model")
WeightBucket = list[tuple[str, torch.Tensor]]


class Dispatch(enum.Enum):
    """How a controller routes a worker method across the ranks of a role."""

    ALL = "all"  # same arguments to every rank; result of each rank, in rank order
    RANK0 = "rank0"  # same arguments to every rank (collectives need all); result of rank 0
    DP_SPLIT = "dp_split"  # the Batch argument split by data-parallel rank; results concatenated


@dataclass
class DistInfo:
    """Where a worker sits: its rank and world size in its role's process group."""

    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    device: str = "auto"  # auto: cuda when available, else cpu


@dataclass
class WorkerSpec:
    """Everything a backend needs to build a worker.

    model_path: a Hugging Face folder. options: the backend's options dataclass instance.
    role_options: the role's own section (e.g. the actor's policy loss, the critic's clip).
    algorithms: the registry, so the worker looks up policy losses, KL estimators by name.
    """

    role: str
    model_path: str
    options: Any
    role_options: Any
    dist: DistInfo = field(default_factory=DistInfo)
    registry: Any = None
    seed: int = 0
    total_steps: int = 0  # trainer steps of the run (for LR schedules such as cosine)


class Worker(ABC):
    """One role on one rank. Tensors in and out are on CPU; shapes as documented per method."""

    DISPATCH: ClassVar[dict[str, Dispatch]] = {
        "log_prob": Dispatch.DP_SPLIT,
        "values": Dispatch.DP_SPLIT,
        "score": Dispatch.DP_SPLIT,
        "update": Dispatch.DP_SPLIT,
        "sft_update": Dispatch.DP_SPLIT,
        "sft_eval": Dispatch.DP_SPLIT,
        "export_weights": Dispatch.RANK0,
        "save": Dispatch.ALL,
        "load": Dispatch.ALL,
    }

    @abstractmethod
    def build(self) -> None:
        """Initialise the process group, load the model (and optimizer for trainable roles)."""

    def log_prob(self, batch: Batch, with_entropy: bool = False) -> Batch:
        """Log-probs of the response tokens under this role's model.

        batch: ``input_ids``, ``attention_mask``, ``position_ids`` ``(batch, seq_len)``;
        ``responses``, ``response_mask`` ``(batch, response_len)``.
        Returns a Batch with ``log_probs`` ``(batch, response_len)`` and, if asked,
        ``entropy`` ``(batch, response_len)``.
        """
        raise NotImplementedError(f"{type(self).__name__} does not compute log_prob")

    def values(self, batch: Batch) -> Batch:
        """Critic: ``values`` ``(batch, response_len)`` for the same inputs as ``log_prob``."""
        raise NotImplementedError(f"{type(self).__name__} does not compute values")

    def score(self, batch: Batch) -> Batch:
        """Reward model: ``scores`` ``(batch,)``, one per sequence."""
        raise NotImplementedError(f"{type(self).__name__} does not score")

    def update(self, batch: Batch) -> dict[str, float]:
        """Train on ``batch`` (the whole step's samples for this rank); return averaged metrics."""
        raise NotImplementedError(f"{type(self).__name__} does not train")

    def sft_update(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of supervised fine-tuning on ``input_ids``, ``attention_mask``,
        ``position_ids``, ``loss_mask`` ``(batch, seq_len)`` (loss on tokens where the mask is 1)."""
        raise NotImplementedError(f"{type(self).__name__} does not do supervised training")

    def sft_eval(self, batch: Batch) -> dict[str, float]:
        """The SFT loss on ``batch`` without training (held-out loss); same inputs as ``sft_update``."""
        raise NotImplementedError(f"{type(self).__name__} does not do supervised training")

    def export_weights(self, bucket_bytes: int = 64 << 20, all_ranks: bool = False) -> Iterator[WeightBucket]:
        """Full (unsharded) weights in Hugging Face names, in buckets of about ``bucket_bytes``.
        Every rank must call it (it gathers shards); rank 0 gets the weights, and with
        ``all_ranks`` every rank does (each feeds its own colocated rollout engine)."""
        raise NotImplementedError(f"{type(self).__name__} does not export weights")

    def save(self, path: Path) -> None:
        """Write this rank's model/optimizer state under ``path``."""
        raise NotImplementedError(f"{type(self).__name__} cannot save")

    def load(self, path: Path) -> None:
        """Restore what ``save`` wrote."""
        raise NotImplementedError(f"{type(self).__name__} cannot load")
