"""The policy endpoint: OpenAI-compatible ``/v1/chat/completions`` and ``/v1/completions`` on
loopback in front of a rollout engine, for agents written against the ``openai`` client. Every call
is recorded per trajectory (the exact prompt ids, sampled ids and log-probs), and the calls that
continue one another become the sample's ``Trajectory``, token for token as sampled."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import math
import secrets
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from trellis import Generation, RolloutEngine, SamplingParams, ToolCallParser, Trajectory, encode_text, render_chat
from trellis.kit.multiturn import renders_tools
from trellis_algos import openai_api as wire
from trellis_algos.openai_api import Refused, canonical
from trellis_multiturn import ChatDeltas, record_into

log = logging.getLogger("trellis")

HEADER = "X-Trellis-Trajectory"  # the trajectory a request belongs to (or the body's ``user``)
MAX_BODY = 64 << 20  # long conversations: aiohttp's 1 MiB default is too small
LIMITS = ("max_assistant_turns", "max_response_tokens")  # episode ends after which every call is refused
CHAT_FIRST = (
    "the first call's messages must begin with the sample's prompt (sample.messages, as the chat template renders them, with "
    "tools=sample.tools if it has any), which is what the trajectory trains on; send sample.messages, then your own turns after them"
)
TEXT_FIRST = (
    "the first call's prompt must begin with the sample's prompt (sample.prompt_text, or its token ids sample.prompt_ids), "
    "which is what the trajectory trains on; send it, then your own text after it"
)
_SAID: set[str] = set()  # warnings given once per process (one run)


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
    then every token appended) and as text; a request whose rendered messages (or prompt) start
    with ``chain_text`` continues the trajectory with the ids of the rest. ``history``: the chat
    messages of the last call and its reply (``canonical``; None before a chat call and after a
    completions call); a chat request that repeats them and adds messages continues it too, even
    where the template renders them differently from ``chain_text``.
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
    history: list[tuple] | None = None
    ended: str = ""
    closed: bool = False
    engine_error: BaseException | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    prompt_len: int = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_len = len(self.chain_ids)


class PolicyEndpoint:
    """``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` on 127.0.0.1 (a free port),
    for requests that carry this endpoint's bearer ``token`` and the id of a running sample's episode.

    A chat request's messages are rendered with the tokenizer's chat template (the request's
    ``tools`` too) and sampled by ``engine`` with the sample's settings; the reply's content is the
    decoded sample, or, when the request has tools and ``parser`` finds calls in it, the text
    outside them with the calls as ``tool_calls``. A completions request's prompt (text or ids) is
    sampled as given. Calls of one episode run one at a time.
    """

    def __init__(self, engine: RolloutEngine, tokenizer: Any, template_kwargs: dict[str, Any], parser: ToolCallParser) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs)
        self.parser = parser
        self.chat = ChatDeltas(tokenizer, template_kwargs)
        self.token = secrets.token_urlsafe(32)
        self.episodes: dict[str, Episode] = {}
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._renders_tools: bool | None = None
        self._warned_rewrite = False

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._text)
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
        return web.json_response({"object": "list", "data": [{"id": wire.MODEL, "object": "model", "owned_by": "trellis"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        return await self._handle(request, self._serve_chat)

    async def _text(self, request: web.Request) -> web.Response:
        return await self._handle(request, self._serve_text)

    async def _handle(self, request: web.Request, serve: Callable[[Episode, dict], Awaitable[dict[str, Any]]]) -> web.Response:
        if not self._authorized(request):
            return _error(401, "missing or wrong bearer token (Authorization: Bearer <the run's token>); use the client trellis gives the agent")
        try:
            body = await wire.request_body(request)
            episode = self._episode(request, body)
            async with episode.lock:
                if episode.closed:
                    raise Refused(f"trajectory {episode.id!r} has ended")
                return web.json_response(await serve(episode, body))
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

    async def _serve_chat(self, episode: Episode, body: dict) -> dict[str, Any]:
        req = wire.chat_request(body)
        params = _params(episode.params, body)
        kwargs = dict(self.template_kwargs)
        if req.tools is not None:
            kwargs["tools"] = self._tools(req.tools)
        try:
            text = render_chat(self.tokenizer, req.messages, True, kwargs)
        except Exception as exc:  # noqa: BLE001 - the template's own error is the agent's to read
            raise Refused(f"the chat template cannot render these messages: {type(exc).__name__}: {exc}") from None
        delta = self._chat_delta(episode, text, req, kwargs)
        ids, gen, trained = await self._step(episode, delta, lambda: encode_text(self.tokenizer, text), params, req.max_tokens, CHAT_FIRST)
        content, calls = self.parser.split(self._content(gen)) if req.tools else (self._content(gen), [])
        message = wire.assistant_message(content, calls)
        if trained:
            episode.chain_text = text + self._content(gen) + self.chat.sampled_closing(gen.token_ids)
            reply = {"role": "assistant", "content": content, "tool_calls": [{"function": {"name": c.name, "arguments": c.arguments}} for c in calls]}
            episode.history = [canonical(m) for m in req.messages] + [canonical(reply)]
        return wire.chat_reply(message, gen, len(ids))

    async def _serve_text(self, episode: Episode, body: dict) -> dict[str, Any]:
        req = wire.text_request(body, len(self.tokenizer))
        params = _params(episode.params, body)
        prompt = req.prompt
        if isinstance(prompt, str):
            given = prompt[len(episode.chain_text) :]
            delta = encode_text(self.tokenizer, given) if not episode.ended and prompt.startswith(episode.chain_text) else None
            ids, gen, trained = await self._step(episode, delta, lambda: encode_text(self.tokenizer, prompt), params, req.max_tokens, TEXT_FIRST)
        else:
            n = len(episode.chain_ids)
            delta = prompt[n:] if not episode.ended and prompt[:n] == episode.chain_ids else None
            given = self.tokenizer.decode(delta or [])
            ids, gen, trained = await self._step(episode, delta, lambda: list(prompt), params, req.max_tokens, TEXT_FIRST)
        text = self._content(gen)
        if trained:
            episode.chain_text += given + text + self.chat.sampled_closing(gen.token_ids)
            episode.history = None
        tokens = [self.tokenizer.decode([t]) for t in gen.token_ids] if req.logprobs else None
        return wire.text_reply(text, gen, len(ids), tokens)

    def _chat_delta(self, episode: Episode, text: str, req: wire.ChatRequest, kwargs: dict[str, Any]) -> list[int] | None:
        """The ids a chat request adds to the trajectory; None when it does not continue it."""
        if episode.ended:
            return None
        if text.startswith(episode.chain_text):
            return encode_text(self.tokenizer, text[len(episode.chain_text) :])
        known = episode.history
        if known is None or len(req.messages) <= len(known) or [canonical(m) for m in req.messages[: len(known)]] != known:
            return None
        # the same conversation, which the template renders differently (e.g. earlier reasoning
        # dropped): the new messages go after the sampled ids, as tool_agent appends them
        try:
            delta = ChatDeltas(self.tokenizer, kwargs).after_model(episode.calls[-1].generation.token_ids, req.messages[len(known) :])
        except ValueError:
            return None
        self._rerendered(episode, text)
        return delta

    async def _step(
        self, episode: Episode, delta: list[int] | None, rendered: Callable[[], list[int]], params: SamplingParams, max_tokens: int, first: str
    ) -> tuple[list[int], Generation, bool]:
        """Sample one call: after the trajectory plus ``delta`` (trained), or, when it does not
        continue the trajectory (``delta`` None), after the ``rendered`` ids (served, not trained).
        Returns the prompt ids, the generation and whether it was added to the trajectory."""
        traj = episode.trajectory
        if episode.ended in LIMITS:
            raise Refused(_limit_message(episode))
        if delta is not None:
            room = episode.budget - len(traj.response_ids) - len(delta)
            if traj.assistant_turns >= episode.max_turns:
                episode.ended = "max_assistant_turns"
            elif room <= 0:
                episode.ended = "max_response_tokens"
            if episode.ended:
                raise Refused(_limit_message(episode))
            ids = episode.chain_ids + delta
        else:
            if not traj.assistant_turns:
                raise Refused(first)
            self._history_rewritten(episode)
            ids = rendered()
            room = episode.prompt_len + episode.budget - len(ids)  # the trajectory's own context length
            if room <= 0:
                raise Refused(f"the request renders to {len(ids)} tokens, more than this trajectory's context")
        gen = await self._sample(episode, ids, dataclasses.replace(params, max_new_tokens=min(max_tokens, params.max_new_tokens, room)))
        trained = delta is not None and not episode.closed  # a call that outlived its agent (timeout) is not added
        if trained:
            traj.add_environment(delta)
            traj.add_model(gen)
            episode.chain_ids = ids + gen.token_ids
        episode.calls.append(Call(ids, gen, trained))
        return ids, gen, trained

    def _tools(self, tools: list[dict]) -> list[dict]:
        if self._renders_tools is None:
            self._renders_tools = renders_tools(self.tokenizer, self.template_kwargs, tools)
        if not self._renders_tools:
            raise Refused(
                "this tokenizer's chat template does not render tools, so the model would never see them; drop tools from the "
                "request or use a model whose template renders them"
            )
        rendered = self.template_kwargs.get("tools") or []
        if tools != rendered:
            raise Refused(
                f"tools differ from the {len(rendered)} tool schemas the sample's prompt was rendered with (sample.tools, from "
                "multi_turn.tools and multi_turn.environment), and the trajectory trains on that prompt; send tools=sample.tools"
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

    def _rerendered(self, episode: Episode, text: str) -> None:
        if "rerendered" in _SAID:
            return
        _SAID.add("rerendered")
        ids, chain = encode_text(self.tokenizer, text), episode.chain_ids
        at = next((i for i, (a, b) in enumerate(zip(ids, chain)) if a != b), min(len(ids), len(chain)))
        log.warning(
            "policy endpoint: trajectory %s: the chat template renders the conversation so far differently from the ids the "
            "endpoint sampled, first at token %d (response position %d: sampled %r, rendered %r), e.g. it drops earlier "
            "reasoning; the sampled ids are kept and the new messages appended after them (said once per run)",
            episode.id,
            at,
            at - episode.prompt_len,
            self.tokenizer.decode(chain[at : at + 8]),
            self.tokenizer.decode(ids[at : at + 8]),
        )

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


def _error(status: int, message: str) -> web.Response:
    return web.json_response(wire.error_body(status, message), status=status)
