"""A verl PPO/GRPO config (YAML files and/or ``key=value`` overrides) as a trellis ``rl`` config."""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trellis import ConfigError, DataError, Registry, RegistryError, validate_recipe_config
from trellis_verl_compat import scoring
from trellis_verl_compat import shared_rules as shared
from trellis_verl_compat.features import (
    ASYNC_RULES,
    DAPO_RULES,
    DISTILL_RULES,
    LORA_RULES,
    MANAGER_KWARGS,
    ROLLOUT_CORRECTION_RULES,
    critic_defaults,
    fully_async,
)
from trellis_verl_compat.launch import ENTRIES, MAIN_PPO, Launch, config_files, entry_of, module_of, read_script
from trellis_verl_compat.parity import verl_base
from trellis_verl_compat.reasons import RL_KNOWN, Known, feature_off
from trellis_verl_compat.rule import ACTOR, AR, MODE, MULTI_TURN, ROLLOUT, SKIP, Differs, Rule, Source, Unmapped, set_dotted, when
from trellis_verl_compat.sft import SFT_DEFAULTS, SFT_KNOWN, SFT_RULES, SFT_SECTIONS, group_choices


@dataclass(frozen=True)
class Unresolved:
    """A value whose interpolation names a key no given file sets (hydra would merge it from
    another file): treated as not given, and reported."""

    text: Any


def _times_n(value: Any, src: Source) -> int:
    return int(value) * int(src.get(AR + "rollout.n", 1))


def _custom_reward(prefix: str) -> Callable[[Any, Source], str]:
    return lambda value, src: str(src.get(prefix + "custom_reward_function.name") or "compute_score")


def _custom_function(src: Source) -> bool:
    return bool(src.get("custom_reward_function.path") or src.get("reward.custom_reward_function.path"))


def _reward_model(path_key: str, generative: bool) -> Callable[[Any, Source], Any]:
    """``reward_model.enable`` (verl 0.9.1: ``reward.reward_model.enable``): the folder ``path_key``
    names. Alone it is the reward model's role (``reward.model.path``, ``generative`` False); beside a
    custom reward function verl serves it on its engine and hands the function the reward router
    (the GenRM pattern): trellis's judge engine (``reward.judge.model``, ``generative`` True)."""

    def convert(value: Any, src: Source) -> Any:
        if not value or _custom_function(src) != generative:
            return SKIP
        if src.get(path_key) is None:
            raise Unmapped(f"the reward model is enabled but {path_key} is not given; give the reward model's folder")
        return src[path_key]

    return convert


def _served_model(enable_key: str) -> Callable[[Any, Source], Any]:
    """A setting of the reward model verl serves to a custom function (``reward_model.rollout.*``)."""
    return lambda value, src: value if src.get(enable_key) and _custom_function(src) else SKIP


def _when_multi_turn(convert: Callable[[Any, Source], Any]) -> Callable[[Any, Source], Any]:
    return when(MULTI_TURN, convert)


def _turns(value: Any, src: Source) -> Any:
    """verl's null (no limit but the token budget) as the budget itself: every turn takes a token at least."""
    return int(src.get("data.max_response_length") or 0) or SKIP if value is None else value


