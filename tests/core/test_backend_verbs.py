"""Verbs a backend declares (``Backend.verbs``): the role worker serves them, in-process and
through a controller, as their routes say; one named like a verb the worker serves is refused."""

from __future__ import annotations

import pytest

from trellis.interfaces.backend import Backend, DistInfo
from trellis.interfaces.dispatch import ALL, RANK0, Route
from trellis.registry import Registry
from trellis.runtime.controller import LocalWorkerGroup
from trellis.runtime.worker import RoleWorker, WorkerSpec


class Echoing(Backend):
    verbs = {"echo": Route(RANK0)}

    def __init__(self, spec) -> None:
        self.spec = spec

    def build(self) -> None:
        pass

    def forward(self, micros, outputs):
        return []

    def echo(self, text: str) -> str:
        return f"{self.spec.role}: {text}"


class Clashing(Echoing):
    verbs = {"save": Route(ALL)}


def built(backend: type[Backend]) -> RoleWorker:
    worker = RoleWorker(WorkerSpec("actor", "no-model", backend, None, None, {}, DistInfo(), Registry()))
    worker.build()
    return worker


def test_a_verb_the_backend_declares_is_served_in_process_and_through_the_controller():
    worker = built(Echoing)
    assert worker.echo("hi") == "actor: hi"
    assert LocalWorkerGroup("actor", worker).echo("hi") == "actor: hi"
    with pytest.raises(AttributeError, match="has no attribute or backend verb 'shout'"):
        worker.shout("hi")


def test_a_backend_verb_named_like_one_the_worker_serves_is_refused():
    with pytest.raises(ValueError, match=r"backend Clashing declares verbs \['save'\], which the role worker serves; name them otherwise"):
        LocalWorkerGroup("actor", built(Clashing))
