"""What a multi-turn rollout talks to: the configured interactions and tools, resolved once from
the config (``AgentSpec``, picklable, sent to every rollout process) and built where the loop runs
(``Environment``)."""

from __future__ import annotations

import asyncio
import difflib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from trellis import (
    ConfigError,
    Interaction,
    PromptEncoder,
    Registry,
    RegistryError,
    Tool,
    checked_options,
)
from trellis.kit.multiturn import ClassAdapter, renders_tools
from trellis_algos import AgentLoopConfig, InteractionConfig, MultiTurnConfig, ToolConfig
from trellis_multiturn.environment_class import EnvironmentClass, Episodes, describe_environment
from trellis_multiturn.tool_calls import ToolCallParser


@dataclass
class AgentSpec:
    """Everything the agent loop needs, resolved from ``multi_turn`` (factories, not objects, so
    it pickles to Ray ranks); ``template_kwargs`` go to the chat template (``tools``: the schemas,
    the environment class's methods after the configured tools). ``tools`` are those trellis runs;
    ``agent_tools`` the schema-only entries of ``multi_turn.tools`` (rendered, never run: the
    agent runs them), their function name to their config key."""

    settings: MultiTurnConfig
    interactions: dict[str, Callable[[], Interaction]]
    tools: list[tuple[Callable[[], Tool], ToolConfig]]
    parser: Callable[[], ToolCallParser]
    tokenizer: Any
    template_kwargs: dict[str, Any]
    environment: EnvironmentClass | None = None
    agent_tools: dict[str, str] = field(default_factory=dict)
    images: PromptEncoder | None = None  # a vision-language model's prompt encoder: renders the images tools return
    max_prompt_length: int = 0  # the data's bound on a row's prompt tokens (0: unknown)

    @property
    def interaction_names(self) -> list[str]:
        return list(self.interactions)


def agent_spec(node: DictConfig, registry: Registry, tokenizer: Any) -> AgentSpec:
    """Resolve a checked ``multi_turn`` section; every error names the config key and the fix."""
    settings = _settings(node)
    _check_something_to_talk_to(settings, registry)
    interactions: dict[str, Callable[[], Interaction]] = {}
    for i, icfg in enumerate(settings.interactions):
        key = f"multi_turn.interactions[{i}]"
        if icfg.name in interactions:
            raise ConfigError(f"config key '{key}.name': interaction {icfg.name!r} is configured twice; give each a distinct name")
        interactions[icfg.name] = _factory(icfg, "interaction", registry, key)
    tools: list[tuple[Callable[[], Tool], ToolConfig]] = []
    schemas: list[dict[str, Any]] = []
    agent_tools: dict[str, str] = {}
    for i, tcfg in enumerate(settings.tools):
        key = f"multi_turn.tools[{i}]"
        if tcfg.component or tcfg.verl_class:
            if tcfg.verl_class and not tcfg.schema:
                raise ConfigError(f"config key '{key}.schema' is required for a verl tool; give its OpenAI function schema")
            tools.append((_factory(tcfg, "tool", registry, key), tcfg))
            schema = tcfg.schema or registry.get("tool", tcfg.component).declared["schema"]
            name = check_tool_schema(schema, f"{key}.schema")
        else:
            schema = tcfg.schema
            name = check_agent_tool(tcfg, key)
            agent_tools[name] = key
        if name in (tool_name(s, "") for s in schemas):
            raise ConfigError(f"config key '{key}': a tool named {name!r} is configured twice")
        schemas.append(schema)
    environment = describe_environment(settings.environment) if settings.environment else None
    for schema in environment.schemas if environment else ():
        name = schema["function"]["name"]
        if name in (tool_name(s, "") for s in schemas):
            raise ConfigError(f"config key 'multi_turn.environment': its method {name!r} has the name of a tool in multi_turn.tools; rename one")
        schemas.append(schema)
    if schemas and tokenizer is not None and not renders_tools(tokenizer, {}, schemas):
        key = "multi_turn.environment" if environment else "multi_turn.tools"
        raise ConfigError(
            f"config key {key!r} gives the model {len(schemas)} tool{'s' * (len(schemas) != 1)}, but the chat template of "
            f"{getattr(tokenizer, 'name_or_path', '')!r} does not render tools: the prompts would carry no tool schema and the "
            "model would never see them; use a model (or model.tokenizer_path) whose chat template renders tools, e.g. Qwen2.5's"
        )
    parser = registry.get("tool_parser", settings.tool_parser).obj
    return AgentSpec(settings, interactions, tools, parser, tokenizer, {"tools": schemas} if schemas else {}, environment, agent_tools)


