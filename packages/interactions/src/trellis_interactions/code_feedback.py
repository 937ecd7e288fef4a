"""``code_feedback``: runs the model's program against the sample's test cases on a Sandbox Fusion
server (trellis-sandbox) and tells the model the first failing case, until every case passes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from trellis import Interaction, InteractionTurn, ranged


@dataclass
class CodeFeedbackOptions:
    """url: the Sandbox Fusion server. language: of the programs. run_timeout: seconds per case.
    max_feedback_chars: the longest excerpt of a program's output or error quoted back."""

    url: str = "http://127.0.0.1:8080"
    language: str = "python"
    run_timeout: float = ranged(10.0, gt=0)
    max_feedback_chars: int = ranged(300, ge=20)


class CodeFeedback(Interaction):
    """``start(instance_id, ground_truth=...)`` takes the cases in verl's ``sandbox_fusion`` format
    (``inputs``/``outputs`` with optional ``fn_name``, or ``assert_case``). Each reply runs the
    last fenced code block of the model's turn: all cases pass -> done, score 1; otherwise the
    score is the fraction passed and the reply names the first failure (input, expected, got)."""

    def __init__(self, options: CodeFeedbackOptions | None = None) -> None:
        super().__init__(options or CodeFeedbackOptions())
        try:
            from trellis_sandbox import client, testcases
        except ImportError:
            raise ImportError("interaction code_feedback needs trellis-sandbox: pip install trellis-interactions[sandbox]") from None
        self._client = client.get_client(self.options.url)
        self._cases = testcases
        self.truths: dict[str, Any] = {}

    async def start(self, instance_id: str, ground_truth: Any, **kwargs: Any) -> None:
        if ground_truth is None:
            raise ValueError("interaction code_feedback needs extra_info.interaction_kwargs.ground_truth (the test cases)")
        self._cases.build_cases("", ground_truth, self.options.language)  # malformed cases fail here, not mid-conversation
        self.truths[instance_id] = ground_truth

    async def respond(self, instance_id: str, messages: list[dict[str, str]]) -> InteractionTurn:
        from trellis_sandbox.api import RunRequest

        opts = self.options
        code = self._cases.extract_code(messages[-1]["content"], opts.language)
        cases = self._cases.build_cases(code, self.truths[instance_id], opts.language)
        runs = [RunRequest(c.code, opts.language, run_timeout=opts.run_timeout, stdin=c.stdin) for c in cases]
        results = await asyncio.gather(*(self._client.run(r) for r in runs))
        outcomes = [self._cases.classify(c, r) for c, r in zip(cases, results)]
        passed = outcomes.count("pass")
        if passed == len(cases):
            return InteractionTurn(done=True, message="", score=1.0, metrics={"cases_passed": float(passed)})
        i = next(k for k, o in enumerate(outcomes) if o != "pass")
        return InteractionTurn(done=False, message=self._describe(cases[i], results[i], outcomes[i], passed, len(cases)), score=passed / len(cases))

    def _describe(self, case: Any, result: Any, outcome: str, passed: int, total: int) -> str:
        cut = self.options.max_feedback_chars
        run = result.run_result
        head = f"{passed} of {total} tests passed. The first failure ({outcome.replace('_', ' ')})"
        stdin = "" if case.stdin is None else f" with input {case.stdin[:cut]!r}"
        if outcome == "wrong_answer" and case.expected is not None:
            got = (run.stdout or "")[:cut] if run else ""
            return f"{head}{stdin}: expected {case.expected[:cut]!r}, got {got!r}. Fix the program."
        detail = (run.stderr or run.stdout or "")[-cut:] if run else (result.message or "")[:cut]
        return f"{head}{stdin}: {detail.strip() or outcome}. Fix the program."

    async def finalize(self, instance_id: str) -> None:
        self.truths.pop(instance_id, None)
