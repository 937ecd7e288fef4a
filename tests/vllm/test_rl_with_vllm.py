"""The rl recipe end to end with ``rollout.name=vllm``: the only change from the default config."""

from __future__ import annotations

from engine_cases import run_rl_with


def test_rl_recipe_runs_with_the_vllm_rollout(tiny_model_path, tmp_path):
    run_rl_with("vllm", "max_model_len", tiny_model_path, tmp_path)
