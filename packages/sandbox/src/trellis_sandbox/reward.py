"""The ``sandbox_fusion`` reward: run a response's code against its test cases on a Sandbox Fusion server.

Used as ``reward.name=sandbox_fusion`` with ``reward.kwargs.url=http://127.0.0.1:8080``. The reward
manager scores samples concurrently (this function's ``max_concurrency`` attribute, or
``reward.max_concurrency``), and one sample's cases run concurrently too; all of them share the
process's one limit on requests in flight (``get_client``). A server with a token gets it from
``TRELLIS_SANDBOX_TOKEN`` in this process's environment (not a kwarg: it would be saved with the run).
"""

from __future__ import annotations

from typing import Any

from trellis_sandbox.api import SANDBOX_ERROR, RunRequest
from trellis_sandbox.client import get_client
from trellis_sandbox.testcases import CLASSES, build_cases, classify, extract_code

SCORINGS = ("fraction", "all")


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    url: str | None = None,
    language: str = "python",
    scoring: str = "fraction",
    stop_on_first_failure: bool = False,
    run_timeout: float = 10.0,
    compile_timeout: float = 10.0,
    memory_limit_mb: int = 1024,
    max_concurrency: int = 32,
) -> dict[str, float]:
    """``score``: the fraction of cases passed (``scoring="fraction"``) or 1.0 only when all pass
    (``"all"``). Also returns, for each result class in ``CLASSES`` (pass, wrong_answer,
    runtime_error, timeout, compile_error, sandbox_error), the fraction of this sample's cases in it,
    so the reward manager reports ``reward/<class>``. A case the sandbox could not run (unreachable,
    refused, no answer in time) raises: the sample counts in ``reward/errors``, never as a 0. ``stop_on_first_failure``: run the cases one by
    one and stop at the first that does not pass (the rest count as not run: in no class).
    The code is the response's last fenced block (see ``extract_code``)."""
    _need_url(url)
    if scoring not in SCORINGS:
        raise ValueError(f"reward.kwargs.scoring={scoring!r}; use one of {SCORINGS}")
    cases = build_cases(extract_code(solution_str, language), ground_truth, language)
    if not cases:
        raise ValueError("sandbox_fusion ground_truth has no test cases; give at least one")
    client = get_client(url, max_concurrency)

    def request(case):
        return RunRequest(case.code, language, compile_timeout, run_timeout, memory_limit_mb, case.stdin)

    if stop_on_first_failure:
        responses = []
        for case in cases:
            responses.append(client.run_sync(request(case)))
            if classify(case, responses[-1]) != "pass":
                break
    else:
        responses = client.run_many_sync([request(c) for c in cases])
    classes = [classify(c, r) for c, r in zip(cases, responses)]
    if "sandbox_error" in classes:  # a case the sandbox did not run says nothing of the code: an error, not a score
        problem = next(r.message for c, r in zip(classes, responses) if c == "sandbox_error")
        raise RuntimeError(f"the sandbox did not run {classes.count('sandbox_error')} of {len(cases)} cases: {problem}")
    passed = classes.count("pass") / len(cases)
    score = passed if scoring == "fraction" else float(passed == 1.0)
    return {"score": score, **{k: classes.count(k) / len(cases) for k in CLASSES}}


def preflight(url: str | None = None, max_concurrency: int = 32, **_: Any) -> None:
    """Before any model is built: ``url`` is set and the sandbox there runs a trivial program."""
    _need_url(url)
    resp = get_client(url, max_concurrency).run_sync(RunRequest("print(1)", "python", 10.0, 10.0, 256, ""))
    if resp.status == SANDBOX_ERROR:
        raise ConnectionError(f"{resp.message}; start it (`trellis-sandbox serve`) or fix reward.kwargs.url")


def _need_url(url: str | None) -> None:
    if url is None:
        raise ValueError("reward sandbox_fusion needs the server's address: set reward.kwargs.url=http://HOST:PORT (e.g. `trellis-sandbox serve`)")


compute_score.max_concurrency = 32  # the reward manager's default thread count for this reward
compute_score.preflight = preflight  # the recipes' checks call it before building anything
