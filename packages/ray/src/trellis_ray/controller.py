"""The Ray controller (``trainer.controller=ray``): N ranks per role as Ray actors in placement
groups; actor, ref and rollout share one process per rank (hybrid engine), or the engines run in a
pool of their own (``trainer.rollout_pool``, :mod:`trellis_ray.pool`). A cluster it starts itself is
private: its own temp dir, no dashboard, token authentication with a fresh token, on one machine in
a loopback-only network namespace (:mod:`trellis_ray.network`)."""

from __future__ import annotations

import logging
import math
import os
import secrets
import tempfile
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig

import trellis
from trellis.kit.controller import Controller, DistInfo, Mesh, RolloutGroup, Worker, WorkerGroup
from trellis_ray import network
from trellis_ray.pool import spawn_pool
from trellis_ray.ranks import RankFailure, RayPool, RayRollout, RayWorkerGroup

log = logging.getLogger("trellis")


# Ray starts the worker processes of a cluster that ray.init starts at niceness 15 (its daemons stay
# responsive), so any neighbour at the default niceness takes their cores: a neighbour's two busy
# threads left the ranks and engines of a 2-core machine about 3% of a core. Here they do the run's
# work: niceness 0, as `ray job submit` gives its jobs' workers. Read by the raylet when it starts.
WORKER_NICENESS = {"RAY_worker_niceness": "0"}


