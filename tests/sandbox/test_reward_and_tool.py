"""The ``sandbox_fusion`` reward (verl's test-case formats, result classes, scoring) and the
``code_interpreter`` tool against the real server; and the official ``sandbox-fusion`` client."""

from __future__ import annotations

import asyncio
import json

import pytest

from trellis.plugins import load_plugins
from trellis_sandbox.reward import compute_score
from trellis_sandbox.testcases import extract_code
from trellis_sandbox.tool import CodeInterpreterOptions, CodeInterpreterTool

SUM = {"inputs": ["1 2\n", "10 -3\n", "0 0\n"], "outputs": ["3\n", "7\n", "0\n"]}
GOOD = "Here you go:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\n"


def score(server, response, ground_truth=SUM, **kwargs):
    return compute_score("code", response, ground_truth, None, url=server.url, **kwargs)


def test_extract_code_prefers_the_last_block_of_the_language():
    assert extract_code("```python\nprint(1)\n```\ntext\n```py\nprint(2)\n```") == "print(2)\n"
    assert extract_code("```cpp\nint x;\n```\n```python\nprint(3)\n```\n```text\nout\n```") == "print(3)\n"
    assert extract_code("```\nprint(4)\n```") == "print(4)\n"  # untagged
    assert extract_code("```python\nprint(5)") == "print(5)"  # unclosed: the rest of the response
    assert extract_code("print(6)") == "print(6)"  # no fence: all of it
    assert extract_code("```c++\nint main(){}\n```", "cpp") == "int main(){}\n"


def test_stdin_stdout_cases_and_result_classes(server):
    assert score(server, GOOD) == {"score": 1.0, "pass": 1.0, "wrong_answer": 0.0, "runtime_error": 0.0, "timeout": 0.0,
                                   "compile_error": 0.0, "sandbox_error": 0.0}  # fmt: skip
    wrong = "```python\na, b = map(int, input().split())\nprint(a * b)\n```"  # right only for 0 0
    assert score(server, wrong)["score"] == pytest.approx(1 / 3)
    assert score(server, wrong)["wrong_answer"] == pytest.approx(2 / 3)
    assert score(server, wrong, scoring="all")["score"] == 0.0
    assert score(server, "```python\nraise ValueError\n```")["runtime_error"] == 1.0
    assert score(server, "```python\nwhile True: pass\n```", run_timeout=0.5)["timeout"] == 1.0
    as_json = json.dumps(SUM)  # verl stores ground truths as JSON text
    assert score(server, GOOD, as_json)["score"] == 1.0


def test_cpp_and_compile_errors(server):
    cpp = '```cpp\n#include <cstdio>\nint main(){long a,b;scanf("%ld %ld",&a,&b);printf("%ld\\n",a+b);}\n```'
    assert score(server, cpp, language="cpp")["score"] == 1.0
    assert score(server, "```cpp\nint main( {\n```", language="cpp")["compile_error"] == 1.0


def test_call_based_cases_global_function_and_solution_method(server):
    gt = {"fn_name": "add", "inputs": ["1\n2", [3, 4], "[1]\n[2]"], "outputs": ["3", 7, [1, 2]]}
    assert score(server, "```python\ndef add(a, b):\n    return a + b\n```", gt)["score"] == 1.0
    method = "```python\nclass Solution:\n    def add(self, a, b):\n        return a + b\n```"
    assert score(server, method, gt)["score"] == 1.0
    assert score(server, "```python\ndef sub(a, b):\n    return a - b\n```", gt)["runtime_error"] == 1.0  # no such function


def test_assert_cases(server):
    gt = {"assert_case": ["assert sq(3) == 9", "assert sq(-2) == 4", "assert sq(0) == 1"], "import_prefix": "import math"}
    result = score(server, "```python\ndef sq(x):\n    return x * x\n```", gt)
    assert result["score"] == pytest.approx(2 / 3) and result["wrong_answer"] == pytest.approx(1 / 3)


def test_stop_on_first_failure_runs_no_more_cases(server):
    gt = {"inputs": ["1 1\n", "2 2\n", "3 3\n", "4 4\n"], "outputs": ["2\n", "5\n", "6\n", "8\n"]}  # the second is wrong
    runs = server.stats()["runs"]
    result = score(server, GOOD, gt, stop_on_first_failure=True)
    assert server.stats()["runs"] == runs + 2
    assert result["score"] == 0.25 and result["pass"] == 0.25 and result["wrong_answer"] == 0.25  # cases 3, 4 not run


