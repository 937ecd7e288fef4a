"""The ``code_feedback`` interaction against a real trellis-sandbox server (a subprocess on a free
port, isolated with unshare namespaces): a wrong program is told its first failing case, a right
one ends the conversation."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("trellis_sandbox", reason="code_feedback needs trellis-sandbox")

from trellis_interactions.code_feedback import CodeFeedback, CodeFeedbackOptions  # noqa: E402

CASES = {"inputs": ["1 2\n", "10 -3\n"], "outputs": ["3\n", "7\n"]}
RIGHT = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
WRONG_SECOND = "```python\na, b = map(int, input().split())\nprint(a + b if b > 0 else a)\n```"
CRASH = "```python\nprint(undefined_name)\n```"


@pytest.fixture(scope="module")
def url():
    cmd = [sys.executable, "-m", "trellis_sandbox.cli", "serve", "--host", "127.0.0.1", "--port", "0", "--isolation", "unshare", "--workers", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    line = proc.stdout.readline()
    try:
        assert "serving http://" in line, f"the sandbox server did not start: {line!r}"
        yield line.split("serving ", 1)[1].split(" ", 1)[0]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


def test_feedback_names_the_first_failure_until_the_program_passes(url):
    interaction = CodeFeedback(CodeFeedbackOptions(url=url))

    async def episode():
        await interaction.start("s", ground_truth=CASES)
        turns = [await interaction.respond("s", [{"role": "assistant", "content": text}]) for text in (WRONG_SECOND, CRASH, RIGHT)]
        await interaction.finalize("s")
        return turns

    wrong, crash, right = asyncio.run(episode())
    assert (wrong.done, wrong.score) == (False, 0.5)
    expected = "1 of 2 tests passed. The first failure (wrong answer) with input '10 -3\\n': expected '7\\n', got '10\\n'."
    assert wrong.message == expected + " Fix the program."
    assert (crash.done, crash.score) == (False, 0.0)
    assert "runtime error" in crash.message and "NameError: name 'undefined_name' is not defined" in crash.message
    assert (right.done, right.score) == (True, 1.0)
    assert interaction.truths == {}


def test_malformed_cases_fail_at_start(url):
    with pytest.raises(ValueError, match="ground_truth"):
        asyncio.run(CodeFeedback(CodeFeedbackOptions(url=url)).start("s", ground_truth={"inputs": ["1"]}))
