"""Trellis rollout on SGLang's offline engine (``sglang.Engine``), built in the trainer's process."""

from trellis_sglang.options import SGLangRolloutOptions

__all__ = ["SGLangRolloutOptions", "make_engine"]


def make_engine(spec):
    """Build a :class:`trellis_sglang.engine.SGLangRollout` (imports SGLang on first use)."""
    from trellis_sglang.engine import make_engine as _make

    return _make(spec)
