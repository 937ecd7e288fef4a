"""Multi-turn conversations on the real SGLang engine through the agent loop: environment turns are
the chat template's tokens, and the rollout log-probs of the model's tokens equal a forward pass
over the whole conversation."""

from __future__ import annotations

import asyncio

import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from trellis.config import validate
from trellis.data import PromptDataset
from trellis.examples.tasks import make_arithmetic_split
from trellis.interfaces.agents import Interaction, InteractionTurn
from trellis.interfaces.rollout import RolloutSpec, SamplingParams
from trellis.multiturn.config import MultiTurnConfig
from trellis.multiturn.environment import agent_spec
from trellis.multiturn.loop import AgentLoop
from trellis.plugins import load_plugins
from trellis_sglang import SGLangRolloutOptions, make_engine

FEEDBACK = "<|im_start|>user\nwrong, try again<|im_end|>\n<|im_start|>assistant\n"


class AlwaysWrong(Interaction):
    async def respond(self, instance_id, messages):
        return InteractionTurn(done=False, message="wrong, try again", score=0.0)


def test_sglang_conversations_are_token_exact_with_matching_log_probs(tiny_model_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    engine = make_engine(RolloutSpec(tiny_model_path, SGLangRolloutOptions(context_length=256), tokenizer))
    registry = load_plugins().registry
    if "always_wrong" not in registry.names("interaction"):
        registry.adding_for("test_sglang_multiturn")
        registry.add("interaction", "always_wrong", AlwaysWrong)
    section = {"enable": True, "max_assistant_turns": 3, "max_user_turns": 2, "max_response_tokens": 120,
               "interactions": [{"name": "w", "component": "always_wrong"}]}  # fmt: skip
    agent = agent_spec(validate(OmegaConf.create(section), MultiTurnConfig, registry, "multi_turn."), registry, tokenizer)
    prompts = PromptDataset(make_arithmetic_split(3, 0, max_value=30), tokenizer, 64).as_batch()
    try:
        out = asyncio.run(AgentLoop(engine, agent).run(prompts, SamplingParams(n=2, max_new_tokens=6)))
    finally:
        engine.close()

    assert out["num_turns"].tolist() == [3] * 6 and list(out["finish_reason"]) == ["max_user_turns"] * 6
    for row in range(6):
        mask = out["response_mask"][row].tolist()
        ids = out["responses"][row].tolist()
        length = int(out["attention_mask"][row].sum() - prompts["attention_mask"][row // 2].sum())
        # runs of environment tokens (mask 0) inside the response: exactly the two feedback turns
        runs, start = [], None
        for i in range(length):
            if mask[i] == 0 and start is None:
                start = i
            if mask[i] == 1 and start is not None:
                runs.append((start, i))
                start = None
        assert len(runs) == 2
        for _, end in runs:
            assert tokenizer.decode(ids[:end]).endswith("<|im_end|>\n" + FEEDBACK)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    n = out["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"]).logits
    lp = torch.log_softmax(logits[:, -n - 1 : -1].float(), -1).gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out["rollout_log_probs"], lp * out["response_mask"], atol=1e-4, rtol=0)
