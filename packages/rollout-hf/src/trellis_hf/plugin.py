"""Registers the ``hf`` rollout."""

from __future__ import annotations

from trellis import hookimpl
from trellis_hf.engine import HFRolloutOptions, make_engine


@hookimpl
def trellis_register(registry):
    registry.add("rollout", "hf", make_engine, options=HFRolloutOptions)
