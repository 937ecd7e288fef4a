"""Registry of named components by kind, filled by plugins through ``trellis_register``."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.metadata
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# the kinds core defines; a plugin adds its own through ``trellis_add_kinds``
KINDS = (
    "backend",
    "rollout",
    "advantage",
    "policy_loss",
    "kl",
    "sft_loss",
    "preference_loss",
    "distill_loss",
    "objective",
    "reward",
    "interaction",
    "tool",
    "tool_parser",
    "agent_loop",
    "group_filter",
    "tracker",
    "recipe",
    "dataset",
    "controller",
    "reward_service",
    "prompt_encoder",
    "class_adapter",
    "rollout_function",
)

# Names that Trellis's own packages provide, so that a missing one can be met with the install
# command. Keyed by (kind, name); a kind-wide entry uses name "*".
PROVIDERS: dict[tuple[str, str], str] = {
    ("backend", "fsdp"): "trellis-backend-fsdp",
    ("backend", "megatron"): "trellis-backend-megatron",
    ("rollout", "hf"): "trellis-rollout-hf",
    ("rollout", "vllm"): "trellis-rollout-vllm",
    ("rollout", "sglang"): "trellis-rollout-sglang",
    ("advantage", "*"): "trellis-algos",
    ("policy_loss", "*"): "trellis-algos",
    ("kl", "*"): "trellis-algos",
    ("sft_loss", "*"): "trellis-algos",
    ("preference_loss", "*"): "trellis-algos",
    ("distill_loss", "*"): "trellis-algos",
    ("objective", "*"): "trellis-algos",
    ("recipe", "rl"): "trellis-algos",
    ("group_filter", "zero_variance"): "trellis-algos",
    ("reward", "gsm8k"): "trellis-algos",
    ("reward", "math"): "trellis-algos",
    ("reward", "auto"): "trellis-algos",
    ("recipe", "spin"): "trellis-algos",
    ("recipe", "rm"): "trellis-algos",
    ("recipe", "sft"): "trellis-algos",
    ("reward", "sandbox_fusion"): "trellis-sandbox",
    ("tool", "code_interpreter"): "trellis-sandbox",
    ("interaction", "*"): "trellis-interactions",
    ("agent_loop", "verl"): "trellis-verl-compat",
    ("class_adapter", "verl"): "trellis-verl-compat",
    ("agent_loop", "openai_agent"): "trellis-agents",
    ("agent_loop", "tool_agent"): "trellis-multiturn",
    ("tool_parser", "hermes"): "trellis-multiturn",
    ("rollout_function", "multi_turn"): "trellis-multiturn",
    ("controller", "ray"): "trellis-ray",
    ("reward", "judge"): "trellis-judges",
    ("reward_service", "judge_engine"): "trellis-judges",
    ("reward_service", "reward_model"): "trellis-judges",
    ("prompt_encoder", "images"): "trellis-vision",
    ("tracker", "tensorboard"): "trellis-trackers",
    ("tracker", "wandb"): "trellis-trackers",
    ("tracker", "mlflow"): "trellis-trackers",
}


class RegistryError(LookupError):
    """A component could not be added or found; the message says what to do."""


@dataclass(frozen=True)
class Interface:
    """What the components of a kind declare: ``required`` attributes, and ``optional`` ones (with
    the value a component that leaves one out gets). Read once, when a component is registered,
    into :attr:`Entry.declared`, so callers never probe the object; an attribute a letter or two
    off an optional one's name is refused as a typo (it would be silently ignored)."""

    required: tuple[str, ...] = ()
    optional: Mapping[str, Any] = field(default_factory=dict)
    # an optional attribute that lists names from a closed set: the names a caller acts on
    members: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def read(self, kind: str, name: str, obj: Any, plugin: str | None = None) -> dict[str, Any]:
        who = f"{kind} {name!r}" + (f" (plugin {plugin!r})" if plugin else "")
        missing = [a for a in self.required if not hasattr(obj, a)]
        if missing:
            raise RegistryError(f"{who} has no {', '.join(missing)}; every {kind} declares {', '.join(self.required)}")
        for attr in (a for a in dir(obj) if not a.startswith("_") and a not in self.optional and a not in self.required):
            close = difflib.get_close_matches(attr, list(self.optional), n=1, cutoff=0.85)
            if close:
                raise RegistryError(f"{who} has {attr!r}, which no caller reads; did you mean {close[0]!r}?")
        declared = {a: getattr(obj, a, default) for a, default in self.optional.items()}
        for attr, known in self.members.items():
            for member in declared[attr]:
                if member not in known:  # nothing would act on it: the component would silently go without
                    close = difflib.get_close_matches(member, known, n=1)
                    hint = f"; did you mean {close[0]!r}?" if close else ""
                    raise RegistryError(f"{who} declares {attr} {member!r}, which nothing provides (known: {', '.join(known)}){hint}")
        return declared


# what an advantage estimator may need, each filled or set up by the rl recipe (trellis.interfaces.signatures.AdvantageEstimator)
ADVANTAGE_NEEDS = (
    "values",
    "greedy_baseline",
    "old_log_probs",
    "sum_sq_probs",
    "reward_components",
    "teacher_log_probs",
    "groups",
    "on_policy_only",
)