@pytest.mark.parametrize(
    "ground_truth, message",
    [
        ("not json", "ground_truth is not JSON"),
        ({"inputs": ["1"]}, "give 'inputs' and 'outputs' lists"),
        ({"inputs": ["1"], "outputs": []}, "1 inputs and 0 outputs"),
        ({"inputs": [], "outputs": []}, "has no test cases"),
    ],
)
def test_bad_ground_truths_name_the_problem(server, ground_truth, message):
    with pytest.raises(ValueError, match=message):
        score(server, GOOD, ground_truth)


def test_the_reward_needs_a_url_and_a_known_scoring(server):
    with pytest.raises(ValueError, match=r"set reward.kwargs.url=http://HOST:PORT"):
        compute_score("code", GOOD, SUM)
    with pytest.raises(ValueError, match=r"reward.kwargs.scoring='most'; use one of \('fraction', 'all'\)"):
        score(server, GOOD, scoring="most")


def test_the_plugin_registers_the_reward_and_the_tool():
    registry = load_plugins().registry
    assert registry.get("reward", "sandbox_fusion").obj is compute_score
    entry = registry.get("tool", "code_interpreter")
    assert entry.obj is CodeInterpreterTool and entry.options is CodeInterpreterOptions


def test_code_interpreter_tool(server):
    async def session():
        tool = CodeInterpreterTool(CodeInterpreterOptions(url=server.url, max_output_chars=50, run_timeout=1))
        await tool.create("s1")
        ok = await tool.execute("s1", {"code": "print('hello')\nimport sys; sys.stderr.write('warn')"})
        long = await tool.execute("s1", {"code": "print('x' * 120)"})
        slow = await tool.execute("s1", {"code": "while True: pass"})
        bad = await tool.execute("s1", {"source": "print(1)"})
        calls = tool.calls["s1"]
        await tool.release("s1")
        return ok, long, slow, bad, calls, tool.calls

    ok, long, slow, bad, calls, left = asyncio.run(session())
    assert ok.text == "Exit code 0.\nstdout:\nhello\n\nstderr:\nwarn" and ok.metrics["tool/ok"] == 1.0
    assert "x" * 50 + "\n...[71 more characters cut]" in long.text  # 120 x and a newline, cut at 50
    assert slow.text.startswith("Timed out after 1 s.") and slow.metrics["tool/ok"] == 0.0
    assert "non-empty string argument 'code'" in bad.text and bad.metrics == {"tool/bad_call": 1.0}
    assert calls == 3 and left == {}
    with pytest.raises(ValueError, match=r"set its option url=http://HOST:PORT"):
        CodeInterpreterTool(CodeInterpreterOptions())


def test_the_official_sandbox_fusion_client_works_against_our_server(server):
    sandbox_fusion = pytest.importorskip("sandbox_fusion", reason="pip install sandbox-fusion (the nox session installs it)")
    from sandbox_fusion import RunCodeRequest, RunStatus, run_code

    resp = run_code(RunCodeRequest(code="print(input()[::-1])", language="python", stdin="abc"), endpoint=server.url)
    assert resp.status == RunStatus.Success and resp.run_result.stdout == "cba\n" and resp.run_result.return_code == 0
    cpp = RunCodeRequest(code='#include <cstdio>\nint main(){puts("hi");return 3;}', language="cpp")
    resp = run_code(cpp, endpoint=server.url)
    assert resp.status == RunStatus.Failed and resp.run_result.return_code == 3 and resp.compile_result.return_code == 0
    slow = run_code(RunCodeRequest(code="while True: pass", language="python", run_timeout=1), endpoint=server.url)
    assert slow.run_result.status.value == "TimeLimitExceeded"
    mapping = sandbox_fusion.SummaryMapping(RunTimeout="timeout", RunFailed="failed")
    assert sandbox_fusion.summary_run_code_result(slow, mapping) == "timeout"


def test_the_tools_numeric_options_declare_and_enforce_ranges(assert_ranges_enforced):
    """``trellis plugins`` printed a note for each of them: a timeout of 0 or a negative memory limit passed."""
    from trellis.plugins import load_plugins

    assert assert_ranges_enforced(CodeInterpreterOptions, load_plugins().registry) == 5
