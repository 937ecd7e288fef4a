"""Megatron's process groups on a CUDA rank: ``init_parallel`` told by core that the rank's device
is CUDA (the default group stays gloo here) still builds the gloo groups Megatron's optimizer
builder asks for, so a trainable role builds (issue 33: it asserted "Intra partial data parallel
group is not initialized" on every GPU)."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf
from ranks import run_ranks

from trellis.config import validate
from trellis.interfaces.dispatch import Mesh
from trellis.plugins import load_plugins
from trellis.recipes.options import ActorConfig
from trellis.runtime.worker import build_worker


def _actor_on_cuda_groups(info, path: str) -> dict:
    """Build a trainable actor after core's group join answered a CUDA device."""
    from megatron.core import parallel_state as mpu

    from trellis_megatron import distributed

    joined = distributed.join_process_group

    def join_as_cuda(dist_info):
        joined(dist_info)
        return torch.device("cuda", 0)  # what core answers on a GPU rank

    distributed.join_process_group = join_as_cuda
    registry = load_plugins().registry
    options = validate(OmegaConf.create({"micro_batch_samples": 2, "optim": {"lr": 1e-3}, "policy_loss": {"name": "vanilla"}}), ActorConfig, registry)
    worker = build_worker(registry, "megatron", "actor", path, options, {"update": "policy"}, dist=info)
    return {
        "optimizer_params": sum(len(g["params"]) for g in worker.backend.optimizer.param_groups),
        "gloo_dp": torch.distributed.get_world_size(mpu.get_data_parallel_group_gloo(with_context_parallel=True, partial_data_parallel=True)),
    }


def test_trainable_role_builds_with_cuda_group_setup(tiny_untied_model_path):
    (result,) = run_ranks(_actor_on_cuda_groups, Mesh(), tiny_untied_model_path)
    assert result["gloo_dp"] == 1  # the one rank's gloo data-parallel group
    assert result["optimizer_params"] > 0  # the optimizer holds the model's weights
