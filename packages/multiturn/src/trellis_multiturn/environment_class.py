"""Environment classes (``multi_turn.environment``): a user's class whose public typed methods are
the model's tools, one object per sample (``reset`` with the row's ``extra_info``, an optional
``reward()`` for the whole sample); each tool's schema comes from its signature and docstring."""

from __future__ import annotations

import copy
import difflib
import inspect
import json
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Union

from trellis import ConfigError, Tool, ToolResult
from trellis_multiturn.references import finite_reward, load_reference

KEY = "multi_turn.environment"
RESERVED = ("reset", "reward")
_SIMPLE = {str: "string", int: "integer", float: "number", bool: "boolean"}
_TYPES = "str, int, float, bool, list[...], Literal[...] or Optional[...] of these"
_ARG = re.compile(r"(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)")  # "name: text" or "name (type): text"
_SECTION = re.compile(r"[A-Z]\w*( \w+)?:$")  # "Args:", "Returns:", "See Also:"


@dataclass(frozen=True)
class EnvironmentClass:
    """A checked environment class, picklable for the rollout processes: its reference, one
    OpenAI function schema per tool method, the ``extra_info`` keys ``reset`` takes (None: all of
    them, it takes ``**kwargs``) and those it cannot do without, and whether it has ``reward``."""

    ref: str
    schemas: tuple[dict[str, Any], ...]
    reset_fields: tuple[str, ...] | None
    reset_needs: tuple[str, ...]
    rewarded: bool


def describe_environment(ref: str) -> EnvironmentClass:
    """Load and check the class ``ref`` names; every refusal names ``multi_turn.environment``,
    the method or parameter, and the fix."""
    cls = load_reference(ref, KEY)
    if not inspect.isclass(cls):
        raise ConfigError(f"config key '{KEY}': {ref!r} is not a class; name a class whose public methods are the model's tools")
    name = cls.__name__
    needed = [p.name for p in _parameters(cls) if p.default is p.empty]
    if needed:
        raise ConfigError(f"config key '{KEY}': {name}() needs {', '.join(needed)}; one object is built per sample with no arguments, "
                          "so give them defaults and set per-sample state in reset()")  # fmt: skip
    methods = _public_methods(cls)
    reset = methods.pop("reset", None)
    if reset is None:
        raise ConfigError(f"config key '{KEY}': {name} has no reset method; define reset(self, **extra_info) (it starts each sample's episode)")
    reward = methods.pop("reward", None)
    close = difflib.get_close_matches("reward", list(methods), n=1, cutoff=0.8)
    if reward is None and close:
        raise ConfigError(f"config key '{KEY}': {name}.{close[0]} would be a tool; did you mean reward (the sample's reward)? "
                          f"rename it, or make it private (_{close[0]})")  # fmt: skip
    if reward is not None and _parameters(reward):
        raise ConfigError(f"config key '{KEY}': {name}.reward takes parameters; define reward(self) -> float")
    if not methods:
        raise ConfigError(f"config key '{KEY}': {name} has no public methods besides reset and reward, so the model would have no "
                          "tools; define at least one typed, documented method")  # fmt: skip
    reset_params = _parameters(reset)
    takes_all = any(p.kind is p.VAR_KEYWORD for p in reset_params)
    named = [p for p in reset_params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return EnvironmentClass(
        ref=ref,
        schemas=tuple(tool_schema(name, method) for method in methods.values()),
        reset_fields=None if takes_all else tuple(p.name for p in named),
        reset_needs=tuple(p.name for p in named if p.default is p.empty),
        rewarded=reward is not None,
    )


def _public_methods(cls: type) -> dict[str, Any]:
    """The class's public functions (its bases' too), in the order they were defined."""
    out: dict[str, Any] = {}
    for klass in reversed(cls.__mro__[:-1]):
        for attr, value in vars(klass).items():
            if attr.startswith("_"):
                continue
            if isinstance(value, (staticmethod, classmethod)):
                raise ConfigError(f"config key '{KEY}': {cls.__name__}.{attr} is a {type(value).__name__}; tools are instance methods, "
                                  f"so make it one, or make it private (_{attr})")  # fmt: skip
            if inspect.isfunction(value):
                out[attr] = value
            else:
                out.pop(attr, None)  # a subclass replaced the method by something else
    return out


def _parameters(fn: Any) -> list[inspect.Parameter]:
    """The parameters after ``self``."""
    return list(inspect.signature(fn).parameters.values())[0 if inspect.isclass(fn) else 1 :]


def tool_schema(cls_name: str, method: Any) -> dict[str, Any]:
    """The OpenAI function schema of ``method``: its name, the docstring's text before its sections
    as the description, each parameter typed by its annotation and described by the docstring's
    ``Args:`` entry; parameters without a default are required."""
    where = f"{cls_name}.{method.__name__}"
    if not inspect.getdoc(method):
        raise ConfigError(f"config key '{KEY}': {where} has no docstring; it becomes the tool's description, so say what the method "
                          "does, with an Args: section describing each parameter")  # fmt: skip
    description, args = parse_docstring(inspect.getdoc(method))
    try:
        hints = typing.get_type_hints(method)
    except Exception as exc:  # noqa: BLE001 - an annotation that does not resolve is the user's to fix
        raise ConfigError(f"config key '{KEY}': the annotations of {where} do not resolve ({type(exc).__name__}: {exc})") from None
    properties, required = {}, []
    for p in _parameters(method):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise ConfigError(f"config key '{KEY}': {where} takes {p.name!r} as {p.kind.description}; a tool's arguments are passed by name, "
                              "so give each its own parameter")  # fmt: skip
        if p.name not in hints:
            raise ConfigError(f"config key '{KEY}': {where}'s parameter {p.name!r} has no type annotation; annotate it with {_TYPES}")
        if p.name not in args:
            raise ConfigError(f"config key '{KEY}': {where}'s docstring does not describe parameter {p.name!r}; add `{p.name}: <what it is>` "
                              "to its Args: section")  # fmt: skip
        try:
            schema = json_schema(hints[p.name])
        except TypeError:
            raise ConfigError(f"config key '{KEY}': {where}'s parameter {p.name!r} has type {hints[p.name]!r}, which a tool schema here "
                              f"cannot express; use {_TYPES}") from None  # fmt: skip
        properties[p.name] = {**schema, "description": args.pop(p.name)}
        if p.default is p.empty:
            required.append(p.name)
    if args:
        extra = next(iter(args))
        close = difflib.get_close_matches(extra, list(properties), n=1)
        raise ConfigError(f"config key '{KEY}': {where}'s docstring describes {extra!r} in Args:, which is not a parameter"
                          + (f" (did you mean {close[0]!r}?)" if close else f" (parameters: {', '.join(properties) or 'none'})"))  # fmt: skip
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": method.__name__, "description": description, "parameters": parameters}}


def json_schema(annotation: Any) -> dict[str, Any]:
    """The JSON schema of a parameter's type; ``TypeError`` for a type outside :data:`_TYPES`."""
    if annotation in _SIMPLE:
        return {"type": _SIMPLE[annotation]}
    if annotation is list:
        return {"type": "array"}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list and len(args) == 1:
        return {"type": "array", "items": json_schema(args[0])}
    if origin is Literal:
        kinds = {type(a) for a in args}
        if len(kinds) != 1 or next(iter(kinds)) not in _SIMPLE:
            raise TypeError(annotation)
        return {"type": _SIMPLE[kinds.pop()], "enum": list(args)}
    if origin in (Union, types.UnionType) and len(args) == 2 and type(None) in args:
        inner = json_schema(next(a for a in args if a is not type(None)))
        inner["type"] = [inner["type"], "null"]
        if "enum" in inner:
            inner["enum"] = [*inner["enum"], None]
        return inner
    raise TypeError(annotation)


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """A Google-style docstring's description (the text before its first section, on one line)
    and its ``Args:`` entries, ``{name: text}`` (continuation lines joined)."""
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if _SECTION.match(line.strip()) and not line[:1].isspace()), len(lines))
    description = " ".join(" ".join(lines[:start]).split())
    args: dict[str, str] = {}
    in_args, current, indent = False, None, None
    for line in lines[start:]:
        if not line.strip():
            continue
        if not line[:1].isspace():
            in_args, current, indent = line.strip() in ("Args:", "Arguments:"), None, None
            continue
        if not in_args:
            continue
        depth = len(line) - len(line.lstrip())
        match = _ARG.fullmatch(line.strip())
        if match and (indent is None or depth <= indent):
            indent, current = depth, match[1]
            args[current] = match[2]
        elif current is not None:
            args[current] = f"{args[current]} {line.strip()}".strip()
    return description, args


