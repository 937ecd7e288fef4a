"""Typed run config: a YAML file plus ``key=value`` overrides, checked against dataclasses.

A recipe declares its config as a dataclass (registered as the recipe's options). A field made
with :func:`component` holds a named component (``{name: grpo, <options>}``) whose options are
checked against the dataclass that the component registered; a field made with :func:`ranged`
declares the numbers it accepts, one made with :func:`choice` the strings. Every error names the
dotted path, the bad value and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trellis.registry import Registry, RegistryError


class ConfigError(ValueError):
    """The config is invalid; the message names the key, the value and the fix."""


COMPONENT_KIND = "trellis_component_kind"
RANGE = "trellis_range"
CHOICES = "trellis_choices"
SWITCH = "trellis_switch"


@dataclasses.dataclass(frozen=True)
class Range:
    """Bounds of a numeric option: greater than ``gt`` / at least ``ge``, less than ``lt`` / at most ``le``."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None

    def contains(self, value: float) -> bool:
        return not (
            (self.gt is not None and not value > self.gt)
            or (self.ge is not None and not value >= self.ge)
            or (self.lt is not None and not value < self.lt)
            or (self.le is not None and not value <= self.le)
        )

    def __str__(self) -> str:
        low = f"({_num(self.gt)}" if self.gt is not None else f"[{_num(self.ge)}" if self.ge is not None else None
        high = f"{_num(self.lt)})" if self.lt is not None else f"{_num(self.le)}]" if self.le is not None else None
        if low and high:
            return f"in {low}, {high}"
        if low:
            return f"{'>' if low[0] == '(' else '>='} {low[1:]}"
        return f"{'<' if high[-1] == ')' else '<='} {high[:-1]}" if high else "any number"


