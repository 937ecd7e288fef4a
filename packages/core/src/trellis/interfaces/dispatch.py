"""The device mesh of a role and how a call is dealt over it (dispatch modes).

A role's ranks form a mesh of data- (dp), context- (cp), tensor- (tp) and pipeline-parallel (pp)
coordinates. A dispatch mode says how a controller turns one call into per-rank calls
(``scatter``) and the per-rank results back into one (``gather``). The built-in modes:

- ``ALL``: the same arguments to every rank; the list of every rank's result.
- ``RANK0``: the same arguments to every rank (collectives need them all); rank 0's result.
- ``DP_SPLIT``: the ``Batch`` argument dealt over the data-parallel groups, replicated to the
  tp/cp/pp ranks of a group; results collected from one rank per group (the last pipeline
  stage, tp and cp rank 0) and put back in the original sample order.

A backend may declare modes of its own: any object with ``scatter`` and ``gather``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from trellis.batch import Batch


@dataclass(frozen=True)
class Mesh:
    """Sizes of each parallel dimension; the world is their product. Ranks are laid out with tp
    varying fastest, then cp, then dp, then pp (Megatron's default order)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"mesh size {name}={getattr(self, name)} must be at least 1")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def coords(self, rank: int) -> dict[str, int]:
        """``{"dp": .., "tp": .., "pp": .., "cp": ..}`` of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.world_size} ranks ({self})")
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        return {"dp": dp, "tp": tp, "pp": pp, "cp": cp}

    def collects(self, rank: int) -> bool:
        """Whether ``rank`` returns its data-parallel group's result: the last pipeline stage,
        tensor- and context-parallel rank 0."""
        c = self.coords(rank)
        return c["tp"] == 0 and c["cp"] == 0 and c["pp"] == self.pp - 1

    @staticmethod
    def data_parallel(world_size: int) -> Mesh:
        return Mesh(dp=world_size)

    @staticmethod
    def for_options(options: Any, world_size: int) -> Mesh:
        """A backend's or engine's layout: ``options.mesh(world_size)`` when its options dataclass
        defines that method, else every rank data-parallel."""
        mesh_of = getattr(options, "mesh", None)
        mesh = mesh_of(world_size) if callable(mesh_of) else Mesh.data_parallel(world_size)
        if mesh.world_size != world_size:
            raise ValueError(f"{type(options).__name__}.mesh({world_size}) gave {mesh}, which has {mesh.world_size} ranks")
        return mesh


class DispatchMode(Protocol):
    """How one call becomes per-rank calls and how their results become one."""

    def scatter(self, args: tuple, mesh: Mesh) -> list[tuple]:
        """Per-rank positional arguments, one tuple per rank of ``mesh``."""

    def gather(self, results: list[Any], mesh: Mesh) -> Any:
        """One result from every rank's result (in rank order)."""


class _All:
    def scatter(self, args: tuple, mesh: Mesh) -> list[tuple]:
        return [args] * mesh.world_size

    def gather(self, results: list[Any], mesh: Mesh) -> Any:
        return results

    def __repr__(self) -> str:
        return "ALL"


class _Rank0(_All):
    def gather(self, results: list[Any], mesh: Mesh) -> Any:
        return results[0]

    def __repr__(self) -> str:
        return "RANK0"


class DataParallel:
    """Deal the first ``Batch`` among the positional arguments over the data-parallel groups.

    ``strided``: group g takes samples g, g+D, g+2D, ... (D data-parallel groups), so the k-th
    mini-batch of all groups together is exactly the k-th mini-batch one rank would take and D
    ranks train like one; the sample count must divide by D. Otherwise contiguous chunks of
    ``ceil(n / D)`` (the last ones smaller, possibly empty), as prompts for rollout engines.
    Batch results come back in the original order; metric dicts are averaged over groups.
    """

    def __init__(self, strided: bool = True) -> None:
        self.strided = strided

    def indices(self, n: int, groups: int) -> list[torch.Tensor]:
        """The sample indices of each data-parallel group."""
        if self.strided:
            if n % groups:
                raise ValueError(
                    f"a batch of {n} samples cannot be split evenly over {groups} data-parallel ranks; "
                    f"make the samples per step a multiple of {groups}"
                )
            return [torch.arange(g, n, groups) for g in range(groups)]
        size = -(-n // groups)
        return [torch.arange(min(g * size, n), min((g + 1) * size, n)) for g in range(groups)]

    def scatter(self, args: tuple, mesh: Mesh) -> list[tuple]:
        at = batch_position(args)
        if at is None:
            raise ValueError("a data-parallel call needs a Batch argument; none was given")
        parts = [args[at][i] for i in self.indices(len(args[at]), mesh.dp)]
        return [(*args[:at], parts[mesh.coords(r)["dp"]], *args[at + 1 :]) for r in range(mesh.world_size)]

    def gather(self, results: list[Any], mesh: Mesh) -> Any:
        collected = collect(results, mesh)
        if not isinstance(collected[0], Batch):
            return mean_metrics(collected)
        n = sum(len(b) for b in collected)
        order = torch.cat(self.indices(n, mesh.dp))
        # a group with no samples (contiguous chunks of a short batch) returns an empty batch
        return Batch.cat([b for b in collected if len(b)], pad=True)[torch.argsort(order)]

    def __repr__(self) -> str:
        return "DP_SPLIT" if self.strided else "DP_CHUNKS"


def batch_position(args: tuple) -> int | None:
    """Where the first ``Batch`` is among a call's positional arguments (the one a route deals
    and selects the inputs of), or None."""
    return next((i for i, arg in enumerate(args) if isinstance(arg, Batch)), None)


def collect(results: Sequence[Any], mesh: Mesh) -> list[Any]:
    """The results of the collecting rank of each data-parallel group, in data-parallel order."""
    by_dp = {mesh.coords(r)["dp"]: res for r, res in enumerate(results) if mesh.collects(r)}
    return [by_dp[g] for g in range(mesh.dp)]


def mean_metrics(results: list[Any]) -> Any:
    """Rank results that are metric dicts are averaged key by key; anything else is the first."""
    if not isinstance(results[0], dict):
        return results[0]
    return {k: sum(r[k] for r in results) / len(results) for k in results[0]}


ALL: DispatchMode = _All()
RANK0: DispatchMode = _Rank0()
DP_SPLIT: DispatchMode = DataParallel(strided=True)
DP_CHUNKS: DispatchMode = DataParallel(strided=False)


@dataclass(frozen=True)
class Route:
    """How a worker verb is called: its dispatch mode and the ``Batch`` fields it reads
    (``None``: the batch as given). Controllers send ``batch.select(*inputs)``, nothing more.

    method: the worker method that serves the verb, called with the verb's name first (a role
    worker's training verbs are all served by ``train(verb, batch)``); None: the method named
    like the verb."""

    mode: DispatchMode
    inputs: tuple[str, ...] | None = None
    method: str | None = None
