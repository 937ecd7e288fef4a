"""``gsm8k``: checks the model's answer with verl's GSM8K rule and asks for another try until it
is right or the turns run out (verl's GSM8K interaction does the same check)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trellis import Interaction, InteractionTurn, choice, ranged
from trellis_algos import gsm8k_score


@dataclass
class AnswerCheckOptions:
    """method: ``strict`` (the last ``#### <number>``) or ``flexible`` (the last number).
    feedback: the user turn sent after a wrong answer. score / wrong_score: a turn's score when the
    answer is right / wrong (wrong includes no answer)."""

    method: str = choice("strict", ("strict", "flexible"))
    feedback: str = "Wrong, try again."
    score: float = ranged(1.0)  # any finite number
    wrong_score: float = ranged(0.0)


class AnswerCheck(Interaction):
    """``start(instance_id, ground_truth=...)`` from the sample's ``extra_info.interaction_kwargs``
    (verl's schema); each reply scores the model's last turn."""

    def __init__(self, options: AnswerCheckOptions | None = None) -> None:
        super().__init__(options or AnswerCheckOptions())
        self.truths: dict[str, str] = {}

    async def start(self, instance_id: str, ground_truth: Any, **kwargs: Any) -> None:
        if ground_truth is None:
            raise ValueError("interaction gsm8k needs extra_info.interaction_kwargs.ground_truth in the sample")
        self.truths[instance_id] = str(ground_truth)

    async def respond(self, instance_id: str, messages: list[dict[str, str]]) -> InteractionTurn:
        answer = messages[-1]["content"] if messages and messages[-1]["role"] == "assistant" else ""
        opts = self.options
        right = gsm8k_score("", answer, self.truths[instance_id], method=opts.method) == 1.0
        if right:
            return InteractionTurn(done=True, message="", score=opts.score)
        return InteractionTurn(done=False, message=opts.feedback, score=opts.wrong_score)

    async def finalize(self, instance_id: str) -> None:
        self.truths.pop(instance_id, None)
