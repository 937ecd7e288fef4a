"""The multi_turn section with trellis-multiturn installed: its string options enforce their values,
and the recipe finds the package's runner only when the section is switched on."""

from __future__ import annotations

import trellis_multiturn.plugin
from trellis.plugins import load_plugins
from trellis.recipes.rl.multi_turn import MultiTurnConfig
from trellis_multiturn.runner import MultiTurn

REGISTRY = load_plugins(entry_points=False, extra=[("multiturn", trellis_multiturn.plugin)]).registry


def test_the_sections_string_options_enforce_their_values(assert_choices_enforced):
    # agent_loop (tool_agent), tool_parser (hermes), score (last, sum, reward)
    assert assert_choices_enforced(MultiTurnConfig, REGISTRY, ("agent", "environment")) == 3


def test_the_package_registers_the_sections_runner():
    entry = REGISTRY.get("rollout_function", "multi_turn")
    assert isinstance(entry.obj, MultiTurn) and entry.plugin == "multiturn"
