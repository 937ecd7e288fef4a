"""What the ``rl`` recipe checks before any model is built, and the data it reads: errors a user
can fix, each naming the key and the fix."""

from __future__ import annotations

import importlib.util
import logging

from omegaconf import DictConfig

from trellis import ConfigError, RegistryError, instantiate_options, resolve_component
from trellis.kit.recipe import OBJECTIVE, Plan, backend_mesh, controller_class, engine_devices, expert_counts, text_config
from trellis_algos.prompts import PromptDataset, PromptLoader, load_prompt_data, load_prompt_rows, prompt_images
from trellis_algos.rewards import AUTO_SOURCES, RewardConfig, RewardService, check_reward, unknown_sources
from trellis_algos.rl.ahead import partial_chunk, staleness_bound
from trellis_algos.rl.dynamic_sampling import group_filters
from trellis_algos.rl.memory import check_activation_memory
from trellis_algos.rl.multi_turn import ConversationRollout, MultiTurnRunner
from trellis_algos.rl.teacher import TEACHER_NEED, check_teacher
from trellis_algos.sections import check_inputs
from trellis_algos.tokenizers import policy_tokenizer

log = logging.getLogger("trellis")
# the reward services (trellis-judges') that serve reward.judge and reward.model, by the key that asks for each
SERVICES = {"reward.judge": "judge_engine", "reward.model": "reward_model"}
REWARD_MODEL = "reward_model"  # the role the reward_model service spawns: trainer.separate_pools may place it


def needs(registry, estimator: str) -> tuple[str, ...]:
    """What the advantage estimator named ``estimator`` declares in its ``needs`` attribute
    (``trellis.interfaces.signatures.AdvantageEstimator``; read when it was registered)."""
    return tuple(registry.get("advantage", estimator).declared["needs"])


def check(cfg: DictConfig, registry) -> None:
    """Errors a user can fix, found before any model is built (and, on CUDA, a warning when the
    actor's micro-batches cannot fit the device: ``trellis_algos.rl.memory``)."""
    services = reward_services(cfg, registry)
    for service in services:
        service.check(cfg, registry)  # before the reward's checks, which call the servers of the sources a service answers
    check_reward(cfg.reward, registry, cfg.recipe, services)
    check_inputs(cfg)
    check_experts(cfg)
    check_context(cfg)
    staleness_bound(cfg.trainer)
    partial_chunk(cfg.trainer, cfg.multi_turn.enable)
    check_rollout_placement(cfg, registry)
    samples = check_batch_sizes(cfg, registry)
    if cfg.algorithm.use_kl_in_reward:
        _lookup(registry, "objective", "kl_in_reward", "algorithm.use_kl_in_reward")
    check_auto_reward(cfg)
    if cfg.multi_turn.enable:
        multi_turn_runner(registry).check(cfg, registry)
    check_streaming(cfg)
    declared = needs(registry, cfg.algorithm.advantage.name)
    check_length_shaping(cfg)
    check_teacher(cfg, declared)
    check_reward_model_pool(cfg)
    if cfg.algorithm.dynamic_sampling.enable:
        check_dynamic_sampling(cfg, declared)
        group_filters(cfg.algorithm.dynamic_sampling, registry)  # their options checked before any model is built
    if "on_policy_only" in declared:
        check_on_policy(cfg, samples)
    seq_len = longest_sequence(cfg)
    check_activation_memory(cfg, registry, "actor", seq_len, seq_len - cfg.data.max_prompt_length)
    if "groups" in declared and cfg.sampling.n < 2 and cfg.actor.distill.use_policy_loss:  # else the advantages are not used
        log.warning("advantage %r compares samples of one prompt; with sampling.n=1 every advantage is 0", cfg.algorithm.advantage.name)


