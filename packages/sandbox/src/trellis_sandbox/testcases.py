"""Test cases in verl's formats, the code a response holds, and the class of each case's result.

A ground truth (a dict, or a JSON string of one) is one of:

- stdin/stdout: ``{"inputs": [stdin, ...], "outputs": [expected stdout, ...]}``; a case passes when
  stdout equals the expected text up to trailing newlines (as verl compares);
- call-based (Python): the same plus ``"fn_name"``: each input holds the arguments, one JSON value a
  line (or a list of them), the function is looked up globally or as a method of ``Solution()``, and
  its result is printed as JSON (str for int/float/str), compared with the expected output (JSON of
  a non-string expected value);
- assert-style (Python): ``{"assert_case": ["assert f(1) == 2", ...]}`` with an optional
  ``"import_prefix"``; a case passes when the program with that assert appended exits 0, and an
  ``AssertionError`` is a wrong answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from trellis_sandbox.api import FINISHED, SANDBOX_ERROR, TIME_LIMIT, RunResponse

CLASSES = ("pass", "wrong_answer", "runtime_error", "timeout", "compile_error", "sandbox_error")

_FENCE = re.compile(r"```[ \t]*([\w+#-]*)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
_TAGS = {"python": {"python", "py", "python3"}, "cpp": {"cpp", "c++", "cc"}, "c": {"c"}}

# Reads the arguments (one JSON value a line), calls the function, prints the result.
_CALL_HARNESS = """

def _trellis_call(name):
    import json, sys
    args = [json.loads(line) for line in sys.stdin.read().splitlines() if line.strip()]
    fn = globals().get(name)
    if fn is None and "Solution" in globals():
        fn = getattr(globals()["Solution"](), name)
    if fn is None:
        raise SystemExit(f"no function or Solution method named {name!r}")
    out = fn(*args)
    print(out if isinstance(out, (int, float, str)) and not isinstance(out, bool) else json.dumps(out))

_trellis_call(%r)
"""


@dataclass(frozen=True)
class Case:
    """One program run: the code, its stdin, the expected stdout (None: exit code 0 is enough)."""

    code: str
    stdin: str | None
    expected: str | None
    assertion: bool = False


def extract_code(response: str, language: str = "python") -> str:
    """The last fenced block tagged with ``language`` (else the last fenced block, an unclosed one
    included); the whole response when it has no fence."""
    blocks = [(tag.lower(), body) for tag, body in _FENCE.findall(response)]
    if not blocks:
        return response
    tagged = [body for tag, body in blocks if tag in _TAGS.get(language, {language})]
    return (tagged or [body for _, body in blocks])[-1]


def parse_ground_truth(ground_truth: Any) -> dict[str, Any]:
    if isinstance(ground_truth, (str, bytes)):
        try:
            ground_truth = json.loads(ground_truth)
        except json.JSONDecodeError as exc:
            raise ValueError(f"sandbox_fusion ground_truth is not JSON ({exc}); give {{'inputs': [...], 'outputs': [...]}}") from None
    if not isinstance(ground_truth, dict):
        raise ValueError(f"sandbox_fusion ground_truth is {type(ground_truth).__name__}; give a dict with 'inputs'/'outputs' or 'assert_case'")
    return ground_truth


def build_cases(code: str, ground_truth: Any, language: str) -> list[Case]:
    """The runs that test ``code`` against ``ground_truth`` (see the module docstring for the formats)."""
    gt = parse_ground_truth(ground_truth)
    if "assert_case" in gt:
        _python_only("assert_case", language)
        prefix = gt.get("import_prefix") or ""
        return [Case(f"{prefix}\n{code}\n\n{a}\n", None, None, assertion=True) for a in _list(gt, "assert_case")]
    if "inputs" not in gt or "outputs" not in gt:
        raise ValueError(f"sandbox_fusion ground_truth has keys {sorted(gt)}; give 'inputs' and 'outputs' lists (and 'fn_name'), or 'assert_case'")
    inputs, outputs = _list(gt, "inputs"), _list(gt, "outputs")
    if len(inputs) != len(outputs):
        raise ValueError(f"sandbox_fusion ground_truth has {len(inputs)} inputs and {len(outputs)} outputs; give one output per input")
    fn_name = gt.get("fn_name")
    if not fn_name:
        return [Case(code, str(i), str(o)) for i, o in zip(inputs, outputs)]
    _python_only("fn_name", language)
    program = code + _CALL_HARNESS % fn_name
    return [Case(program, _arguments(i), o if isinstance(o, str) else json.dumps(o)) for i, o in zip(inputs, outputs)]


def classify(case: Case, resp: RunResponse) -> str:
    """One of :data:`CLASSES` for ``case``'s run."""
    if resp.status == SANDBOX_ERROR:
        return "sandbox_error"
    comp = resp.compile_result
    if comp is not None and (comp.status != FINISHED or comp.return_code != 0):
        return "compile_error"
    run = resp.run_result
    if run is None:
        return "sandbox_error"
    if run.status == TIME_LIMIT:
        return "timeout"
    if run.status != FINISHED or run.return_code != 0:
        return "wrong_answer" if case.assertion and "AssertionError" in (run.stderr or "") else "runtime_error"
    if case.expected is None or (run.stdout or "").rstrip("\n") == case.expected.rstrip("\n"):
        return "pass"
    return "wrong_answer"


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else "\n".join(json.dumps(v) for v in value)


def _list(gt: dict[str, Any], key: str) -> list[Any]:
    value = gt[key]
    if not isinstance(value, list):
        raise ValueError(f"sandbox_fusion ground_truth[{key!r}] is {type(value).__name__}; give a list")
    return value


def _python_only(key: str, language: str) -> None:
    if language != "python":
        raise ValueError(f"sandbox_fusion ground_truth with {key!r} runs Python only, not language={language!r}")