class Episodes:
    """The objects of one environment class, one per running sample (built where the loop runs)."""

    def __init__(self, env: EnvironmentClass) -> None:
        self.env = env
        self.cls = load_reference(env.ref, KEY)
        self.objects: dict[str, Any] = {}

    def tools(self) -> dict[str, Tool]:
        """Each method as a ``Tool`` that calls it on the calling sample's object."""
        return {s["function"]["name"]: MethodTool(self, s) for s in self.env.schemas}

    async def open(self, instance_id: str, extra_info: dict[str, Any]) -> None:
        """A fresh object for the sample, then ``reset`` with its row's ``extra_info`` (a copy:
        every sample of a prompt starts from the same row)."""
        fields = self.env.reset_fields
        kwargs = {k: v for k, v in extra_info.items() if fields is None or k in fields}
        self.objects[instance_id] = obj = self.cls()
        await _maybe_await(obj.reset(**copy.deepcopy(kwargs)))

    async def reward(self, instance_id: str) -> float:
        """The sample's ``reward()``; 0.0 when the class has none."""
        if not self.env.rewarded:
            return 0.0
        return finite_reward(await _maybe_await(self.objects[instance_id].reward()), f"{self.cls.__name__}.reward()")

    async def close(self, instance_id: str) -> None:
        self.objects.pop(instance_id, None)


class MethodTool(Tool):
    """One method of an environment class as a tool; its text is what the method returned (a
    string as is, anything else as JSON, or ``str`` where JSON cannot hold it)."""

    def __init__(self, episodes: Episodes, schema: dict[str, Any]) -> None:
        super().__init__(None)
        self.episodes, self.schema = episodes, schema
        self.method = schema["function"]["name"]

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        result = await _maybe_await(getattr(self.episodes.objects[instance_id], self.method)(**arguments))
        if isinstance(result, str):
            return ToolResult(result)
        try:
            return ToolResult(json.dumps(result))
        except TypeError:
            return ToolResult(str(result))


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value
