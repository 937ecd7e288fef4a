"""One rank that casts nothing builds a plain module instead of FSDP2 shards: its checkpoints load
on two sharded ranks and theirs on it, with the optimizer state, and it lends its model to a
rollout engine in the same process (``full_module``)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from test_fsdp_worker import OBJECTIVES, actor_options, end_rank, free_port, make_worker, prepared_batch

from trellis.interfaces.backend import DistInfo
from trellis.plugins import load_plugins


@pytest.fixture(scope="module")
def registry():
    return load_plugins().registry


def options(registry):
    # Adam's eps at 1e-3: a gradient of pure rounding noise (the k_proj biases') would otherwise
    # move its weight by +-lr, and 1 rank and 2 round differently
    return actor_options(registry, optim={"eps": 1e-3})


def exported(worker) -> dict[str, torch.Tensor]:
    return dict(b for bucket in worker.export_weights() for b in bucket)


def _resume_on_two_ranks(rank: int, world: int, port: int, path: str, batch, plain_ckpt: str, sharded_ckpt: str, out: str) -> None:
    """Load the one-rank checkpoint on ``world`` sharded ranks, train one step, save, export."""
    torch.set_num_threads(1)
    registry = load_plugins().registry
    worker = make_worker(registry, path, "actor", options(registry), OBJECTIVES["actor"], DistInfo(rank, world, master_port=port))
    assert worker.backend.sharded and worker.full_module() is None
    worker.load(plain_ckpt)
    worker.train("update", batch.chunk(world)[rank])
    worker.save(sharded_ckpt)
    weights = exported(worker)
    if rank == 0:
        torch.save(weights, out)
    end_rank()


def test_checkpoints_move_between_one_plain_rank_and_two_sharded_ranks(registry, tiny_model_path, tmp_path):
    batch = prepared_batch(tiny_model_path)
    one = make_worker(registry, tiny_model_path, "actor", options(registry), OBJECTIVES["actor"])
    assert not one.backend.sharded and one.full_module() is one.backend.model
    one.train("update", batch)
    one.save(tmp_path / "plain")
    one.train("update", batch)  # the second step, uninterrupted: Adam's moments from the first matter
    expected = exported(one)

    out = str(tmp_path / "weights.pt")
    args = (2, free_port(), tiny_model_path, batch, str(tmp_path / "plain"), str(tmp_path / "sharded"), out)
    mp.start_processes(_resume_on_two_ranks, args=args, nprocs=2, start_method="spawn")
    sharded = torch.load(out)
    assert set(sharded) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(sharded[name], tensor, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")

    back = make_worker(registry, tiny_model_path, "actor", options(registry), OBJECTIVES["actor"])
    back.load(tmp_path / "sharded")
    for name, tensor in exported(back).items():
        assert torch.equal(tensor, sharded[name]), name


def test_a_cast_or_offloaded_parameters_lend_no_module(registry, tiny_model_path):
    """bfloat16 compute needs FSDP2's cast (so one rank shards too), and offloaded parameters
    leave during generation: neither can lend its model."""
    cast = make_worker(registry, tiny_model_path, "actor", actor_options(registry), OBJECTIVES["actor"], param_dtype="bfloat16")
    offloaded = make_worker(registry, tiny_model_path, "actor", actor_options(registry), OBJECTIVES["actor"], offload_params=True)
    assert cast.backend.sharded and cast.full_module() is None
    assert not offloaded.backend.sharded and offloaded.full_module() is None
