"""What a role's parts declare: verbs a backend declares (``Backend.verbs``), served by the role
worker in-process and through a controller as their routes say (one named like a verb the worker
serves is refused); what a training objective declares (``OBJECTIVE``), read when the role is built."""

from __future__ import annotations

import pytest

from trellis.interfaces.backend import Backend, DistInfo
from trellis.interfaces.dispatch import ALL, RANK0, Route
from trellis.registry import Registry, RegistryError
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


def built(backend: type[Backend], objectives: dict[str, str] | None = None, registry: Registry | None = None) -> RoleWorker:
    worker = RoleWorker(WorkerSpec("actor", "no-model", backend, None, None, objectives or {}, DistInfo(), registry or Registry()))
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


class Counting:
    """A training objective's parts, all but ``loss``, and ``prefx``: a typo of ``prefix``."""

    outputs, inputs, summed = ("log_probs",), (), frozenset({"loss"})
    prefx = "count"

    def __init__(self, role_options, registry) -> None:
        pass

    def rows(self, batch):
        return batch

    def counts(self, batch):
        return None


def test_an_objective_is_checked_against_its_interface_when_the_role_is_built():
    registry = Registry()
    registry.add("objective", "counting", Counting)
    required = "outputs, inputs, summed, rows, counts, loss"
    with pytest.raises(RegistryError, match=f"objective 'counting' has no loss; every objective declares {required}"):
        built(Echoing, {"update": "counting"}, registry)

    class WithLoss(Counting):
        def loss(self, micro, outputs, agg):
            return None, {}

    registry.add("objective", "with_loss", WithLoss)
    with pytest.raises(RegistryError, match=r"objective 'with_loss' has 'prefx', which no caller reads; did you mean 'prefix'\?"):
        built(Echoing, {"update": "with_loss"}, registry)
