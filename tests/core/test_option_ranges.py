"""Declared ranges of numeric options: every shipped options dataclass declares them, compose
enforces them, and the error names the key, the value and the range before anything is built."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from omegaconf import OmegaConf

from trellis.config import ConfigError, Range, compose, option_dataclasses, ranged, unranged_options, validate
from trellis.plugins import load_plugins
from trellis.recipes.options import PreferenceTrainConfig, SFTTrainConfig, TrainerConfig

CORE = load_plugins(entry_points=False).registry
# core's recipe sections, and those core offers other packages' recipes (trellis-algos' sft, spin, rm)
SHARED = (TrainerConfig, SFTTrainConfig, PreferenceTrainConfig)
CORE_SCHEMAS = sorted(
    {s for options in [*(e.options for e in CORE.entries() if e.options), *SHARED] for s in option_dataclasses(options)}, key=lambda s: s.__qualname__
)


def test_core_recipes_reach_every_options_section():
    names = {s.__name__ for s in CORE_SCHEMAS}
    assert {"RLConfig", "SFTTrainConfig", "TrainerConfig", "OptimConfig", "ActorConfig", "RewardConfig", "MultiTurnConfig", "ToolConfig"} <= names
    assert unranged_options(CORE) == []


@pytest.mark.parametrize("schema", CORE_SCHEMAS, ids=lambda s: s.__qualname__)
def test_every_numeric_core_option_rejects_values_outside_its_range(schema, assert_ranges_enforced):
    assert_ranges_enforced(schema, CORE)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("actor.optim.lr=-1e-5", "config key 'actor.optim.lr' is -1e-05; it must be > 0; set actor.optim.lr to a value > 0"),
        ("sampling.n=0", "config key 'sampling.n' is 0; it must be >= 1"),
        ("sampling.top_p=1.5", "config key 'sampling.top_p' is 1.5; it must be in (0, 1]"),
        ("actor.optim.betas=[0.9,1.0]", "config key 'actor.optim.betas' is [0.9, 1.0] (item 1.0); it must be in [0, 1)"),
    ],
)
def test_compose_names_key_value_and_range(override, message, tmp_path):
    with pytest.raises(ConfigError) as err:
        compose(None, ["recipe=rl", "model.path=m", "data.train_path=d.jsonl", override], CORE)
    assert str(err.value).startswith(message)


def test_optional_numbers_accept_none_and_plugins_use_the_same_mechanism():
    @dataclass
    class PluginOptions:
        temperature: float | None = ranged(None, gt=0, le=2)

    assert validate(OmegaConf.create({"temperature": None}), PluginOptions, CORE).temperature is None
    with pytest.raises(ConfigError, match=r"'x.temperature' is 2.5; it must be in \(0, 2\]"):
        validate(OmegaConf.create({"temperature": 2.5}), PluginOptions, CORE, "x.")
    assert [str(Range(ge=1)), str(Range(lt=0)), str(Range(ge=0, le=1))] == [">= 1", "< 0", "in [0, 1]"]


def test_train_with_an_out_of_range_value_stops_before_any_model_or_run_folder(tmp_path, train_with):
    proc = train_with("actor.optim.lr=-1e-5")
    assert proc.returncode == 2
    expected = "trellis: error: config key 'actor.optim.lr' is -1e-05; it must be > 0; set actor.optim.lr to a value > 0"
    assert proc.stderr.strip().splitlines() == [expected]
    assert not (tmp_path / "runs").exists()
