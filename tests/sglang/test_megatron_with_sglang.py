"""The Megatron backend with the SGLang rollout: the run equals the FSDP backend's (engine_cases)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="install trellis-backend-megatron to run the Megatron + SGLang test")

from engine_cases import check_megatron_equals_fsdp  # noqa: E402


def test_megatron_with_sglang_equals_fsdp_with_sglang(tiny_model_path, tmp_path):
    check_megatron_equals_fsdp(tiny_model_path, tmp_path, "rollout.name=sglang", "rollout.context_length=128")
