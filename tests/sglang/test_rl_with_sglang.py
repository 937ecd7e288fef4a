"""The rl recipe end to end with ``rollout.name=sglang``: the only change from the default config.
The run closes its engine at the end (the controller's shutdown), so this process exits by itself.
And SGLang as a judge model the recipe serves."""

from __future__ import annotations

from engine_cases import check_judge_engine, run_rl_with


def test_rl_recipe_runs_with_the_sglang_rollout(tiny_model_path, tmp_path):
    run_rl_with("sglang", "context_length", tiny_model_path, tmp_path)


def test_a_judge_model_served_by_sglang_answers_chat_completions(tiny_model_path):
    check_judge_engine("sglang", tiny_model_path, context_length=128)
