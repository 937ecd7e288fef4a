"""Controllers run role workers and route calls to them; a controller is a component (kind
``controller``) that ``trainer.controller`` names. ``LocalController`` (``local``, the default):
every role in this process, world size 1. trellis-ray's (``ray``) runs N ranks per role with the
same groups."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import pickle
import threading
from collections.abc import Callable, Iterator
from itertools import chain
from typing import Any

import torch
from omegaconf import DictConfig

from trellis.batch import Batch
from trellis.config import ConfigError
from trellis.interfaces.backend import MODEL_INPUTS, DistInfo, refuse_lost_images
from trellis.interfaces.dispatch import Mesh, Route, batch_position
from trellis.interfaces.moe import refuse_lost_routes
from trellis.interfaces.rollout import (
    ALL_MEMORY,
    Generation,
    RolloutEngine,
    RolloutFn,
    SamplingParams,
    sync_engine,
    weights_awake,
    with_images,
)
from trellis.runtime.worker import Worker

log = logging.getLogger("trellis")


def batch_bytes(batch: Batch) -> int:
    """Bytes a batch takes on the wire: its tensors plus its pickled Python fields."""
    tensors = sum(t.numel() * t.element_size() for t in batch.tensors.values())
    return tensors + (len(pickle.dumps(batch.non_tensors)) if batch.non_tensors else 0)


def sync_from(engine: RolloutEngine, worker: Worker) -> None:
    """Load ``worker``'s current weights into ``engine`` (both in this process), exported in the
    engine's ``weight_dtype`` and kept on the worker's device (``all_ranks``: no copy through host
    memory). The engine checks the worker's ``weight_shapes()`` first (when the backend can tell),
    then reads the export one tensor at a time as the backend gathers it. A policy's LoRA adapter
    goes alone to an engine with ``adapter_sync`` (every rank gathers it whole: it is small)."""
    if engine.adapter_sync and worker.adapter is not None:  # the adapter alone, on the engine's base
        with weights_awake(engine):
            engine.load_adapter(*worker.export_adapter())
        return
    shapes, weights = exported_update(worker, engine.weight_dtype)
    sync_engine(engine, weights, shapes)


def exported_update(worker: Worker, dtype: torch.dtype | None) -> tuple[dict | None, Iterator[tuple[str, torch.Tensor]]]:
    """``(manifest, weights)`` of a weight sync from ``worker``: its ``weight_shapes()`` (read
    first, before the export starts gathering) and its full tensors in ``dtype`` as the backend
    gathers them (every rank takes part: a collective)."""
    shapes = worker.weight_shapes()
    return shapes, chain.from_iterable(worker.export_weights(all_ranks=True, dtype=dtype))


async def run_rollout_fn(fn: RolloutFn, engine: RolloutEngine, prompts: Batch, params: SamplingParams) -> Batch:
    """``fn``'s samples of ``prompts`` on ``engine`` (awaited when it is async)."""
    out = fn(engine, prompts, params)
    return await out if inspect.isawaitable(out) else out


