"""Test-only stand-ins that make the generation choreography (and a sync that silently drops the
weights) visible on CPU. (The recipe with a role, verb and kind of its own is a plugin package of
its own on public names only: tests/plugins/outside.)

Nothing here is imported by trellis: the tests load it with ``load_plugins(extra=...)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from trellis import (
    Batch,
    RolloutEngine,
    SamplingParams,
    hookimpl,
)
from trellis.interfaces.rollout import ALL_MEMORY, WEIGHTS
from trellis_fsdp.backend import FSDPBackend, FSDPOptions
from trellis_hf.engine import HFRolloutOptions
from trellis_hf.engine import make_engine as make_hf_engine

EVENTS: list[str] = []  # what the stand-ins saw, in order
LAST_METRICS: dict[str, float] = {}  # run.metrics as trellis_train_end received them


# -- stand-ins that make the choreography visible ---------------------------------------------------
class StrictSleepEngine(RolloutEngine):
    """Stand-in for an engine with a real sleep mode (vLLM's and SGLang's, which need a GPU): the
    HF engine does the work, and this enforces their rules on CPU. Generating on a sleeping
    engine raises, as theirs do; loading weights needs the weights awake; it keeps weights of
    its own (never adopts the actor's module), so every update must arrive by a weight sync."""

    def __init__(self, spec) -> None:
        self.inner = make_hf_engine(spec)
        self.awake = set(ALL_MEMORY)

    def _awake(self, what: str) -> None:
        if self.awake != set(ALL_MEMORY):
            raise RuntimeError(f"{what} on a sleeping engine (awake: {sorted(self.awake)}): wake it first")
        EVENTS.append(what)

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        self._awake("generate")
        return self.inner.generate(prompts, params)

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams):
        self._awake("generate")
        return await self.inner.agenerate(prompt_ids, params)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], shapes: Mapping[str, Sequence[int]] | None = None) -> None:
        if WEIGHTS not in self.awake:
            raise RuntimeError("load_weights with the weights asleep: wake them first")
        EVENTS.append("load_weights")
        self.inner.load_weights(weights, shapes=shapes)

    def sleep(self) -> None:
        self.awake.clear()
        EVENTS.append("sleep")

    def wake(self, tags=ALL_MEMORY) -> None:
        self.awake |= set(tags)
        EVENTS.append("wake")

    def close(self) -> None:
        self.inner.close()


class SkipSyncEngine(RolloutEngine):
    """Stand-in for a weight sync that silently keeps the old weights (verl #7495, TRL #5312): the
    HF engine with weights of its own, whose ``load_weights`` reads the update and drops it."""

    def __init__(self, spec) -> None:
        self.inner = make_hf_engine(spec)
        self.weight_dtype = self.inner.weight_dtype

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        return self.inner.generate(prompts, params)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], shapes: Mapping[str, Sequence[int]] | None = None) -> None:
        for _ in weights:
            pass

    def close(self) -> None:
        self.inner.close()


class RecordingBackend:
    """The FSDP backend, recording when its role offloads and onloads (which the real one does
    only as its options ask, invisibly on CPU)."""

    def __init__(self, spec) -> None:
        self._inner = FSDPBackend(spec)
        self._role = spec.role

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_inner"], name)

    def offload(self) -> None:
        EVENTS.append(f"offload {self._role}")
        self._inner.offload()

    def onload(self) -> None:
        EVENTS.append(f"onload {self._role}")
        self._inner.onload()


class SpinePlugin:
    """Registers the above; a plain object, as any third-party plugin module would be."""

    @hookimpl
    def trellis_register(self, registry):
        registry.add("rollout", "strict_sleep", StrictSleepEngine, options=HFRolloutOptions)
        registry.add("rollout", "skip_sync", SkipSyncEngine, options=HFRolloutOptions)
        registry.add("backend", "recording", RecordingBackend, options=FSDPOptions)

    @hookimpl
    def trellis_train_end(self, run_dir, metrics):
        LAST_METRICS.clear()
        LAST_METRICS.update(metrics)
