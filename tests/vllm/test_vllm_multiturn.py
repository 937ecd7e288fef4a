"""Multi-turn conversations on the real vLLM engine: the shared case (``tests/engine_cases.py``) and
many seeded conversations joining the engine between its steps."""

from __future__ import annotations

import asyncio

import torch
from engine_cases import MultiTurnCases, always_wrong_agent, build

from trellis.interfaces.rollout import SamplingParams
from trellis_algos import PromptDataset
from trellis_demo.tasks import make_arithmetic_split


class TestVLLMMultiTurn(MultiTurnCases):
    ENGINE = "vllm"
    CONTEXT = "max_model_len"


def test_many_seeded_conversations_at_once_are_reproducible(tiny_model_path):
    """64 seeded conversations joining the engine between its steps: on CPU a prefill split over
    steps used to rewind a seeded generator and crash vLLM; the same seed gives the same tokens."""
    engine = build("vllm", tiny_model_path, max_model_len=512)
    agent = always_wrong_agent(engine.tokenizer, max_assistant_turns=3, max_user_turns=3, max_response_tokens=400)
    prompts = PromptDataset(make_arithmetic_split(16, 1, max_value=30), engine.tokenizer, 64).as_batch()

    def run():
        return asyncio.run(agent(engine, prompts, SamplingParams(n=4, max_new_tokens=8, seed=3)))

    first, second = run(), run()
    engine.close()
    assert first["num_turns"].tolist() == [3] * 64
    assert torch.equal(first["responses"], second["responses"]) and torch.equal(first["rollout_log_probs"], second["rollout_log_probs"])
