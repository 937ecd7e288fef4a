"""The ``multi_turn`` section checked against the rest of an rl config and its data, before any
model is built (the recipe's ``check``: ``--dry-run`` and ``train`` both run it)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig

from trellis import AgentLoop, ConfigError, Registry
from trellis_algos import InteractionConfig, load_prompt_rows
from trellis_multiturn.environment import agent_spec, check_interaction_names, class_adapter, interaction_name
from trellis_multiturn.rollout import AGENT_COLUMN, agent_rollout

log = logging.getLogger("trellis")


def check_multi_turn(cfg: DictConfig, registry: Registry) -> None:
    """Settings that would be silently ignored, interactions and tools that cannot be built (each
    registered one is built once here), data
    rows that lack what their interaction needs to start, and a token budget with no room for
    feedback: errors naming the key, except the budget (a warning)."""
    mt = cfg.multi_turn
    spec = agent_spec(mt, registry, tokenizer=None)
    if cfg.reward.path and mt.score != "reward":
        raise ConfigError(
            f"config key 'reward.path' is {cfg.reward.path!r}, but multi_turn.score={mt.score} takes each sample's reward from the "
            "interaction's scores and never calls it; set multi_turn.score=reward to score trajectories with your function, or drop reward.path"
        )
    if spec.environment is not None and spec.environment.rewarded and mt.score == "reward":
        raise ConfigError(
            f"config key 'multi_turn.score' is reward with multi_turn.environment {mt.environment!r}, whose reward() would be ignored "
            "(the reward function scores the decoded trajectories instead); set multi_turn.score=last, or drop reward() from the class"
        )
    for i, icfg in enumerate(spec.settings.interactions):
        if icfg.component:
            build_once(spec.interactions[icfg.name], f"multi_turn.interactions[{i}]")
    for i, (make, tcfg) in enumerate(spec.tools):
        if tcfg.component:
            build_once(make, f"multi_turn.tools[{i}]")
    needs = {icfg.name: start_needs(icfg, registry) for icfg in spec.settings.interactions}
    loops = {}
    for key, rows in zip(("train_path", "val_path"), load_prompt_rows(cfg.data)):
        where = f"data.{key} {cfg.data[key]!r}"
        check_interaction_names(rows, spec.interaction_names, where)
        check_interaction_kwargs(rows, needs, where)
        if spec.environment is not None:
            check_reset_fields(rows, spec.environment.reset_needs, where)
        loops[where] = enumerate(row.get(AGENT_COLUMN) for row in rows)
    used = agent_rollout(spec, registry, loops).loops  # every row's agent loop is installed
    check_agent_function(spec.settings, used)
    check_agent_tools(spec.agent_tools, used)
    if mt.max_response_tokens == 0 and mt.max_assistant_turns > 1:
        new, turns = cfg.sampling.max_new_tokens, mt.max_assistant_turns
        log.warning(
            "multi_turn.max_response_tokens=0: all turns share sampling.max_new_tokens x multi_turn.max_assistant_turns = %d x %d = %d "
            "tokens, the environment's replies included, so a long answer plus a reply leaves little or no room for the next answer "
            "(multiturn/finish_max_response_tokens counts such samples); set multi_turn.max_response_tokens to %d plus the tokens of "
            "the replies you expect",
            new, turns, new * turns, new * turns,
        )  # fmt: skip


def check_agent_function(settings: Any, loops: dict[str, type[AgentLoop]]) -> None:
    """``multi_turn.agent`` is set exactly when a loop the run uses runs it (``runs_agent``); then
    every loop checks the settings it runs with (:meth:`AgentLoop.check`)."""
    runners = sorted(name for name, cls in loops.items() if cls.runs_agent)
    if settings.agent and not runners:
        raise ConfigError(
            f"config key 'multi_turn.agent' is {settings.agent!r}, but neither multi_turn.agent_loop nor any row's agent_name picks "
            "a loop that runs it (openai_agent, from trellis-agents), so it would never run; set multi_turn.agent_loop=openai_agent "
            "or drop multi_turn.agent"
        )
    if runners and not settings.agent:
        raise ConfigError(
            f"agent loop {runners[0]!r} runs the function 'multi_turn.agent', which is not set; give multi_turn.agent=path/to/file.py:function"
        )
    for cls in loops.values():
        cls.check(settings)


def check_agent_tools(agent_tools: dict[str, str], loops: dict[str, type[AgentLoop]]) -> None:
    """A schema-only tool (the agent runs it) is not used with a loop that runs tools itself."""
    runners = sorted(name for name, cls in loops.items() if cls.runs_tools)
    if agent_tools and runners:
        name, key = next(iter(agent_tools.items()))
        raise ConfigError(
            f"config key {key!r} gives only a schema for tool {name!r}, which trellis never runs (an agent that calls the policy "
            f"endpoint runs it), but agent loop {runners[0]!r} runs the model's tool calls itself and has no {name!r} to run; give the "
            "entry a component or verl_class, or run these rows with an agent that runs its own tools (multi_turn.agent_loop=openai_agent)"
        )


def build_once(make: Any, key: str) -> None:
    """Build a registered tool or interaction once and drop it, so the checks of its own options
    (a sandbox tool without the server's address...) stop the run now, not after the models load."""
    try:
        make()
    except Exception as exc:  # noqa: BLE001 - whatever its constructor refuses is the user's to fix
        raise ConfigError(f"config key '{key}.options': {exc}") from None


def start_needs(icfg: InteractionConfig, registry: Registry) -> tuple[str, ...]:
    """The keys of ``extra_info.interaction_kwargs`` an interaction cannot start without: its
    ``start``'s keyword parameters without default; for a verl class also ``name`` (verl's
    agent loop requires it in every row)."""
    if icfg.verl_class:
        return class_adapter(registry, "").start_needs(icfg.verl_class)
    return _required_parameters(getattr(registry.get("interaction", icfg.component).obj, "start", None))


def _required_parameters(method: Any) -> tuple[str, ...]:
    if method is None:  # a factory, not a class: nothing to read
        return ()
    params = list(inspect.signature(method).parameters.values())[2:]  # self, instance_id
    return tuple(p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def check_interaction_kwargs(rows: Sequence[dict[str, Any]], needs: dict[str, tuple[str, ...]], where: str) -> None:
    """Every row gives its interaction the ``interaction_kwargs`` it needs (a null value counts as missing)."""
    for i, row in enumerate(rows):
        extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
        name = interaction_name(extra, list(needs))
        kwargs = extra.get("interaction_kwargs") or {}
        missing = [k for k in needs.get(name, ()) if kwargs.get(k) is None]
        if missing:
            raise ConfigError(
                f"{where}: row {i} has no extra_info.interaction_kwargs.{missing[0]}, which interaction {name!r} needs to start "
                f"(it needs {', '.join(needs[name])}); give every row extra_info.interaction_kwargs with them, in verl's schema "
                f"(e.g. {{name: {name}, {', '.join(f'{k}: ...' for k in needs[name] if k != 'name')}}})"
            )


def check_reset_fields(rows: Sequence[dict[str, Any]], needs: tuple[str, ...], where: str) -> None:
    """Every row's ``extra_info`` has what the environment class's ``reset`` takes without default."""
    for i, row in enumerate(rows):
        extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
        missing = [k for k in needs if k not in extra]
        if missing:
            raise ConfigError(
                f"{where}: row {i} has no extra_info.{missing[0]}, which multi_turn.environment's reset() takes without a default "
                f"(it needs {', '.join(needs)}); add it to every row's extra_info, or give the parameter a default"
            )
