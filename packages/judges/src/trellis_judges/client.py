"""Reward ``judge``: an LLM judge over an OpenAI-compatible ``/v1/chat/completions`` endpoint.

The prompt is ``template`` filled with ``{question}`` (the row's ``extra_info.question``, as in
verl's GSM8K data), ``{response}`` (the decoded response) and ``{reference}`` (the ground truth);
the reply's text becomes a float by a named rule (``PARSERS``). Standard library only (urllib): the
reward manager already calls a reward from a pool of threads, so each call blocks in its thread.

One ``Endpoint`` per URL is shared by the whole process (the first call fixes its limits): a
token bucket of requests per minute (no burst: requests are spaced ``60 / requests_per_minute``
seconds apart), optionally one of tokens per minute (holding one second's worth: a request reserves
its prompt's characters / 4 plus ``max_tokens``, settled by the reply's ``usage.total_tokens``), and
a cap on requests in flight.
Retries, with exponential backoff (or the server's ``Retry-After``), on HTTP 429 and 5xx only;
any other HTTP error, a dead endpoint, a timeout or a reply no rule can parse raises at once, so the
reward manager counts the sample in ``reward/errors`` (never a silent 0).

With ``reward.judge.engine`` the ``rl`` recipe serves a judge model itself and sends here every
judge that names no url (``trellis_judges.engine``).
"""

from __future__ import annotations

import json
import re
import string
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

DEFAULT_TEMPLATE = (
    "Grade the response to the question. The reference answer is: {reference}\n\n"
    "Question: {question}\n\nResponse: {response}\n\n"
    "Reply with a score between 0 and 1 inside <score></score> tags."
)
FIELDS = ("question", "response", "reference")


class JudgeError(RuntimeError):
    """The judge could not score a response; the message says which request and why."""


# -- parse rules -------------------------------------------------------------------------------------
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
_SCORE_TAG = re.compile(r"<score>\s*(-?\d+(?:\.\d+)?)\s*</score>", re.IGNORECASE)


def last_number(text: str) -> float:
    """The last number in ``text`` (``"7 of 10, so 0.7"`` -> 0.7)."""
    found = _NUMBER.findall(text)
    if not found:
        raise JudgeError(f"parse 'last_number' found no number in the judge's reply {text[-200:]!r}")
    return float(found[-1])


def yes_no(text: str) -> float:
    """1.0 when the last standalone ``yes``/``no`` (any case) is ``yes``, 0.0 when it is ``no``."""
    found = _YES_NO.findall(text)
    if not found:
        raise JudgeError(f"parse 'yes_no' found neither 'yes' nor 'no' in the judge's reply {text[-200:]!r}")
    return 1.0 if found[-1].lower() == "yes" else 0.0


def score_tag(text: str) -> float:
    """The number in the last ``<score>...</score>`` of ``text``."""
    found = _SCORE_TAG.findall(text)
    if not found:
        raise JudgeError(f"parse 'score_tag' found no <score>number</score> in the judge's reply {text[-200:]!r}")
    return float(found[-1])


PARSERS: dict[str, Callable[[str], float]] = {"last_number": last_number, "yes_no": yes_no, "score_tag": score_tag}


def template_fields(template: str) -> set[str]:
    """The ``{field}`` names ``template`` uses; raises naming the unknown ones."""
    try:
        used = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        raise JudgeError(f"judge template is not a format string ({exc}); write literal braces as {{{{ and }}}}") from None
    unknown = used - set(FIELDS)
    if unknown:
        raise JudgeError(f"judge template uses {sorted(unknown)}; it can use {{question}}, {{response}}, {{reference}}")
    return used


# -- rate limits -------------------------------------------------------------------------------------
class TokenBucket:
    """``per_minute`` units refilled evenly, holding at most ``capacity``; thread-safe."""

    def __init__(self, per_minute: float, capacity: float) -> None:
        self.rate = per_minute / 60.0
        self.capacity = capacity
        self.level = capacity
        self.stamp = time.monotonic()
        self.lock = threading.Lock()

    def _refill(self) -> None:
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def take(self, need: float, cost: float) -> None:
        """Wait until the bucket holds ``need`` units, then spend ``cost`` (may go into debt)."""
        while True:
            with self.lock:
                self._refill()
                if self.level >= need:
                    self.level -= cost
                    return
                wait = (need - self.level) / self.rate
            time.sleep(wait)

    def spend(self, cost: float) -> None:
        """Spend ``cost`` without waiting (into debt, or, when negative, a refund up to ``capacity``)."""
        with self.lock:
            self._refill()
            self.level = min(self.capacity, self.level - cost)


