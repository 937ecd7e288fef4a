"""The plugin loads through the entry point and registers every name; options fit omegaconf."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch
from omegaconf import OmegaConf

from trellis.config import option_dataclasses
from trellis.interfaces.signatures import AdvantageInputs, Aggregation, PolicyLossInputs
from trellis.plugins import load_plugins
from trellis_algos.kl import KLControlOptions

EXPECTED = {
    "advantage": {
        *("gae", "grpo", "grpo_vectorized", "grpo_passk", "rloo", "rloo_vectorized"),
        *("reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo", "gpg"),
        *("optimal_token_baseline", "tir_optimal_token_baseline", "gdpo", "reverse_kl_teacher"),
    },
    "policy_loss": {
        *("vanilla", "clip_cov", "kl_cov", "gspo", "sapo", "cispo", "gmpo", "geo_mean"),
        *("dppo_tv", "dppo_kl", "dro", "reinforce", "gpg", "bypass_mode"),
    },
    "kl": {name + plus for name in ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl") for plus in ("", "+")},
    "sft_loss": {"cross_entropy", "dft"},
    "preference_loss": {"sigmoid", "ipo"},
    "distill_loss": {"reverse_kl", "forward_kl", "jsd"},
    "objective": {"policy", "value", "sft", "preference", "bradley_terry", "kl_in_reward"},
    "recipe": {"rl", "sft", "spin", "rm"},
    "group_filter": {"zero_variance"},
    "reward": {"gsm8k", "math", "auto"},
}
SIMPLE_TYPES = {int, float, bool, str}


@pytest.fixture(scope="module")
def plugins():
    return load_plugins()


def test_every_name_is_registered_by_the_algos_plugin(plugins):
    info = next(i for i in plugins.infos if i.name == "algos")
    assert info.distribution == "trellis-algos" and info.error is None
    assert set(info.registered) == {(kind, name) for kind, names in EXPECTED.items() for name in names}
    for kind, names in EXPECTED.items():
        for name in names:
            assert plugins.registry.get(kind, name).plugin == "algos"


def test_every_name_in_trellis_algos_all_resolves():
    """What other packages may import of trellis-algos (its recipes' data, the roles' sections, the rl
    recipe's sections and services, the wire format) is there under each name ``__all__`` lists."""
    import trellis_algos

    assert [name for name in trellis_algos.__all__ if not hasattr(trellis_algos, name)] == []
    assert {"PromptDataset", "EpochLoader", "ActorConfig", "check_inputs", "openai_api"} <= set(trellis_algos.__all__)


def test_aliases_share_one_function(plugins):
    get = plugins.registry.get
    assert get("policy_loss", "geo_mean").obj is get("policy_loss", "gmpo").obj
    assert get("kl", "low_var_kl").obj is get("kl", "k3").obj
    assert get("kl", "mse").obj is get("kl", "k2").obj


def test_options_are_omegaconf_friendly(plugins):
    seen = 0
    for entry in plugins.registry.entries():
        # a recipe's options are a whole run config (nested sections), composed in tests/integration
        if entry.plugin != "algos" or entry.options is None or entry.kind == "recipe":
            continue
        seen += 1
        for f in dataclasses.fields(entry.options):
            hint = typing.get_type_hints(entry.options)[f.name]
            allowed = SIMPLE_TYPES | {t | None for t in SIMPLE_TYPES}
            assert hint in allowed, f"{entry.kind} {entry.name}: field {f.name} has type {hint}"
            assert f.default is not dataclasses.MISSING, f"{entry.kind} {entry.name}: {f.name} has no default"
        cfg = OmegaConf.merge(OmegaConf.structured(entry.options), OmegaConf.create({}))
        assert OmegaConf.to_object(cfg) == entry.options()
    assert seen >= 10


def test_every_numeric_option_declares_and_enforces_a_range(plugins, assert_ranges_enforced):
    schemas = {s for e in plugins.registry.entries() if e.plugin == "algos" and e.options for s in option_dataclasses(e.options)}
    schemas = {s for s in schemas if s.__module__.startswith("trellis_algos")}
    checked = sum(assert_ranges_enforced(schema, plugins.registry) for schema in schemas | {KLControlOptions})
    assert checked >= 30


def test_every_string_option_with_a_fixed_set_of_values_declares_and_enforces_it(plugins, assert_choices_enforced):
    """The options of trellis-algos' components (estimators, losses, filters); its recipes' sections
    are checked in tests/algos/test_recipe_options.py."""
    entries = [e for e in plugins.registry.entries() if e.plugin == "algos" and e.options and e.kind != "recipe"]
    schemas = {s for e in entries for s in option_dataclasses(e.options)}
    open_ended = {"reward_keys", "reward_weights", "rollout_rs", "rollout_rs_threshold"}  # names, criteria lists
    checked = {s.__name__: assert_choices_enforced(s, plugins.registry, open_ended) for s in schemas}
    assert (checked["VanillaOptions"], checked["BypassOptions"], checked["GPGOptions"]) == (1, 2, 1)  # rollout_is; loss_type; alpha_from


def test_components_run_by_name_with_default_options(plugins):
    get = plugins.registry.get
    data = AdvantageInputs(torch.tensor([[0.0, 1.0], [0.0, 0.0]]), torch.tensor([[1, 1], [1, 0]]), torch.tensor([0, 0]))
    entry = get("advantage", "grpo")
    adv, _ = entry.obj(data, entry.options(norm_by_std=False))
    # R = 1, 0: mean .5 -> .5 on both tokens of sample 0, -.5 on the valid token of sample 1
    assert adv.tolist() == [[0.5, 0.5], [-0.5, 0.0]]
    logp = torch.zeros(2, 2, requires_grad=True)
    pl = get("policy_loss", "vanilla")
    loss, metrics = pl.obj(PolicyLossInputs(logp, torch.zeros(2, 2), adv, data.response_mask), Aggregation(), pl.options())
    # ratio 1: -A per token, token-mean (-.5 - .5 + .5) / 3
    assert loss.item() == pytest.approx(-0.5 / 3) and {"pg_loss", "clip_frac", "approx_kl"} <= set(metrics)
