"""The ``verl_default`` reward: verl's own ``default_compute_score`` (``verl.utils.reward_score``),
so that a run converted from verl scores every ``data_source`` as verl does (MATH by its boxed
answer, ``math`` / ``math_dapo`` / ``aime*`` by DAPO's -1/+1 rule, ...). verl is imported, not
re-implemented: install it without its dependencies (``pip install --no-deps verl==0.9.1``) beside
``ray`` and ``tensordict``, which its package imports."""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

INSTALL = "pip install --no-deps verl==0.9.1 && pip install ray tensordict"


def available() -> bool:
    """Whether verl's scoring functions can be imported here (checked without importing verl)."""
    return all(importlib.util.find_spec(name) is not None for name in ("verl", "ray", "tensordict"))


@functools.cache
def _default_compute_score():
    try:
        from verl.utils.reward_score import default_compute_score
    except ImportError as exc:
        raise RuntimeError(
            f"reward 'verl_default' calls verl's default_compute_score, which cannot be imported here ({exc}); "
            f"install it: {INSTALL}; or set reward.name=auto (trellis's own scoring by data_source)"
        ) from None
    return default_compute_score


def verl_default(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs: Any) -> Any:
    """verl's ``default_compute_score`` for one sample: a float, or a dict holding ``score``."""
    return _default_compute_score()(data_source, solution_str, ground_truth, extra_info, **kwargs)


def _preflight(**kwargs: Any) -> None:
    _default_compute_score()


verl_default.preflight = _preflight