class Endpoint:
    """One judge server's limits and counters, shared by every call in the process."""

    def __init__(self, url: str, requests_per_minute: float, tokens_per_minute: float | None, max_in_flight: int) -> None:
        self.url = url
        self.limits = (requests_per_minute, tokens_per_minute, max_in_flight)
        self.requests = TokenBucket(requests_per_minute, 1.0)
        self.tokens = TokenBucket(tokens_per_minute, tokens_per_minute / 60.0) if tokens_per_minute else None
        self.in_flight = threading.BoundedSemaphore(max_in_flight)
        self.sent = 0  # HTTP requests sent, retries included

    def post(self, body: dict[str, Any], timeout_s: float, retries: int, backoff_s: float, api_key: str | None = None) -> dict[str, Any]:
        """The JSON reply of ``/v1/chat/completions`` for ``body``, retried on 429 and 5xx only;
        ``api_key``: sent as ``Authorization: Bearer <api_key>`` (None: no header)."""
        data = json.dumps(body).encode()
        # reserved before sending (about 4 characters a token, plus the whole reply), settled with the reply's usage
        estimate = -(-sum(len(m["content"]) for m in body["messages"]) // 4) + body["max_tokens"]
        for attempt in range(retries + 1):
            if self.tokens is not None:
                self.tokens.take(min(estimate, self.tokens.capacity), estimate)
            self.requests.take(1.0, 1.0)
            with self.in_flight:
                self.sent += 1
                request = urllib.request.Request(self.url + "/v1/chat/completions", data, _headers(api_key))
                try:
                    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
                        raw = resp.read()
                    reply = json.loads(raw)
                except urllib.error.HTTPError as exc:
                    status, detail, retry_after = exc.code, exc.read()[:300].decode(errors="replace"), exc.headers.get("Retry-After")
                except (urllib.error.URLError, OSError) as exc:
                    raise JudgeError(f"judge at {self.url} did not answer: {getattr(exc, 'reason', exc)}") from None
                except ValueError:
                    raise JudgeError(f"judge at {self.url} answered with no JSON: {raw[:300]!r}") from None
                else:
                    if self.tokens is not None:
                        self.tokens.spend(float((reply.get("usage") or {}).get("total_tokens") or estimate) - estimate)
                    return reply
            if status != 429 and status < 500:
                raise JudgeError(f"judge at {self.url} refused the request: HTTP {status}: {detail}")
            if attempt < retries:
                wait = backoff_s * 2**attempt
                if retry_after and retry_after.replace(".", "", 1).isdigit():
                    wait = min(max(wait, float(retry_after)), 60.0)
                time.sleep(wait)
        raise JudgeError(f"judge at {self.url} answered HTTP {status} after {retries + 1} attempts: {detail}")


_ENDPOINTS: dict[str, Endpoint] = {}
_ENDPOINTS_LOCK = threading.Lock()


def base_url(url: Any) -> str:
    """``http://host:port`` from that, or from it followed by ``/v1`` or ``/v1/chat/completions``."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise JudgeError(
            f"reward.kwargs.url={url!r}; give the judge server's address, e.g. http://127.0.0.1:8000 (vLLM's `vllm serve`), "
            "or set reward.judge.engine and reward.judge.model to have trellis serve a judge model itself"
        )
    url = url.rstrip("/")
    for tail in ("/chat/completions", "/v1"):
        url = url.removesuffix(tail)
    return url


def get_endpoint(url: str, requests_per_minute: float = 600, tokens_per_minute: float | None = None, max_in_flight: int = 16) -> Endpoint:
    """The process's ``Endpoint`` for ``url``; the first call fixes its limits (one limit per server)."""
    if requests_per_minute <= 0 or (tokens_per_minute is not None and tokens_per_minute <= 0) or max_in_flight < 1:
        raise JudgeError(
            f"judge limits requests_per_minute={requests_per_minute}, tokens_per_minute={tokens_per_minute}, max_in_flight={max_in_flight}; "
            "give positive rates (tokens_per_minute may be null: no limit) and max_in_flight >= 1"
        )
    base = base_url(url)
    limits = (requests_per_minute, tokens_per_minute, max_in_flight)
    with _ENDPOINTS_LOCK:
        endpoint = _ENDPOINTS.get(base)
        if endpoint is None:
            endpoint = _ENDPOINTS[base] = Endpoint(base, *limits)
        elif endpoint.limits != limits:
            raise JudgeError(
                f"the judge at {base} already runs with (requests_per_minute, tokens_per_minute, max_in_flight)={endpoint.limits}, "
                f"not {limits}: one limit holds per server for the whole process; give every use of it the same limits"
            )
        return endpoint


# -- the reward --------------------------------------------------------------------------------------
def judge_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    url: str | None = None,
    model: str = "default",
    template: str = DEFAULT_TEMPLATE,
    parse: str = "score_tag",
    timeout_s: float = 60.0,
    retries: int = 4,
    backoff_s: float = 0.5,
    requests_per_minute: float = 600,
    tokens_per_minute: float | None = None,
    max_in_flight: int = 16,
    max_tokens: int = 512,
    temperature: float = 0.0,
    api_key: str | None = None,
) -> float:
    """The judge's score of ``solution_str``: ``template`` sent as one user message to ``model`` at
    ``url`` (with ``api_key`` as its bearer token, if given), the reply parsed by rule ``parse``
    (``last_number``, ``yes_no``, ``score_tag``)."""
    rule = _rule(parse)
    fields = template_fields(template)
    question = (extra_info or {}).get("question")
    if "question" in fields and question is None:
        raise JudgeError("the judge template uses {question} but the row's extra_info has no 'question'; add it to the data or drop {question}")
    prompt = template.format(question=question, response=solution_str, reference=ground_truth)
    endpoint = get_endpoint(url, requests_per_minute, tokens_per_minute, max_in_flight)
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": temperature}
    reply = endpoint.post(body, timeout_s, retries, backoff_s, api_key)
    try:
        text = reply["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise JudgeError(f"judge at {endpoint.url} sent no choices[0].message.content: {json.dumps(reply)[:300]}") from None
    return rule(text or "")


def check_prompt(template: str = DEFAULT_TEMPLATE, parse: str = "score_tag", **_: Any) -> None:
    """Checks the template and the parse rule (what a judge needs besides its server)."""
    _rule(parse)
    template_fields(template)


def preflight(
    url: str | None = None,
    model: str = "default",
    template: str = DEFAULT_TEMPLATE,
    parse: str = "score_tag",
    timeout_s: float = 60.0,
    api_key: str | None = None,
    **_: Any,
) -> None:
    """Checks, before any model is built, the template, the parse rule and that ``url`` answers
    ``GET /v1/models`` listing ``model`` (when it lists models at all)."""
    check_prompt(template, parse)
    base = base_url(url)
    try:
        request = urllib.request.Request(base + "/v1/models", headers=_headers(api_key))
        with urllib.request.urlopen(request, timeout=min(timeout_s, 10.0)) as resp:
            listed = [m.get("id") for m in (json.loads(resp.read()).get("data") or [])]
    except urllib.error.HTTPError as exc:
        raise JudgeError(f"judge at {base} answered GET /v1/models with HTTP {exc.code}; is it an OpenAI-compatible server?") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise JudgeError(f"judge at {base} did not answer GET /v1/models: {getattr(exc, 'reason', exc)}; start it or fix url") from None
    if listed and model not in listed:
        raise JudgeError(f"judge at {base} serves {listed}, not model={model!r}; set the judge's model to one of them")


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}


def _rule(parse: str) -> Callable[[str], float]:
    if parse not in PARSERS:
        raise JudgeError(f"judge parse={parse!r}; use one of {', '.join(PARSERS)}")
    return PARSERS[parse]


judge_score.max_concurrency = 16  # the reward manager's default thread count; the endpoint's max_in_flight caps requests
judge_score.preflight = preflight
judge_score.offline_preflight = check_prompt  # for a judge the run serves itself (reward.judge), whose server is not up yet