def check_experts(cfg: DictConfig) -> None:
    """``actor.router_replay`` and ``actor.router_aux_loss_coef`` need a mixture-of-experts model;
    recorded routes travel with samples generated in one piece (not a partial rollout's chunks)."""
    actor = cfg.actor
    asked = [key for key, on in (("router_replay", actor.router_replay != "off"), ("router_aux_loss_coef", actor.router_aux_loss_coef > 0)) if on]
    if asked and expert_counts(text_config(cfg.model.path)) is None:
        raise ConfigError(
            f"config key 'actor.{asked[0]}'={actor[asked[0]]!r}: model.path {cfg.model.path!r} has no experts (a dense model), "
            f"so it would be ignored; remove it, or train a mixture-of-experts model"
        )
    if actor.router_replay == "off":
        return
    if cfg.trainer.partial_rollout:
        raise ConfigError(
            f"config key 'actor.router_replay'={actor.router_replay!r}: a partial rollout's chunks run under different "
            "weights and do not carry one routing; set trainer.partial_rollout: false or actor.router_replay: off"
        )


def check_batch_sizes(cfg: DictConfig, registry) -> int:
    """A step's samples (returned) and the actor's and critic's mini-batches share evenly over the
    data-parallel ranks, and the mini-batches cut the step into whole parts."""
    samples = cfg.data.train_batch_prompts * cfg.sampling.n
    world = backend_mesh(cfg, registry).dp
    if samples % world:
        raise ConfigError(
            f"a step has data.train_batch_prompts x sampling.n = {samples} samples, which {world} data-parallel ranks "
            f"(trainer.nnodes x trainer.procs_per_node, over the backend's tensor/pipeline groups) cannot share evenly; "
            f"make it a multiple of {world}"
        )
    for role in ("actor", "critic"):
        mini = cfg[role].mini_batch_samples
        if mini and mini % world:
            raise ConfigError(f"config key '{role}.mini_batch_samples' is {mini}; it must be a multiple of the {world} data-parallel ranks")
        if mini and samples % mini:
            raise ConfigError(
                f"config key '{role}.mini_batch_samples' is {mini}, but a step has data.train_batch_prompts x sampling.n = "
                f"{cfg.data.train_batch_prompts} x {cfg.sampling.n} = {samples} samples; choose a divisor of {samples}"
            )
    return samples


def check_auto_reward(cfg: DictConfig) -> None:
    """``reward.name=auto`` has a rule for every data source of the training and held-out rows."""
    if cfg.reward.name != "auto" or cfg.reward.path:
        return
    for key, rows in zip(("train_path", "val_path"), load_prompt_rows(cfg.data)):
        unknown = unknown_sources(row.get("data_source") for row in rows)
        if unknown:
            raise ConfigError(
                f"config key 'reward.name' is auto, which has no reward for data_source {', '.join(map(repr, unknown))} "
                f"(in data.{key} {cfg.data[key]!r}); name a reward, or give reward.path and reward.name of your own function"
            )
        math = sorted({str(row.get("data_source")) for row in rows if AUTO_SOURCES.get(row.get("data_source")) == "math"})
        if math and importlib.util.find_spec("math_verify") is None:
            raise ConfigError(
                f"config key 'reward.name' is auto, which scores data_source {', '.join(map(repr, math))} (in data.{key}) with "
                "math-verify, not installed: pip install trellis-algos[math]"
            )


def check_dynamic_sampling(cfg: DictConfig, declared: tuple[str, ...]) -> None:
    """Dynamic sampling compares the samples of a prompt and regenerates prompts round by round."""
    if cfg.sampling.n < 2:
        raise ConfigError(
            f"config key 'algorithm.dynamic_sampling.enable' is true with sampling.n={cfg.sampling.n}: a group of one sample "
            "never varies, so every group would be dropped; set sampling.n to 2 or more"
        )
    if "greedy_baseline" in declared:
        raise ConfigError(
            f"config key 'algorithm.dynamic_sampling.enable' is true with advantage {cfg.algorithm.advantage.name!r}, whose greedy "
            "baseline is generated for one batch of prompts; set algorithm.dynamic_sampling.enable=false or choose another advantage"
        )


