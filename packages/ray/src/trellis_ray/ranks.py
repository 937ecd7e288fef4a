"""Ray's ranks: a rank process (a Ray actor holding the workers of every role colocated there and,
for the actor's pool, a rollout engine), pools of them in placement groups, and the worker and
rollout groups that route calls to a pool. Every wait on Ray has a timeout."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from itertools import chain
from typing import Any

import torch

from trellis.kit.controller import (
    DP_CHUNKS,
    Batch,
    DistInfo,
    Generation,
    Mesh,
    RolloutEngine,
    RolloutFn,
    RolloutGroup,
    SamplingParams,
    WeightTransport,
    Worker,
    WorkerGroup,
    describe_engine,
    exported_update,
    run_rollout_fn,
    sync_engine,
    sync_from,
    tensor_digest,
    with_images,
)

log = logging.getLogger("trellis")


class RankFailure(RuntimeError):
    """A rank died or raised; the message names the role, rank, node and the remote traceback."""


def _timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """``fn``'s result (a generator listed: it cannot cross processes) and the seconds it took."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    result = list(result) if isinstance(result, Iterator) else result
    return result, time.perf_counter() - start


class RankProcess:
    """One process of one rank: holds the workers of every role colocated here and, for the
    actor's pool, a rollout engine (a rollout pool's process: an engine and no workers). Runs as a
    Ray actor; ``agenerate`` makes it an asyncio actor, so every call runs on its event-loop
    thread, the thread the engine is built and stepped on."""

    def __init__(self, rank: int, threads: int, local_rank: int) -> None:
        import torch

        os.environ["OMP_NUM_THREADS"] = str(threads)
        os.environ["LOCAL_RANK"] = str(local_rank)  # not the driver's (a torchrun-launched driver has one)
        torch.set_num_threads(threads)
        niceness = os.nice(0)  # above 0: a cluster started by ray.init without trellis_ray.controller.WORKER_NICENESS
        if niceness > 0:
            log.warning(
                "rank %d runs at niceness %d: any process at the default niceness on this node takes its cores first; "
                "start the Ray cluster with RAY_worker_niceness=0 in its environment",
                rank,
                niceness,
            )
        self.rank = rank
        self.workers: dict[str, Worker] = {}
        self.engine: RolloutEngine | None = None
        self.transport: WeightTransport | None = None  # the actor's rank 0 and a pool's engines: set by join_transport

    def address(self) -> tuple[str, int, str]:
        """This node's IP, a free port on it and its temp folder (rank 0's are where the ranks of
        the process group meet)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1], tempfile.gettempdir()

    def add_worker(self, role: str, make_worker: Callable[[DistInfo], Worker], dist: DistInfo) -> dict:
        worker = make_worker(dist)
        worker.build()
        self.workers[role] = worker
        return worker.routes()

    def call(self, role: str, method: str, args: tuple, kwargs: dict) -> tuple[Any, float]:
        return _timed(getattr(self.workers[role], method), *args, **kwargs)

    def add_rollout(self, make_engine: Callable[[], RolloutEngine]) -> tuple[torch.dtype | None, str, tuple[str, ...]]:
        """Build this rank's engine; returns what its rollout group keeps of it (``describe_engine``)."""
        self.engine = make_engine()
        return describe_engine(self.engine)

    def generate(self, prompts: Batch, params: SamplingParams) -> tuple[Batch, float]:
        if not len(prompts):  # a short batch left this engine group without prompts
            return Batch(), 0.0
        return _timed(self.engine.generate, prompts, params)

    async def rollout(self, prompts: Batch, params: SamplingParams, fn: RolloutFn) -> tuple[Batch, float]:
        if not len(prompts):
            return Batch(), 0.0
        start = time.perf_counter()
        out = await run_rollout_fn(fn, self.engine, prompts, params)
        return out, time.perf_counter() - start

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams, images: dict | None = None) -> Generation:
        return await self.engine.agenerate(prompt_ids, params, **with_images(images))

    def sync_rollout(self, role: str) -> tuple[None, float]:
        return _timed(sync_from, self.engine, self.workers[role])

    def sleep_rollout(self) -> tuple[None, float]:
        return _timed(self.engine.sleep)

    def wake_rollout(self, tags: tuple[str, ...]) -> tuple[None, float]:
        return _timed(self.engine.wake, tags)

    def join_transport(self, transport: WeightTransport, rank: int, world: int, address: tuple[str, int]) -> None:
        """Keep ``transport`` here as rank ``rank`` of its ``world`` ends (rank 0: the actor's rank 0)."""
        transport.join(rank, world, address)
        self.transport = transport

    def send_weights(self, role: str, dtype: torch.dtype | None, version: int) -> tuple[tuple[Any, dict[str, str]] | None, float]:
        """Every rank exports ``role``'s weights in ``dtype`` (a collective); rank 0 sends them by
        its transport stamped ``version`` and returns the transport's handle and its digest of each
        tensor sent (in send order); the other ranks return None."""
        start = time.perf_counter()
        shapes, weights = exported_update(self.workers[role], dtype)
        if self.rank:
            for _ in weights:
                pass
            return None, time.perf_counter() - start
        digests: dict[str, str] = {}

        def noted():
            for name, tensor in weights:
                digests[name] = tensor_digest(tensor)
                yield name, tensor

        handle = self.transport.send(noted(), shapes, version)
        return (handle, digests), time.perf_counter() - start

    def receive_weights(self, handle: Any, version: int) -> tuple[dict[str, str] | None, float]:
        """A rollout pool's engine: load the update ``handle`` names (version ``version``) from the
        transport into the engine; the engine's digests of the tensors it received (None: it cannot tell)."""
        start = time.perf_counter()
        manifest, tensors = self.transport.receive(handle, version)
        names: list[str] = []

        def noted():
            for name, tensor in tensors:
                names.append(name)
                yield name, tensor

        stream = noted()
        try:
            sync_engine(self.engine, stream, manifest)
        finally:
            for _ in stream:  # a refused update is still read whole: a broadcast waits for every receiver
                pass
        return self.engine.weight_checksums(names), time.perf_counter() - start

    def close(self) -> None:
        """Close the rollout engine (its subprocesses, memory), then the workers (a backend leaves
        its process group), before Ray ends this process: ``ray.kill`` skips atexit hooks."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        while self.workers:
            self.workers.popitem()[1].close()

    def copy_weights(self, source: str, target: str) -> tuple[None, float]:
        return _timed(lambda: self.workers[target].load_weights(chain.from_iterable(self.workers[source].export_weights(all_ranks=True))))


# Passed from the driver to every rank (Ray's runtime env): how collectives find the network, where models are cached.
FORWARDED_ENV = ("GLOO_SOCKET_IFNAME", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
FORWARDED_PREFIXES = ("NCCL_",)


def forwarded_env() -> dict[str, str]:
    """The driver's variables the ranks need to agree with it on (``NCCL_*``, ``GLOO_SOCKET_IFNAME``, ``HF_HOME``...)."""
    return {k: v for k, v in os.environ.items() if k in FORWARDED_ENV or k.startswith(FORWARDED_PREFIXES)}