class WorkerGroup:
    """The ranks of one role. Call a worker verb by name; the worker's ``routes()`` say how it is
    dealt over the role's mesh and which fields of its ``Batch`` argument travel:
    ``group.log_prob(batch)`` sends ``batch.select(<what log_prob reads>)`` to the data-parallel
    groups (strided) and gathers the results back in the original order; ``group.export_weights()``
    returns rank 0's result; a role's training verbs are called alike (``group.update(batch)``, or
    ``group.train("update", batch)``). Subclasses say how a call reaches the ranks (``_execute``)."""

    ships = False  # calls cross processes: count the bytes they carry

    def __init__(self, role: str, mesh: Mesh, routes: dict[str, Route]) -> None:
        self.role = role
        self.mesh = mesh
        self.routes = routes
        self.bytes_sent = 0  # Batch bytes shipped to the ranks since the last ``traffic()``
        self.bytes_given = 0  # what the whole batches handed to the calls would have been

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    def __getattr__(self, verb: str) -> Callable[..., Any]:
        table = self.__dict__.get("routes", {})
        if verb not in table:
            raise AttributeError(f"role {self.__dict__.get('role')!r} has no dispatched verb {verb!r}; known: {sorted(table)}")
        return lambda *args, **kwargs: self.call(verb, *args, **kwargs)

    def call(self, verb: str, *args: Any, **kwargs: Any) -> Any:
        """``verb`` on every rank as its route says (a route with a ``method`` gets the verb first)."""
        route = self._route(verb)
        if route.method is not None:
            return self._dispatch(route.method, route, (verb, *args), kwargs)
        return self._dispatch(verb, route, args, kwargs)

    def train(self, verb: str, batch: Batch) -> dict[str, float]:
        """One training verb (its objective's loss minimised) on ``batch``; the metrics."""
        return self._dispatch("train", self._route(verb), (verb, batch), {})

    def evaluate(self, verb: str, batch: Batch) -> dict[str, float]:
        """A training verb's loss on ``batch`` without training (held-out loss)."""
        return self._dispatch("evaluate", self._route(verb), (verb, batch), {})

    def _route(self, verb: str) -> Route:
        if verb not in self.routes:
            raise AttributeError(f"role {self.role!r} has no dispatched verb {verb!r}; known: {sorted(self.routes)}")
        return self.routes[verb]

    def _dispatch(self, method: str, route: Route, args: tuple, kwargs: dict[str, Any]) -> Any:
        at = batch_position(args)
        if at is not None and route.inputs is not None:
            given = args[at]
            refuse_lost_images(given, route.inputs, f"the backend of role {self.role!r}")
            refuse_lost_routes(given, route.inputs, f"the backend of role {self.role!r}")
            shipped = given.select(*[k for k in route.inputs if k in given])
            if self.ships:
                self.bytes_given += batch_bytes(given)
                self.bytes_sent += batch_bytes(shipped)
            args = (*args[:at], shipped, *args[at + 1 :])
        results = self._execute(method, route.mode.scatter(args, self.mesh), kwargs)
        return route.mode.gather(results, self.mesh)

    def traffic(self) -> tuple[int, int]:
        """``(bytes sent, bytes the whole batches would have been)`` since the last call."""
        out = (self.bytes_sent, self.bytes_given)
        self.bytes_sent = self.bytes_given = 0
        return out

    def _execute(self, method: str, per_rank_args: list[tuple], kwargs: dict[str, Any]) -> list[Any]:
        raise NotImplementedError


def describe_engine(engine: RolloutEngine) -> tuple[torch.dtype | None, str, tuple[str, ...]]:
    """What a rollout group keeps of its engines (:meth:`RolloutGroup.described_by`), from one of them
    wherever it runs: its weight dtype, class name and model inputs."""
    return engine.weight_dtype, type(engine).__name__, tuple(engine.model_inputs)


