"""The local controller's rollout verbs against the engine interface: a weight sync wakes the
weights alone, loads, then wakes the KV cache; ``sleep`` reaches the engine; ``shutdown`` closes it.

``RecordingEngine`` is a fake that only records the calls made to it (no model: the order of the
calls is what is tested here; the real engines' sleep is tested in their own sessions, and the
order inside a Ray rank in tests/ray)."""

from __future__ import annotations

import torch

from trellis.interfaces.rollout import KV_CACHE, WEIGHTS, RolloutEngine, sync_engine
from trellis.runtime.controller import LocalController


class RecordingEngine(RolloutEngine):
    """Fake: records calls; ``load_weights`` drains the iterator it is given (as engines do)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def generate(self, prompts, params):
        self.calls.append(("generate",))

    def load_weights(self, weights, shapes=None):
        self.calls.append(("load_weights", [name for name, _ in weights]))

    def sleep(self):
        self.calls.append(("sleep",))

    def wake(self, tags=(WEIGHTS, KV_CACHE)):
        self.calls.append(("wake", tuple(tags)))

    def close(self):
        self.calls.append(("close",))


class ExportingActor:
    """Stands in for the actor's worker group: one rank whose export yields two buckets."""

    def __init__(self) -> None:
        self.workers = [self]

    def full_module(self):
        return None  # nothing to lend: the engine keeps its weights and takes syncs

    def export_weights(self, all_ranks: bool = False, dtype=None):
        assert all_ranks and dtype is None  # one rank: the tensors stay on the actor's device, as trained (the engine names no dtype)
        yield [("a", torch.zeros(1))]
        yield [("b", torch.ones(1))]

    def weight_shapes(self):
        return None  # its backend cannot tell: the engine checks the tensors as they come


def test_sleep_then_sync_wakes_weights_loads_then_wakes_the_kv_cache_and_shutdown_closes():
    engine = RecordingEngine()
    ctrl = LocalController()
    rollout = ctrl.spawn_rollout(lambda: engine, ExportingActor())
    rollout.sleep()
    rollout.sync_weights(version=3)
    assert engine.calls == [("sleep",), ("wake", (WEIGHTS,)), ("load_weights", ["a", "b"]), ("wake", (KV_CACHE,))]
    assert rollout.version == 3
    ctrl.shutdown()
    ctrl.shutdown()  # twice: closed once
    assert engine.calls[-1] == ("close",) and engine.calls.count(("close",)) == 1


def test_sync_engine_on_the_default_interface_is_a_plain_load():
    """An engine without sleep support (the interface's default no-op sleep/wake) just loads."""

    class Plain(RolloutEngine):
        loaded: list = []

        def generate(self, prompts, params):
            raise AssertionError("not called")

        def load_weights(self, weights, shapes=None):
            self.loaded.extend(name for name, _ in weights)

    engine = Plain()
    engine.sleep()
    sync_engine(engine, iter([("w", torch.zeros(2))]))
    engine.close()
    assert engine.loaded == ["w"]