def _set_env(values: dict[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _reload_auth_settings() -> None:
    """Ray reads ``RAY_AUTH_*`` once per process (its config at import, the token on first use):
    make it read them again after they change. Private Ray APIs, used only where they exist."""
    import ray._raylet

    config, loader = getattr(ray._raylet, "Config", None), getattr(ray._raylet, "AuthenticationTokenLoader", None)
    if config is not None and loader is not None:
        config.initialize("")
        loader.instance().reset_cache()


def _join(ray, address: str) -> None:
    """Join the cluster at ``address``; a refused or unreachable cluster is a clear error, not a hang."""
    try:
        ray.init(address=address, log_to_driver=True)
    except ConnectionError as exc:
        raise trellis.ConfigError(
            f"could not join the Ray cluster at RAY_ADDRESS={address!r} ({exc}). If Ray's log above says "
            "'InvalidAuthToken', the cluster uses token authentication (on by default since Ray 2.59): give this "
            "process the cluster's token with RAY_AUTH_TOKEN_PATH=<its token file> (or RAY_AUTH_TOKEN) and "
            "RAY_AUTH_MODE=token; otherwise check that the address is right and the cluster is up"
        ) from None


class RayController(Controller):
    """Roles on Ray: one pool of ``nnodes x procs_per_node`` ranks for actor, ref and rollout
    (colocated), and the critic / reward model there too or, if asked, on a pool of their own.
    ``rollout_pool`` N > 0: the engines in N processes of their own instead, fed by the weight
    transport ``transport`` (``object_store`` or ``broadcast``, buckets of ``bucket_mb``).

    Joins the cluster at ``RAY_ADDRESS`` if set; otherwise starts a private local cluster (own temp
    dir) and stops it at the end. It never runs ``ray stop``, which would kill other users' Ray.
    """

    engine_pools = True

    @classmethod
    def from_trainer(cls, trainer: DictConfig) -> RayController:
        return cls(
            trainer.nnodes,
            trainer.procs_per_node,
            trainer.ray_timeout_s,
            trainer.ray_call_timeout_s,
            list(trainer.separate_pools),
            rollout_pool=trainer.rollout_pool,
            transport=trainer.weight_transport,
            bucket_mb=trainer.transport_bucket_mb,
        )

    @staticmethod
    def ranks(trainer: DictConfig) -> tuple[int, int]:
        return trainer.nnodes * trainer.procs_per_node, trainer.procs_per_node

    @classmethod
    def check(cls, trainer: DictConfig, engine_devices: int) -> None:
        """Colocated, each rank holds one device and builds its own engine: an engine spans several
        devices (tensor parallel) only in a pool of its own."""
        if engine_devices > 1 and not trainer.rollout_pool:
            raise trellis.ConfigError(
                f"config key 'rollout.tensor_parallel_size' is {engine_devices} with trainer.controller=ray: each Ray rank holds one "
                f"device and builds its own rollout engine, so an engine cannot span {engine_devices} devices; set "
                "trainer.rollout_pool=N (N engine processes of their own, each spanning its devices), rollout.tensor_parallel_size=1 "
                "(one data-parallel engine per rank), or trainer.controller=local, where the engine spans the machine's devices itself"
            )

    @classmethod
    def enter(cls, cfg: DictConfig, argv: list[str]) -> int | None:
        """A single-machine run relaunches itself in a loopback-only network namespace (see
        :mod:`trellis_ray.network`); in that namespace, loopback comes up first."""
        if network.inside():
            network.loopback_up()
            return None
        command = network.relaunch_command(cfg, argv)
        return network.run(command) if command else None

    def __init__(
        self,
        nnodes: int,
        procs_per_node: int,
        timeout_s: float,
        call_timeout_s: float,
        separate_pools: list[str] = (),
        rollout_pool: int = 0,
        transport: str = "object_store",
        bucket_mb: float = 64.0,
    ) -> None:
        import ray

        self.ray = ray
        self.world = nnodes * procs_per_node
        self.procs_per_node = procs_per_node
        self.timeout_s, self.call_timeout_s = timeout_s, call_timeout_s
        self.separate = set(separate_pools)
        self.rollout_pool, self.transport, self.bucket_mb = rollout_pool, transport, bucket_mb
        self.started_cluster = False
        self._restore_env: dict[str, str | None] = {}
        self._token: Path | None = None
        if not ray.is_initialized():
            if os.environ.get("RAY_ADDRESS"):
                _join(ray, os.environ["RAY_ADDRESS"])
            else:
                self._start_private_cluster()
        self.use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        # a node's cores are shared by its ranks and, with a rollout pool, its engine processes
        self.threads = max(1, (os.cpu_count() or 1) // (procs_per_node + math.ceil(rollout_pool / nnodes)))
        self.pools: dict[str, RayPool] = {}

    def _start_private_cluster(self) -> None:
        """A local cluster for this run alone: its own temp dir (private to this user), no
        dashboard, and token authentication whatever the Ray version's default, with a fresh token
        in a file only this user can read (deleted at shutdown)."""
        tmp = Path(tempfile.mkdtemp(prefix="trellis-ray-"))
        self._token = tmp / "auth_token"
        fd = os.open(self._token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, secrets.token_hex(32).encode())
        os.close(fd)
        auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self._token), "RAY_AUTH_TOKEN": None}
        self._restore_env = {k: os.environ.get(k) for k in (*auth, *WORKER_NICENESS)}
        _set_env({**auth, **WORKER_NICENESS})
        _reload_auth_settings()
        self.started_cluster = True
        try:
            self.ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, _temp_dir=str(tmp), log_to_driver=True)
        except BaseException:
            self._forget_private_cluster()
            raise

    def _pool(self, role: str) -> RayPool:
        name = role if role in self.separate else "actor"
        if name not in self.pools:
            timeouts = (self.timeout_s, self.call_timeout_s)
            self.pools[name] = RayPool(self.ray, name, self.world, self.procs_per_node, self.use_gpu, timeouts, self.threads)
        return self.pools[name]

    def world_size(self) -> int:
        return self.world

    def spawn(self, role: str, make_worker: Callable[[DistInfo], Worker], mesh: Mesh | None = None) -> WorkerGroup:
        mesh = mesh or Mesh.data_parallel(self.world)
        if mesh.world_size != self.world:
            raise ValueError(f"role {role!r} asks for a mesh of {mesh.world_size} ranks ({mesh}); the pool has {self.world}")
        pool = self._pool(role)
        master, port, _ = pool.nodes[0]
        dists = [DistInfo(i, self.world, master, port, device=pool.device, mesh=mesh, init_method=pool.rendezvous) for i in range(self.world)]
        refs = [r.add_worker.remote(role, make_worker, d) for r, d in zip(pool.ranks, dists)]
        routes = pool.get(refs, f"building {role}", role)[0]
        return RayWorkerGroup(role, pool, mesh, routes)

    def spawn_rollout(self, make_engine, actor, mesh=None, own_weights=False, engine_devices=1) -> RolloutGroup:  # types: Controller's
        """An engine per rank of the actor, laid out as ``mesh``, holding its own copy of the
        weights; with ``rollout_pool`` N, N engine processes of their own spanning
        ``engine_devices`` each (:func:`trellis_ray.pool.spawn_pool`)."""
        if self.rollout_pool:
            return spawn_pool(self, make_engine, actor, engine_devices)
        pool = self._pool("actor")
        built = pool.get([r.add_rollout.remote(make_engine) for r in pool.ranks], "building the rollout", "rollout")
        rollout = RayRollout(pool, actor.role, mesh or Mesh.data_parallel(self.world))
        rollout.described_by(built[0])
        return rollout

    def copy_weights(self, source: WorkerGroup, target: WorkerGroup) -> None:
        if source.pool is not target.pool:
            raise ValueError(
                f"copying weights {source.role} -> {target.role} needs both roles in one pool; "
                f"remove {target.role!r} or {source.role!r} from trainer.separate_pools"
            )
        source.pool.timed([r.copy_weights.remote(source.role, target.role) for r in source.pool.ranks], "weight copy", target.role)

    def dispatch_seconds(self) -> float:
        return sum(p.dispatch_seconds() for p in self.pools.values())

    def shutdown(self) -> None:
        for pool in self.pools.values():
            try:  # engines first: a rank killed with its engine open can leave the engine's processes behind
                pool.get([r.close.remote() for r in pool.ranks], "closing the rollout engines and workers")
            except RankFailure as exc:
                log.warning("%s", exc)
            for r in pool.ranks:
                self.ray.kill(r)
            for pg in pool.pgs:
                self.ray.util.remove_placement_group(pg)
        self.pools.clear()
        if self.started_cluster:
            self.ray.shutdown()
            self._forget_private_cluster()

    def _forget_private_cluster(self) -> None:
        """Delete the token and put Ray's auth settings back as they were before the cluster."""
        self.started_cluster = False
        self._token.unlink(missing_ok=True)
        _set_env(self._restore_env)
        _reload_auth_settings()
