"""Plugin discovery through entry points: the example plugin, a broken one, duplicates, typos."""

from __future__ import annotations

import types

import pytest

import trellis
from trellis.plugins import load_plugins
from trellis.registry import KINDS, RegistryError


def test_example_plugin_is_discovered_with_every_kind():
    plugins = load_plugins()
    example = next(i for i in plugins.infos if i.name == "example")
    assert example.distribution == "trellis-example-plugin" and example.version == "0.1.0"
    assert example.error is None
    # every kind but those core reads by one fixed name: class_adapter by its config field's (verl_class: "verl"),
    # rollout_function by its section's (multi_turn: trellis-multiturn's)
    assert {kind for kind, _ in example.registered} == set(KINDS) - {"class_adapter", "rollout_function"}
    core = plugins.infos[0]
    assert (core.name, core.distribution) == ("core", "trellis-core")
    assert ("tracker", "jsonl") in core.registered


def test_component_used_by_name():
    import torch

    from trellis.interfaces.signatures import AdvantageInputs

    plugins = load_plugins()
    entry = plugins.registry.get("advantage", "example_scaled")
    data = AdvantageInputs(
        token_rewards=torch.tensor([[0.0, 1.0, 0.0]]),
        response_mask=torch.tensor([[1, 1, 0]]),
        group_ids=torch.tensor([0]),
    )
    adv, _ = entry.obj(data, entry.options(scale=3.0))
    assert adv.tolist() == [[3.0, 3.0, 0.0]]
    reward = plugins.registry.get("reward", "example_length").obj
    assert reward("x", "abcd", "4") == 1.0 and reward("x", "abc", "4") == 0.0


def test_duplicate_from_second_plugin_names_both():
    clash = types.ModuleType("clash")  # a plugin object pluggy can hash, as a module is

    @trellis.hookimpl
    def trellis_register(registry):
        registry.add("advantage", "example_scaled", object())

    clash.trellis_register = trellis_register
    with pytest.raises(RegistryError, match="registered twice: by plugin 'example' and by plugin 'clash'"):
        load_plugins(extra=[("clash", clash)])


def test_an_in_process_plugin_under_an_installed_name_is_refused():
    with pytest.raises(RegistryError, match="two plugins are named 'example'.*pass an in-process plugin under another name"):
        load_plugins(extra=[("example", types.ModuleType("example"))])


def test_core_is_its_own_entry_point_and_loads_first():
    plugins = load_plugins(entry_points=False)
    assert [(i.name, i.distribution) for i in plugins.infos] == [("core", "trellis-core")]
    assert plugins.registry.get("controller", "local").plugin == "core"


def test_failing_import_is_reported_not_fatal(broken_vllm_plugin):
    plugins = load_plugins()
    broken = next(i for i in plugins.infos if i.name == "vllm")
    assert broken.distribution == "trellis-rollout-vllm"
    assert "ModuleNotFoundError" in broken.error and "vllm_engine_that_is_not_installed" in broken.error
    # the others still load
    assert "example_echo" in plugins.registry.names("rollout")
    # a run that needs it fails with that error
    with pytest.raises(RegistryError) as err:
        plugins.registry.get("rollout", "vllm")
    assert "rollout 'vllm' is not available: plugin 'vllm' (trellis-rollout-vllm) failed to load" in str(err.value)
    assert "vllm_engine_that_is_not_installed" in str(err.value)


def test_plugin_failing_in_register_is_reported_and_rolled_back():
    half = types.ModuleType("half")  # a plugin object pluggy can hash, as a module is

    @trellis.hookimpl
    def trellis_register(registry):
        registry.add("kl", "half_done", object())
        raise RuntimeError("engine version too old")

    half.trellis_register = trellis_register
    plugins = load_plugins(extra=[("half", half)])
    info = next(i for i in plugins.infos if i.name == "half")
    assert "RuntimeError: engine version too old" in info.error
    assert "half_done" not in plugins.registry.names("kl")


def test_hook_typo_is_caught():
    typo = types.ModuleType("typo")  # a plugin object pluggy can hash, as a module is

    @trellis.hookimpl
    def trellis_step_ended(step, metrics):
        pass

    typo.trellis_step_ended = trellis_step_ended
    with pytest.raises(Exception, match="trellis_step_ended"):
        load_plugins(extra=[("typo", typo)])


def test_lifecycle_hooks_reach_plugins():
    seen = []
    observer = types.ModuleType("observer")  # a plugin object pluggy can hash, as a module is

    @trellis.hookimpl
    def trellis_checkpoint_saved(step, path):
        seen.append((step, path))

    observer.trellis_checkpoint_saved = trellis_checkpoint_saved
    plugins = load_plugins(extra=[("observer", observer)])
    plugins.hook.trellis_checkpoint_saved(step=3, path="/tmp/ckpt-3")
    assert seen == [(3, "/tmp/ckpt-3")]


def test_registration_hooks_are_called_through_pluggy_with_any_subset_of_their_arguments():
    """As the hook specs promise, an implementation may take fewer arguments than the spec: one that
    takes none is still called, once, in its plugin's turn (a direct call passed registry= to it)."""
    calls = []
    counted = types.ModuleType("counted")

    @trellis.hookimpl
    def trellis_register():
        calls.append("register")

    counted.trellis_register = trellis_register
    plugins = load_plugins(extra=[("counted", counted)])
    assert calls == ["register"] and next(i for i in plugins.infos if i.name == "counted").error is None
