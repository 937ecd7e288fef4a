"""Plugin manager: finds plugins by entry point (group ``trellis``) and fills the registry."""

from __future__ import annotations

import importlib.metadata as md
import traceback
from dataclasses import dataclass, field

import pluggy

from trellis import hookspecs
from trellis.registry import Registry, RegistryError

ENTRY_POINT_GROUP = "trellis"
CORE = "trellis-core"


@dataclass
class PluginInfo:
    """What ``trellis plugins`` reports for one plugin."""

    name: str
    distribution: str
    version: str
    registered: list[tuple[str, str]] = field(default_factory=list)  # (kind, name)
    error: str | None = None


@dataclass
class Plugins:
    """The loaded plugin manager, the registry it filled and a report per plugin."""

    manager: pluggy.PluginManager
    registry: Registry
    infos: list[PluginInfo]

    @property
    def hook(self):
        return self.manager.hook


def load_plugins(extra: list[tuple[str, object]] | None = None, entry_points: bool = True) -> Plugins:
    """Build the plugin manager: core's own entry point first, every other installed entry point
    (unless ``entry_points`` is false), then ``extra`` (``(name, plugin)``: a module, a class or an
    instance, hashable as pluggy needs).

    A plugin that fails to import or to register is recorded with its error and skipped; the
    others load. Hook implementations that match no spec (typos) raise here.
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    registry = Registry()
    infos: list[PluginInfo] = []
    candidates: list[tuple[PluginInfo, object | None]] = []
    found = md.entry_points(group=ENTRY_POINT_GROUP)
    for ep in sorted(found, key=lambda e: (_distribution(e) != CORE, e.name)):
        if not entry_points and _distribution(ep) != CORE:
            continue
        info = PluginInfo(ep.name, _distribution(ep), ep.dist.version if ep.dist else "?")
        try:
            candidates.append((info, ep.load()))
        except Exception as exc:  # noqa: BLE001 - any import failure is reported, not fatal
            info.error = _describe(exc)
            candidates.append((info, None))
    for name, obj in extra or []:
        candidates.append((PluginInfo(name, "<in-process>", "-"), obj))

    loaded: list[tuple[PluginInfo, object]] = []
    for info, obj in candidates:
        infos.append(info)
        if obj is None:
            registry.note_load_error(info.distribution, f"plugin {info.name!r} ({info.distribution}) failed to load: {info.error}")
            continue
        if pm.has_plugin(info.name):
            raise RegistryError(
                f"two plugins are named {info.name!r} ({info.distribution} and one loaded before it); "
                "uninstall one, or pass an in-process plugin under another name"
            )
        pm.register(obj, name=info.name)
        loaded.append((info, obj))
    # every plugin's kinds first, so that any plugin may register components of any kind
    loaded = [(info, obj) for info, obj in loaded if not _call(pm, registry, info, obj, "trellis_add_kinds")]
    for info, obj in loaded:
        before = {(e.kind, e.name) for e in registry.entries()}
        _call(pm, registry, info, obj, "trellis_register")
        info.registered = sorted({(e.kind, e.name) for e in registry.entries()} - before)
    registry.adding_for("<direct>")
    pm.check_pending()
    return Plugins(pm, registry, infos)


def _call(pm: pluggy.PluginManager, registry: Registry, info: PluginInfo, obj: object, hook: str) -> bool:
    """Call ``obj``'s implementation of ``hook`` (if any) through pluggy with the registry, one
    plugin at a time so that its additions are attributed to it. A plugin that fails is recorded,
    its entries dropped and it is unregistered (returns True); a duplicate or a bad kind is a
    conflict to fix, raised."""
    caller = pm.subset_hook_caller(hook, remove_plugins=[p for _, p in pm.list_name_plugin() if p is not obj])
    if not caller.get_hookimpls():
        return False
    registry.adding_for(info.name)
    try:
        caller(registry=registry)
    except RegistryError:
        raise
    except Exception as exc:  # noqa: BLE001
        registry.remove_plugin(info.name)
        info.error = _describe(exc)
        registry.note_load_error(info.distribution, f"plugin {info.name!r} ({info.distribution}) failed to register: {info.error}")
        pm.unregister(obj)
        return True
    return False


def _distribution(ep: md.EntryPoint) -> str:
    return ep.dist.name if ep.dist else "?"


def _describe(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"
