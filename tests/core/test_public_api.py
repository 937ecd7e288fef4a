"""The public API plugins may import: every name in ``trellis.__all__`` and in each kit's ``__all__`` resolves."""

from __future__ import annotations

import importlib

import pytest

import trellis


def test_every_name_in_trellis_all_resolves():
    # names load lazily from the module ``trellis._API`` maps them to: a wrong module shows only here
    assert [name for name in trellis.__all__ if not hasattr(trellis, name)] == []


def test_a_name_outside_the_api_is_refused_by_name():
    with pytest.raises(AttributeError, match="module 'trellis' has no attribute 'left_pad'"):
        trellis.left_pad  # noqa: B018 - the attribute access is the test


@pytest.mark.parametrize("kit", [f"trellis.kit.{name}" for name in ("backend", "engine", "controller", "recipe", "multiturn", "rewards", "runs")])
def test_every_name_in_a_kit_resolves(kit):
    module = importlib.import_module(kit)
    assert module.__all__ and [name for name in module.__all__ if not hasattr(module, name)] == []
