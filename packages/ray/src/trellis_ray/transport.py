"""Weight transports between Ray processes: through Ray's object store (the default) and by a
broadcast over a process group of the trainer's rank 0 and the engine processes (gloo on CPU,
NCCL on GPU), both in buckets stamped with the weight version."""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from trellis.kit.controller import Bucket, Manifest, StaleWeights, WeightTransport, buckets, unpack


class ObjectStoreTransport(WeightTransport):
    """Rank 0 puts every bucket in Ray's object store and returns their references; each engine
    process reads them in order. The whole update sits in the object store once, whatever the
    number of engines (they read the same objects), until the driver drops the references."""

    def __init__(self, bucket_mb: float = 64.0) -> None:
        self.bucket_mb = bucket_mb

    def send(self, weights: Iterable[tuple[str, torch.Tensor]], manifest: Manifest, version: int) -> tuple[Manifest, list]:
        import ray

        # tensors leave the device: an engine process may sit on another one (or none)
        on_host = ((name, t.detach().cpu()) for name, t in weights)
        refs = [ray.put(b) for b in buckets(on_host, int(self.bucket_mb * 2**20), version)]
        return (dict(manifest) if manifest is not None else None), refs

    def receive(self, handle: tuple[Manifest, list], version: int) -> tuple[Manifest, Iterator[tuple[str, torch.Tensor]]]:
        import ray

        manifest, refs = handle

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for ref in refs:
                yield from unpack(ray.get(ref), version)

        return manifest, tensors()


class BroadcastTransport(WeightTransport):
    """A process group of its own (``world`` = the trainer's rank 0 + the engine processes), made
    once at pool start from a TCP store that rank 0 hosts, apart from the trainer's group. Per
    sync: the version and manifest (pickled), then per bucket a header (names, dtypes, shapes) and
    its bytes in one flat tensor, then an end mark. gloo on CPU, NCCL on GPU (tensors on the
    device)."""

    live = True

    def __init__(self, bucket_mb: float = 64.0, backend: str = "gloo", timeout_s: float = 1800.0) -> None:
        self.bucket_mb, self.backend, self.timeout_s = bucket_mb, backend, timeout_s
        self.group = None

    def join(self, rank: int, world: int, address: tuple[str, int]) -> None:
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.timeout_s)
        host, port = address
        self._store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
        store = dist.PrefixStore("trellis-weights", self._store)
        if self.backend == "nccl":
            self.group, self.device = dist.ProcessGroupNCCL(store, rank, world), torch.device("cuda", torch.cuda.current_device())
        else:
            self.group, self.device = dist.ProcessGroupGloo(store, rank, world, timeout), torch.device("cpu")

    def _bcast(self, tensor: torch.Tensor) -> torch.Tensor:
        self.group.broadcast([tensor]).wait()
        return tensor

    def _send_obj(self, obj: Any) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        self._bcast(torch.tensor([data.numel()], dtype=torch.long, device=self.device))
        self._bcast(data)

    def _recv_obj(self) -> Any:
        size = int(self._bcast(torch.zeros(1, dtype=torch.long, device=self.device)))
        return pickle.loads(self._bcast(torch.empty(size, dtype=torch.uint8, device=self.device)).cpu().numpy().tobytes())

    def send(self, weights: Iterable[tuple[str, torch.Tensor]], manifest: Manifest, version: int) -> None:
        self._send_obj((version, dict(manifest) if manifest is not None else None))
        for bucket in buckets(weights, int(self.bucket_mb * 2**20), version):
            flat = torch.cat([t.detach().to(self.device).contiguous().reshape(-1).view(torch.uint8) for _, t in bucket.tensors])
            entries = [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in bucket.tensors]
            self._send_obj((bucket.version, entries, flat.numel()))
            self._bcast(flat)
        self._send_obj(None)

    def receive(self, handle: None, version: int) -> tuple[Manifest, Iterator[tuple[str, torch.Tensor]]]:
        sent, manifest = self._recv_obj()
        if sent != version:
            raise StaleWeights(f"the trainer sent weights of version {sent} during the sync of version {version}")

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            while (header := self._recv_obj()) is not None:
                stamp, entries, size = header
                flat = self._bcast(torch.empty(size, dtype=torch.uint8, device=self.device))
                got, at = [], 0
                for name, dtype, shape in entries:
                    dtype = getattr(torch, dtype)
                    n = dtype.itemsize * int(torch.Size(shape).numel())
                    got.append((name, flat[at : at + n].view(dtype).reshape(shape)))
                    at += n
                yield from unpack(Bucket(stamp, got), version)

        return manifest, tensors()

    def close(self) -> None:
        self.group = self._store = None
