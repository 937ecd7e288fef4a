"""The policy endpoint: an OpenAI-compatible ``/v1/chat/completions`` on loopback in front of a
rollout engine, for agents written against the ``openai`` client. Every call is recorded per
trajectory (the exact prompt ids, sampled ids and log-probs), and the calls that continue one
another become the sample's ``Trajectory``, token for token as sampled."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import math
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from trellis.data import encode_text, render_chat
from trellis.interfaces.agents import Trajectory
from trellis.interfaces.rollout import Generation, RolloutEngine, SamplingParams
from trellis.multiturn.chat import ChatDeltas
from trellis.multiturn.sampled import record_into

log = logging.getLogger("trellis")

HEADER = "X-Trellis-Trajectory"  # the trajectory a request belongs to (or the body's ``user``)
MODEL = "trellis-policy"
MAX_BODY = 64 << 20  # long conversations: aiohttp's 1 MiB default is too small
# request keys the endpoint reads; any other key with a value is refused by name
SUPPORTED = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "user", "tools", "tool_choice", "stream")
LIMITS = ("max_assistant_turns", "max_response_tokens")  # episode ends after which every call is refused


class Refused(Exception):
    """A request the endpoint does not serve; answered with ``status`` and the message."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Call:
    """One completion served: the prompt ids the engine got and what it sampled."""

    prompt_ids: list[int]
    generation: Generation
    trained: bool  # part of the trajectory: it continues the calls before it


