"""The rl recipe end to end with ``rollout.name=vllm``: the only change from the default config; and vLLM as a judge model the recipe serves."""

from __future__ import annotations

from engine_cases import check_judge_engine, run_rl_with


def test_rl_recipe_runs_with_the_vllm_rollout(tiny_model_path, tmp_path):
    run_rl_with("vllm", "max_model_len", tiny_model_path, tmp_path)


def test_a_judge_model_served_by_vllm_answers_chat_completions(tiny_model_path):
    check_judge_engine("vllm", tiny_model_path, max_model_len=128)