def check_agent_tool(tcfg: ToolConfig, key: str) -> str:
    """A ``multi_turn.tools`` entry without component or verl_class: a tool the agent runs itself,
    given by its whole schema (parameters included: nothing else describes its arguments) and
    nothing that only a tool trellis runs would read; returns its function name."""
    if tcfg.schema is None:
        raise ConfigError(
            f"config key {key!r} gives neither 'component' (a registered tool), 'verl_class' (a class path) nor 'schema'; set one "
            "of the first two for a tool trellis runs, or only 'schema' (its OpenAI function schema) for a tool your agent runs itself"
        )
    name = check_tool_schema(tcfg.schema, f"{key}.schema")
    if "parameters" not in tcfg.schema["function"]:
        raise ConfigError(
            f"config key '{key}.schema.function.parameters' is missing from tool {name!r}, which your agent runs itself (no "
            "component): the schema is all the model learns of its arguments; give parameters: {type: object, properties: {...}}"
        )
    default = ToolConfig()
    ignored = [k for k in ("options", "max_concurrency", "timeout_s") if getattr(tcfg, k) != getattr(default, k)]
    if ignored:
        raise ConfigError(
            f"config key '{key}.{ignored[0]}' is set for tool {name!r}, which has only a schema: trellis never runs it (your agent "
            f"does), so it would be ignored; drop it, or give the tool a component or verl_class"
        )
    return name


def _settings(node: DictConfig) -> MultiTurnConfig:
    """The section as dataclasses (its ranges were checked when the config was composed)."""
    data = OmegaConf.to_container(node, resolve=True)
    interactions = [InteractionConfig(**x) for x in data.pop("interactions")]
    tools = [ToolConfig(**x) for x in data.pop("tools")]
    loops = [AgentLoopConfig(**x) for x in data.pop("agent_loops")]
    return MultiTurnConfig(**data, interactions=interactions, tools=tools, agent_loops=loops)


def _check_something_to_talk_to(settings: MultiTurnConfig, registry: Registry) -> None:
    """A conversation needs another side: an entry of the section, or a default loop that brings its own environment."""
    if settings.interactions or settings.tools or settings.agent or settings.environment or settings.agent_loops:
        return
    if registry.get("agent_loop", settings.agent_loop).obj.brings_environment:
        return
    raise ConfigError(
        "multi_turn.enable=true needs at least one entry in multi_turn.interactions, multi_turn.tools or "
        "multi_turn.agent_loops, an environment class in multi_turn.environment, an agent function in "
        "multi_turn.agent (with multi_turn.agent_loop=openai_agent), or a multi_turn.agent_loop that brings its own "
        f"environment (brings_environment = True); multi_turn.agent_loop={settings.agent_loop!r} does not"
    )


def _factory(cfg: InteractionConfig | ToolConfig, kind: str, registry: Registry, key: str) -> Callable[[], Any]:
    """Builds the component (with its checked options) or the verl class behind its adapter."""
    if bool(cfg.component) == bool(cfg.verl_class):
        raise ConfigError(f"config key {key!r}: set exactly one of 'component' (a registered {kind}) and 'verl_class' (a class path)")
    if cfg.verl_class:
        adapter = class_adapter(registry, f"{key}.verl_class")
        try:
            if isinstance(cfg, InteractionConfig):
                return adapter.interaction(cfg.verl_class, dict(cfg.options), cfg.name, f"{key}.verl_class")
            return adapter.tool(cfg.verl_class, dict(cfg.options), dict(cfg.schema or {}), f"{key}.verl_class")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    try:
        entry = registry.get(kind, cfg.component)
    except RegistryError as exc:
        raise ConfigError(f"config key '{key}.component': {exc}") from None
    return functools.partial(entry.obj, checked_options(entry, cfg.options, registry, f"{key}.options"))


def class_adapter(registry: Registry, key: str) -> ClassAdapter:
    """The adapter (kind ``class_adapter``) that runs the verl classes ``verl_class`` names."""
    try:
        return registry.get("class_adapter", "verl").obj
    except RegistryError as exc:
        raise ConfigError(f"config key {key!r} names a verl class, which runs through an adapter: {exc}") from None