def _verl_yaml(path: Any, what: str) -> list[dict[str, Any]]:
    """The list under ``what`` (``interaction`` / ``tools``) of a verl interaction or tool config file."""
    try:
        data = yaml.safe_load(Path(str(path)).expanduser().read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise Unmapped(f"cannot read {path!r} ({type(exc).__name__}); copy its {what} entries into multi_turn by hand") from None
    entries = data.get(what) if isinstance(data, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and e.get("class_name") for e in entries):
        raise Unmapped(f"{path!r} has no list '{what}' of entries with a class_name (verl's layout)")
    return entries


def _interactions(value: Any, src: Source) -> list[dict[str, Any]]:
    entries = _verl_yaml(value, "interaction")
    return [{"name": e.get("name", e["class_name"]), "verl_class": e["class_name"], "options": e.get("config") or {}} for e in entries]


def _tools(value: Any, src: Source) -> list[dict[str, Any]]:
    return [{"verl_class": e["class_name"], "options": e.get("config") or {}, "schema": e.get("tool_schema")} for e in _verl_yaml(value, "tools")]


def _agent_loops(value: Any, src: Source) -> list[dict[str, Any]]:
    """verl's ``agent_loop_config_path``: a YAML list of ``{name, _target_, ...}``, each an entry
    run by trellis-interactions' ``verl`` loop (``_target_`` its class, the other keys its
    constructor's keyword arguments); rows pick one by name in ``agent_name``, as in verl."""
    if not src.get(ROLLOUT + "multi_turn.enable"):
        raise Unmapped(
            "trellis runs agent loops in multi-turn runs only; set actor_rollout_ref.rollout.multi_turn.enable=true "
            "(multi_turn.enable=true) to convert the file's entries into multi_turn.agent_loops"
        )
    try:
        entries = yaml.safe_load(Path(str(value)).expanduser().read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise Unmapped(f"cannot read {value!r} ({type(exc).__name__}); copy its entries into multi_turn.agent_loops by hand") from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and e.get("name") and e.get("_target_") for e in entries):
        raise Unmapped(f"{value!r} is not a list of entries with a name and a _target_ (verl's layout)")
    loops = []
    for e in entries:
        kwargs = {k: v for k, v in e.items() if k not in ("name", "_target_")}
        options = {"verl_class": e["_target_"], **({"kwargs": kwargs} if kwargs else {})}
        loops.append({"name": e["name"], "component": "verl", "options": options})
    return loops


def _gen_batch(value: Any, src: Source) -> Any:
    if src.get(MODE) == "fully_async" or value in (None, src.get("data.train_batch_size")):
        return SKIP
    raise Unmapped("trellis generates data.train_batch_prompts new prompts per dynamic-sampling round (verl: gen_batch_size)")


def _moe_script(src: Source) -> str | None:
    """What makes a verl script a mixture-of-experts one (expert parallelism, routing replay), or None."""
    experts = src.get(ACTOR + "megatron.expert_model_parallel_size") or 1
    replay = src.get(ACTOR + "megatron.router_replay.mode") or "disabled"
    if int(experts) > 1 or replay != "disabled":
        return f"expert_model_parallel_size={experts}, router_replay.mode={replay}"
    return None


def _strategy(value: Any, src: Source) -> Any:
    """verl's actor strategy: ``megatron`` is trellis's megatron backend, but for a mixture-of-experts
    script, which trains on fsdp (the megatron backend builds dense models); fsdp and fsdp2 are fsdp."""
    if value != "megatron":
        return SKIP
    moe = _moe_script(src)
    if moe:
        raise Unmapped(
            f"a mixture-of-experts script ({moe}) trains on trellis's fsdp backend; its megatron backend builds dense models (docs/moe.md)"
        )
    return "megatron"


def _megatron_parallel(value: Any, src: Source) -> Any:
    """A Megatron parallel size, for a script that runs on trellis's megatron backend."""
    if src.get(ACTOR + "strategy") != "megatron":
        raise Unmapped("a Megatron setting, and the script's actor strategy is not megatron")
    if _moe_script(src):
        raise Unmapped("the script trains a mixture-of-experts model, which trellis runs on fsdp (no model parallelism there)")
    return value


def _router_replay(value: Any, src: Source) -> Any:
    """verl's routing-replay mode: R3 replays the engine's experts (trellis's ``rollout``); R2 the
    trainer's own from its old-log-prob forward, which trellis does not record."""
    if value == "R3":
        return "rollout"
    if value == "disabled":
        return SKIP
    raise Unmapped(f"{value!r} replays the trainer's own routing of the old-log-prob forward; trellis replays the engine's (R3: rollout)")


def _batching(verl_prefix: str, trellis_prefix: str) -> list[Rule]:
    return [
        Rule(verl_prefix + "ppo_mini_batch_size", trellis_prefix + "mini_batch_samples", _times_n, "prompts x rollout.n = samples"),
        Rule(verl_prefix + "ppo_micro_batch_size_per_gpu", trellis_prefix + "micro_batch_samples", note="per rank"),
        Rule(
            verl_prefix + "ppo_max_token_len_per_gpu",
            trellis_prefix + "max_tokens_per_micro_batch",
            when(verl_prefix + "use_dynamic_bsz"),
            "with use_dynamic_bsz",
        ),
        Rule(verl_prefix + "ppo_epochs", trellis_prefix + "ppo_epochs"),
        Rule(verl_prefix + "shuffle", trellis_prefix + "shuffle"),
        Rule(verl_prefix + "loss_agg_mode", trellis_prefix + "loss_agg_mode"),
    ]


RULES: tuple[Rule, ...] = (
    Rule(AR + "model.path", "model.path"),
    Rule("data.tokenizer", "model.tokenizer_path"),
    Rule("data.train_files", "data.train_path", shared.data_files, "one file or a list"),
    Rule("data.val_files", "data.val_path", shared.data_files, "one file or a list"),
    Rule("data.train_batch_size", "data.train_batch_prompts", note="prompts"),
    Rule("data.max_prompt_length", "data.max_prompt_length", note="longer prompts are dropped"),
    Rule("data.max_response_length", "sampling.max_new_tokens"),
    Rule(ROLLOUT + "response_length", "sampling.max_new_tokens"),
    Rule("data.shuffle", "data.shuffle"),
    Rule("data.image_key", "data.image_key", note="a vision-language model's images (trellis-vision)"),
    *_batching(ACTOR, "actor."),
    *shared.optim(ACTOR, "actor."),
    Rule(ACTOR + "policy_loss.loss_mode", "actor.policy_loss.name", lambda v, s: str(v).replace("-", "_"), "clip-cov -> clip_cov"),
    *(Rule(ACTOR + key, "actor.policy_loss." + key) for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c")),
    *(Rule(ACTOR + "policy_loss." + key, "actor.policy_loss." + key) for key in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio")),
    *(Rule(ACTOR + key, "actor." + key) for key in ("entropy_coeff", "use_kl_loss", "kl_loss_coef", "kl_loss_type")),
    Rule(ROLLOUT + "name", "rollout.name"),
    *(Rule(ROLLOUT + key, "sampling." + key) for key in ("n", "temperature", "top_p", "top_k")),
    Rule(ROLLOUT + "tensor_model_parallel_size", "rollout.tensor_parallel_size", note="engines that have it (vllm)"),
    *(Rule(ROLLOUT + key, "rollout." + key, note="engines that have it") for key in ("gpu_memory_utilization", "max_num_seqs", "enforce_eager")),
    Rule(ROLLOUT + "val_kwargs.n", "validation.n"),
    Rule(ROLLOUT + "val_kwargs.temperature", "validation.temperature", note="greedy is always reported too"),
    Rule(ROLLOUT + "multi_turn.enable", "multi_turn.enable"),
    *(
        Rule(ROLLOUT + "multi_turn." + key, "multi_turn." + key, _turns, "null (no limit) -> data.max_response_length")
        for key in ("max_assistant_turns", "max_user_turns")
    ),
    Rule(
        ROLLOUT + "multi_turn.interaction_config_path",
        "multi_turn.interactions",
        _when_multi_turn(_interactions),
        "the file's entries, as verl_class",
    ),
    Rule(
        ROLLOUT + "multi_turn.tool_config_path", "multi_turn.tools", _when_multi_turn(_tools), "the file's entries, as verl_class with their schema"
    ),
    Rule(
        ROLLOUT + "agent.agent_loop_config_path",
        "multi_turn.agent_loops",
        _agent_loops,
        "the file's entries, component verl (verl_class from _target_, the other keys as kwargs); multi-turn runs",
    ),
    Rule(ROLLOUT + "multi_turn.format", "multi_turn.tool_parser"),
    Rule(
        ROLLOUT + "multi_turn.max_tool_response_length",
        "multi_turn.max_tool_response_chars",
        _when_multi_turn(lambda v, s: v),
        "characters in both; verl's default 256",
    ),
    Rule("data.max_response_length", "multi_turn.max_response_tokens", _when_multi_turn(lambda v, s: v), "multi-turn: all turns"),
    Rule(ROLLOUT + "multi_turn.enable", "multi_turn.score", _when_multi_turn(lambda v, s: "reward"), "verl scores trajectories"),
    Rule(ACTOR + "strategy", "backend.name", _strategy, "megatron -> megatron (a mixture-of-experts script stays on fsdp)"),
    *(
        Rule(ACTOR + f"megatron.{kind}_model_parallel_size", f"backend.{kind}_parallel", _megatron_parallel, "under strategy megatron")
        for kind in ("tensor", "pipeline")
    ),
    Rule(AR + "model.enable_gradient_checkpointing", "backend.activation_checkpointing"),
    Rule(AR + "model.use_remove_padding", "backend.padding_free"),
    Rule(ACTOR + "freeze_vision_tower", "backend.freeze_vision_tower"),
    Rule(
        ROLLOUT + "enable_rollout_routing_replay",
        "actor.router_replay",
        lambda v, s: "measure" if v else SKIP,
        "true: the engine records each token's experts (R3 replays them)",
    ),
    *(Rule(ACTOR + f"{engine}.router_replay.mode", "actor.router_replay", _router_replay, "R3 -> rollout") for engine in ("megatron", "veomni")),
    Rule(ACTOR + "fsdp_config.model_dtype", "backend.dtype", shared.dtype, "fp32 -> float32, bf16 -> bfloat16"),
    Rule(ACTOR + "fsdp_config.param_offload", "backend.offload_params", note="while the engine generates"),
    Rule(ACTOR + "fsdp_config.optimizer_offload", "backend.offload_optimizer", note="while the engine generates"),
    Rule("algorithm.adv_estimator", "algorithm.advantage.name"),
    Rule("algorithm.gamma", "algorithm.advantage.gamma", note="estimators that have it (gae, reinforce_plus_plus)"),
    Rule("algorithm.lam", "algorithm.advantage.lam", note="gae"),
    Rule("algorithm.norm_adv_by_std_in_grpo", "algorithm.advantage.norm_by_std", note="grpo"),
    Rule("algorithm.use_kl_in_reward", "algorithm.use_kl_in_reward"),
    Rule("algorithm.kl_penalty", "algorithm.kl_penalty", note="verl's names are trellis aliases (kl = k1)"),
    Rule("algorithm.kl_ctrl.type", "algorithm.kl_ctrl_type"),
    Rule("algorithm.kl_ctrl.kl_coef", "algorithm.kl_coef"),
    Rule("algorithm.kl_ctrl.target_kl", "algorithm.target_kl"),
    Rule("algorithm.kl_ctrl.horizon", "algorithm.kl_horizon"),
    Rule("critic.model.path", "critic.model_path"),
    *_batching("critic.", "critic."),
    *shared.optim("critic.", "critic."),
    Rule("critic.cliprange_value", "critic.cliprange_value"),
    *(
        rule
        for prefix in ("", "reward.")
        for rule in (
            Rule(prefix + "custom_reward_function.path", "reward.path"),
            Rule(
                prefix + "custom_reward_function.path", "reward.name", _custom_reward(prefix), "custom_reward_function.name (default compute_score)"
            ),
            Rule(prefix + "custom_reward_function.reward_kwargs", "reward.kwargs"),
        )
    ),
    *(
        rule
        for rm, path in (("reward_model.", "reward_model.model.path"), ("reward.reward_model.", "reward.reward_model.model_path"))
        for rule in (
            Rule(rm + "enable", "reward.model.path", _reward_model(path, False), f"{path}, when enable is true (no custom function)"),
            Rule(
                rm + "enable",
                "reward.model.layout",
                lambda v, s: "conversation" if v and not _custom_function(s) else SKIP,
                "verl's reward loop renders the conversation",
            ),
            Rule(
                rm + "enable",
                "reward.judge.model",
                _reward_model(path, True),
                f"{path}, when enable is true beside custom_reward_function.path: served to the function as verl's reward router",
            ),
            Rule(rm + "rollout.name", "reward.judge.engine", _served_model(rm + "enable"), "the served reward model's engine (GenRM)"),
            Rule(rm + "rollout.response_length", "reward.judge.max_new_tokens", _served_model(rm + "enable"), "the served model's longest reply"),
        )
    ),
    Rule("trainer.total_training_steps", "trainer.total_steps", shared.steps),
    Rule("trainer.total_epochs", "trainer.total_steps", shared.epochs, "epochs x (training rows // train_batch_size)"),
    Rule("trainer.nnodes", "trainer.nnodes"),
    Rule("trainer.n_gpus_per_node", "trainer.procs_per_node"),
    Rule("trainer.n_gpus_per_node", "trainer.controller", shared.controller, "ray when nnodes x n_gpus_per_node > 1"),
    Rule("trainer.save_freq", "trainer.save_every_steps", shared.freq, "-1 -> 0 (the last step only)"),
    Rule("trainer.test_freq", "trainer.val_every_steps", shared.freq, "-1 -> 0 (before and after training)"),
    Rule("trainer.val_before_train", "validation.before_train"),
    Rule("trainer.logger", "trainer.trackers", shared.trackers, "jsonl added (metrics.jsonl)"),
    Rule("trainer.default_local_dir", "trainer.run_dir"),
    Rule("trainer.resume_mode", "trainer.resume", shared.resume, "disable -> never; resume_path -> trainer.resume_from_path"),
    Rule("trainer.max_actor_ckpt_to_keep", "trainer.keep_checkpoints", note="null: every checkpoint kept, in both"),
    *LORA_RULES,
    *DAPO_RULES,
    *DISTILL_RULES,
    *ASYNC_RULES,
    *ROLLOUT_CORRECTION_RULES,
    Rule(ROLLOUT + "val_kwargs.do_sample", "validation.temperature", lambda v, s: SKIP if v else 0, "false: greedy (temperature 0)"),
    Rule("data.gen_batch_size", "data.train_batch_prompts", _gen_batch, "fully async: one prompt a request in both"),
    Rule("rollout.total_rollout_steps", "trainer.total_steps", fully_async(lambda v, s: shared.total_steps(s)), "// prompts per sync (fully async)"),
)

# verl's defaults (ppo_trainer.yaml) where they differ from trellis's, applied under what the user gives
VERL_DEFAULTS: Source = {
    "data.train_batch_size": 1024,
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    ACTOR + "ppo_mini_batch_size": 256,
    ACTOR + "optim.lr": 1e-6,
    ACTOR + "optim.weight_decay": 0.01,
    "critic.optim.weight_decay": 0.01,
    ROLLOUT + "n": 1,
    "algorithm.adv_estimator": "gae",
    "trainer.total_epochs": 30,
    "trainer.n_gpus_per_node": 8,
    "trainer.max_actor_ckpt_to_keep": None,  # every checkpoint kept
    ROLLOUT + "val_kwargs.temperature": 0,  # greedy validation
    ROLLOUT + "multi_turn.max_tool_response_length": 256,
}

# dict values read whole (not key by key)
WHOLE = ("custom_reward_function.reward_kwargs", "reward.custom_reward_function.reward_kwargs", *MANAGER_KWARGS)

# verl's top-level sections: a file with none of them is not a verl config
VERL_SECTIONS = ("actor_rollout_ref", "algorithm", "critic", "custom_reward_function", "data", "reward", "reward_model", "trainer")

# trellis sections that hold a registered component's options: (section, kind, trellis default name)
COMPONENT_SECTIONS = (
    ("actor.policy_loss", "policy_loss", "vanilla"),
    ("algorithm.advantage", "advantage", "grpo"),
    ("rollout", "rollout", "hf"),
    ("backend", "backend", "fsdp"),
)


@dataclass
class Conversion:
    """The trellis config, the verl keys left out (key, value, why) and the verl defaults used."""

    config: dict[str, Any]
    unmapped: list[tuple[str, Any, str]] = field(default_factory=list)
    defaults_used: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the converter could not check here
    differences: dict[str, tuple[Any, str]] = field(default_factory=dict)  # verl key -> (value, how the run differs from verl's)
    origin: dict[str, str] = field(default_factory=dict)  # trellis key -> the verl key it came from


def settled(key: str, value: Any, src: Source, known: Known = RL_KNOWN) -> bool:
    """Whether verl key ``key`` needs no report: another rule reads it, its value is what trellis
    does anyway, or its feature is off."""
    if any(fnmatch(key, pattern) for pattern in known.read) or feature_off(key, value, src):
        return True
    return any(fnmatch(key, pattern) and expected == value for pattern, expected in known.behaviour.items())


def read_verl(args: list[str], files: list[dict[str, Any]] = ()) -> dict[str, Any]:
    """The dotted keys and resolved values of the mappings ``files`` (a hydra config's, composed),
    then verl YAML files and ``key=value`` overrides (hydra's ``+key``/``++key`` accepted), merged
    in order; an unresolvable interpolation's value is None."""
    parts = [OmegaConf.create(data) for data in files]
    for arg in args:
        if "=" in arg:
            try:
                parts.append(OmegaConf.from_dotlist([arg.lstrip("+")]))
            except OmegaConfBaseException as exc:
                raise DataError(f"verl override {arg!r} cannot be read ({exc.msg.splitlines()[0]}); give key=value") from None
        else:
            parts.append(OmegaConf.create(_verl_file(arg)))
    cfg = OmegaConf.merge(*parts) if parts else OmegaConf.create()
    flat: dict[str, Any] = {}
    raw = OmegaConf.to_container(cfg, resolve=False)
    for key in _leaves(raw):
        try:  # an interpolation into a file hydra would have merged (verl's ${model_engine}) resolves to nothing
            value = OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
            flat[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        except OmegaConfBaseException:
            flat[key] = Unresolved(functools.reduce(lambda node, part: node[part], key.split("."), raw))
    return flat


def _verl_file(arg: str) -> dict[str, Any]:
    """A verl YAML file's mapping; anything else (no file, not YAML, not a mapping, a trellis
    config, none of verl's sections) is refused with the reason."""
    path = Path(arg)
    if not path.is_file():
        raise DataError(f"verl config {arg!r} does not exist; give a verl YAML file or key=value overrides")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise DataError(f"verl config {arg!r} is not a text file; give a verl YAML file") from None
    except yaml.YAMLError as exc:
        raise DataError(f"verl config {arg!r} is not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict):
        raise DataError(f"verl config {arg!r} holds a YAML {type(data).__name__}, not verl's mapping of sections ({', '.join(VERL_SECTIONS)})")
    if "recipe" in data:
        raise DataError(f"{arg!r} is a trellis config (it has 'recipe: {data['recipe']}'), not a verl one; use it as it is: trellis train {arg}")
    if not set(map(str, data)) & {*VERL_SECTIONS, "defaults"}:
        raise DataError(f"verl config {arg!r} has none of verl's sections ({', '.join(VERL_SECTIONS)}); its keys: {', '.join(map(str, data))}")
    return data


def _leaves(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict) and node and prefix[:-1] not in WHOLE:
        return [leaf for k, v in node.items() for leaf in _leaves(v, f"{prefix}{k}.")]
    return [prefix[:-1]]


def convert(given: dict[str, Any], registry: Registry | None = None, entry: str = MAIN_PPO) -> Conversion:
    """The trellis config for verl keys ``given`` (dotted) launched by the verl entry point
    ``entry``: an ``rl`` config, or an ``sft`` one for verl's SFT trainer; with ``registry``, options
    a component does not take (e.g. ``clip_ratio_c`` for gspo) are left out and reported."""
    if not given:
        raise DataError("no verl keys given; give verl YAML files and/or key=value overrides as for verl.trainer.main_ppo")
    launched = entry_of(entry)
    if launched.recipe == "sft":
        out = Conversion({"recipe": "sft"})
        defaults = {**SFT_DEFAULTS, **launched.defaults}
        apply_rules(out, SFT_RULES, given, defaults, {MODE: launched.mode}, registry, SFT_SECTIONS, SFT_KNOWN)
        return out
    values = {k: v for k, v in given.items() if v is not None and not isinstance(v, Unresolved)}
    defaults = {**VERL_DEFAULTS, **launched.defaults}
    src = {**defaults, **values, MODE: launched.mode}
    if src.get("algorithm.adv_estimator") == "gae":  # verl's critic takes the actor's batching where its own is not given
        defaults |= critic_defaults(src)
    extra = {MODE: launched.mode}
    if src.get(MULTI_TURN):  # verl's null turn limits mean "no limit": converted, not skipped
        limits = (ROLLOUT + "multi_turn." + k for k in ("max_assistant_turns", "max_user_turns"))
        extra |= {key: None for key in limits if given.get(key) is None}
    verl_scores = scoring.available()
    out = Conversion({"recipe": "rl", "reward": {"name": "verl_default" if verl_scores else "auto"}})
    if not verl_scores:
        out.notes.append(
            "reward.name: auto (trellis's scoring by data_source) where verl's default_compute_score differs for MATH (math-verify "
            f"takes an unboxed answer) and math/aime (0/1, not -1/+1); to score as verl: {scoring.INSTALL}, then convert again"
        )
    apply_rules(out, RULES, given, defaults, extra, registry, COMPONENT_SECTIONS, RL_KNOWN)
    reward = out.config["reward"]
    if "model" in reward and reward["name"] in ("auto", "verl_default") and "path" not in reward:
        del reward["name"]  # verl's reward model alone is the reward (its score replaces the function's)
    return out


def apply_rules(
    out: Conversion,
    rules: tuple[Rule, ...],
    given: dict[str, Any],
    defaults: Source,
    extra: Source,
    registry: Registry | None,
    sections: tuple[tuple[str, str, str], ...],
    known: Known,
) -> None:
    """Convert ``given`` (verl's ``defaults`` under it, then ``extra``: the mode and what a recipe
    adds) by ``rules`` into ``out``, and report every given key no rule took, with its reason
    (``known``; ``sections``: the config's component sections, whose options are checked)."""
    unresolved = {k: v.text for k, v in given.items() if isinstance(v, Unresolved)}
    given = {k: None if k in unresolved else v for k, v in given.items()}
    values = {k: v for k, v in given.items() if v is not None}
    src = {**defaults, **values, **extra}
    origin = out.origin
    failed: dict[str, str] = {}
    for rule in rules:
        if rule.verl not in src:
            continue
        try:
            value = rule.convert(src[rule.verl], src)
        except Unmapped as exc:
            failed[rule.verl] = str(exc)
            continue
        except (TypeError, ValueError) as exc:
            raise DataError(f"verl key '{rule.verl}' is {src[rule.verl]!r}, which does not convert ({exc}); give a number") from None
        if isinstance(value, Differs):
            out.differences.setdefault(rule.verl, (src[rule.verl], value.why))
            value = value.value
        if value is not SKIP:
            set_dotted(out.config, rule.trellis, value)
            origin[rule.trellis] = rule.verl
    used = {*origin.values(), *failed, *out.differences}
    out.defaults_used = [f"{k}={v}" for k, v in defaults.items() if given.get(k) is None and k in used]
    if registry is not None:
        for key, why in _foreign_options(out.config, registry, sections):
            failed[origin[key]] = why
    mapped = {rule.verl for rule in rules}
    for key, value in {**given, **{k: src[k] for k in failed if k not in given}}.items():
        if key in failed:
            out.unmapped.append((key, value, failed[key] + ("" if key in given else " (verl's default)")))
        elif key in unresolved:
            why = next((why for pattern, why in known.reasons if fnmatch(key, pattern) and why), None)
            out.unmapped.append((key, unresolved[key], why or "its interpolation names a key that no given file or override sets; give the value"))
        elif value is None or key in mapped or settled(key, value, src, known):
            continue
        else:
            why = next((why for pattern, why in known.reasons if fnmatch(key, pattern)), "no trellis counterpart")
            if why:
                out.unmapped.append((key, value, why))


def check_converted(conversion: Conversion, registry: Registry) -> None:
    """The converted config against the ``rl`` schema (types, ranges, names; required keys may
    still be missing): a ``DataError`` names the verl key a bad value came from."""
    config = copy.deepcopy(conversion.config)
    sections = COMPONENT_SECTIONS if config["recipe"] == "rl" else SFT_SECTIONS
    for section, kind, default in sections:  # an engine or backend not installed here is checked where it is
        *parents, last = section.split(".")
        node = functools.reduce(lambda tree, part: tree.get(part, {}), parents, config)
        name = (node.get(last) or {}).get("name", default)
        try:
            registry.get(kind, name)
        except RegistryError as exc:
            node.pop(last, None)
            conversion.notes.append(f"{section}: {exc}; its options are checked when trellis train runs where it is installed")
    trainer = config.get("trainer", {})
    judge = config.get("reward", {}).get("judge", {})
    try:  # the engine a served reward model runs on, installed where the run is
        judge.get("engine") and registry.get("rollout", judge["engine"])
    except RegistryError as exc:
        del judge["engine"]
        conversion.notes.append(f"reward.judge.engine: {exc}; installed where trellis train runs, it is checked there")
    try:  # trainer.controller=ray: trellis-ray, installed where the run is
        registry.get("controller", trainer.get("controller", "local"))
    except RegistryError as exc:
        del trainer["controller"]
        conversion.notes.append(f"trainer.controller: {exc}; installed where trellis train runs, it is checked there")
    try:
        validate_recipe_config(OmegaConf.create(config), registry)
    except ConfigError as exc:
        key = re.search(r"config key '([^']+)'", str(exc))
        verl = conversion.origin.get(key.group(1)) if key else None
        raise DataError(f"the verl config does not convert{f' (from verl key {verl!r})' if verl else ''}: {exc}") from None


def _foreign_options(config: dict[str, Any], registry: Registry, sections: tuple[tuple[str, str, str], ...]) -> list[tuple[str, str]]:
    """Options under a component section that the named component does not take (removed)."""
    dropped = []
    for section, kind, default in sections:
        *parents, last = section.split(".")
        node = config
        for part in parents:
            node = node.get(part, {})
        options = node.get(last)
        if not options:
            continue
        name = options.get("name", default)
        try:
            entry = registry.get(kind, name)
        except RegistryError:
            continue  # compose names the missing plugin
        takes = {f.name for f in dataclasses.fields(entry.options)} if entry.options else set()
        for option in [k for k in options if k != "name" and k not in takes]:
            del options[option]
            dropped.append((f"{section}.{option}", f"{kind} {name!r} has no option {option}"))
    return dropped


def report(conversion: Conversion) -> str:
    """The stderr text: the verl defaults used, the keys converted with a difference from verl's
    run and each verl key not converted, with why."""
    lines = [f"# verl defaults used (not given): {', '.join(conversion.defaults_used)}"] if conversion.defaults_used else []
    lines += [f"# {note}" for note in conversion.notes]
    if conversion.differences:
        lines.append(f"# converted, but the run differs from verl's ({len(conversion.differences)}):")
        lines += [f"{key}={value!r}: {why}" for key, (value, why) in conversion.differences.items()]
    if conversion.unmapped:
        lines.append(f"# verl keys not converted ({len(conversion.unmapped)}):")
        lines += [f"{key}={value!r}: {why}" for key, value, why in conversion.unmapped]
    return "\n".join(lines)


def read_launch(args: list[str], entry: str | None = None, config_path: str | None = None, config_name: str | None = None, resolved: bool = False):
    """``(given keys, entry point, defaults entries not found)`` for the command line of
    ``from-verl``: a launch script (its command's entry point, hydra config and overrides, then the
    arguments after it), or verl YAML files and overrides; the options win over the script's.
    ``resolved``: under verl's own installed config for the entry point, every key of it given
    (the parity table's input)."""
    launch, rest, base = Launch(), [], Path(".")
    for arg in args:
        if arg.endswith(".sh") and "=" not in arg:
            if not Path(arg).is_file():
                raise DataError(f"verl launch script {arg!r} does not exist")
            launch = read_script(Path(arg))
            base = Path(arg).parent
            rest = [*launch.overrides, *rest]
        else:
            rest.append(arg)
    launch.entry = entry or launch.entry
    launch.config_path = config_path or launch.config_path
    launch.config_name = config_name or launch.config_name
    files, missing = config_files(launch, base)
    choices: dict[str, str] = {}
    if module_of(launch.entry) in ENTRIES and ENTRIES[module_of(launch.entry)].recipe == "sft":
        choices, rest = group_choices(rest)
    if resolved:
        files = [*verl_base(launch.entry, choices), *files]
    return read_verl(rest, files), launch.entry, missing
