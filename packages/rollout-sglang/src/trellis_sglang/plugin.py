"""Registers the ``sglang`` rollout. SGLang is imported only when an engine is built, so ``trellis
plugins`` lists this rollout where SGLang is not installed."""

from __future__ import annotations

from trellis import hookimpl
from trellis_sglang import make_engine
from trellis_sglang.options import SGLangRolloutOptions


@hookimpl
def trellis_register(registry):
    registry.add("rollout", "sglang", make_engine, options=SGLangRolloutOptions)
