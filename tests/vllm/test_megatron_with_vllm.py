"""The Megatron backend with the vLLM rollout: the run equals the FSDP backend's (engine_cases)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="install trellis-backend-megatron to run the Megatron + vLLM test")

from engine_cases import check_megatron_equals_fsdp  # noqa: E402


def test_megatron_with_vllm_equals_fsdp_with_vllm(tiny_model_path, tmp_path):
    check_megatron_equals_fsdp(tiny_model_path, tmp_path, "rollout.name=vllm", "rollout.max_model_len=128")
