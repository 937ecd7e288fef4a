"""The options of trellis-algos' recipes (their own sections, the roles' and the ``reward`` section):
every section they reach declares its choices and ranges, compose and ``trellis train`` name the key, the
value and the fix before anything is built, and a section another package serves names that package
when it is missing (core and trellis-algos alone)."""

from __future__ import annotations

import pytest
from cli_runs import run_cli
from omegaconf import OmegaConf
from open_options import OPEN_ENDED

import trellis_algos.plugin
from trellis.config import ConfigError, compose, option_dataclasses, unranged_options, validate
from trellis.plugins import load_plugins
from trellis_algos.rl.checks import reward_services
from trellis_algos.rl.multi_turn import MultiTurnConfig

# core and trellis-algos only, whatever else this venv has installed
REGISTRY = load_plugins(entry_points=False, extra=[("algos", trellis_algos.plugin)]).registry
# the sections trellis-algos' recipes declare (their own, the reward section, the roles they train); core's in tests/core
SCHEMAS = sorted(
    {
        s
        for name in ("rl", "sft", "spin", "rm")
        for s in option_dataclasses(REGISTRY.get("recipe", name).options)
        if s.__module__.startswith("trellis_algos")
    },
    key=lambda s: s.__qualname__,
)


def test_the_recipes_reach_their_sections_and_every_number_declares_a_range():
    sections = {"RLConfig", "RLTrainerConfig", "AlgorithmConfig", "MultiTurnConfig", "ToolConfig", "DynamicSamplingConfig", "TeacherConfig"}
    sections |= {"ActorConfig", "CriticConfig", "DistillConfig", "SFTTrainConfig", "PreferenceTrainConfig"}
    assert sections | {"RewardConfig", "RewardModelConfig"} <= {s.__name__ for s in SCHEMAS}
    assert unranged_options(REGISTRY) == []


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: s.__qualname__)
def test_every_numeric_recipe_option_rejects_values_outside_its_range(schema, assert_ranges_enforced):
    assert_ranges_enforced(schema, REGISTRY)


def test_every_recipe_string_option_with_a_fixed_set_of_values_declares_and_enforces_it(assert_choices_enforced):
    checked = {s.__qualname__: assert_choices_enforced(s, REGISTRY, OPEN_ENDED.get(s.__qualname__, ())) for s in SCHEMAS}
    # algorithm.kl_penalty and kl_ctrl_type, multi_turn.score, dynamic_sampling.metric and filters, reward.model.layout, the
    # trainer's section: core's 5 (controller, ray_network, trackers, separate_pools, weight_transport) plus async_mode and
    # async_schedule; the roles' sections: actor.loss_agg_mode, kl_loss_type and router_replay, critic.loss_agg_mode, sft's
    # train.loss_agg_mode; spin's pairs (multi_turn.agent_loop and tool_parser name trellis-multiturn's components: tests/multiturn)
    assert sum(checked.values()) == 19, {k: v for k, v in checked.items() if v}


def test_compose_names_key_value_valid_values_and_closest():
    with pytest.raises(ConfigError) as err:
        compose(None, ["recipe=rl", "model.path=m", "data.train_path=d.jsonl", "actor.optim.lr_schedule=cosin"], REGISTRY)
    assert str(err.value) == "config key 'actor.optim.lr_schedule' is 'cosin'; valid values: constant, cosine; did you mean 'cosine'?"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("actor.optim.lr=-1e-5", "config key 'actor.optim.lr' is -1e-05; it must be > 0; set actor.optim.lr to a value > 0"),
        ("sampling.n=0", "config key 'sampling.n' is 0; it must be >= 1"),
        ("sampling.top_p=1.5", "config key 'sampling.top_p' is 1.5; it must be in (0, 1]"),
        ("actor.optim.betas=[0.9,1.0]", "config key 'actor.optim.betas' is [0.9, 1.0] (item 1.0); it must be in [0, 1)"),
    ],
)
def test_compose_names_key_value_and_range(override, message):
    with pytest.raises(ConfigError) as err:
        compose(None, ["recipe=rl", "model.path=m", "data.train_path=d.jsonl", override], REGISTRY)
    assert str(err.value).startswith(message)


@pytest.fixture
def train_with(tmp_path, tiny_model_path):
    """``train_with(override)``: ``trellis train run.yaml <override>`` (in this process,
    ``cli_runs``), on a one-row rl config in ``tmp_path``; returns its exit status and output."""

    def run(override: str):
        data = tmp_path / "train.jsonl"
        data.write_text('{"prompt": [{"role": "user", "content": "1+1="}], "reward_model": {"ground_truth": "2"}}\n')
        config = tmp_path / "run.yaml"
        config.write_text(f"recipe: rl\nmodel: {{path: {tiny_model_path}}}\ndata: {{train_path: {data}}}\n")
        return run_cli("train", str(config), override, cwd=tmp_path)

    return run


@pytest.mark.parametrize(
    ("override", "error"),
    [
        ("actor.optim.lr=-1e-5", "config key 'actor.optim.lr' is -1e-05; it must be > 0; set actor.optim.lr to a value > 0"),
        ("actor.optim.lr_schedule=cosin", "config key 'actor.optim.lr_schedule' is 'cosin'; valid values: constant, cosine; did you mean 'cosine'?"),
    ],
)
def test_train_with_a_bad_value_stops_before_any_model_or_run_folder(tmp_path, train_with, override, error):
    proc = train_with(override)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"trellis: error: {error}"]
    assert not (tmp_path / "runs").exists()


def test_multi_turn_without_its_package_names_the_install_command(monkeypatch):
    """The rl recipe reads its multi_turn section without trellis-multiturn; switched on, it needs
    that package (the section's default agent loop and parser are its, looked up only then)."""
    monkeypatch.setattr("trellis.registry._distribution_installed", lambda name: False)

    def section(**given):
        return validate(OmegaConf.create(given), MultiTurnConfig, REGISTRY, "multi_turn.")

    assert section().agent_loop == "tool_agent"
    with pytest.raises(ConfigError) as err:
        section(enable=True)
    msg = str(err.value)
    assert msg.startswith("config key 'multi_turn.agent_loop' is 'tool_agent'") and "pip install trellis-multiturn" in msg, msg
    with pytest.raises(ConfigError) as err:  # a name given in the switched-off section is still checked
        section(tool_parser="hermes")
    assert "pip install trellis-multiturn" in str(err.value)


@pytest.mark.parametrize(("key", "value"), [("reward.model.path", "rm"), ("reward.judge.engine", "hf")])
def test_a_reward_a_service_serves_without_its_package_names_the_install_command(monkeypatch, key, value):
    monkeypatch.setattr("trellis.registry._distribution_installed", lambda name: False)
    cfg = OmegaConf.create({})
    OmegaConf.update(cfg, key, value)  # the rl config's reward section is all that is read
    with pytest.raises(ConfigError) as err:
        reward_services(cfg, REGISTRY)
    assert str(err.value).startswith(f"config key '{key.rsplit('.', 1)[0]}'") and "pip install trellis-judges" in str(err.value), err.value
