"""Controllers run role workers and route calls to them. ``LocalController``: every role in this
process, world size 1 (the default; no Ray needed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trellis.batch import Batch
from trellis.workers import Dispatch, DistInfo, Worker


class WorkerGroup:
    """The ranks of one role. Call a worker method by name; ``Worker.DISPATCH`` says how it is routed.

    ``group.log_prob(batch)`` splits ``batch`` across data-parallel ranks and concatenates the
    results in order; ``group.export_weights()`` returns rank 0's result.
    """

    def __init__(self, role: str, workers: list[Worker]) -> None:
        self.role = role
        self.workers = workers

    def __getattr__(self, method: str) -> Callable[..., Any]:
        workers = self.__dict__.get("workers") or []
        table = type(workers[0]).DISPATCH if workers else {}
        if method not in table:
            raise AttributeError(f"role {self.__dict__.get('role')!r} has no dispatched method {method!r}; known: {sorted(table)}")
        mode = table[method]

        def call(*args: Any, **kwargs: Any) -> Any:
            if mode is Dispatch.DP_SPLIT:
                batch, rest = args[0], args[1:]
                parts = batch.chunk(len(self.workers)) if len(self.workers) > 1 else [batch]
                results = [getattr(w, method)(p, *rest, **kwargs) for w, p in zip(self.workers, parts)]
                return Batch.cat(results) if isinstance(results[0], Batch) else _mean_metrics(results)
            results = [getattr(w, method)(*args, **kwargs) for w in self.workers]
            return results[0] if mode is Dispatch.RANK0 else results

        return call


class Controller:
    """Creates worker groups for roles. Subclasses decide where ranks run."""

    def spawn(self, role: str, make_worker: Callable[[DistInfo], Worker]) -> WorkerGroup:
        raise NotImplementedError

    def shutdown(self) -> None:
        """Stop every worker this controller started."""


class LocalController(Controller):
    """World size 1: each role is one worker object in the current process."""

    def __init__(self) -> None:
        self.groups: list[WorkerGroup] = []

    def spawn(self, role: str, make_worker: Callable[[DistInfo], Worker]) -> WorkerGroup:
        worker = make_worker(DistInfo(rank=0, world_size=1))
        worker.build()
        group = WorkerGroup(role, [worker])
        self.groups.append(group)
        return group


def _mean_metrics(results: list[Any]) -> Any:
    if not isinstance(results[0], dict):
        return results[0]
    return {k: sum(r[k] for r in results) / len(results) for k in results[0]}
