"""The OpenAI wire format of the policy endpoint (trellis-agents) and the judge engine's server (trellis-judges): requests of
``/v1/chat/completions`` and ``/v1/completions`` checked field by field (what cannot be served is
refused by name), chat messages as the chat template takes them, and the replies."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from trellis import Generation, ToolCall

MODEL = "trellis-policy"
CHAT_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "user", "tools", "tool_choice", "stream")
TEXT_FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "n", "user", "logprobs", "echo", "stream")
NO_LIMIT = 1 << 62  # max_tokens unset: the run's sampling.max_new_tokens (and the trajectory's budget) cut the turn


class Refused(Exception):
    """A request the endpoint does not serve; answered with ``status`` and the message."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class ChatRequest:
    """messages: as the chat template takes them (a tool call's ``arguments`` an object, missing
    content ""); tools: the request's schemas (None: not given)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    max_tokens: int


@dataclass
class TextRequest:
    """prompt: text, or token ids; logprobs: answer the sampled tokens' log-probs."""

    prompt: str | list[int]
    max_tokens: int
    logprobs: bool


async def request_body(request: Any) -> dict:
    """The JSON object an aiohttp ``request`` carries; refused when it holds none."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise Refused(f"the request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise Refused("the request body must be a JSON object")
    return body


def chat_request(body: dict) -> ChatRequest:
    _common(body, CHAT_FIELDS)
    if body.get("tool_choice") not in (None, "auto"):
        raise Refused(f"tool_choice={body['tool_choice']!r} is not supported; the model decides (auto)")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Refused("messages must be a non-empty list of {role, content} objects")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise Refused("tools must be a list of OpenAI function schemas")
    limit = _max_tokens(body, ("max_tokens", "max_completion_tokens"))
    return ChatRequest([_template_message(i, m) for i, m in enumerate(messages)], tools, limit)


def text_request(body: dict, vocab_size: int) -> TextRequest:
    _common(body, TEXT_FIELDS)
    if body.get("echo"):
        raise Refused("echo=true is not supported: the reply holds the sampled text only (prepend the prompt yourself)")
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0):  # False == 0: not asked
        raise Refused(
            f"logprobs={logprobs!r} is not supported: the endpoint has the sampled tokens' log-probs, not the most likely "
            "alternatives; ask logprobs=0 for the sampled tokens' log-probs"
        )
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise Refused(f"prompt holds {len(prompt)} prompts; send one prompt per request (each call is a step of one trajectory)")
    if isinstance(prompt, list):
        bad = next((i for i, t in enumerate(prompt) if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size), None)
        if bad is not None:
            raise Refused(f"prompt[{bad}]={prompt[bad]!r} is not a token id of this model (ids 0 to {vocab_size - 1})")
    if not prompt or not isinstance(prompt, (str, list)):
        raise Refused(f"prompt must be a non-empty string or list of token ids, got {prompt!r:.100}")
    return TextRequest(prompt, _max_tokens(body, ("max_tokens",)), logprobs is not None and logprobs is not False)


def _common(body: dict, fields: tuple[str, ...]) -> None:
    unknown = [k for k, v in body.items() if k not in fields and v is not None]
    if unknown:
        raise Refused(f"this endpoint does not support {', '.join(map(repr, sorted(unknown)))} here (supported: {', '.join(fields)})")
    if body.get("stream"):
        raise Refused("stream=true is not supported; the endpoint answers each request whole")
    if body.get("n") not in (None, 1):
        raise Refused(f"n={body['n']!r} is not supported: one completion per request (each is a step of one trajectory)")


def _max_tokens(body: dict, keys: tuple[str, ...]) -> int:
    limits = [body[k] for k in keys if body.get(k) is not None]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in limits):
        raise Refused(f"{' / '.join(keys)} must be positive integers, got {limits}")
    return min(limits, default=NO_LIMIT)


def _template_message(i: int, message: Any) -> dict[str, Any]:
    """A request's message as chat templates take it (transformers' convention): a tool call's
    arguments an object, not the JSON string the OpenAI API sends; no content as ""."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise Refused(f"messages[{i}] must be an object with a string role")
    content = message.get("content")
    if not isinstance(content, (str, type(None))):
        raise Refused(f"messages[{i}].content is not a string; content parts (lists) are not supported, send text")
    out = {k: v for k, v in message.items() if v is not None}
    out["content"] = content or ""
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise Refused(f"messages[{i}].tool_calls must be a list of {{id, type: function, function: {{name, arguments}}}}")
        out["tool_calls"] = [_template_call(f"messages[{i}].tool_calls[{j}]", c) for j, c in enumerate(calls)]
    return out


def _template_call(where: str, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise Refused(f"{where} must be {{id, type: function, function: {{name, arguments}}}}")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError as exc:
            raise Refused(f"{where}.function.arguments is not JSON ({exc.msg} at position {exc.pos})") from None
    if not isinstance(arguments, dict):
        raise Refused(f"{where}.function.arguments must be a JSON object")
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if call.get("id") is not None:
        out["id"] = call["id"]
    return out


def canonical(message: dict[str, Any]) -> tuple:
    """What of a template-form message two requests must agree on to be the same conversation:
    role, content, the tool calls' names and arguments, and the call a tool message answers."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True)) for c in message.get("tool_calls") or ())
    return message["role"], message.get("content") or "", calls, message.get("tool_call_id")


def assistant_message(content: str, calls: list[ToolCall]) -> dict[str, Any]:
    """The reply's message in the OpenAI shape (``tool_calls`` only when the model called; then
    content is the text outside the calls, or None)."""
    if not calls:
        return {"role": "assistant", "content": content}
    tool_calls = [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls
    ]
    return {"role": "assistant", "content": content or None, "tool_calls": tool_calls}


def chat_reply(message: dict[str, Any], gen: Generation, prompt_tokens: int, model: str = MODEL) -> dict[str, Any]:
    finish = "tool_calls" if message.get("tool_calls") and gen.finish_reason != "length" else gen.finish_reason
    choice = {"index": 0, "message": message, "finish_reason": finish}
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", **_envelope(gen, prompt_tokens, model), "choices": [choice]}


def text_reply(text: str, gen: Generation, prompt_tokens: int, tokens: list[str] | None) -> dict[str, Any]:
    """tokens: each sampled token's text, to answer the log-probs with (None: not asked)."""
    logprobs = None if tokens is None else {"tokens": tokens, "token_logprobs": list(gen.log_probs), "top_logprobs": None}
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": gen.finish_reason}
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", **_envelope(gen, prompt_tokens, MODEL), "choices": [choice]}


def error_body(status: int, message: str) -> dict[str, Any]:
    """An OpenAI-style error reply for HTTP ``status``."""
    kind = {401: "authentication_error", 404: "not_found_error", 500: "server_error"}.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _envelope(gen: Generation, prompt_tokens: int, model: str) -> dict[str, Any]:
    completion = len(gen.token_ids)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}
    return {"created": int(time.time()), "model": model, "usage": usage}