class RayPool:
    """``world`` ranks packed by node: one placement group of ``procs_per_node`` bundles per node
    (``STRICT_PACK``: a node's ranks on one machine, their ranks consecutive), one
    ``RankProcess`` per bundle, holding ``gpus`` devices when the cluster has GPUs."""

    def __init__(
        self,
        ray,
        name: str,
        world: int,
        procs_per_node: int,
        use_gpu: bool,
        timeouts: tuple[float, float],
        threads: int,
        gpus: int = 1,
    ) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        timeout_s, self.timeout_s = timeouts  # placement, then every call
        self.ray, self.name = ray, name
        gpus = gpus if use_gpu else 0
        bundle = {"CPU": 1, "GPU": gpus} if gpus else {"CPU": 1}
        per_node = min(world, procs_per_node)
        self.pgs = [placement_group([dict(bundle) for _ in range(per_node)], strategy="STRICT_PACK") for _ in range(world // per_node)]
        try:
            ray.get([pg.ready() for pg in self.pgs], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            for pg in self.pgs:
                ray.util.remove_placement_group(pg)
            raise RuntimeError(
                f"Ray could not place pool {name!r} within trainer.ray_timeout_s={timeout_s:g} s: it asks for {len(self.pgs)} node(s) with "
                f"{per_node} x {bundle} each but the cluster has {ray.available_resources()} available of {ray.cluster_resources()}; "
                f"lower trainer.procs_per_node / trainer.nnodes or add resources"
            ) from None
        remote = ray.remote(num_cpus=1, num_gpus=gpus)(RankProcess)
        env = {"env_vars": forwarded_env()}
        self.ranks = [
            remote.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pgs[i // per_node], placement_group_bundle_index=i % per_node),
                runtime_env=env,
            ).remote(i, threads, 0 if use_gpu else i % per_node)  # Ray shows a rank its own GPU alone, as device 0
            for i in range(world)
        ]
        self.nodes = self.get([r.address.remote() for r in self.ranks], "start")
        self.device = "cuda" if use_gpu else "cpu"
        master, port, tmp = self.nodes[0]
        # Ranks on one machine meet through a file (nothing listens); across machines through rank
        # 0's node address (torch's store listens there).
        one_machine = len({ip for ip, _, _ in self.nodes}) == 1
        self.rendezvous = f"file://{tmp}/trellis-rendezvous-{uuid.uuid4().hex}" if one_machine else f"tcp://{master}:{port}"
        self.dispatch_s = 0.0
        self._clock = threading.Lock()  # a pool may be called from a background thread of the driver

    def timed(self, refs: list, what: str, role: str) -> list:
        """Results of timed rank calls; adds the wall time not spent computing on the slowest rank
        (serialisation, transfer, scheduling) to ``dispatch_s``."""
        start = time.perf_counter()
        pairs = self.get(refs, what, role)
        with self._clock:
            self.dispatch_s += time.perf_counter() - start - max(seconds for _, seconds in pairs)
        return [result for result, _ in pairs]

    def dispatch_seconds(self) -> float:
        """``dispatch_s`` since the last call."""
        with self._clock:
            seconds, self.dispatch_s = self.dispatch_s, 0.0
        return seconds

    def get(self, refs: list, what: str, role: str | None = None) -> list:
        """``ray.get`` with a timeout; a dead or failing rank becomes a ``RankFailure`` that says where."""
        ray = self.ray
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RankFailure(f"pool {self.name!r}: {what} did not finish within {self.timeout_s:g} s (trainer.ray_call_timeout_s)") from None
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            rank = self._failed_rank(refs)
            node = self.nodes[rank][0] if rank is not None and hasattr(self, "nodes") else "?"
            cause = getattr(exc, "traceback_str", None) or "".join(traceback.format_exception_only(exc))
            raise RankFailure(
                f"role {role or self.name!r} rank {rank} on node {node} failed in {what}: {cause.strip()}\n"
                "the run can be resumed from its last checkpoint (trainer.resume=auto)"
            ) from None

    def _failed_rank(self, refs: list) -> int | None:
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        for i, ref in enumerate(refs):
            if ref in ready:
                try:
                    self.ray.get(ref, timeout=0)
                except Exception:  # noqa: BLE001 - we only want to know which one failed
                    return i
        return None


class RayWorkerGroup(WorkerGroup):
    ships = True

    def __init__(self, role: str, pool: RayPool, mesh: Mesh, routes: dict) -> None:
        super().__init__(role, mesh, routes)
        self.pool = pool

    def _execute(self, method: str, per_rank_args: list[tuple], kwargs: dict[str, Any]) -> list[Any]:
        refs = [r.call.remote(self.role, method, a, kwargs) for r, a in zip(self.pool.ranks, per_rank_args)]
        return self.pool.timed(refs, f"{self.role}.{method}", self.role)


class RayRollout(RolloutGroup):
    def __init__(self, pool: RayPool, actor_role: str, mesh: Mesh) -> None:
        super().__init__()
        self.pool, self.actor_role, self.mesh = pool, actor_role, mesh
        self.engines = mesh.dp
        # agenerate takes the engine groups in turn (their collecting ranks drive the engine)
        self._next = itertools.cycle([r for i, r in enumerate(pool.ranks) if mesh.collects(i)])

    def _generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        return self._deal("generate", prompts, params)

    def _rollout(self, prompts: Batch, params: SamplingParams, fn: RolloutFn) -> Batch:
        return self._deal("rollout", prompts, params, fn)

    def _deal(self, method: str, prompts: Batch, params: SamplingParams, *extra: Any) -> Batch:
        per_rank = DP_CHUNKS.scatter((prompts,), self.mesh)
        # Each engine group samples a contiguous chunk of the prompts. An engine seeds the sample
        # k of its call with seed + k (vLLM: per prompt seed + i*n, plus the sample index), so
        # offsetting by the chunk's first global sample index seeds every sample with seed + its
        # global index, as one engine would: no two samples of a step share a seed.
        starts = [int(chunk[0]) if len(chunk) else 0 for chunk in DP_CHUNKS.indices(len(prompts), self.mesh.dp)]
        refs = []
        for i, (r, (part,)) in enumerate(zip(self.pool.ranks, per_rank)):
            refs.append(getattr(r, method).remote(part, params.skip(starts[self.mesh.coords(i)["dp"]] * params.n), *extra))
        # groups pad responses to their own longest; gather pads to the longest overall
        return DP_CHUNKS.gather(self.pool.timed(refs, f"rollout.{method}", "rollout"), self.mesh)

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams, images: dict | None = None) -> Generation:
        try:
            return await asyncio.wait_for(next(self._next).agenerate.remote(prompt_ids, params, **with_images(images)), self.pool.timeout_s)
        except asyncio.TimeoutError:
            raise RankFailure(f"pool {self.pool.name!r}: rollout.agenerate did not finish within {self.pool.timeout_s:g} s") from None

    def _sync(self) -> None:
        self.pool.timed([r.sync_rollout.remote(self.actor_role) for r in self.pool.ranks], "weight sync", self.actor_role)

    def _sleep(self) -> None:
        self.pool.timed([r.sleep_rollout.remote() for r in self.pool.ranks], "rollout.sleep", "rollout")

    def _wake(self, tags) -> None:
        self.pool.timed([r.wake_rollout.remote(tuple(tags)) for r in self.pool.ranks], "rollout.wake", "rollout")