def check_streaming(cfg: DictConfig) -> None:
    """``reward.stream_prompts`` scores parts of a single-turn generation with reward functions."""
    size = cfg.reward.stream_prompts
    if not size:
        return
    for key, on, why in (
        ("multi_turn.enable", cfg.multi_turn.enable, "conversations are scored as a batch when they end"),
        ("reward.model.path", cfg.reward.model.path, "the reward model scores the whole batch in one pass"),
        ("trainer.partial_rollout", cfg.trainer.partial_rollout, "a generation cut in chunks is scored once whole"),
    ):
        if on:
            raise ConfigError(f"config key 'reward.stream_prompts' is {size} with {key} set: {why}; set reward.stream_prompts=0")


def check_length_shaping(cfg: DictConfig) -> None:
    """``reward.overlong`` needs a buffer within the response budget, and, like ``actor.mask_truncated``,
    reads a response's length against ``sampling.max_new_tokens``: single-turn runs only."""
    buffer = cfg.reward.overlong.buffer_len
    if buffer > cfg.sampling.max_new_tokens:
        raise ConfigError(
            f"config key 'reward.overlong.buffer_len' is {buffer}, longer than sampling.max_new_tokens={cfg.sampling.max_new_tokens}; "
            "choose a buffer within the response budget (DAPO used a quarter of it)"
        )
    for key, on in (("reward.overlong.buffer_len", buffer > 0), ("actor.mask_truncated", cfg.actor.mask_truncated)):
        if on and cfg.multi_turn.enable:
            raise ConfigError(
                f"config key '{key}' is set with multi_turn.enable=true: a conversation's length is not one response's "
                f"against sampling.max_new_tokens; unset {key} for multi-turn runs"
            )


def reward_services(cfg: DictConfig, registry) -> list[type[RewardService]]:
    """The reward services the run's reward asks for (each registered service's ``wanted``), by
    name. ``reward.judge`` or ``reward.model`` set without its service installed is refused naming trellis-judges."""
    reward = instantiate_options(cfg.reward, RewardConfig)
    for key, given in (("reward.judge", reward.judge.given()), ("reward.model", bool(reward.model.path))):
        if given:
            _lookup(registry, "reward_service", SERVICES[key], key)
    services = (registry.get("reward_service", name).obj for name in registry.names("reward_service"))
    return [service for service in services if service.wanted(reward)]


def check_reward_model_pool(cfg: DictConfig) -> None:
    """``trainer.separate_pools`` names ``reward_model`` only when ``reward.model.path`` gives one."""
    if REWARD_MODEL in cfg.trainer.separate_pools and not cfg.reward.model.path:
        raise ConfigError(
            f"config key 'trainer.separate_pools' lists {REWARD_MODEL!r}, but reward.model.path is empty, so there is no reward "
            f"model to place; set reward.model.path=<folder> or take {REWARD_MODEL!r} out of trainer.separate_pools"
        )


def check_rollout_placement(cfg: DictConfig, registry) -> None:
    """Where the engines go: the controller places them as asked (``trainer.rollout_pool`` needs
    one with engine pools; see :meth:`~trellis.runtime.controller.Controller.check`)."""
    _, options = resolve_component(registry, "rollout", cfg.rollout)
    controller_class(registry, cfg.trainer).check(cfg.trainer, engine_devices(options))