def ranged(
    default: Any = dataclasses.MISSING,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A numeric option with the values it accepts, checked when the config is composed:
    ``lr: float = ranged(1e-5, gt=0)``. None passes (for optional fields); a list's items are
    each checked."""
    metadata = {RANGE: Range(gt, ge, lt, le)}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def switch(option: dataclasses.Field, off: Any, turn_on: str) -> Any:
    """Marks ``option`` (a ``ranged``, ``choice`` or plain ``dataclasses.field``) as its section's
    on/off switch: while it is ``off``, another option of the section set away from its default
    would be ignored, so the config is refused, saying how to switch it on (``set <key> <turn_on>``):
    ``rank: int = switch(ranged(0, ge=0), off=0, turn_on="above 0 (e.g. 8) to train a LoRA adapter")``."""
    option.metadata = types.MappingProxyType({**option.metadata, SWITCH: (off, turn_on)})
    return option


@dataclasses.dataclass(frozen=True)
class Choices:
    """The strings a string option accepts: ``values``, or the names registered for component
    ``kind`` (plugins add to them)."""

    values: tuple[str, ...] = ()
    kind: str | None = None

    def check(self, path: str, value: Any, registry: Registry) -> None:
        """Raise ``ConfigError`` naming ``path``, the value, the valid values and the closest of
        them when ``value`` (or an item of it) is not one of them; None passes."""
        items = list(value) if isinstance(value, (list, tuple, ListConfig)) else [value]
        for item in items:
            if item is None:
                continue
            shown = repr(value) if item is value else f"{_show(value)} (item {item!r})"
            if self.kind is not None:
                try:
                    registry.get(self.kind, item)
                except RegistryError as exc:
                    raise ConfigError(f"config key {path!r} is {shown}: {exc}") from None
            elif item not in self.values:
                close = difflib.get_close_matches(str(item), self.values, n=1, cutoff=0.0)
                raise ConfigError(f"config key {path!r} is {shown}; valid values: {', '.join(self.values)}; did you mean {close[0]!r}?")


def choice(
    default: Any = dataclasses.MISSING, values: Sequence[str] = (), *, kind: str | None = None, default_factory: Any = dataclasses.MISSING
) -> Any:
    """A string option with the values it accepts, checked when the config is composed:
    ``lr_schedule: str = choice("constant", ("constant", "cosine"))``, or with ``kind`` the names
    registered for that component kind (``tool_parser: str = choice("hermes", kind="tool_parser")``).
    None passes (for optional fields); a list's items are each checked."""
    if (kind is None) == (not values):
        raise ValueError("choice() takes either the valid values or a component kind")
    if values and default not in (dataclasses.MISSING, None, *values):
        raise ValueError(f"choice(): the default {default!r} is not one of the valid values {list(values)}")
    metadata = {CHOICES: Choices(tuple(values), kind)}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def field_choices(f: dataclasses.Field) -> Choices | None:
    """The values a :func:`choice` field declares, or None."""
    return f.metadata.get(CHOICES)


def option_dataclasses(schema: type) -> list[type]:
    """``schema`` and every options dataclass nested in it (sections and list items), each once."""
    found: list[type] = []
    todo = [schema]
    while todo:
        cls = todo.pop()
        if cls in found:
            continue
        found.append(cls)
        for hint in typing.get_type_hints(cls).values():
            nested = hint if dataclasses.is_dataclass(hint) else _dataclass_items(hint)
            if nested is not None:
                todo.append(nested)
    return found


def numeric_fields(schema: type) -> list[dataclasses.Field]:
    """The fields of ``schema`` that hold numbers (int or float, optional, or a list of them)."""
    hints = typing.get_type_hints(schema)
    return [f for f in dataclasses.fields(schema) if _is_numeric(hints[f.name])]


def string_fields(schema: type) -> list[dataclasses.Field]:
    """The fields of ``schema`` that hold strings (optional, or a list of them), unions with other types excepted."""
    hints = typing.get_type_hints(schema)
    return [f for f in dataclasses.fields(schema) if _is_string(hints[f.name])]


def unranged_options(registry: Registry) -> list[str]:
    """``Class.field`` for every numeric option, in the installed recipes' and components' options,
    that declares no range (see :func:`ranged`)."""
    schemas = {s for entry in registry.entries() if entry.options for s in option_dataclasses(entry.options)}
    return sorted(f"{s.__module__}.{s.__qualname__}.{f.name}" for s in schemas for f in numeric_fields(s) if field_range(f) is None)


def _is_numeric(hint: Any) -> bool:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is list:
        return bool(args) and _is_numeric(args[0])
    if args and len(args) == 1 and typing.get_origin(hint) in (typing.Union, types.UnionType):
        return _is_numeric(args[0])
    return hint in (int, float)


def _is_string(hint: Any) -> bool:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is list:
        return bool(args) and _is_string(args[0])
    if args and len(args) == 1 and typing.get_origin(hint) in (typing.Union, types.UnionType):
        return _is_string(args[0])
    return hint is str


def field_range(f: dataclasses.Field) -> Range | None:
    """The range a :func:`ranged` field declares, or None."""
    return f.metadata.get(RANGE)


def check_range(path: str, value: Any, allowed: Range) -> None:
    """Raise ``ConfigError`` naming ``path``, the value and the range when ``value`` (or an item of it) lies outside."""
    items = list(value) if isinstance(value, (list, tuple, ListConfig)) else [value]
    for item in items:
        if item is not None and not allowed.contains(item):
            shown = repr(value) if item is value else f"{_show(value)} (item {item!r})"
            raise ConfigError(f"config key {path!r} is {shown}; it must be {allowed}; set {path} to a value {allowed}")


def component(kind: str, name: str, **options: Any) -> Any:
    """A config field that names a registered component of ``kind`` plus that component's options.

    In YAML it reads ``advantage: {name: grpo, norm_by_std: false}``; the options are checked
    against the component's own options dataclass once its name is known.
    """
    default = {"name": name, **options}
    return dataclasses.field(default_factory=lambda: dict(default), metadata={COMPONENT_KIND: kind})


def load_raw(path: str | Path | None, overrides: list[str] = ()) -> DictConfig:
    """Read a YAML file (optional) and apply ``key=value`` overrides on top."""
    cfg = OmegaConf.create()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist; pass the path of a YAML file")
        cfg = OmegaConf.load(path)
        if not isinstance(cfg, DictConfig):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top, not a list")
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise ConfigError(f"override {bad[0]!r} is not of the form key=value (e.g. trainer.total_steps=10)")
    parsed = [_parse_override(o) for o in overrides]
    try:
        return OmegaConf.merge(cfg, *parsed)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot apply overrides {list(overrides)}: {exc}") from None


def _parse_override(override: str) -> DictConfig:
    """One ``key=value``; a value YAML cannot read is named with its key (no parser traceback)."""
    key, value = override.split("=", 1)
    try:
        return OmegaConf.from_dotlist([override])
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(
            f"override {key!r}: the value {value!r} is not valid YAML ({problem}); if it is a string, quote it: {key}=\"'{value}'\" in the shell"
        ) from None
    except OmegaConfBaseException as exc:
        raise ConfigError(f"override {key!r}: cannot read {override!r}: {exc.msg.splitlines()[0]}") from None


def compose(path: str | Path | None, overrides: list[str], registry: Registry, schema: type | None = None) -> DictConfig:
    """Load, check and resolve a run config.

    ``schema`` defaults to the options dataclass of the recipe named by the top-level ``recipe`` key.
    """
    raw = load_raw(path, overrides)
    if schema is None:
        schema = recipe_schema(raw, registry)
    cfg = validate(raw, schema, registry)
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"config interpolation failed at {_key(exc)}: {exc.msg}") from None
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(
            f"config key {missing[0]!r} is required and has no default; set it in the YAML or "
            f"pass {missing[0]}=... on the command line" + (f" (also missing: {', '.join(missing[1:])})" if len(missing) > 1 else "")
        )
    return cfg


