"""Config errors: each names the dotted path, the bad value and the fix."""

from __future__ import annotations

import textwrap
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from trellis import TrainerConfig
from trellis.config import ConfigError, compose, validate
from trellis.plugins import load_plugins


@pytest.fixture(scope="module")
def registry():
    """Core plus the example plugin only, whatever else this venv has installed."""
    import trellis_example.plugin

    return load_plugins(entry_points=False, extra=[("example", trellis_example.plugin)]).registry


@pytest.fixture
def yaml_file(tmp_path):
    def write(text: str):
        path = tmp_path / "run.yaml"
        path.write_text(textwrap.dedent(text))
        return path

    return write


BASE = """
recipe: example_echo
data:
  path: data.jsonl
"""


def test_defaults_filled_and_types_converted(registry, yaml_file):
    cfg = compose(yaml_file(BASE), ["trainer.lr=1", "advantage.scale=3"], registry)
    assert cfg.trainer.total_steps == 2 and cfg.data.max_prompt_length == 16
    assert cfg.trainer.lr == 1.0 and isinstance(cfg.trainer.lr, float)
    assert dict(cfg.advantage) == {"name": "example_scaled", "scale": 3.0}


def test_a_number_given_for_a_string_becomes_that_string_without_a_warning(registry, yaml_file):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # OmegaConf's FutureWarning on an implicit int -> str
        cfg = compose(yaml_file(BASE), ["trainer.run_dir=5"], registry)
    assert cfg.trainer.run_dir == "5"


def test_unknown_nested_key_names_path_valid_keys_and_closest(registry, yaml_file):
    with pytest.raises(ConfigError) as err:
        compose(yaml_file(BASE), ["trainer.totl_steps=3"], registry)
    assert str(err.value) == (
        "unknown config key 'trainer.totl_steps'; valid keys here: lr, run_dir, total_steps, trackers; did you mean 'trainer.total_steps'?"
    )


def test_unknown_top_level_key(registry, yaml_file):
    expected = r"unknown config key 'sead'; valid keys here: advantage, data, recipe, seed, trainer; did you mean 'seed'\?"
    with pytest.raises(ConfigError, match=expected):
        compose(yaml_file(BASE + "sead: 3\n"), [], registry)


def test_unknown_component_option_checked_against_component_dataclass(registry, yaml_file):
    with pytest.raises(ConfigError, match=r"unknown config key 'advantage.scal'; valid keys here: scale; did you mean 'advantage.scale'\?"):
        compose(yaml_file(BASE), ["advantage.scal=1"], registry)


def test_wrong_type_names_path_value_and_expected_type(registry, yaml_file):
    with pytest.raises(ConfigError) as err:
        compose(yaml_file(BASE), ["trainer.total_steps=ten"], registry)
    msg = str(err.value)
    assert msg.startswith("config key 'trainer.total_steps' has value 'ten' but expects type int; set trainer.total_steps to a value of type int")


def test_wrong_type_in_component_option(registry, yaml_file):
    with pytest.raises(ConfigError, match=r"config key 'advantage.scale' has value 'big' but expects type float"):
        compose(yaml_file(BASE), ["advantage.scale=big"], registry)


def test_section_given_a_scalar(registry, yaml_file):
    with pytest.raises(ConfigError, match=r"config key 'trainer' must be a mapping of options \(total_steps, lr, run_dir, trackers\), got 5"):
        compose(yaml_file(BASE), ["trainer=5"], registry)


def test_unknown_component_name_gives_install_command(registry, yaml_file, monkeypatch):
    monkeypatch.setattr("trellis.registry._distribution_installed", lambda name: False)
    with pytest.raises(ConfigError) as err:
        compose(yaml_file(BASE), ["advantage.name=grpo"], registry)
    msg = str(err.value)
    assert "config key 'advantage.name'" in msg and "pip install trellis-algos" in msg
    assert "installed advantage names: example_scaled" in msg


@pytest.mark.parametrize("recipe", ["rl", "sft", "spin", "rm"])
def test_a_recipe_of_trellis_algos_without_it_gives_the_install_command(registry, yaml_file, monkeypatch, recipe):
    """Core ships no recipe: every one of them is trellis-algos', and asking for one without it says so."""
    monkeypatch.setattr("trellis.registry._distribution_installed", lambda name: False)
    with pytest.raises(ConfigError) as err:
        compose(yaml_file(f"recipe: {recipe}\n"), [], registry)
    msg = str(err.value)
    assert msg.startswith(f"config key 'recipe': recipe {recipe!r}") and "pip install trellis-algos" in msg, msg


@dataclass
class WithTrainer:
    recipe: str = "placed"
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def test_the_ray_controller_without_its_package_names_the_install_command(yaml_file, monkeypatch):
    """trainer.controller names a registered controller: core has 'local'; 'ray' comes with trellis-ray."""
    registry = load_plugins(entry_points=False).registry
    registry.add("recipe", "placed", SimpleNamespace(Config=WithTrainer, run=lambda cfg, ctx: {}), options=WithTrainer)
    monkeypatch.setattr("trellis.registry._distribution_installed", lambda name: False)
    with pytest.raises(ConfigError) as err:
        compose(yaml_file("recipe: placed\n"), ["trainer.controller=ray"], registry)
    msg = str(err.value)
    assert "config key 'trainer.controller' is 'ray'" in msg and "pip install trellis-ray" in msg
    assert "installed controller names: local" in msg
    assert compose(yaml_file("recipe: placed\n"), [], registry).trainer.controller == "local"


