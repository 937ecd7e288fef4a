"""Multi-turn conversations on the real SGLang engine through the agent loop (the shared case in
``tests/engine_cases.py``)."""

from __future__ import annotations

from engine_cases import MultiTurnCases


class TestSGLangMultiTurn(MultiTurnCases):
    ENGINE = "sglang"
    CONTEXT = "context_length"
