"""Core's own plugin: the components that ship with trellis-core, registered like any plugin's."""

from __future__ import annotations

from trellis.hookspecs import hookimpl
from trellis.runtime.controller import LocalController
from trellis.runtime.trackers import ConsoleTracker, JsonlTracker


@hookimpl
def trellis_register(registry):
    registry.add("tracker", "console", ConsoleTracker)
    registry.add("tracker", "jsonl", JsonlTracker)
    registry.add("controller", "local", LocalController)
