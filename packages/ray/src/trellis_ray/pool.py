"""A rollout pool apart from the trainer (``trainer.rollout_pool=N``): N engine processes of
their own, fed the actor's weights by a :class:`~trellis.interfaces.transport.WeightTransport`
and verified after every sync (each engine's digest of every tensor against the trainer's)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from trellis import SyncCheckFailed
from trellis.kit.controller import Mesh, RolloutEngine, WeightTransport, digest_dtype
from trellis_ray.ranks import RayPool, RayRollout, RayWorkerGroup
from trellis_ray.transport import BroadcastTransport, ObjectStoreTransport

log = logging.getLogger("trellis")


class PoolOwner(Protocol):
    """What :func:`spawn_pool` reads of the controller that owns the pool (``RayController``)."""

    ray: Any  # the ray module, imported by the controller
    rollout_pool: int
    pools: dict[str, RayPool]
    use_gpu: bool
    timeout_s: float
    call_timeout_s: float
    threads: int
    transport: str
    bucket_mb: float


class PoolRollout(RayRollout):
    """The engines of a pool apart from the actor: prompts dealt as ``RayRollout`` deals them (each
    engine a data-parallel group of one process), weights moved by ``transport`` from the actor's
    rank 0 and verified. Shares no state with the actor's group: its own pool (ranks, dispatch
    clock), so a background thread may ``generate`` while the main thread trains the actor; a
    sync waits for the engines' calls already queued (each engine process runs one call at a time)."""

    def __init__(self, pool: RayPool, actor: RayWorkerGroup, transport: WeightTransport) -> None:
        super().__init__(pool, actor.role, Mesh.data_parallel(len(pool.ranks)))
        self.actor, self.transport = actor, transport
        self.unverified: set[str] = set()  # names whose digests could not be compared (another dtype): the probe checks them

    def _sync(self) -> None:
        """Send the actor's current weights stamped with the version, load them in every engine,
        then compare every engine's digests with the trainer's (:meth:`verify`)."""
        self._transfer(self.version)

    def _transfer(self, version: int) -> None:
        actor = self.actor.pool
        sends = [r.send_weights.remote(self.actor_role, self.weight_dtype, version) for r in actor.ranks]
        if self.transport.live:  # the engines receive while rank 0 sends
            receives = [r.receive_weights.remote(None, version) for r in self.pool.ranks]
            sent = actor.timed(sends, "weight send", self.actor_role)[0]
        else:
            sent = actor.timed(sends, "weight send", self.actor_role)[0]
            receives = [r.receive_weights.remote(sent[0], version) for r in self.pool.ranks]
        held = self.pool.timed(receives, "weight receive", "rollout")
        self.verify(version, sent[1], held)

    def verify(self, version: int, trainer: dict[str, str], engines: list[dict[str, str] | None]) -> None:
        """Raise :class:`SyncCheckFailed` naming the step, the engine and the first tensor whose
        digest differs from the trainer's (``trainer``: name -> digest in send order)."""
        for i, held in enumerate(engines):
            if held is None:  # the engine cannot tell: the probe after the sync is the check
                continue
            for name, want in trainer.items():
                have = held.get(name)
                if have is not None and digest_dtype(have) != digest_dtype(want):
                    if name not in self.unverified:
                        self.unverified.add(name)
                        log.info("sync check: engine holds %r as %s, sent as %s: left to the probe", name, digest_dtype(have), digest_dtype(want))
                    continue
                if have != want:
                    raise SyncCheckFailed(
                        f"step {version}: after the weight sync, rollout engine {i} of {len(engines)} ({self.engine_name}) holds "
                        f"{name!r} " + ("not at all" if have is None else f"with digest {have}") + f", the trainer sent {want}: the "
                        "engine did not load that tensor as sent. Check the engine's load_weights for it (its name, a skipped or "
                        "renamed parameter, a cast)"
                    )


def spawn_pool(ctrl: PoolOwner, make_engine: Callable[[], RolloutEngine], actor: RayWorkerGroup, devices: int) -> PoolRollout:
    """``ctrl.rollout_pool`` engine processes (one placement group each: Ray spreads them), each
    building its engine from ``make_engine``, and the weight transport joined by the actor's rank
    0 (which hosts its rendezvous) and every engine process."""
    n = ctrl.rollout_pool
    pool = RayPool(ctrl.ray, "rollout", n, 1, ctrl.use_gpu, (ctrl.timeout_s, ctrl.call_timeout_s), ctrl.threads, devices)
    ctrl.pools["rollout"] = pool  # closed and removed at shutdown with the others
    built = pool.get([r.add_rollout.remote(make_engine) for r in pool.ranks], "building the rollout pool", "rollout")
    if ctrl.transport == "broadcast":
        transport = BroadcastTransport(ctrl.bucket_mb, "nccl" if ctrl.use_gpu else "gloo", ctrl.call_timeout_s)
    else:
        transport = ObjectStoreTransport(ctrl.bucket_mb)
    sender = actor.pool.ranks[0]
    ip, port, _ = actor.pool.get([sender.address.remote()], "finding the weight transport's address")[0]
    ends = [sender, *pool.ranks]
    pool.get([r.join_transport.remote(transport, i, len(ends), (ip, port)) for i, r in enumerate(ends)], "joining the weight transport")
    log.info("rollout: %d engine process(es) of their own, weights by %s", n, type(transport).__name__)
    rollout = PoolRollout(pool, actor, transport)
    rollout.described_by(built[0])
    return rollout