def test_missing_required_value(registry, yaml_file):
    with pytest.raises(ConfigError, match=r"config key 'data.path' is required and has no default; set it in the YAML or pass data.path=\.\.\."):
        compose(yaml_file("recipe: example_echo\n"), [], registry)


def test_missing_recipe_key_lists_recipes(registry, yaml_file):
    with pytest.raises(ConfigError, match=r"config key 'recipe' is missing; name the recipe to run.*example_echo"):
        compose(yaml_file("seed: 1\n"), [], registry)


def test_unknown_recipe(registry, yaml_file):
    with pytest.raises(ConfigError, match=r"config key 'recipe': recipe 'rll' is not installed.*installed recipe names: example_echo"):
        compose(yaml_file("recipe: rll\n"), [], registry)


def test_bad_override_and_missing_file(registry, yaml_file, tmp_path):
    with pytest.raises(ConfigError, match=r"override 'seed' is not of the form key=value"):
        compose(yaml_file(BASE), ["seed"], registry)
    with pytest.raises(ConfigError, match=r"config file '.*nope.yaml' does not exist"):
        compose(tmp_path / "nope.yaml", [], registry)


def test_component_shorthand_keeps_recipe_defaults_for_same_name(registry, yaml_file):
    cfg = compose(yaml_file(BASE + "advantage: example_scaled\n"), [], registry)
    assert dict(cfg.advantage) == {"name": "example_scaled", "scale": 2.0}


def test_installed_provider_gets_no_pip_hint(registry, yaml_file, monkeypatch):
    monkeypatch.setattr("trellis.registry._distribution_installed", lambda name: True)
    with pytest.raises(ConfigError) as err:
        compose(yaml_file(BASE), ["advantage.name=grpo"], registry)
    assert "pip install" not in str(err.value) and "installed advantage names: example_scaled" in str(err.value)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "data.path=...",
            "override 'data.path': the value '...' is not valid YAML (did not find expected node content); "
            "if it is a string, quote it: data.path=\"'...'\" in the shell",
        ),
        ("trainer.trackers=[jsonl", "override 'trainer.trackers': the value '[jsonl' is not valid YAML (did not find expected ',' or ']')"),
    ],
)
def test_override_value_yaml_cannot_read_names_the_key(registry, yaml_file, override, message):
    with pytest.raises(ConfigError) as err:
        compose(yaml_file(BASE), [override], registry)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert compose(yaml_file(BASE), ["data.path='...'"], registry).data.path == "..."


def test_cli_prints_one_line_for_an_unreadable_override(yaml_file, capsys):
    from trellis.cli import main

    assert main(["config", "show", str(yaml_file(BASE)), "data.path=..."]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "trellis: error: override 'data.path': the value '...' is not valid YAML (did not find expected node content); "
        "if it is a string, quote it: data.path=\"'...'\" in the shell"
    ]


@dataclass
class Inner:
    lr: float = 1.0
    clip: float = 1.0


@dataclass
class Outer:
    inner: Inner = field(default_factory=lambda: Inner(lr=0.5))


def test_a_sections_defaults_come_from_its_parent_given_or_not(registry):
    """SFT's ``train.optim.lr`` defaults to 1e-4 (not OptimConfig's 1e-5), also when other optim keys are set."""
    assert dict(validate(OmegaConf.create({"inner": {"clip": 2.0}}), Outer, registry).inner) == {"lr": 0.5, "clip": 2.0}
    assert dict(validate(OmegaConf.create({}), Outer, registry).inner) == {"lr": 0.5, "clip": 1.0}


def test_a_hugging_face_trainer_checkpoint_is_a_model_folder_and_a_trellis_one_is_not(tmp_path):
    """HF Trainer and TRL save ``checkpoint-N`` model folders (config.json and weights): refused as
    trellis checkpoints by their name alone, they could not start a run or be evaluated."""
    from trellis.recipes.options import check_not_a_run
    from trellis.runtime.checkpoint import MANIFEST

    hf = tmp_path / "trl" / "checkpoint-20"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    check_not_a_run(hf)
    ours = tmp_path / "run" / "checkpoint-4"
    ours.mkdir(parents=True)
    (ours / MANIFEST).write_text("{}")
    with pytest.raises(ConfigError, match=r"is a trellis checkpoint, not a Hugging Face model folder; export it first"):
        check_not_a_run(ours)


def test_a_run_folder_that_kept_no_checkpoint_is_known_by_its_provenance(tmp_path):
    """A run with trainer.keep_checkpoints=0 leaves no checkpoint-N, but every run writes
    provenance.json: given as a model folder, it is refused naming the final model it saved."""
    from trellis.recipes.options import check_not_a_run
    from trellis.runtime import provenance

    run = tmp_path / "run"
    (run / "hf_model").mkdir(parents=True)
    (run / "hf_model" / "config.json").write_text("{}")
    check_not_a_run(run, "teacher.path")
    (run / provenance.FILE).write_text("{}")
    with pytest.raises(ConfigError) as refused:
        check_not_a_run(run, "teacher.path")
    assert str(refused.value) == (
        f"config key 'teacher.path': {str(run)!r} is a trellis run folder, not a Hugging Face model folder; export it first: "
        f"trellis export {run} {run}-hf, then set teacher.path={run}-hf (or set teacher.path={run / 'hf_model'}, the model the run "
        "saved at its end)"
    )
