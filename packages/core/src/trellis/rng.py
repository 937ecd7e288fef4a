"""This process's random-number states (python, numpy, torch CPU and its CUDA device, and the
generators rollout engines sample tokens from), to save in a checkpoint and restore, so a resumed
run draws the same numbers as one that was never stopped.

Only the current CUDA device's state is kept: a rank uses one device, and a checkpoint holding
every visible device's state could not be restored where fewer devices are visible. Also
:func:`stream_seed`, the seed of each shuffle stream of a run."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

# device -> the generator engines in this process sample tokens from (sampling_generator)
_sampling: dict[str, torch.Generator] = {}


def sampling_generator(device: torch.device | str, seed: int) -> torch.Generator:
    """The generator engines of this process sample tokens from on ``device``, seeded with ``seed``
    (an engine asks once, when it is built, and keeps it). Apart from torch's default generator,
    which every thread of the process draws from: the trainer's thread too while an engine
    generates ahead of it, and a draw there would move the samples by when it lands. Checkpoints
    keep its state."""
    return _sampling_on(device).manual_seed(seed)


def _sampling_on(device: torch.device | str) -> torch.Generator:
    key = str(torch.device(device))
    return _sampling.setdefault(key, torch.Generator(key))


def stream_seed(seed: int, offset: int) -> int:
    """The seed of stream ``offset`` (an epoch, a step) of a run seeded ``seed``: the run's seed
    spread far apart first, so that nearby run seeds do not share streams."""
    return (seed * 1_000_003 + offset) % 2**63


def get_rng_state() -> dict[str, Any]:
    """Every generator's state, in plain types and tensors (loadable with ``torch.load(weights_only=True)``)."""
    kind, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "key": torch.from_numpy(key.astype(np.int64)), "pos": pos, "has_gauss": has_gauss, "gauss": gauss},
        "torch": torch.get_rng_state(),
        "sampling": {device: generator.get_state() for device, generator in _sampling.items()},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned (the CUDA state, into the current device, only
    where CUDA is in use). Older checkpoints hold a list of every visible device's state: the
    current device's entry is used."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    for device, saved in state.get("sampling", {}).items():  # older checkpoints hold none
        _sampling_on(device).set_state(saved)
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if isinstance(cuda, (list, tuple)):
            device = torch.cuda.current_device()
            cuda = cuda[device] if device < len(cuda) else None
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