@dataclass
class Episode:
    """One sample's calls and the trajectory they build.

    ``chain_ids`` / ``chain_text``: the conversation so far as the engine saw it (the row's prompt,
    then every token appended) and as the chat template renders it; a request whose rendered
    messages start with ``chain_text`` continues the trajectory with the ids of the rest.
    ``ended``: why the trajectory stopped growing ("" while it grows).
    """

    id: str
    chain_ids: list[int]
    chain_text: str
    params: SamplingParams
    budget: int  # response tokens after the row's prompt, model and environment
    max_turns: int
    turns: list[Generation]  # the sample's record that its trained ids are checked against
    trajectory: Trajectory = field(default_factory=Trajectory)
    calls: list[Call] = field(default_factory=list)
    ended: str = ""
    closed: bool = False
    engine_error: BaseException | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class PolicyEndpoint:
    """``/v1/chat/completions`` and ``/v1/models`` on 127.0.0.1 (a free port), for requests that
    carry this endpoint's bearer ``token`` and the id of a running sample's episode.

    Each request's messages are rendered with the tokenizer's chat template (the request's
    ``tools`` too, where the template renders them) and sampled by ``engine`` with the sample's
    settings; the reply's content is the decoded sample. Calls of one episode run one at a time.
    """

    def __init__(self, engine: RolloutEngine, tokenizer: Any, template_kwargs: dict[str, Any]) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs)
        self.chat = ChatDeltas(tokenizer, template_kwargs)
        self.token = secrets.token_urlsafe(32)
        self.episodes: dict[str, Episode] = {}
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._renders_tools: bool | None = None
        self._warned_rewrite = False

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}/v1"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(
        self, prompt_ids: list[int], raw_prompt: list[dict], params: SamplingParams, budget: int, max_turns: int, turns: list[Generation]
    ) -> Episode:
        """A new episode after the row's prompt ``prompt_ids`` (``raw_prompt`` rendered)."""
        text = render_chat(self.tokenizer, list(raw_prompt), True, self.template_kwargs)
        episode = Episode(uuid.uuid4().hex, list(prompt_ids), text, params, budget, max_turns, turns)
        self.episodes[episode.id] = episode
        return episode

    async def end(self, episode: Episode) -> None:
        """Refuse the episode's later calls; a call in flight finishes first, untrained if it
        had not been added yet."""
        self.episodes.pop(episode.id, None)
        async with episode.lock:
            episode.closed = True

    # -- requests --------------------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _error(401, "missing or wrong bearer token (Authorization: Bearer <the run's token>)")
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "trellis"}]})

    async def _completions(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _error(401, "missing or wrong bearer token (Authorization: Bearer <the run's token>); use the client trellis gives the agent")
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise Refused(f"the request body is not JSON: {exc}") from None
            if not isinstance(body, dict):
                raise Refused("the request body must be a JSON object")
            episode = self._episode(request, body)
            async with episode.lock:
                if episode.closed:
                    raise Refused(f"trajectory {episode.id!r} has ended")
                return web.json_response(await self._serve(episode, body))
        except Refused as exc:
            return _error(exc.status, str(exc))

    def _authorized(self, request: web.Request) -> bool:
        given = request.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode())

    def _episode(self, request: web.Request, body: dict) -> Episode:
        header, user = request.headers.get(HEADER), body.get("user")
        if header and user and header != user:
            raise Refused(f"the {HEADER} header ({header!r}) and the body's user ({user!r}) name different trajectories")
        tid = header or user
        if not tid:
            raise Refused(f"no trajectory id: send the {HEADER} header or the body's user field (the client trellis gives the agent sends it)")
        episode = self.episodes.get(tid)
        if episode is None:
            raise Refused(
                f"unknown trajectory id {tid!r}: it names no running sample (each sample's client sends its own; it is refused once the sample ends)"
            )
        return episode

    async def _serve(self, episode: Episode, body: dict) -> dict[str, Any]:
        messages, kwargs, max_tokens = self._request(body)
        params = _params(episode.params, body)
        if episode.ended in LIMITS:
            raise Refused(_limit_message(episode))
        try:
            text = render_chat(self.tokenizer, messages, True, kwargs)
        except Exception as exc:  # noqa: BLE001 - the template's own error is the agent's to read
            raise Refused(f"the chat template cannot render these messages: {type(exc).__name__}: {exc}") from None
        traj = episode.trajectory
        if not episode.ended and text.startswith(episode.chain_text):
            delta = encode_text(self.tokenizer, text[len(episode.chain_text) :])
            room = episode.budget - len(traj.response_ids) - len(delta)
            if traj.assistant_turns >= episode.max_turns:
                episode.ended = "max_assistant_turns"
            elif room <= 0:
                episode.ended = "max_response_tokens"
            if episode.ended:
                raise Refused(_limit_message(episode))
            ids = episode.chain_ids + delta
            gen = await self._sample(episode, ids, dataclasses.replace(params, max_new_tokens=min(max_tokens, params.max_new_tokens, room)))
            if not episode.closed:  # a call that outlived its agent (timeout) is not added
                traj.add_environment(delta)
                traj.add_model(gen)
                episode.chain_ids = ids + gen.token_ids
                episode.chain_text = text + self._content(gen) + self.chat.sampled_closing(gen.token_ids)
            episode.calls.append(Call(ids, gen, not episode.closed))
        else:
            if not traj.assistant_turns:
                raise Refused(
                    "the first call's messages must begin with the sample's prompt (sample.messages, as the chat template renders "
                    "them), which is what the trajectory trains on; send sample.messages, then your own turns after them"
                )
            self._history_rewritten(episode)
            ids = encode_text(self.tokenizer, text)
            room = len(episode.calls[0].prompt_ids) + episode.budget - len(ids)  # the trajectory's own context length
            if room <= 0:
                raise Refused(f"the messages render to {len(ids)} tokens, more than this trajectory's context")
            gen = await self._sample(episode, ids, dataclasses.replace(params, max_new_tokens=min(max_tokens, params.max_new_tokens, room)))
            episode.calls.append(Call(ids, gen, False))
        return _completion(self._content(gen), gen, len(ids))

    def _request(self, body: dict) -> tuple[list[dict], dict[str, Any], int]:
        """The messages, the chat template's kwargs and the token limit; what cannot be served is refused by name."""
        unknown = [k for k, v in body.items() if k not in SUPPORTED and v is not None]
        if unknown:
            raise Refused(f"the policy endpoint does not support {', '.join(map(repr, sorted(unknown)))} (supported: {', '.join(SUPPORTED)})")
        if body.get("stream"):
            raise Refused("stream=true is not supported; the endpoint answers each request whole")
        if body.get("n") not in (None, 1):
            raise Refused(f"n={body['n']!r} is not supported: one completion per request (each is a step of one trajectory)")
        if body.get("tool_choice") not in (None, "auto"):
            raise Refused(f"tool_choice={body['tool_choice']!r} is not supported; the model decides (auto)")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise Refused("messages must be a non-empty list of {role, content} objects")
        bad = next((i for i, m in enumerate(messages) if not isinstance(m.get("content"), (str, type(None)))), None)
        if bad is not None:
            raise Refused(f"messages[{bad}].content is not a string; content parts (lists) are not supported, send text")
        kwargs = dict(self.template_kwargs)
        if body.get("tools") is not None:
            kwargs["tools"] = self._tools(body["tools"])
        limits = [body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in limits):
            raise Refused(f"max_tokens / max_completion_tokens must be positive integers, got {limits}")
        return messages, kwargs, min(limits, default=1 << 62)

    def _tools(self, tools: Any) -> list[dict]:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise Refused("tools must be a list of OpenAI function schemas")
        if self._renders_tools is None:
            probe = [{"role": "user", "content": "?"}]
            with_tools = render_chat(self.tokenizer, probe, True, {**self.template_kwargs, "tools": tools})
            without = {k: v for k, v in self.template_kwargs.items() if k != "tools"}
            self._renders_tools = with_tools != render_chat(self.tokenizer, probe, True, without)
        if not self._renders_tools:
            raise Refused(
                "this tokenizer's chat template does not render tools, so the model would never see them; drop tools from the "
                "request or use a model whose template renders them"
            )
        return tools

    async def _sample(self, episode: Episode, ids: list[int], params: SamplingParams) -> Generation:
        async def run() -> Generation:
            record_into(episode.turns)  # this task's context only: the sample's record, checked after it
            return await self.engine.agenerate(ids, params)

        try:
            return await asyncio.create_task(run())
        except Exception as exc:
            episode.engine_error = exc  # re-raised by the sample: the engine's errors stop the run
            raise Refused(f"the rollout engine failed: {type(exc).__name__}: {exc}", status=500) from None

    def _content(self, gen: Generation) -> str:
        return self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)

    def _history_rewritten(self, episode: Episode) -> None:
        if episode.ended:
            return
        episode.ended = "history_rewritten"
        if not self._warned_rewrite:
            self._warned_rewrite = True
            log.warning(
                "policy endpoint: an agent sent messages that do not continue its trajectory (earlier turns changed, or a call "
                "from an earlier point); the trajectory ends before that call (finish_reason history_rewritten) and later calls "
                "are served but not trained (said once per rollout)"
            )


