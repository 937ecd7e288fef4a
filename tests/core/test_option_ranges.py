"""Declared ranges of numeric options: every shipped options dataclass declares them, compose
enforces them, and the error names the key, the value and the range before anything is built."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from omegaconf import OmegaConf

from trellis.config import ConfigError, Range, option_dataclasses, ranged, unranged_options, validate
from trellis.plugins import load_plugins
from trellis.recipes.options import AdapterConfig, BatchingConfig, OptimConfig, PromptData, SamplingConfig, TrainerConfig

CORE = load_plugins(entry_points=False).registry
# the sections core offers the recipes of other packages (trellis-algos' rl, sft, spin, rm): the recipes' own and
# those of the roles they train are checked in tests/algos/test_recipe_options.py
SHARED = (TrainerConfig, OptimConfig, AdapterConfig, BatchingConfig, SamplingConfig, PromptData)
CORE_SCHEMAS = sorted(
    {s for options in [*(e.options for e in CORE.entries() if e.options), *SHARED] for s in option_dataclasses(options)}, key=lambda s: s.__qualname__
)


def test_core_sections_reach_every_options_section():
    names = {s.__name__ for s in CORE_SCHEMAS}
    assert {"TrainerConfig", "OptimConfig", "AdapterConfig", "BatchingConfig", "SamplingConfig", "PromptData"} <= names
    assert unranged_options(CORE) == []


@pytest.mark.parametrize("schema", CORE_SCHEMAS, ids=lambda s: s.__qualname__)
def test_every_numeric_core_option_rejects_values_outside_its_range(schema, assert_ranges_enforced):
    assert_ranges_enforced(schema, CORE)


def test_optional_numbers_accept_none_and_plugins_use_the_same_mechanism():
    @dataclass
    class PluginOptions:
        temperature: float | None = ranged(None, gt=0, le=2)

    assert validate(OmegaConf.create({"temperature": None}), PluginOptions, CORE).temperature is None
    with pytest.raises(ConfigError, match=r"'x.temperature' is 2.5; it must be in \(0, 2\]"):
        validate(OmegaConf.create({"temperature": 2.5}), PluginOptions, CORE, "x.")
    assert [str(Range(ge=1)), str(Range(lt=0)), str(Range(ge=0, le=1))] == [">= 1", "< 0", "in [0, 1]"]
