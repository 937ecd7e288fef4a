"""Controllers run role workers and route calls to them. ``LocalController``: every role in this
process, world size 1 (the default; no Ray needed). The Ray controller (``ray_controller.py``)
runs N ranks per role with the same groups."""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from typing import Any

import torch

from trellis.batch import Batch
from trellis.rollout import RolloutEngine, SamplingParams
from trellis.workers import Dispatch, DistInfo, Worker


class WorkerGroup:
    """The ranks of one role. Call a worker method by name; the worker class's ``DISPATCH`` table
    says how it is routed: ``group.log_prob(batch)`` deals ``batch`` out to the data-parallel
    ranks (strided) and gathers the results back in the original order; ``group.export_weights()`` returns rank 0's result.
    Subclasses say how a call reaches the ranks (``_execute``)."""

    def __init__(self, role: str, world_size: int, dispatch: dict[str, Dispatch]) -> None:
        self.role = role
        self.world_size = world_size
        self.dispatch = dispatch

    def __getattr__(self, method: str) -> Callable[..., Any]:
        table = self.__dict__.get("dispatch", {})
        if method not in table:
            raise AttributeError(f"role {self.__dict__.get('role')!r} has no dispatched method {method!r}; known: {sorted(table)}")
        return lambda *args, **kwargs: self.call(method, *args, **kwargs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        mode = self.dispatch[method]
        if mode is Dispatch.DP_SPLIT:
            batch, rest = args[0], args[1:]
            if len(batch) % self.world_size:
                raise ValueError(
                    f"{self.role}.{method}: a batch of {len(batch)} samples cannot be split evenly over "
                    f"{self.world_size} data-parallel ranks; make the samples per step a multiple of {self.world_size}"
                )
            # Rank r takes samples r, r+W, r+2W, ...: the k-th mini-batch of every rank together is
            # then exactly the k-th mini-batch one rank would take, so N ranks train like one.
            index = [torch.arange(r, len(batch), self.world_size) for r in range(self.world_size)]
            results = self._execute(method, [(batch[i], *rest) for i in index], kwargs)
            if not isinstance(results[0], Batch):
                return mean_metrics(results)
            return Batch.cat(results)[torch.argsort(torch.cat(index))]
        results = self._execute(method, [args] * self.world_size, kwargs)
        return results[0] if mode is Dispatch.RANK0 else results

    def _execute(self, method: str, per_rank_args: list[tuple], kwargs: dict[str, Any]) -> list[Any]:
        raise NotImplementedError


class RolloutGroup:
    """The rollout engine(s), colocated with the actor's ranks (hybrid engine): ``generate`` splits
    the prompts over the ranks; ``sync_weights`` moves the actor's weights into the engines in memory."""

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        raise NotImplementedError

    def sync_weights(self) -> None:
        raise NotImplementedError


class Controller:
    """Creates worker groups for roles. Subclasses decide where ranks run."""

    def spawn(self, role: str, make_worker: Callable[[DistInfo], Worker]) -> WorkerGroup:
        raise NotImplementedError

    def spawn_rollout(self, make_engine: Callable[[], RolloutEngine], actor: WorkerGroup) -> RolloutGroup:
        """A rollout engine in each process of ``actor``'s ranks."""
        raise NotImplementedError

    def dispatch_seconds(self) -> float:
        """Seconds spent moving calls and results between this process and the ranks (not computing)
        since the last call; 0 for the local controller."""
        return 0.0

    def shutdown(self) -> None:
        """Stop every worker this controller started."""


class LocalWorkerGroup(WorkerGroup):
    def __init__(self, role: str, workers: list[Worker]) -> None:
        super().__init__(role, len(workers), type(workers[0]).DISPATCH)
        self.workers = workers

    def _execute(self, method: str, per_rank_args: list[tuple], kwargs: dict[str, Any]) -> list[Any]:
        return [getattr(w, method)(*a, **kwargs) for w, a in zip(self.workers, per_rank_args)]


class LocalRollout(RolloutGroup):
    def __init__(self, engine: RolloutEngine, actor: LocalWorkerGroup) -> None:
        self.engine = engine
        self.actor = actor

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        return self.engine.generate(prompts, params)

    def sync_weights(self) -> None:
        self.engine.load_weights(chain.from_iterable(self.actor.workers[0].export_weights()))


class LocalController(Controller):
    """World size 1: each role is one worker object in the current process."""

    def spawn(self, role: str, make_worker: Callable[[DistInfo], Worker]) -> WorkerGroup:
        worker = make_worker(DistInfo(rank=0, world_size=1))
        worker.build()
        return LocalWorkerGroup(role, [worker])

    def spawn_rollout(self, make_engine: Callable[[], RolloutEngine], actor: WorkerGroup) -> RolloutGroup:
        return LocalRollout(make_engine(), actor)


def mean_metrics(results: list[Any]) -> Any:
    """Rank results that are metric dicts are averaged key by key; anything else is rank 0's."""
    if not isinstance(results[0], dict):
        return results[0]
    return {k: sum(r[k] for r in results) / len(results) for k in results[0]}
