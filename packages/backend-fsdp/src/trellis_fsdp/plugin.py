"""Registers the ``fsdp`` backend."""

from __future__ import annotations

from trellis import hookimpl
from trellis_fsdp.backend import FSDPBackend, FSDPOptions


@hookimpl
def trellis_register(registry):
    registry.add("backend", "fsdp", FSDPBackend, options=FSDPOptions)