def recipe_schema(raw: DictConfig, registry: Registry) -> type:
    name = raw.get("recipe")
    if name is None:
        installed = ", ".join(registry.names("recipe")) or "none installed"
        raise ConfigError(f"config key 'recipe' is missing; name the recipe to run, e.g. recipe: rl (available: {installed})")
    try:
        entry = registry.get("recipe", str(name))
    except RegistryError as exc:
        raise ConfigError(f"config key 'recipe': {exc}") from None
    if entry.options is None:
        raise ConfigError(f"recipe {name!r} declares no config dataclass")
    return entry.options


def validate_recipe_config(raw: DictConfig, registry: Registry) -> DictConfig:
    """``raw`` checked against the options of the recipe its ``recipe`` key names, defaults filled;
    a required key left unset stays ``???``."""
    return validate(raw, recipe_schema(raw, registry), registry)


def validate(raw: DictConfig, schema: type, registry: Registry, path: str = "", default: Any = None) -> DictConfig:
    """Check ``raw`` against dataclass ``schema``; return a typed ``DictConfig`` with defaults filled
    (from ``default``, an instance of ``schema``, when given: a section's default in its parent)."""
    if not isinstance(raw, DictConfig):
        where = path.rstrip(".") or "<root>"
        keys = ", ".join(f.name for f in dataclasses.fields(schema))
        raise ConfigError(f"config key {where!r} must be a mapping of options ({keys}), got {_show(raw)}")
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key in raw.keys():
        if key not in fields:
            raise ConfigError(_unknown_key(f"{path}{key}", str(key), list(fields)))
    hints = typing.get_type_hints(schema)
    node = OmegaConf.structured(schema if default is None else default)
    # plain values first: their errors need no registry lookup
    for name, f in sorted(fields.items(), key=lambda item: _needs_registry(item[1])):
        sub_path = f"{path}{name}"
        kind = f.metadata.get(COMPONENT_KIND)
        if kind is not None:
            sub = _with_default_options(raw.get(name), f.default_factory())
            with _unlocked(node):
                node[name] = _validate_component(sub, kind, registry, sub_path)
        elif dataclasses.is_dataclass(hints[name]):
            # an absent section too: its components' default options are filled in like a given one's
            sub = raw[name] if name in raw else OmegaConf.create({})
            with _unlocked(node):
                node[name] = validate(sub, hints[name], registry, sub_path + ".", _section_default(default, f))
        elif _dataclass_items(hints[name]) is not None:
            if name in raw:
                node[name] = _validate_list(raw[name], _dataclass_items(hints[name]), registry, sub_path)
        elif name in raw:
            value = raw._get_node(name)._value() if OmegaConf.is_interpolation(raw, name) else raw[name]
            declared = (hints[name], *typing.get_args(hints[name]))
            if type(value) is int and float in declared:
                value = float(value)
            elif type(value) is int and str in declared:  # e.g. trainer.threads=2 from the command line
                value = str(value)
            elif type(value) is bool and str in declared and _word(f, value) is not None:
                value = _word(f, value)  # YAML reads off / on as booleans: trainer.async_mode=off
            try:
                node[name] = value
            except OmegaConfBaseException as exc:
                raise ConfigError(_wrong_type(sub_path, value, hints[name], exc)) from None
        if OmegaConf.is_missing(node, name) or OmegaConf.is_interpolation(node, name):
            continue
        allowed, choices = field_range(f), field_choices(f)
        if allowed is not None:
            check_range(sub_path, node[name], allowed)
        if choices is not None and not (choices.kind is not None and name not in raw and _switched_off(node, schema)):
            choices.check(sub_path, node[name], registry)
    _refuse_switched_off(raw, node, schema if default is None else default, path)
    return node


