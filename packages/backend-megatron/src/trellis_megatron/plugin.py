"""Registers the ``megatron`` backend."""

from __future__ import annotations

from trellis.hookspecs import hookimpl
from trellis_megatron.backend import MegatronBackend, MegatronOptions


@hookimpl
def trellis_register(registry):
    registry.add("backend", "megatron", MegatronBackend, options=MegatronOptions)
