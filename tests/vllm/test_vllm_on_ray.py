"""The vLLM rollout under Ray on a real local cluster (loopback): built in the actor's rank process
beside FSDP, and in an engine process of its own (``trainer.rollout_pool``) fed by a weight
transport, also a step ahead of training. vLLM reports no digests: the probe checks each sync."""

from __future__ import annotations

import tempfile

import pytest

ray = pytest.importorskip("ray")

from engine_cases import check_engine_process_equals_rank, check_engine_process_one_step_ahead  # noqa: E402

VLLM = ("rollout.name=vllm", "rollout.max_model_len=128")


@pytest.fixture(scope="module")
def ray_cluster():
    """A private local cluster for this module: 3 logical CPUs (an actor rank, an engine process, a spare)."""
    ray.init(num_cpus=3, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="trellis-ray-test-"), log_to_driver=False)
    yield
    ray.shutdown()


def test_vllm_in_an_engine_process_of_its_own_equals_vllm_in_the_rank(ray_cluster, tiny_model_path, tmp_path):
    check_engine_process_equals_rank(tiny_model_path, tmp_path, *VLLM)


def test_vllm_in_an_engine_process_of_its_own_one_step_ahead(ray_cluster, tiny_model_path, tmp_path):
    check_engine_process_one_step_ahead(tiny_model_path, tmp_path, *VLLM)
