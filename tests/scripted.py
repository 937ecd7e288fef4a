"""A stand-in rollout engine that answers each model turn with a scripted text (a random tiny model
cannot be made to write a given answer or tool call), and a chat template written for the tests
that drops reasoning from earlier assistant turns, as published reasoning templates do; the helpers
that run core's multi-turn loop on it (a ``multi_turn`` section resolved, prompts, a rollout)."""

from __future__ import annotations

import asyncio

from omegaconf import OmegaConf

from trellis.config import validate
from trellis.data import encode_text
from trellis.interfaces.rollout import Generation, RolloutEngine, SamplingParams
from trellis_algos import PromptDataset
from trellis_algos.rl.multi_turn import MultiTurnConfig
from trellis_multiturn.environment import agent_spec
from trellis_multiturn.loop import ToolAgentLoop
from trellis_multiturn.rollout import AgentRollout


class ScriptedEngine(RolloutEngine):
    """Stand-in engine: turn k of every conversation answers ``script[k]`` (cut at the turn's
    token limit), each token with log-prob -0.25, and records the prompt ids it was given."""

    def __init__(self, tokenizer, script, block: asyncio.Event | None = None):
        self.tokenizer, self.script, self.block = tokenizer, script, block
        self.prompts: list[list[int]] = []
        self.opening = encode_text(tokenizer, "<|im_start|>assistant\n")  # one per assistant turn, this one included

    def generate(self, prompts, params):
        raise NotImplementedError

    def load_weights(self, weights, shapes=None):
        raise NotImplementedError

    async def agenerate(self, prompt_ids, params):
        self.prompts.append(list(prompt_ids))
        if self.block is not None:
            await self.block.wait()
        k = len(self.opening)
        turn = sum(prompt_ids[i : i + k] == self.opening for i in range(len(prompt_ids))) - 1
        text = self.script[min(turn, len(self.script) - 1)]
        ids = encode_text(self.tokenizer, text) + [self.tokenizer.eos_token_id]
        ids = ids[: params.max_new_tokens]
        return Generation(ids, [-0.25] * len(ids), "stop" if ids[-1] == self.tokenizer.eos_token_id else "length")


REASONING_TEMPLATE = (
    "{%- set ns = namespace(last_user=0) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}{%- set content = m.content -%}"
    "{%- if m.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{{ '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


# core's multi-turn loop on a scripted engine: the resolved section, the prompts, a run
def spec(registry, tokenizer, **section):
    """The ``multi_turn`` section (``enable`` and ``section``) checked and resolved."""
    node = validate(OmegaConf.create({"enable": True, **section}), MultiTurnConfig, registry, "multi_turn.")
    return agent_spec(node, registry, tokenizer)


def prompts(tokenizer, rows, template_kwargs=None):
    """``rows`` as a prompt batch, rendered with the tokenizer's chat template."""
    return PromptDataset(rows, tokenizer, 1024, chat_template_kwargs=template_kwargs).as_batch()


def row(question="12+34=", **extra_info):
    """A prompt row in verl's schema whose answer is 46."""
    prompt = [{"role": "user", "content": question}]
    return {"prompt": prompt, "data_source": "arithmetic", "reward_model": {"ground_truth": "46"}, "extra_info": extra_info}


def tool_agent(agent):
    """The rollout function with core's default loop alone."""
    return AgentRollout(agent, {"tool_agent": ToolAgentLoop})


def run(engine, agent, batch, n=1, max_new_tokens=16):
    """The rollout of ``batch`` through core's loop on ``engine``: ``n`` samples a prompt."""
    return asyncio.run(tool_agent(agent)(engine, batch, SamplingParams(n=n, max_new_tokens=max_new_tokens)))
