"""Registers the ``gsm8k`` interaction."""

from __future__ import annotations

from trellis.hookspecs import hookimpl
from trellis_interactions.answer_check import AnswerCheck, AnswerCheckOptions


@hookimpl
def trellis_register(registry):
    registry.add("interaction", "gsm8k", AnswerCheck, options=AnswerCheckOptions)