def _params(base: SamplingParams, body: dict) -> SamplingParams:
    """The sample's settings; a request may repeat them, not change them: the trainer scores tokens
    at the run's temperature. A greedy pass (validation) decodes greedily whatever it asks."""
    for key, have in (("temperature", base.temperature), ("top_p", base.top_p)):
        asked = body.get(key)
        if asked is None or (key == "temperature" and base.greedy):
            continue
        if isinstance(asked, bool) or not isinstance(asked, (int, float)) or not math.isclose(asked, have, rel_tol=1e-6):
            raise Refused(
                f"{key}={asked!r} differs from the run's {key}={have:g}; the trainer scores tokens at the run's settings, so leave "
                f"{key} unset (or give the run's value) and set sampling.{key} (validation.{key} for sampled validation) instead"
            )
    return base


def _limit_message(episode: Episode) -> str:
    if episode.ended == "max_assistant_turns":
        return f"this trajectory has had its {episode.max_turns} model turns (multi_turn.max_assistant_turns); end the episode"
    return f"this trajectory's token budget ({episode.budget} response tokens, multi_turn.max_response_tokens) is spent; end the episode"


def _completion(content: str, gen: Generation, prompt_tokens: int) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": gen.finish_reason}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(gen.token_ids), "total_tokens": prompt_tokens + len(gen.token_ids)},
    }


def _error(status: int, message: str) -> web.Response:
    kind = {401: "authentication_error", 500: "server_error"}.get(status, "invalid_request_error")
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": None}}, status=status)
