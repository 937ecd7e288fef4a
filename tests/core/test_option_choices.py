"""Declared choices of string options: every shipped string option with a fixed set of values
declares it (``choice``), compose enforces it, and the error names the key, the value, the valid
values and the closest of them before anything is built."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from omegaconf import OmegaConf
from open_options import OPEN_ENDED

from trellis.config import ConfigError, choice, option_dataclasses, validate
from trellis.plugins import load_plugins
from trellis.recipes.options import AdapterConfig, BatchingConfig, OptimConfig, PromptData, SamplingConfig, TrainerConfig

CORE = load_plugins(entry_points=False).registry
# the sections core offers the recipes of other packages (trellis-algos' rl, sft, spin, rm): the recipes' own and
# those of the roles they train are checked in tests/algos/test_recipe_options.py
SHARED = (TrainerConfig, OptimConfig, AdapterConfig, BatchingConfig, SamplingConfig, PromptData)
CORE_SCHEMAS = sorted(
    {s for options in [*(e.options for e in CORE.entries() if e.options), *SHARED] for s in option_dataclasses(options)}, key=lambda s: s.__qualname__
)


def test_every_core_string_option_with_a_fixed_set_of_values_declares_and_enforces_it(assert_choices_enforced):
    checked = sum(assert_choices_enforced(s, CORE, OPEN_ENDED.get(s.__qualname__, ())) for s in CORE_SCHEMAS)
    # lr_schedule, controller, ray_network, trackers, separate_pools, weight_transport, adapter.init
    assert checked == 7


@pytest.mark.parametrize(
    ("section", "message"),
    [
        # controllers are a component kind: core has 'local' (trellis-ray adds 'ray')
        ({"controller": "rey"}, "config key 'trainer.controller' is 'rey': controller 'rey' is not installed (installed controller names: local)"),
        (
            {"separate_pools": ["critic", "reward"]},
            "config key 'trainer.separate_pools' is ['critic', 'reward'] (item 'reward'); valid values: critic, reward_model; "
            "did you mean 'reward_model'?",
        ),
        # a component kind's names: the registry's message, with what is installed
        (
            {"trackers": ["console", "jsnol"]},
            "config key 'trainer.trackers' is ['console', 'jsnol'] (item 'jsnol'): tracker 'jsnol' is not installed "
            "(installed tracker names: console, jsonl); did you mean 'jsonl'?",
        ),
    ],
)
def test_list_items_and_component_names_are_checked_too(section, message):
    with pytest.raises(ConfigError) as err:
        validate(OmegaConf.create(section), TrainerConfig, CORE, "trainer.")
    assert str(err.value) == message


def test_none_passes_an_optional_choice_and_a_choice_must_hold_its_default():
    @dataclass
    class PluginOptions:
        mode: str | None = choice(None, ("fast", "exact"))

    assert validate(OmegaConf.create({"mode": None}), PluginOptions, CORE).mode is None
    assert validate(OmegaConf.create({"mode": "exact"}), PluginOptions, CORE).mode == "exact"
    with pytest.raises(ValueError, match=r"the default 'slow' is not one of the valid values \['fast', 'exact'\]"):
        choice("slow", ("fast", "exact"))
    with pytest.raises(ValueError, match="either the valid values or a component kind"):
        choice("x")