def on_policy_update(cfg: DictConfig, registry, estimator_needs: tuple[str, ...], samples: int) -> bool:
    """Whether the actor's update can take the old log-probs from its own first forward instead of
    a separate pass (exact): the policy objective declares it can (``first_forward``), one
    optimizer step per batch, and nothing before the update reads them (the in-reward KL, an
    estimator that needs them or a teacher's, which are compared with them)."""
    policy = OBJECTIVE.read("objective", "policy", registry.get("objective", "policy").obj(cfg.actor, registry))
    return (
        policy["first_forward"] == "old_log_probs"
        and Plan.of(cfg.actor).one_update(samples)  # the same rule the actor's worker checks the batch against
        and not cfg.algorithm.use_kl_in_reward
        and not {"old_log_probs", "sum_sq_probs", TEACHER_NEED} & set(estimator_needs)
    )


def check_on_policy(cfg: DictConfig, samples: int) -> None:
    """OPO is exact on-policy: each step's fresh samples get one optimizer step. Settings that
    would update on them again are refused, by name."""
    off = []
    if cfg.actor.ppo_epochs > 1:
        off.append(f"actor.ppo_epochs={cfg.actor.ppo_epochs} (use 1)")
    if cfg.actor.mini_batch_samples not in (0, samples):
        off.append(f"actor.mini_batch_samples={cfg.actor.mini_batch_samples} (use 0: the step's {samples} samples at once)")
    if off:
        raise ConfigError(
            f"advantage 'opo' is exact on-policy (one update per batch of fresh samples), but {' and '.join(off)} "
            "would update on samples after the policy moved; see trellis config init opo"
        )


def _lookup(registry, kind: str, name: str, key: str):
    try:
        return registry.get(kind, name)
    except RegistryError as exc:
        raise ConfigError(f"config key {key!r}: {exc}") from None


def multi_turn_runner(registry) -> MultiTurnRunner:
    """What runs the ``multi_turn`` section (trellis-multiturn), or an error naming the package."""
    return _lookup(registry, "rollout_function", "multi_turn", "multi_turn.enable").obj


def load_data(cfg: DictConfig, registry, tokenizer) -> tuple[ConversationRollout | None, PromptLoader, PromptDataset | None]:
    """The rollout function of conversations (multi-turn runs: the agent loops the rows pick), the
    training prompt loader and the held-out prompts."""
    encoder = prompt_images(cfg.model.path, cfg.data, registry, tokenizer)
    if not cfg.multi_turn.enable:
        return (None, *load_prompt_data(cfg.data, tokenizer, cfg.seed, encoder=encoder))
    return multi_turn_runner(registry).load(cfg, registry, tokenizer, encoder)


def check_data(cfg: DictConfig, registry) -> str:
    """The prompts read and tokenized as training would (columns, chat template, lengths)."""
    _, train, val = load_data(cfg, registry, policy_tokenizer(cfg))
    longest = max(len(item["input_ids"]) for item in train.dataset.items)
    held_out = f", {len(val)} held-out" if val is not None else ""
    return f"{len(train.dataset)} training prompts (longest {longest} tokens of data.max_prompt_length={cfg.data.max_prompt_length}){held_out}"


def check_context(cfg: DictConfig) -> None:
    """One turn, the longest prompt and its new tokens, fits the model's positions: beyond them an
    engine caps the context and a rotary model reads positions it never learned."""
    limit = text_config(cfg.model.path).get("max_position_embeddings")
    prompt, new = cfg.data.max_prompt_length, cfg.sampling.max_new_tokens
    if limit and prompt + new > limit:
        raise ConfigError(
            f"config keys 'data.max_prompt_length' ({prompt}) + 'sampling.max_new_tokens' ({new}) = {prompt + new} tokens, more than "
            f"the {limit} positions of model.path {cfg.model.path!r} (max_position_embeddings); lower one of them"
        )


def longest_sequence(cfg: DictConfig) -> int:
    """The longest prompt + response a run asks its rollout for: the engines' context length."""
    response = cfg.sampling.max_new_tokens
    if cfg.multi_turn.enable:  # every turn, model and environment, within the response budget
        response = cfg.multi_turn.max_response_tokens or response * cfg.multi_turn.max_assistant_turns
    return cfg.data.max_prompt_length + response