# what the components of a kind declare (trellis.recipes.train.Recipe, trellis.interfaces.signatures.AdvantageEstimator,
# the tool schema of trellis.interfaces.agents, a tracker's (module, pip requirement) in trellis.runtime.trackers)
INTERFACES: dict[str, Interface] = {
    "recipe": Interface(
        ("Config", "run"), {"check": None, "check_data": None, "evaluate": None, "resume_safe_keys": (), "policy": None, "exports": {}}
    ),
    # needs: what the rl step sets up and fills (a closed set: each is work the step does); reads: batch fields as they are (open)
    "advantage": Interface(optional={"needs": (), "reads": ()}, members={"needs": ADVANTAGE_NEEDS}),
    "policy_loss": Interface(optional={"corrects_rollout": False}),  # the loss corrects the engine's drift itself (bypass_mode)
    "tool": Interface(optional={"schema": None}),
    "tracker": Interface(optional={"requires": None}),
    "rollout_function": Interface(("check", "load")),  # trellis_algos.rl.multi_turn.MultiTurnRunner
}


@dataclass(frozen=True)
class Entry:
    """One registered component: the object, its options dataclass, the plugin that added it and
    what it declares of its kind's :class:`Interface` (``declared``: attribute -> value)."""

    kind: str
    name: str
    obj: Any
    options: type | None
    plugin: str
    declared: Mapping[str, Any] = field(default_factory=dict)


class Registry:
    """Named components by kind. Duplicates are refused; unknown names say how to get them."""

    def __init__(self) -> None:
        self._entries: dict[str, dict[str, Entry]] = {kind: {} for kind in KINDS}
        self._plugin = "<direct>"
        self._load_errors: dict[str, str] = {}  # distribution -> "plugin 'x' failed: ..."
        self._kind_owners: dict[str, str] = {}  # kind a plugin added -> that plugin

    def adding_for(self, plugin: str) -> None:
        """Attribute the following ``add`` calls to ``plugin`` (set by the plugin manager)."""
        self._plugin = plugin

    def add_kind(self, kind: str) -> None:
        """A new kind of component that plugins may register (from ``trellis_add_kinds``)."""
        if not kind.isidentifier():
            raise RegistryError(f"plugin {self._plugin!r} adds kind {kind!r}; a kind is a lowercase identifier such as 'teacher_loss'")
        if kind in self._entries:
            owner = self._kind_owners.get(kind, "trellis-core")
            raise RegistryError(f"plugin {self._plugin!r} adds kind {kind!r}, which {owner!r} already defines; rename it")
        self._entries[kind] = {}
        self._kind_owners[kind] = self._plugin

    def kinds(self) -> list[str]:
        """Core's kinds, then those plugins added, in order."""
        return list(self._entries)

    def note_load_error(self, distribution: str, message: str) -> None:
        self._load_errors[distribution] = message

    def add(self, kind: str, name: str, obj: Any, *, options: type | None = None) -> None:
        """Register ``obj`` as ``kind``/``name``.

        ``options`` is a dataclass of the component's config options; when omitted, the
        object's ``Options`` attribute is used if it has one.
        """
        if kind not in self._entries:
            raise RegistryError(
                f"plugin {self._plugin!r} registers unknown kind {kind!r}; "
                f"valid kinds: {', '.join(self._entries)} (a plugin adds a kind through the trellis_add_kinds hook)"
            )
        if options is None:
            options = getattr(obj, "Options", None)
        if options is not None and not dataclasses.is_dataclass(options):
            raise RegistryError(f"{kind} {name!r}: options must be a dataclass, got {options!r}")
        existing = self._entries[kind].get(name)
        if existing is not None:
            raise RegistryError(
                f"{kind} {name!r} is registered twice: by plugin {existing.plugin!r} and by "
                f"plugin {self._plugin!r}; uninstall one of them or rename the component"
            )
        interface = INTERFACES.get(kind)
        declared = interface.read(kind, name, obj, self._plugin) if interface is not None else {}
        self._entries[kind][name] = Entry(kind, name, obj, options, self._plugin, declared)

    def remove_plugin(self, plugin: str) -> None:
        """Drop every entry and kind that ``plugin`` added (used when its registration fails midway)."""
        for by_name in self._entries.values():
            for name in [n for n, e in by_name.items() if e.plugin == plugin]:
                del by_name[name]
        for kind in [k for k, owner in self._kind_owners.items() if owner == plugin]:
            del self._entries[kind], self._kind_owners[kind]

    def get(self, kind: str, name: str) -> Entry:
        """The entry for ``kind``/``name``, or an error listing what is installed and how to get it."""
        if kind not in self._entries:
            raise RegistryError(f"unknown component kind {kind!r}; valid kinds: {', '.join(self._entries)}")
        entry = self._entries[kind].get(name)
        if entry is not None:
            return entry
        raise RegistryError(self._missing_message(kind, name))

    def __contains__(self, key: tuple[str, str]) -> bool:
        kind, name = key
        return name in self._entries.get(kind, {})

    def names(self, kind: str) -> list[str]:
        return sorted(self._entries[kind])

    def entries(self) -> list[Entry]:
        return [e for by_name in self._entries.values() for e in by_name.values()]

    def _missing_message(self, kind: str, name: str) -> str:
        installed = self.names(kind)
        have = ", ".join(installed) if installed else "none"
        provider = PROVIDERS.get((kind, name)) or PROVIDERS.get((kind, "*"))
        if provider and provider in self._load_errors:
            return f"{kind} {name!r} is not available: {self._load_errors[provider]}"
        msg = f"{kind} {name!r} is not installed"
        if provider and not _distribution_installed(provider):
            msg += f": pip install {provider}"
        msg += f" (installed {kind} names: {have})"
        close = difflib.get_close_matches(name, installed, n=1)
        if close:
            msg += f"; did you mean {close[0]!r}?"
        if self._load_errors:
            msg += "; plugins that failed to load: " + "; ".join(self._load_errors.values())
        return msg


def _distribution_installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
