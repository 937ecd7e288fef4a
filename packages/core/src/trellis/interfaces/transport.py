"""Weight transport from the trainer's rank 0 to rollout engines in processes of their own: the
interface both ends share, the buckets an update travels in, and the per-tensor digest a verified
sync compares (trainer's export against what each engine then holds)."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

Manifest = Mapping[str, Sequence[int]] | None  # the trainer's weight_shapes(): name -> full shape, in send order (None: unknown)


class SyncCheckFailed(RuntimeError):
    """An engine's weights differ from the trainer's after a weight sync: a verified sync's digests
    (trellis-ray's pools), or the rl recipe's probe of log-probs (``trellis_algos.rl.sync_probe``)."""


class StaleWeights(RuntimeError):
    """An engine received a bucket of another weight version than the sync it was asked for."""


@dataclass
class Bucket:
    """Consecutive tensors of one update (about ``bucket_mb`` together), stamped with its version."""

    version: int
    tensors: list[tuple[str, torch.Tensor]]


def buckets(weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, version: int) -> Iterator[Bucket]:
    """``weights`` grouped in order into buckets of at least ``bucket_bytes`` (the last may be
    smaller; a tensor larger than a bucket travels alone)."""
    held: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        held.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield Bucket(version, held)
            held, size = [], 0
    if held:
        yield Bucket(version, held)


def unpack(bucket: Bucket, version: int) -> list[tuple[str, torch.Tensor]]:
    """A received bucket's tensors, after checking it belongs to the sync of ``version``."""
    if bucket.version != version:
        raise StaleWeights(f"a weight bucket of version {bucket.version} arrived during the sync of version {version}")
    return bucket.tensors


def tensor_digest(tensor: torch.Tensor) -> str:
    """``"<dtype>:<hash of the bytes>"``: equal only for the same dtype and bit-identical values
    (order-free sums would hide a permutation; the dtype says whether two digests are comparable)."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return f"{str(tensor.dtype).removeprefix('torch.')}:{hashlib.blake2b(data, digest_size=12).hexdigest()}"


def digest_dtype(digest: str) -> str:
    return digest.split(":", 1)[0]


class WeightTransport(ABC):
    """Moves one update at a time from the trainer's rank 0 (rank 0 of the transport) to the
    engine processes (ranks 1..N). Built on the driver and pickled to every end; ``join`` runs once
    per end at pool start (all ends at once), then each sync runs ``send`` on rank 0 and
    ``receive`` on every engine process, the driver handing ``send``'s result to ``receive``."""

    bucket_mb: float = 64.0
    live = False  # True: the engines receive while rank 0 sends (no handle); False: after, from send's handle

    def join(self, rank: int, world: int, address: tuple[str, int]) -> None:
        """Set this end up (rank 0 listens at ``address``); nothing to do by default."""

    @abstractmethod
    def send(self, weights: Iterable[tuple[str, torch.Tensor]], manifest: Manifest, version: int) -> Any:
        """Ship ``weights`` (read once, lazily) with their manifest, stamped ``version``; returns
        what the engines' ``receive`` needs (picklable), or None when it travels on its own."""

    @abstractmethod
    def receive(self, handle: Any, version: int) -> tuple[Manifest, Iterator[tuple[str, torch.Tensor]]]:
        """The update ``send`` shipped: its manifest at once, then its tensors as they arrive (read
        them all: a bucket left unread can block the sender). Raises :class:`StaleWeights` on a
        bucket of another version."""

    def close(self) -> None:
        """Leave what ``join`` set up."""
