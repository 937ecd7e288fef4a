"""Tensors parked in host memory while a rollout engine needs the accelerator: each distinct
storage is copied to (pinned, on CUDA) host memory and freed in place, then refilled in place, so
every tensor object (FSDP2's shards, the optimizer's state) stays the one its owner holds."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor


@dataclass
class HostCopy:
    """One storage's bytes in host memory; the original storage is resized to 0 meanwhile."""

    storage: torch.UntypedStorage
    host: torch.UntypedStorage

    @staticmethod
    def of(tensors: Iterable[torch.Tensor]) -> list[HostCopy]:
        """Copy out and free the storage behind each tensor (once per storage; empty ones skipped)."""
        copies, seen = [], set()
        for t in tensors:
            local = t.to_local() if isinstance(t, DTensor) else t
            storage = local.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            host = torch.UntypedStorage(storage.nbytes(), device="cpu")
            if storage.device.type == "cuda":
                host = host.pin_memory()
            host.copy_(storage, non_blocking=True)
            copies.append(HostCopy(storage, host))
        if any(c.storage.device.type == "cuda" for c in copies):
            torch.cuda.synchronize()  # the copies are done before the device memory is released
        for c in copies:
            c.storage.resize_(0)
        return copies

    def restore(self) -> None:
        """Refill the original storage with the saved bytes."""
        self.storage.resize_(self.host.nbytes())
        self.storage.copy_(self.host, non_blocking=True)
