"""What a ``multi_turn`` key names by reference (``path/to/file.py:name`` or ``package.module:name``),
and the rewards user code returns."""

from __future__ import annotations

import functools
import importlib
import math
import numbers
from typing import Any

from trellis import ConfigError, RewardError, load_function


@functools.cache  # one module per process, however many rollouts load it
def load_reference(ref: str, key: str) -> Any:
    """The object ``ref`` names; errors name the config ``key`` and the fix."""
    where, sep, name = ref.rpartition(":")
    if not sep or not where or not name:
        raise ConfigError(f"config key '{key}' is {ref!r}; give path/to/file.py:Name or package.module:Name")
    if where.endswith(".py"):
        try:
            return load_function(where, name, (key, key))
        except RewardError as exc:
            raise ConfigError(f"config key '{key}': {exc}") from None
    try:
        found = getattr(importlib.import_module(where), name, None)
    except ImportError as exc:
        raise ConfigError(f"config key '{key}': cannot import module {where!r} ({exc}); is its package installed?") from None
    if found is None:
        raise ConfigError(f"config key '{key}': module {where!r} has no {name!r}")
    return found


def finite_reward(value: Any, who: str) -> float:
    """``value`` as a float; a ``TypeError`` saying what ``who`` returned when it is not a finite number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{who} returned {value!r}; it must return the sample's reward, a finite number")
    return float(value)
