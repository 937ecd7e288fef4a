"""Registers the ``gsm8k`` and ``code_feedback`` interactions."""

from __future__ import annotations

from trellis import hookimpl
from trellis_interactions.answer_check import AnswerCheck, AnswerCheckOptions
from trellis_interactions.code_feedback import CodeFeedback, CodeFeedbackOptions


@hookimpl
def trellis_register(registry):
    registry.add("interaction", "gsm8k", AnswerCheck, options=AnswerCheckOptions)
    registry.add("interaction", "code_feedback", CodeFeedback, options=CodeFeedbackOptions)
