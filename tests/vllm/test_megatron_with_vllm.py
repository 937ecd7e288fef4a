"""The Megatron backend with the vLLM rollout: the actor's weights reach vLLM in Hugging Face names
(mbridge's export) at every sync, and the run equals the FSDP backend's. Each run is a recipe
process with the Megatron CPU shim (``tests/megatron/boot``, test scaffolding: Megatron-Core asks
for CUDA where these CPU runs reach it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="install trellis-backend-megatron to run the Megatron + vLLM test")

from engine_cases import assert_same_run, length_rewarded_rl, step_rows  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "megatron"))
from ranks import boot_env  # noqa: E402 - the shim in every process of the run

TRAIN = "import sys; from trellis.recipes.train import train; train(None, sys.argv[1:])"


def vllm_run(model_path: str, tmp_path, backend: str) -> list[dict]:
    args = [*length_rewarded_rl(model_path, tmp_path, backend), "rollout.name=vllm", "rollout.max_model_len=128", f"backend.name={backend}"]
    done = subprocess.run([sys.executable, "-c", TRAIN, *args], env=boot_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return step_rows(tmp_path / backend)


def test_megatron_with_vllm_equals_fsdp_with_vllm(tiny_model_path, tmp_path):
    """Same seeds: the same sampled tokens, the same learning figures to float32 rounding, and after
    each sync the probe's vLLM-vs-trainer gap at float32 noise (a lost or misnamed tensor would
    stop the run)."""
    fsdp = vllm_run(tiny_model_path, tmp_path, "fsdp")
    megatron = vllm_run(tiny_model_path, tmp_path, "megatron")
    assert_same_run(fsdp, megatron)
    assert all(r["sync/probe_gap"] < 1e-5 for r in fsdp + megatron)
