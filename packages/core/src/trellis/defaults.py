"""Core's own plugin: the components that ship with trellis-core, registered like any plugin's."""

from __future__ import annotations

from trellis.hookspecs import hookimpl
from trellis.rewards import auto_score, gsm8k_score, math_score
from trellis.runtime.controller import LocalController
from trellis.runtime.trackers import ConsoleTracker, JsonlTracker


@hookimpl
def trellis_register(registry):
    registry.add("tracker", "console", ConsoleTracker)
    registry.add("tracker", "jsonl", JsonlTracker)
    registry.add("reward", "gsm8k", gsm8k_score)
    registry.add("reward", "math", math_score)
    registry.add("reward", "auto", auto_score)
    registry.add("controller", "local", LocalController)
