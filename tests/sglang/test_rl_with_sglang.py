"""The rl recipe end to end with ``rollout.name=sglang``: the only change from the default config.
The run closes its engine at the end (the controller's shutdown), so this process exits by itself."""

from __future__ import annotations

from engine_cases import run_rl_with


def test_rl_recipe_runs_with_the_sglang_rollout(tiny_model_path, tmp_path):
    run_rl_with("sglang", "context_length", tiny_model_path, tmp_path)
