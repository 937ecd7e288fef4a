"""Dispatch over a device mesh, on simulated meshes (no processes): which rank gets which samples,
whose results come back, in which order; modes a backend declares itself."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from trellis.batch import Batch
from trellis.interfaces.backend import MODEL_INPUTS
from trellis.interfaces.dispatch import ALL, DP_CHUNKS, DP_SPLIT, RANK0, Mesh, Route
from trellis.interfaces.rollout import SamplingParams
from trellis.runtime.controller import LocalController, WorkerGroup


class SimulatedGroup(WorkerGroup):
    """A worker group whose 'ranks' are callables in this process: rank r runs ``fns[method](r, *args)``."""

    def __init__(self, mesh, routes, fns):
        super().__init__("actor", mesh, routes)
        self.fns, self.calls = fns, []

    def _execute(self, method, per_rank_args, kwargs):
        self.calls.append(per_rank_args)
        return [self.fns[method](r, *args) for r, args in enumerate(per_rank_args)]


def samples(n: int) -> Batch:
    return Batch({"x": torch.arange(n, dtype=torch.float)[:, None], "unread": torch.zeros(n, 3)}, {"tag": [f"s{i}" for i in range(n)]})


def test_mesh_lays_tp_fastest_then_dp_then_pp():
    mesh = Mesh(dp=2, tp=2)
    assert [mesh.coords(r) for r in range(4)] == [
        {"dp": 0, "tp": 0, "pp": 0, "cp": 0},
        {"dp": 0, "tp": 1, "pp": 0, "cp": 0},
        {"dp": 1, "tp": 0, "pp": 0, "cp": 0},
        {"dp": 1, "tp": 1, "pp": 0, "cp": 0},
    ]
    assert [r for r in range(4) if mesh.collects(r)] == [0, 2]  # tp rank 0 of each dp group
    pipeline = Mesh(dp=2, pp=2)
    assert [pipeline.coords(r)["pp"] for r in range(4)] == [0, 0, 1, 1]
    assert [r for r in range(4) if pipeline.collects(r)] == [2, 3]  # the last stage answers
    with pytest.raises(ValueError, match="rank 4 is outside a mesh of 4 ranks"):
        mesh.coords(4)
    with pytest.raises(ValueError, match="tp=0 must be at least 1"):
        Mesh(tp=0)


def test_dp_split_deals_strided_over_dp_groups_and_replicates_within_tp():
    mesh = Mesh(dp=2, tp=2)
    # every rank returns x * 10 + its own rank, so a result from the wrong rank shows
    group = SimulatedGroup(mesh, {"f": Route(DP_SPLIT, ("x",))}, {"f": lambda r, b: Batch({"y": b["x"] * 10 + r})})
    out = group.f(samples(6))
    dealt = [args[0]["x"].flatten().tolist() for args in group.calls[0]]
    assert dealt == [[0, 2, 4], [0, 2, 4], [1, 3, 5], [1, 3, 5]]  # tp ranks of a group see the same samples
    assert group.calls[0][0][0].keys() == ["x"]  # only the declared input travels
    assert out["y"].flatten().tolist() == [0, 12, 20, 32, 40, 52]  # original order, from ranks 0 and 2


def test_dp_split_collects_from_the_last_pipeline_stage_and_averages_metrics():
    mesh = Mesh(dp=2, pp=2)
    group = SimulatedGroup(mesh, {"f": Route(DP_SPLIT)}, {"f": lambda r, b: {"loss": float(r)}})
    assert group.f(samples(4)) == {"loss": 2.5}  # the mean of ranks 2 and 3, the last stage
    with pytest.raises(ValueError, match="a batch of 5 samples cannot be split evenly over 2 data-parallel ranks"):
        group.f(samples(5))


def test_dp_chunks_gives_contiguous_prompts_and_tolerates_empty_groups():
    mesh = Mesh(dp=3)
    group = SimulatedGroup(mesh, {"gen": Route(DP_CHUNKS)}, {"gen": lambda r, b: Batch({"y": b["x"] + 100 * r}) if len(b) else Batch()})
    assert group.gen(samples(4))["y"].flatten().tolist() == [0, 1, 102, 103]
    assert [len(args[0]) for args in group.calls[0]] == [2, 2, 0]


def test_all_and_rank0():
    mesh = Mesh(dp=2)
    group = SimulatedGroup(mesh, {"a": Route(ALL), "b": Route(RANK0)}, {"a": lambda r: r, "b": lambda r: r + 5})
    assert group.a() == [0, 1] and group.b() == 5


def test_a_backend_declares_its_own_mode():
    class FirstStageOnly:
        """Send the batch to pipeline stage 0 only; return its result."""

        def scatter(self, args, mesh):
            return [args if mesh.coords(r)["pp"] == 0 else (None,) for r in range(mesh.world_size)]

        def gather(self, results, mesh):
            return [res for r, res in enumerate(results) if mesh.coords(r)["pp"] == 0]

    mesh = Mesh(dp=1, pp=2)
    group = SimulatedGroup(mesh, {"warm": Route(FirstStageOnly())}, {"warm": lambda r, b: None if b is None else len(b)})
    assert group.warm(samples(3)) == [3]


def test_mesh_from_options_and_the_local_controller_refuses_more_than_one_rank():
    class TPOptions:
        def mesh(self, world):
            return Mesh(dp=world // 2, tp=2)

    assert Mesh.for_options(TPOptions(), 4) == Mesh(dp=2, tp=2)
    assert Mesh.for_options(None, 3) == Mesh(dp=3)
    with pytest.raises(ValueError, match=r"TPOptions.mesh\(3\) gave .* which has 2 ranks"):
        Mesh.for_options(TPOptions(), 3)
    with pytest.raises(ValueError, match="the local controller runs one rank; role 'actor' asks for a mesh of 2"):
        LocalController().spawn("actor", lambda dist: None, Mesh(tp=2))


class Doubling:
    """A rollout function: ``n`` samples per prompt, each the prompt's ids doubled; records the
    engine and the fields it was given."""

    inputs = ("input_ids", "tag")

    def __init__(self):
        self.seen = []

    def __call__(self, engine, prompts, params):
        self.seen.append((engine, prompts.keys()))
        return Batch({"responses": (prompts["input_ids"] * 2).repeat_interleave(params.n, 0)})


class AsyncDoubling(Doubling):
    async def __call__(self, engine, prompts, params):
        await asyncio.sleep(0)
        return Doubling.__call__(self, engine, prompts, params)


@pytest.mark.parametrize("fn", [Doubling(), AsyncDoubling()], ids=["sync", "async"])
def test_rollout_runs_the_callers_function_beside_the_engine(fn):
    """The function gets the engine and the fields it names; the other fields stay with the caller
    and are repeated onto each prompt's samples, which carry the weight version."""
    engine = SimpleNamespace(weight_dtype=None, model_inputs=MODEL_INPUTS)  # all a rollout reads of an engine it never calls
    rollout = LocalController().spawn_rollout(lambda: engine, None)
    rollout.version = 3
    prompts = Batch({"input_ids": torch.tensor([[1, 2], [3, 4]]), "attention_mask": torch.ones(2, 2, dtype=torch.long)},
                    {"tag": ["a", "b"], "uid": ["u0", "u1"]})  # fmt: skip
    out = rollout.rollout(prompts, SamplingParams(n=2), fn)
    assert fn.seen == [(engine, ["input_ids", "tag"])]
    assert out["responses"].tolist() == [[2, 4], [2, 4], [6, 8], [6, 8]]
    assert list(out["uid"]) == ["u0", "u0", "u1", "u1"] and out["attention_mask"].shape == (4, 2)
    assert out["weight_version"].tolist() == [3] * 4 and "tag" not in out