class RolloutGroup:
    """The rollout engine(s), colocated with the actor's ranks (hybrid engine): ``generate`` deals
    the prompts over the engines' data-parallel groups; ``rollout`` runs a function of the caller's
    next to each engine on its share of the prompts (the multi-turn recipe's conversations);
    ``agenerate`` runs one sample on an engine (on the engine's own thread); ``sync_weights`` moves
    the actor's weights into the engines in memory. Every sample carries the ``weight_version`` it
    came from. Calls from several threads take turns (``lock``): a generation ahead of training
    (``trellis_algos.rl.ahead``) and the trainer's weight sync never overlap on an engine."""

    version = 0
    asleep = False  # the engines slept and nothing has woken them since
    shared = False  # the engine generates from the actor's own module: nothing to sync
    engines = 1  # engine groups the prompts are dealt over, in contiguous chunks
    weight_dtype: torch.dtype | None = None  # what the engines hold their weights in (None: unknown)
    engine_name = ""  # the engines' class, for messages
    model_inputs: tuple[str, ...] = MODEL_INPUTS  # the prompt fields the engines read

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._syncs_waiting = 0  # weight syncs waiting for the lock (a partial rollout lets them in)
        self._turns = threading.Condition()

    def described_by(self, description: tuple[torch.dtype | None, str, tuple[str, ...]]) -> None:
        """Keep what :func:`describe_engine` says of the engines."""
        self.weight_dtype, self.engine_name, self.model_inputs = description

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """The engines get the prompts' model inputs only (their ``model_inputs``); the other fields
        (data source, ground truth, ``uid``...) stay here and are repeated onto each prompt's samples."""
        return self._sample(prompts, params, self.model_inputs, self._generate)

    def rollout(self, prompts: Batch, params: SamplingParams, fn: RolloutFn) -> Batch:
        """``fn(engine, prompts, params)`` next to each engine, on the engine's share of the
        prompts (the Ray controller pickles ``fn`` to every rank; an async ``fn`` runs on the
        engine's event loop). The engines get the fields ``fn.inputs`` names (None: every field);
        the others stay here and are repeated onto each prompt's samples, as for ``generate``."""
        return self._sample(prompts, params, fn.inputs, functools.partial(self._rollout, fn=fn))

    def stream(self, prompts: Batch, params: SamplingParams, size: int) -> Iterator[Batch]:
        """The samples of ``prompts`` in parts of at most ``size`` prompts, in order, each as soon
        as it is generated (the caller can work on one part while the next generates). Part k's
        seeds move on past the samples before it (``params.skip``), as one call's would."""
        for start in range(0, len(prompts), size):
            yield self.generate(prompts[start : start + size], params.skip(start * params.n))

    def _sample(self, prompts: Batch, params: SamplingParams, inputs: tuple[str, ...] | None, run: Callable[[Batch, SamplingParams], Batch]) -> Batch:
        if inputs is not None:
            refuse_lost_images(prompts, inputs, f"rollout engine {self.engine_name}")
        shipped = prompts if inputs is None else prompts.select(*[k for k in inputs if k in prompts])
        with self.lock:
            out = run(shipped, params)
            version = self.version
        kept = [k for k in prompts.keys() if k not in shipped]
        if kept:
            out.update(prompts.select(*kept).repeat_interleave(params.n))
        out["weight_version"] = torch.full((len(out),), version, dtype=torch.long)
        return out

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams, images: dict | None = None) -> Generation:
        raise NotImplementedError

    def sync_weights(self, version: int) -> None:
        """Load the actor's current weights (into sleeping engines too: the weights wake first,
        then the KV cache, :func:`~trellis.interfaces.rollout.sync_engine`); later samples carry
        ``version``."""
        with self._turns:
            self._syncs_waiting += 1
        try:
            with self.lock:
                self.version = version  # before the transfer: a transport stamps what it sends
                self._sync()
                self.asleep = False
        finally:
            with self._turns:
                self._syncs_waiting -= 1
                self._turns.notify_all()

    def let_syncs_in(self) -> None:
        """Wait while a weight sync waits for the engines: a generation that runs in chunks calls
        this between two (``trellis_algos.rl.partial``), so the sync goes first."""
        with self._turns:
            self._turns.wait_for(lambda: not self._syncs_waiting)

    def sleep(self) -> None:
        """Every engine frees its KV cache and weights until the next ``sync_weights`` or ``wake``."""
        with self.lock:
            self._sleep()
            self.asleep = True

    def wake(self, tags=ALL_MEMORY) -> None:
        """Every engine takes back the memory ``tags`` name (``weights``, ``kv_cache``)."""
        with self.lock:
            self._wake(tags)
            if set(ALL_MEMORY) <= set(tags):
                self.asleep = False

    def _sleep(self) -> None:
        raise NotImplementedError

    def _wake(self, tags) -> None:
        raise NotImplementedError

    def _generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        raise NotImplementedError

    def _rollout(self, prompts: Batch, params: SamplingParams, fn: RolloutFn) -> Batch:
        raise NotImplementedError

    def _sync(self) -> None:
        raise NotImplementedError


class Controller:
    """Creates worker groups for roles. Subclasses decide where ranks run; the class methods read
    the ``trainer`` section before anything is built."""

    engine_pools: bool = False  # can place rollout engines in processes of their own (trainer.rollout_pool > 0)

    @classmethod
    def from_trainer(cls, trainer: DictConfig) -> Controller:
        """The controller the ``trainer`` section's placement keys ask for."""
        return cls()

    @staticmethod
    def ranks(trainer: DictConfig) -> tuple[int, int]:
        """``(ranks per role, ranks on each machine)`` the ``trainer`` section asks for."""
        return 1, 1

    @classmethod
    def check(cls, trainer: DictConfig, engine_devices: int) -> None:
        """Refuse a placement this controller cannot make, naming the key and the fix;
        ``engine_devices``: the devices one rollout engine spans (its tensor-parallel size)."""
        if trainer.get("rollout_pool") and not cls.engine_pools:
            raise ConfigError(
                f"config key 'trainer.rollout_pool' is {trainer.rollout_pool} with trainer.controller={trainer.controller}, which "
                "places no engine processes of their own; set trainer.controller=ray (pip install trellis-ray), or "
                "trainer.rollout_pool=0 (the engine beside the actor in this process)"
            )

    @classmethod
    def enter(cls, cfg: DictConfig, argv: list[str]) -> int | None:
        """Called by ``trellis train`` before the run, in its own process: the exit status where the
        controller ran the command elsewhere itself (Ray's loopback-only network namespace), None
        to run here."""
        return None

    def world_size(self) -> int:
        """Ranks per role."""
        return 1

    def spawn(self, role: str, make_worker: Callable[[DistInfo], Worker], mesh: Mesh | None = None) -> WorkerGroup:
        """Build ``role`` on ranks laid out as ``mesh`` (default: every rank data-parallel)."""
        raise NotImplementedError

    def spawn_rollout(
        self,
        make_engine: Callable[[], RolloutEngine],
        actor: WorkerGroup,
        mesh: Mesh | None = None,
        own_weights: bool = False,
        engine_devices: int = 1,
    ) -> RolloutGroup:
        """A rollout engine in each process of ``actor``'s ranks; ``mesh`` lays the engines out
        (tp ranks of a group serve one engine; default: one engine per rank). ``own_weights``: the
        engines keep a copy of their own even where they could generate from the actor's model
        (generation overlapping training must not see the weights change under it).
        ``engine_devices``: the devices one engine spans where it has processes of its own."""
        raise NotImplementedError

    def copy_weights(self, source: WorkerGroup, target: WorkerGroup) -> None:
        """``target``'s model takes ``source``'s weights, in memory (e.g. ref <- actor); both
        roles must live in the same processes."""
        raise NotImplementedError

    def dispatch_seconds(self) -> float:
        """Seconds spent moving calls and results between this process and the ranks (not computing)
        since the last call; 0 for the local controller."""
        return 0.0

    def shutdown(self) -> None:
        """Stop every worker this controller started."""


