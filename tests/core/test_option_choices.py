"""Declared choices of string options: every shipped string option with a fixed set of values
declares it (``choice``), compose enforces it, and the error names the key, the value, the valid
values and the closest of them before anything is built."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from omegaconf import OmegaConf

from trellis.config import ConfigError, choice, compose, option_dataclasses, validate
from trellis.plugins import load_plugins
from trellis.recipes.options import PreferenceTrainConfig, SFTTrainConfig, TrainerConfig

CORE = load_plugins(entry_points=False).registry
# core's recipe sections, and those core offers other packages' recipes (trellis-algos' sft, spin, rm)
SHARED = (TrainerConfig, SFTTrainConfig, PreferenceTrainConfig)
CORE_SCHEMAS = sorted(
    {s for options in [*(e.options for e in CORE.entries() if e.options), *SHARED] for s in option_dataclasses(options)}, key=lambda s: s.__qualname__
)
# string options whose values are open: paths, names, free text
OPEN_ENDED = {
    "AdapterConfig": {"target_modules"},  # module-name suffixes of the model at hand, or all-linear
    "AgentLoopConfig": {"name", "component"},  # component: a registered agent loop, checked with the section
    "CriticConfig": {"model_path"},
    "InteractionConfig": {"name", "component", "verl_class"},  # component: a registered name, checked with the section
    "JudgeEngineConfig": {"model"},  # a folder; engine is a choice of the rollout kind's names
    "ModelConfig": {"path", "tokenizer_path"},
    "PromptData": {"image_key"},  # a column of the user's rows
    "MultiTurnConfig": {"agent", "environment"},  # a function or class: path/to/file.py:name, checked with the section
    "RLConfig": {"recipe"},
    "RewardConfig": {"name", "path"},  # a registered reward or a function in reward.path
    "RewardTerm": {"name", "path", "key"},
    "RewardModelConfig": {"path", "key"},
    "RMConfig": {"recipe"},
    "TeacherConfig": {"path"},
    "ToolConfig": {"component", "verl_class"},
    "TrainerConfig": {"run_dir", "threads", "resume", "resume_allow_changes"},  # threads: auto or a count; resume: auto, never or a path
}
OPEN_ENDED["RLTrainerConfig"] = OPEN_ENDED["TrainerConfig"]  # the rl recipe's trainer section adds async_mode


def test_every_core_string_option_with_a_fixed_set_of_values_declares_and_enforces_it(assert_choices_enforced):
    checked = sum(assert_choices_enforced(s, CORE, OPEN_ENDED.get(s.__qualname__, ())) for s in CORE_SCHEMAS)
    # 3 loss_agg_mode, lr_schedule, controller, ray_network, trackers, separate_pools, weight_transport, kl_ctrl_type,
    # multi_turn.score, dynamic_sampling.metric, dynamic_sampling.filters, adapter.init, reward.model.layout, actor.router_replay
    # (actor.kl_loss_type and algorithm.kl_penalty name kl estimators: tests/algos, where they are installed; multi_turn.agent_loop
    # and tool_parser name trellis-multiturn's components: tests/multiturn), and the rl recipe's trainer section: the
    # trainer's 5 again plus async_mode and async_schedule
    assert checked == 23


def test_compose_names_key_value_valid_values_and_closest():
    with pytest.raises(ConfigError) as err:
        compose(None, ["recipe=rl", "model.path=m", "data.train_path=d.jsonl", "actor.optim.lr_schedule=cosin"], CORE)
    assert str(err.value) == "config key 'actor.optim.lr_schedule' is 'cosin'; valid values: constant, cosine; did you mean 'cosine'?"


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


def test_train_with_a_misspelt_lr_schedule_stops_before_any_model_or_run_folder(tmp_path, train_with):
    proc = train_with("actor.optim.lr_schedule=cosin")
    assert proc.returncode == 2
    expected = "trellis: error: config key 'actor.optim.lr_schedule' is 'cosin'; valid values: constant, cosine; did you mean 'cosine'?"
    assert proc.stderr.strip().splitlines() == [expected]
    assert not (tmp_path / "runs").exists()