def _switched_off(node: DictConfig, schema: type) -> bool:
    """Whether ``node``'s section is switched off: the components its options name by default are
    then not looked up (the package providing them may be absent; a name given is still checked)."""
    return any(SWITCH in f.metadata and node[f.name] == f.metadata[SWITCH][0] for f in dataclasses.fields(schema))


def _refuse_switched_off(raw: DictConfig, node: DictConfig, default: Any, path: str) -> None:
    """A section whose :func:`switch` is off, with another option set away from its ``default`` (the
    section's schema or default instance): that option would be ignored."""
    for f in dataclasses.fields(default):
        name = f.name
        if SWITCH not in f.metadata or node[name] != f.metadata[SWITCH][0]:
            continue
        off, turn_on = f.metadata[SWITCH]
        defaults = OmegaConf.structured(default)
        for key in raw:
            if key != name and not OmegaConf.is_missing(node, key) and node[key] != defaults[key]:
                raise ConfigError(
                    f"config key '{path}{key}' is set ({_show(node[key])}) but {path}{name} is {str(off).lower()}, so it would be "
                    f"ignored; set {path}{name} {turn_on}, or drop {path}{key}"
                )


def _word(f: dataclasses.Field, value: bool) -> str | None:
    """The word YAML read as ``value`` (``off``/``on``), when it is one of choice field ``f``'s values."""
    choices = field_choices(f)
    word = "on" if value else "off"
    return word if choices is not None and word in choices.values else None


def _needs_registry(f: dataclasses.Field) -> bool:
    """Whether checking field ``f`` looks names up in the registry (a component, or a choice of a kind's names)."""
    choices = field_choices(f)
    return COMPONENT_KIND in f.metadata or (choices is not None and choices.kind is not None)


def _section_default(parent: Any, f: dataclasses.Field) -> Any:
    """The default of section ``f``: the parent default's value, else the field's own default
    (``optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))`` keeps lr 1e-4)."""
    if parent is not None:
        return getattr(parent, f.name)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _dataclass_items(hint: Any) -> type | None:
    """``X`` for a ``list[X]`` field whose items are option dataclasses, else None."""
    args = typing.get_args(hint)
    return args[0] if typing.get_origin(hint) is list and args and dataclasses.is_dataclass(args[0]) else None


def _validate_list(raw: Any, item: type, registry: Registry, path: str) -> list[DictConfig]:
    if not isinstance(raw, ListConfig):
        raise ConfigError(f"config key {path!r} must be a list of {item.__name__} entries, got {_show(raw)}")
    return [validate(entry, item, registry, f"{path}[{i}].") for i, entry in enumerate(raw)]