class LocalWorkerGroup(WorkerGroup):
    def __init__(self, role: str, worker: Worker) -> None:
        super().__init__(role, Mesh(), worker.routes())
        self.workers = [worker]

    def _execute(self, method: str, per_rank_args: list[tuple], kwargs: dict[str, Any]) -> list[Any]:
        return [getattr(w, method)(*a, **kwargs) for w, a in zip(self.workers, per_rank_args)]


class LocalRollout(RolloutGroup):
    """The engine beside the actor's one rank. When the actor lends its whole model
    (``full_module``) and the engine adopts it, the engine generates from the actor's own
    weights: no second copy, and nothing to sync."""

    def __init__(self, engine: RolloutEngine, actor: LocalWorkerGroup | None, adopt: bool = True) -> None:
        super().__init__()
        self.engine = engine
        self.actor = actor  # None: generation alone, nothing to sync from
        self.described_by(describe_engine(engine))
        module = actor.workers[0].full_module() if actor is not None and adopt else None
        self.shared = module is not None and engine.adopt_module(module)
        if self.shared:
            log.info("rollout: %s generates from the actor's own model (one rank): no weight copy, no weight sync", type(engine).__name__)

    def _generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        return self.engine.generate(prompts, params)

    def _rollout(self, prompts: Batch, params: SamplingParams, fn: RolloutFn) -> Batch:
        return asyncio.run(run_rollout_fn(fn, self.engine, prompts, params))

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams, images: dict | None = None) -> Generation:
        return await self.engine.agenerate(prompt_ids, params, **with_images(images))

    def _sync(self) -> None:
        if not self.shared:
            sync_from(self.engine, self.actor.workers[0])

    def _sleep(self) -> None:
        self.engine.sleep()

    def _wake(self, tags) -> None:
        self.engine.wake(tags)


class LocalController(Controller):
    """World size 1: each role is one worker object in the current process."""

    def __init__(self) -> None:
        self.engines: list[RolloutEngine] = []  # closed at shutdown
        self.workers: list[Worker] = []  # likewise

    def spawn(self, role: str, make_worker: Callable[[DistInfo], Worker], mesh: Mesh | None = None) -> WorkerGroup:
        if mesh is not None and mesh.world_size != 1:
            raise ValueError(f"the local controller runs one rank; role {role!r} asks for a mesh of {mesh.world_size} ({mesh})")
        worker = make_worker(DistInfo(rank=0, world_size=1))
        worker.build()
        self.workers.append(worker)
        return LocalWorkerGroup(role, worker)

    def spawn_rollout(self, make_engine, actor, mesh=None, own_weights=False, engine_devices=1) -> RolloutGroup:  # types: Controller's
        self.engines.append(make_engine())
        return LocalRollout(self.engines[-1], actor, adopt=not own_weights)

    def shutdown(self) -> None:
        """Close every rollout engine built here (SGLang's scheduler is a subprocess), then every
        worker (a backend leaves its process group)."""
        while self.engines:
            self.engines.pop().close()
        while self.workers:
            self.workers.pop().close()

    def copy_weights(self, source: WorkerGroup, target: WorkerGroup) -> None:
        target.workers[0].load_weights(chain.from_iterable(source.workers[0].export_weights(all_ranks=True)))