def tool_name(schema: Any, key: str) -> str:
    """The function name an OpenAI schema declares (``{type: function, function: {name: ...}}``)."""
    function = schema.get("function", schema) if isinstance(schema, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise ConfigError(f"config key {key!r}: the tool's schema {schema!r:.200} has no function name; give schema.function.name")
    return name


FUNCTION_KEYS = ("name", "description", "parameters", "strict")


def check_tool_schema(schema: Any, key: str) -> str:
    """Check an OpenAI function schema, ``{type: function, function: {name, description,
    parameters: <JSON schema of an object>, strict}}``, key by key; return the function's name."""

    def fail(where: str, problem: str) -> ConfigError:
        return ConfigError(f"config key '{key}{where}' {problem}; a tool schema is {{type: function, function: {{name, description, parameters}}}}")

    def known(node: dict, allowed: tuple[str, ...], where: str) -> None:
        for k in node:
            if k not in allowed:
                close = difflib.get_close_matches(str(k), allowed, n=1, cutoff=0.6)
                raise fail(f"{where}.{k}", "is not a key of an OpenAI function schema" + (f" (did you mean '{close[0]}'?)" if close else ""))

    if not isinstance(schema, dict):
        raise fail("", f"is {schema!r:.100}, not a mapping")
    known(schema, ("type", "function"), "")
    if schema.get("type") != "function":
        raise fail(".type", f"is {schema.get('type')!r}; it must be 'function'")
    function = schema.get("function")
    if not isinstance(function, dict):
        raise fail(".function", f"is {function!r:.100}, not a mapping")
    known(function, FUNCTION_KEYS, ".function")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise fail(".function.name", f"is {function.get('name')!r}; give the function's name")
    params = function.get("parameters", {})
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise fail(".function.parameters", f"is {params!r:.100}; it must be a JSON schema of type object")
    properties = params.get("properties", {})
    if not isinstance(properties, dict) or not all(isinstance(p, dict) for p in properties.values()):
        raise fail(".function.parameters.properties", f"is {properties!r:.100}; it must map each argument to its JSON schema")
    required = params.get("required", [])
    missing = [r for r in required if r not in properties] if isinstance(required, list) else [required]
    if missing:
        raise fail(".function.parameters.required", f"names {missing[0]!r}, which parameters.properties does not define")
    return function["name"]


def interaction_name(extra_info: Any, names: Sequence[str]) -> str | None:
    """The interaction a sample uses: ``extra_info.interaction_kwargs.name``, or the only one
    configured; None when none is configured. Raises ``ValueError`` naming the known ones."""
    kwargs = (extra_info or {}).get("interaction_kwargs") or {} if isinstance(extra_info, dict) else {}
    name = kwargs.get("name")
    if name is None:
        if len(names) > 1:
            known = ", ".join(names)
            raise ValueError(f"has no extra_info.interaction_kwargs.name, and {len(names)} interactions are configured ({known}); name one")
        return names[0] if names else None
    if name not in names:
        raise ValueError(f"names interaction {name!r}, which multi_turn.interactions does not configure (configured: {', '.join(names) or 'none'})")
    return name


def check_interaction_names(rows: Sequence[dict[str, Any]], names: Sequence[str], where: str) -> None:
    """Every row of a prompt file picks a configured interaction (checked before any model is built)."""
    for i, row in enumerate(rows):
        try:
            interaction_name(row.get("extra_info"), names)
        except ValueError as exc:
            raise ConfigError(f"{where}: row {i} {exc}") from None


class Environment:
    """The interactions (by name), tools (by function name) and parser, built in the process that
    runs the loop, with each tool's concurrency limit; ``episodes``: the environment class's
    objects per sample (None without ``multi_turn.environment``), whose methods are tools too."""

    def __init__(self, spec: AgentSpec) -> None:
        self.interactions = {name: make() for name, make in spec.interactions.items()}
        self.tools: dict[str, Tool] = {}
        self.tool_configs: dict[str, ToolConfig] = {}
        self.limits: dict[str, asyncio.Semaphore] = {}
        for make, tcfg in spec.tools:
            tool = make()
            if tcfg.schema:
                tool.schema = dict(tcfg.schema)
            name = tool_name(tool.schema, "multi_turn.tools")
            self.tools[name] = tool
            self.tool_configs[name] = tcfg
            if tcfg.max_concurrency > 0:
                self.limits[name] = asyncio.Semaphore(tcfg.max_concurrency)
        self.episodes = Episodes(spec.environment) if spec.environment else None
        for name, tool in self.episodes.tools().items() if self.episodes else ():
            self.tools[name] = tool
            self.tool_configs[name] = ToolConfig(timeout_s=spec.settings.environment_timeout_s)
        self.parser = spec.parser()
