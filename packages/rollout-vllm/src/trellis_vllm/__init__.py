"""Trellis rollout on vLLM's offline engine (``LLM``), colocated with the trainer in one process."""

from trellis_vllm.options import VLLMRolloutOptions

__all__ = ["VLLMRolloutOptions", "make_engine"]


def make_engine(spec):
    """Build a :class:`trellis_vllm.engine.VLLMRollout` (imports vLLM on first use)."""
    from trellis_vllm.engine import make_engine as _make

    return _make(spec)
