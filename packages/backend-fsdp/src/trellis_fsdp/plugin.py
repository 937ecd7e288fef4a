"""Registers the ``fsdp`` backend."""

from __future__ import annotations

from trellis.hookspecs import hookimpl
from trellis_fsdp.worker import FSDPOptions, make_worker


@hookimpl
def trellis_register(registry):
    registry.add("backend", "fsdp", make_worker, options=FSDPOptions)
