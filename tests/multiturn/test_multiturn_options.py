"""The multi_turn section with trellis-multiturn installed: its string options enforce their values,
and the recipe finds the package's runner only when the section is switched on."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

import trellis_multiturn.plugin
from trellis import AgentLoop, ConfigError
from trellis.plugins import load_plugins
from trellis_algos.rl.multi_turn import MultiTurnConfig
from trellis_multiturn.environment import agent_spec
from trellis_multiturn.runner import MultiTurn

REGISTRY = load_plugins(entry_points=False, extra=[("multiturn", trellis_multiturn.plugin)]).registry


def test_the_sections_string_options_enforce_their_values(assert_choices_enforced):
    # agent_loop (tool_agent), tool_parser (hermes), score (last, sum, reward)
    assert assert_choices_enforced(MultiTurnConfig, REGISTRY, ("agent", "environment")) == 3


def test_the_package_registers_the_sections_runner():
    entry = REGISTRY.get("rollout_function", "multi_turn")
    assert isinstance(entry.obj, MultiTurn) and entry.plugin == "multiturn"


def test_a_section_with_nothing_to_talk_to_is_refused_unless_the_loop_brings_its_own_environment():
    """``tool_agent`` needs an interaction, tool, environment class or agent; a loop declaring
    ``brings_environment`` runs with none."""

    class Solitaire(AgentLoop):
        brings_environment = True

    registry = load_plugins(entry_points=False, extra=[("multiturn", trellis_multiturn.plugin)]).registry  # one Solitaire of its own
    registry.add("agent_loop", "solitaire", Solitaire)
    section = OmegaConf.structured(MultiTurnConfig(enable=True))
    with pytest.raises(ConfigError, match="multi_turn.agent_loop='tool_agent' does not"):
        agent_spec(section, registry, tokenizer=None)
    section.agent_loop = "solitaire"
    assert agent_spec(section, registry, tokenizer=None).interactions == {}
