"""What a conversion rule is: one verl key, the trellis key it sets and how its value converts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

AR = "actor_rollout_ref."
ACTOR = AR + "actor."
ROLLOUT = AR + "rollout."
MULTI_TURN = ROLLOUT + "multi_turn.enable"
SKIP = object()  # a converter's answer when the value needs nothing in trellis (verl's "unset")

Source = dict[str, Any]  # dotted verl key -> value (verl's defaults under what the user gave)


class Unmapped(Exception):
    """A verl value trellis cannot express; the message says why."""


@dataclass(frozen=True)
class Differs:
    """A converted value (or ``SKIP``: trellis's own default stands) whose run differs from
    verl's in a way the converter states: ``why`` goes to the report."""

    value: Any
    why: str


@dataclass(frozen=True)
class Rule:
    """One verl key, the trellis key it sets and how its value converts (``note``: for the docs)."""

    verl: str
    trellis: str
    convert: Callable[[Any, Source], Any] = lambda value, src: value
    note: str = ""


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """``tree[a][b][c] = value`` for ``dotted`` ``a.b.c``, making the sections on the way."""
    *parents, last = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[last] = value


def when(key: str, convert: Callable[[Any, Source], Any] = lambda value, src: value) -> Callable[[Any, Source], Any]:
    """``convert`` applied only when the verl key ``key`` is true (a feature's switch), else SKIP."""
    return lambda value, src: convert(value, src) if src.get(key) else SKIP


MODE = "<mode>"  # not a verl key: the async mode of the entry point the run was launched with (off, one_step, fully_async)
