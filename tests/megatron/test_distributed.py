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
from trellis.runtime.worker import build_worker
from trellis_algos import ActorConfig


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


def _reference_on_cuda(info, path: str) -> dict:
    """Build a frozen role with the backend told its device is CUDA (the CPU shim runs it; a
    trainable one cannot build here: Megatron's bf16 optimizer asks for torch.cuda tensor types)."""
    from trellis_megatron import backend

    backend.device_for = lambda dist_info: torch.device("cuda", 0)
    worker = build_worker(load_plugins().registry, "megatron", "ref", path, dist=info)
    model = worker.backend.model
    return {
        "weights": {p.dtype for p in model.parameters()},
        "not_bf16": [n for n, p in model.named_parameters() if p.dtype != torch.bfloat16],
        "fusions": (model.config.bias_activation_fusion, model.config.bias_dropout_fusion, model.config.masked_softmax_fusion),
    }


def test_cuda_default_is_bf16_with_compiled_fusions(tiny_untied_model_path):
    """backend.dtype=auto (the default) is bfloat16 on CUDA; SwiGLU and bias-dropout-add use
    Megatron's compiled fusions (the softmax fusion needs Apex: off)."""
    (result,) = run_ranks(_reference_on_cuda, Mesh(), tiny_untied_model_path)
    assert result["weights"] == {torch.bfloat16}, result["not_bf16"]
    assert result["fusions"] == (True, True, False)


def test_cpu_default_stays_float32():
    from trellis_megatron.backend import fusions
    from trellis_megatron.options import MegatronOptions

    assert (MegatronOptions().activation_dtype("cpu"), MegatronOptions().activation_dtype("cuda")) == ("float32", "bfloat16")
    assert MegatronOptions(dtype="float32").activation_dtype("cuda") == "float32"
    assert not any(fusions("cpu").values())
