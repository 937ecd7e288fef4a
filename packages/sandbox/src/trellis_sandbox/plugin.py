"""Registers the ``sandbox_fusion`` reward and the ``code_interpreter`` tool."""

from __future__ import annotations

from trellis import hookimpl
from trellis_sandbox.reward import compute_score
from trellis_sandbox.tool import CodeInterpreterOptions, CodeInterpreterTool


@hookimpl
def trellis_register(registry):
    registry.add("reward", "sandbox_fusion", compute_score)
    registry.add("tool", "code_interpreter", CodeInterpreterTool, options=CodeInterpreterOptions)
