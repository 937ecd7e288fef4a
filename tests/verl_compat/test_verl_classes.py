"""Interactions and tools written the way verl's are (``verl_style.py``), named by ``verl_class`` in
``multi_turn``, run unchanged through this package's class adapter ``verl`` in core's loop."""

from __future__ import annotations

import pytest
import verl_style
from scripted import ScriptedEngine, prompts, row, run, spec

from trellis.config import ConfigError
from trellis.plugins import load_plugins
from trellis_demo.tiny import TOOLS_CHAT_TEMPLATE, make_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    tok = make_tiny_tokenizer(["12+34= #### 46 wrong, try again", '<tool_call>{"name": "calc", "arguments": {"expr": "12+34"}}'] * 20)
    tok.chat_template = TOOLS_CHAT_TEMPLATE  # the tool reaches the prompts
    return tok


@pytest.fixture(scope="module")
def registry():
    return load_plugins().registry  # this package's class adapter among the installed plugins


def test_verl_style_classes_run_through_the_adapter(registry, tokenizer):
    agent = spec(
        registry,
        tokenizer,
        interactions=[{"name": "gsm8k", "verl_class": "verl_style.VerlStyleInteraction", "options": {"feedback": "try again"}}],
        tools=[{"verl_class": "verl_style.VerlStyleTool", "schema": {"type": "function", "function": {"name": "calc", "parameters": {}}}}],
        max_assistant_turns=3,
    )
    engine = ScriptedEngine(tokenizer, ['<tool_call>{"name": "calc", "arguments": {"expr": "12+34"}}</tool_call>', "#### 45", "#### 46"])
    out = run(engine, agent, prompts(tokenizer, [row(interaction_kwargs={"name": "gsm8k", "ground_truth": "46"})]), max_new_tokens=64)
    assert list(out["turn_scores"]) == [[0.0, 1.0]] and out["tool_rewards"].tolist() == [0.25]
    assert "<|im_start|>tool\n46<|im_end|>" in tokenizer.decode(out["responses"][0].tolist())
    assert [c for c, _ in verl_style.CALLS] == ["start", "create", "execute", "respond", "respond", "release", "finalize"]


def test_a_class_that_cannot_be_used_is_refused_by_its_key(registry, tokenizer):
    with pytest.raises(ConfigError, match=r"multi_turn.interactions\[0\].verl_class.*cannot import module 'no_such_pkg'"):
        spec(registry, tokenizer, interactions=[{"name": "a", "verl_class": "no_such_pkg.Thing"}])
    with pytest.raises(ConfigError, match=r"multi_turn.tools\[0\].verl_class.*module 'verl_style' has no class 'Nope'"):
        spec(registry, tokenizer, tools=[{"verl_class": "verl_style.Nope", "schema": {"type": "function", "function": {"name": "n"}}}])
