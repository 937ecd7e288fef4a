"""Test environment classes as a user would write them, for ``multi_turn.environment=<this
file>:<Class>``, and an in-process plugin for runs with a random tiny model, which cannot write a
tool call: ``load_plugins(extra=[("environments", environments)])`` adds the tool-call parser
``always_guess``, which reads every model turn as a call ``guess(number=<characters in the turn>)``."""

from __future__ import annotations

from typing import Literal

import trellis
from trellis_multiturn.tool_calls import ToolCall, ToolCallParser

RESETS: list[dict] = []  # what reset() got, in this process


class GuessSum:
    """Guess the sum in the row's ``question`` (``a+b=``); the reward is 0.25 per guess, plus 1
    when a guess was right."""

    def reset(self, question: str, noisy: bool = False) -> None:
        RESETS.append({"question": question, "noisy": noisy})
        a, b = question.rstrip("=").split("+")
        self.target, self.guesses = int(a) + int(b), []

    def guess(self, number: int) -> str:
        """Guess the sum; the answer says whether it is right, higher or lower.

        Args:
            number: the guessed sum,
                a whole number.

        Returns:
            right, higher or lower.
        """
        self.guesses.append(number)
        return "right" if number == self.target else "higher" if number < self.target else "lower"

    async def hint(self, kind: Literal["parity", "size"], digits: list[int] | None = None) -> dict:
        """A hint about the sum.

        Args:
            kind: parity (even or odd) or size (how many digits).
            digits (list): digits to ask about; all when omitted.
        """
        return {"parity": self.target % 2} if kind == "parity" else {"size": len(str(self.target)), "asked": digits}

    def reward(self) -> float:
        return 0.25 * len(self.guesses) + (self.target in self.guesses)


class AlwaysGuess(ToolCallParser):
    def parse(self, text: str) -> list[ToolCall]:
        return [ToolCall("guess", {"number": len(text)})]


@trellis.hookimpl
def trellis_register(registry):
    registry.add("tool_parser", "always_guess", AlwaysGuess)
