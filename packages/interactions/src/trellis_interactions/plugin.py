"""Registers the ``gsm8k`` and ``code_feedback`` interactions and the ``verl`` agent loop."""

from __future__ import annotations

from trellis import hookimpl
from trellis_interactions.answer_check import AnswerCheck, AnswerCheckOptions
from trellis_interactions.code_feedback import CodeFeedback, CodeFeedbackOptions
from trellis_interactions.verl_agent_loop import VerlAgentLoop, VerlAgentLoopOptions


@hookimpl
def trellis_register(registry):
    registry.add("interaction", "gsm8k", AnswerCheck, options=AnswerCheckOptions)
    registry.add("interaction", "code_feedback", CodeFeedback, options=CodeFeedbackOptions)
    registry.add("agent_loop", "verl", VerlAgentLoop, options=VerlAgentLoopOptions)
