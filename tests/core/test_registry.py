"""Registry: duplicates refused with both plugins named, unknown names answered with the fix."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from trellis.registry import Registry, RegistryError


def make_registry() -> Registry:
    reg = Registry()
    reg.adding_for("first")
    reg.add("advantage", "grpo", lambda data, options: None)
    return reg


def test_duplicate_names_both_plugins():
    reg = make_registry()
    reg.adding_for("second")
    with pytest.raises(RegistryError, match=r"advantage 'grpo' is registered twice: by plugin 'first' and by plugin 'second'"):
        reg.add("advantage", "grpo", object())


def test_same_name_in_another_kind_is_fine():
    reg = make_registry()
    reg.add("recipe", "grpo", SimpleNamespace(Config=dict, run=lambda cfg, ctx: {}))
    assert reg.get("recipe", "grpo").plugin == "first"


def test_a_kind_s_interface_is_read_once_at_registration():
    """What a recipe declares is read when it registers (left-out capabilities get their
    defaults); a missing required attribute, or one a typo away from a capability (which no caller
    would read), is refused there, naming it."""
    reg = make_registry()
    reg.add("recipe", "mine", SimpleNamespace(Config=dict, run=lambda cfg, ctx: {}, resume_safe_keys=("data.val_path",)))
    declared = reg.get("recipe", "mine").declared
    assert declared == {"check": None, "check_data": None, "evaluate": None, "resume_safe_keys": ("data.val_path",), "policy": None, "exports": {}}
    with pytest.raises(RegistryError, match=r"recipe 'norun' \(plugin 'first'\) has no run; every recipe declares Config, run"):
        reg.add("recipe", "norun", SimpleNamespace(Config=dict))
    with pytest.raises(RegistryError, match=r"recipe 'typo' \(plugin 'first'\) has 'check_date', which no caller reads; did you mean 'check_data'\?"):
        reg.add("recipe", "typo", SimpleNamespace(Config=dict, run=lambda cfg, ctx: {}, check_date=lambda cfg, registry: ""))
    reg.add("advantage", "plain", lambda data, options: None)
    assert reg.get("advantage", "plain").declared == {"needs": (), "reads": ()}

    def bypass(data, agg, options):
        return None

    bypass.corrects_rollout = True  # a policy loss that corrects the engine's drift itself (algos' bypass_mode)
    reg.add("policy_loss", "bypass", bypass)
    assert reg.get("policy_loss", "bypass").declared == {"corrects_rollout": True}
    bypass.corrects_rollouts = True
    with pytest.raises(RegistryError, match=r"has 'corrects_rollouts', which no caller reads; did you mean 'corrects_rollout'\?"):
        reg.add("policy_loss", "typo", bypass)


def test_an_estimator_needing_what_nothing_provides_is_refused_at_registration():
    """The rl recipe fills or sets up each need an estimator declares; a need it does not know
    would leave the estimator silently without it."""
    reg = make_registry()

    def estimator(data, options):
        return None

    estimator.needs = ("old_log_probs", "groups")
    reg.add("advantage", "fine", estimator)
    estimator.needs = ("old_logprobs",)
    refused = r"advantage 'typo' \(plugin 'first'\) declares needs 'old_logprobs', which nothing provides \(known: values, .*\)"
    with pytest.raises(RegistryError, match=refused + r"; did you mean 'old_log_probs'\?"):
        reg.add("advantage", "typo", estimator)
    estimator.needs = ("entropy",)
    with pytest.raises(RegistryError, match=r"declares needs 'entropy', which nothing provides"):
        reg.add("advantage", "unknown", estimator)


def test_unknown_trellis_name_gives_pip_command_and_installed_names():
    reg = make_registry()
    reg.add("rollout", "hf", object())
    with pytest.raises(RegistryError) as err:
        reg.get("rollout", "vllm")
    assert str(err.value) == "rollout 'vllm' is not installed: pip install trellis-rollout-vllm (installed rollout names: hf)"


def test_unknown_name_suggests_close_match():
    reg = make_registry()
    with pytest.raises(RegistryError, match=r"did you mean 'grpo'\?"):
        reg.get("advantage", "grp")


def test_unknown_third_party_name_lists_installed_without_pip():
    reg = make_registry()
    with pytest.raises(RegistryError) as err:
        reg.get("tracker", "my_tracker")
    assert "pip install" not in str(err.value)
    assert "installed tracker names: none" in str(err.value)


def test_unknown_kind_lists_kinds():
    reg = Registry()
    with pytest.raises(RegistryError, match=r"unknown kind 'advantages'.*valid kinds: backend, rollout, advantage"):
        reg.add("advantages", "x", object())


def test_options_taken_from_attribute_and_must_be_dataclass():
    @dataclass
    class Opts:
        beta: float = 0.1

    class Comp:
        Options = Opts

    reg = Registry()
    reg.add("kl", "mine", Comp)
    assert reg.get("kl", "mine").options is Opts
    with pytest.raises(RegistryError, match="options must be a dataclass"):
        reg.add("kl", "other", Comp, options=dict)


def test_remove_plugin_drops_only_its_entries():
    reg = make_registry()
    reg.adding_for("second")
    reg.add("kl", "k9", object())
    reg.remove_plugin("second")
    assert reg.names("kl") == [] and reg.names("advantage") == ["grpo"]