def _with_default_options(sub: Any, default: dict) -> Any:
    """The default component's options apply unless the config names a different component."""
    if sub is None:
        return OmegaConf.create(default)
    if isinstance(sub, str):  # shorthand: `advantage: grpo`
        sub = OmegaConf.create({"name": sub})
    if isinstance(sub, DictConfig) and sub.get("name", default["name"]) == default["name"]:
        return OmegaConf.merge(OmegaConf.create(default), sub)
    return sub


def _validate_component(sub: Any, kind: str, registry: Registry, path: str) -> DictConfig:
    if not isinstance(sub, DictConfig) or "name" not in sub:
        raise ConfigError(f"config key {path!r} must name a {kind} component, e.g. {path}.name=<name>; got {_show(sub)}")
    name = str(sub["name"])
    try:
        entry = registry.get(kind, name)
    except RegistryError as exc:
        raise ConfigError(f"config key '{path}.name': {exc}") from None
    options = {k: v for k, v in sub.items() if k != "name"}
    if entry.options is None:
        if options:
            raise ConfigError(f"config key {path!r}: {kind} {name!r} takes no options, got {sorted(options)}")
        return OmegaConf.create({"name": name})
    checked = validate(OmegaConf.create(options), entry.options, registry, path + ".")
    out = OmegaConf.create({"name": name})
    for key in checked.keys():
        out[key] = checked._get_node(key)
    return out


def instantiate_options(node: DictConfig, schema: type) -> Any:
    """Turn a checked config node (component options included) into ``schema``'s dataclass."""
    data = OmegaConf.to_container(node, resolve=True)
    names = {f.name for f in dataclasses.fields(schema)}
    return schema(**{k: v for k, v in data.items() if k in names})


def checked_options(entry: Any, given: Any, registry: Registry, key: str) -> Any:
    """The options instance of registry ``entry`` from ``given`` (a mapping of options, or None),
    checked against its options dataclass with errors naming ``key``; None for a component that
    declares no options, which is then given none."""
    if entry.options is None:
        if given:
            raise ConfigError(f"config key {key!r}: {entry.kind} {entry.name!r} takes no options, got {sorted(given)}")
        return None
    checked = validate(OmegaConf.create(dict(given or {})), entry.options, registry, f"{key}.")
    return instantiate_options(checked, entry.options)


def resolve_component(registry: Registry, kind: str, node: DictConfig) -> tuple[Any, Any]:
    """The registered ``kind`` that a checked ``component(...)`` node names, and its options
    instance (None when the component declares no options)."""
    entry = registry.get(kind, node.name)
    return entry.obj, instantiate_options(node, entry.options) if entry.options else None


def save(cfg: DictConfig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(OmegaConf.to_yaml(cfg, resolve=True))


def _unknown_key(path: str, key: str, valid: list[str]) -> str:
    msg = f"unknown config key {path!r}; valid keys here: {', '.join(sorted(valid))}"
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if close:
        parent = path.rsplit(".", 1)[0] + "." if "." in path else ""
        msg += f"; did you mean '{parent}{close[0]}'?"
    return msg


def _wrong_type(path: str, value: Any, expected: Any, exc: OmegaConfBaseException) -> str:
    name = getattr(expected, "__name__", None) or str(expected).replace("typing.", "")
    return f"config key {path!r} has value {_show(value)} but expects type {name}; set {path} to a value of type {name} ({exc.msg.splitlines()[0]})"


def _show(value: Any) -> str:
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value)
    return repr(value)


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _key(exc: OmegaConfBaseException) -> str:
    return repr(getattr(exc, "full_key", "?"))


class _unlocked:
    """Temporarily allow replacing a typed node with a differently shaped one."""

    def __init__(self, node: DictConfig) -> None:
        self.node = node

    def __enter__(self) -> None:
        OmegaConf.set_struct(self.node, False)
        self.flag = self.node._get_flag("readonly")

    def __exit__(self, *exc: object) -> None:
        OmegaConf.set_struct(self.node, True)
