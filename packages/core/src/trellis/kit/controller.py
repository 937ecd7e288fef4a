"""What a controller (kind ``controller``) needs: the groups it returns, the worker it hosts, weight syncs and transports, their checks."""

from trellis.batch import Batch
from trellis.interfaces.backend import DistInfo
from trellis.interfaces.dispatch import DP_CHUNKS, Mesh
from trellis.interfaces.rollout import Generation, RolloutEngine, RolloutFn, SamplingParams, sync_engine, with_images
from trellis.interfaces.transport import Bucket, Manifest, StaleWeights, WeightTransport, buckets, digest_dtype, tensor_digest, unpack
from trellis.runtime.controller import (
    Controller,
    LocalController,
    RolloutGroup,
    WorkerGroup,
    describe_engine,
    exported_update,
    run_rollout_fn,
    sync_from,
)
from trellis.runtime.worker import Worker

__all__ = [
    # the interface: a controller builds worker groups and rollout groups
    "Controller",
    "LocalController",
    "WorkerGroup",
    "RolloutGroup",
    # what runs in a rank: the worker of a role (its verbs and routes), where it sits in the mesh
    "Worker",
    "DistInfo",
    "Mesh",
    "DP_CHUNKS",
    "Batch",
    # a rank's rollout engine: generation, rollout functions, its weights from the colocated actor
    "RolloutEngine",
    "describe_engine",
    "RolloutFn",
    "with_images",
    "SamplingParams",
    "Generation",
    "run_rollout_fn",
    "sync_from",
    "sync_engine",
    "exported_update",
    # weights between processes: transports in buckets stamped with the version, digests checked after a sync
    "WeightTransport",
    "Bucket",
    "Manifest",
    "StaleWeights",
    "buckets",
    "unpack",
    "tensor_digest",
    "digest_dtype",
]
