"""Registers the ``images`` prompt encoder (the prompts of a model with a vision tower)."""

from __future__ import annotations

from trellis import hookimpl
from trellis_vision.prompts import ImagePrompts


@hookimpl
def trellis_register(registry):
    registry.add("prompt_encoder", "images", ImagePrompts)
