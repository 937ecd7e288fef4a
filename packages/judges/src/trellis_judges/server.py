"""The judge engine's server (``reward.judge``): ``/v1/chat/completions``, ``/v1/models`` and, for
reward functions written for verl's reward router, SGLang's native ``/generate``, on loopback in
front of a frozen rollout engine driven by one thread of its own (imported only by runs that start
a judge engine)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import threading
from collections.abc import Callable
from typing import Any

from aiohttp import web

from trellis import RolloutEngine, SamplingParams, encode_text, render_chat
from trellis_algos.openai_api import Refused, assistant_message, chat_reply, chat_request, error_body, request_body

log = logging.getLogger("trellis")
COUNTS = ("requests", "refused", "prompt_tokens", "completion_tokens")  # the server's figures, logged as judge/<name>


class JudgeServer:
    """``/v1/chat/completions`` and ``/v1/models`` on 127.0.0.1 (a free port) in front of the engine
    ``make_engine`` builds, for requests that carry this server's bearer ``token``.

    A request's messages are rendered with ``tokenizer``'s chat template (``template_kwargs`` too),
    sampled at the request's ``temperature`` (0: greedy; default 1) and ``top_p``, for at most
    ``max_new_tokens`` tokens (fewer when its ``max_tokens`` asks), and the decoded sample is the
    reply's content. Tools and streaming are refused. It serves one model, listed as ``name``; a
    request naming another is refused. ``counts()``: the requests served and refused so far and
    the tokens they read and wrote.

    ``address`` is what verl calls the reward router's address (``host:port``, here with the token
    as a path prefix: ``127.0.0.1:PORT/TOKEN``): a function that posts to ``http://{address}/generate``
    or ``http://{address}/v1/chat/completions``, as verl's GenRM functions do, reaches this server
    unchanged, without a header, and no other local user can. ``/generate`` takes SGLang's request
    (``input_ids`` or ``text``, ``sampling_params``) and answers ``text``, ``output_ids`` and
    ``meta_info`` (prompt and completion tokens, ``finish_reason.type`` ``stop`` or ``length``)."""

    def __init__(
        self, make_engine: Callable[[], RolloutEngine], tokenizer: Any, name: str, max_new_tokens: int, template_kwargs: dict[str, Any]
    ) -> None:
        self.make_engine = make_engine
        self.tokenizer = tokenizer
        self.name = name
        self.max_new_tokens = max_new_tokens
        self.template_kwargs = dict(template_kwargs)
        self.token = secrets.token_urlsafe(32)
        self.url = ""
        self.address = ""
        self.engine: RolloutEngine | None = None
        self._counts = dict.fromkeys(COUNTS, 0)
        self._lock = threading.Lock()  # counts are read from the reward's threads
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Build the engine and serve it; returns once it answers, or raises the build's error."""
        self._thread = threading.Thread(target=self._main, name="trellis-judge", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            self._thread = None
            raise self._error

    def close(self) -> None:
        """Stop serving and close the engine (requests in flight finish first); twice is harmless."""
        if self._thread is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._thread = None

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    # -- the serving thread -------------------------------------------------------------------------
    def _main(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        runner = None
        try:
            try:
                self.engine = self.make_engine()
                runner = loop.run_until_complete(self._serve())
            except BaseException as exc:  # noqa: BLE001 - handed to start(), which raises it in the caller
                self._error = exc
                return
            finally:
                self._ready.set()
            loop.run_forever()
        finally:
            if runner is not None:
                loop.run_until_complete(runner.cleanup())
            if self.engine is not None:
                self.engine.close()
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

    async def _serve(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post(f"/{self.token}/v1/chat/completions", self._chat)  # the router address's routes: the path is the token
        app.router.add_post(f"/{self.token}/generate", self._generate)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        self.url, self.address = f"http://127.0.0.1:{port}", f"127.0.0.1:{port}/{self.token}"
        return runner

    # -- requests ---------------------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._refuse(401, "missing or wrong bearer token (Authorization: Bearer <the run's token>)")
        return web.json_response({"object": "list", "data": [{"id": self.name, "object": "model", "owned_by": "trellis"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._refuse(401, "missing or wrong bearer token (Authorization: Bearer <the run's token>)")
        try:
            body = await request_body(request)
            req = chat_request(body)
            if req.tools is not None:
                raise Refused("the judge serves no tools; send the messages alone")
            if body.get("model") not in (None, self.name):
                raise Refused(f"model {body['model']!r} is not served here; this server serves {self.name!r}", status=404)
            params = _sampling(body.get("temperature"), body.get("top_p"), min(req.max_tokens, self.max_new_tokens))
            try:
                text = render_chat(self.tokenizer, req.messages, True, self.template_kwargs)
            except Exception as exc:  # noqa: BLE001 - the template's own error is the caller's to read
                raise Refused(f"the judge's chat template cannot render these messages: {type(exc).__name__}: {exc}") from None
            ids = encode_text(self.tokenizer, text)
            gen = await self._run(ids, params)
        except Refused as exc:
            return self._refuse(exc.status, str(exc))
        content = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        return web.json_response(chat_reply(assistant_message(content, []), gen, len(ids), self.name))

    async def _generate(self, request: web.Request) -> web.Response:
        """SGLang's native ``/generate``, one prompt: what a verl GenRM function posts to the reward router."""
        try:
            body = await request_body(request)
            unknown = sorted(set(body) - {"input_ids", "text", "sampling_params"})
            if unknown:
                raise Refused(f"/generate takes input_ids or text and sampling_params; {', '.join(unknown)} is not served here")
            ids = self._prompt_ids(body)
            asked = body.get("sampling_params") or {}
            if not isinstance(asked, dict):
                raise Refused(f"sampling_params={asked!r} is not an object")
            wrong = sorted(set(asked) - NATIVE_SAMPLING)
            if wrong:
                raise Refused(f"sampling_params {', '.join(wrong)} is not served here; it takes {', '.join(sorted(NATIVE_SAMPLING))}")
            longest = asked.get("max_new_tokens", self.max_new_tokens)
            if isinstance(longest, bool) or not isinstance(longest, int) or longest < 1:
                raise Refused(f"sampling_params.max_new_tokens={longest!r}; give a whole number >= 1")
            params = _sampling(asked.get("temperature"), asked.get("top_p"), min(longest, self.max_new_tokens))
            gen = await self._run(ids, params)
        except Refused as exc:
            return self._refuse(exc.status, str(exc))
        text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=asked.get("skip_special_tokens", True) is not False)
        meta = {"prompt_tokens": len(ids), "completion_tokens": len(gen.token_ids), "finish_reason": {"type": gen.finish_reason}}
        return web.json_response({"text": text, "output_ids": list(gen.token_ids), "meta_info": meta})

    def _prompt_ids(self, body: dict) -> list[int]:
        if ("input_ids" in body) == ("text" in body):
            raise Refused("give one prompt as input_ids (a list of token ids) or as text, not both and not neither")
        if "text" in body:
            if not isinstance(body["text"], str):
                raise Refused(f"text={body['text']!r} is not a string (one prompt is served at a time)")
            return encode_text(self.tokenizer, body["text"])
        ids = body["input_ids"]
        vocab = len(self.tokenizer)
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids):
            raise Refused(f"input_ids must be a non-empty list of token ids below the vocabulary's {vocab} (one prompt at a time)")
        return ids

    async def _run(self, ids: list[int], params: SamplingParams) -> Any:
        """One generation on the engine, counted; an engine failure is a 500 (the judge retries, then counts it)."""
        try:
            gen = await self.engine.agenerate(ids, params)
        except Exception as exc:  # noqa: BLE001 - answered as a server error
            log.exception("judge engine failed on a request")
            raise Refused(f"the judge engine failed: {type(exc).__name__}: {exc}", status=500) from None
        with self._lock:
            self._counts["requests"] += 1
            self._counts["prompt_tokens"] += len(ids)
            self._counts["completion_tokens"] += len(gen.token_ids)
        return gen

    def _authorized(self, request: web.Request) -> bool:
        """The bearer token in the header, or the path under the token (``address``'s routes)."""
        if request.path.startswith(f"/{self.token}/"):
            return True
        return hmac.compare_digest(request.headers.get("Authorization", "").encode(), f"Bearer {self.token}".encode())

    def _refuse(self, status: int, message: str) -> web.Response:
        with self._lock:
            self._counts["refused"] += 1
        return web.json_response(error_body(status, message), status=status)


# SGLang's sampling params /generate serves (skip_special_tokens: how the reply's text is decoded)
NATIVE_SAMPLING = frozenset({"max_new_tokens", "temperature", "top_p", "skip_special_tokens"})


def _sampling(temperature: Any, top_p: Any, max_new_tokens: int) -> SamplingParams:
    """A request's ``temperature`` (0 to 2, default 1; 0 is greedy) and ``top_p`` (above 0, at most 1; default 1)."""
    temperature, top_p = 1.0 if temperature is None else temperature, 1.0 if top_p is None else top_p
    for key, value, ok in (("temperature", temperature, "0 to 2"), ("top_p", top_p, "above 0, at most 1")):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise Refused(f"{key}={value!r} is not a number; give one {ok}")
    if not 0 <= temperature <= 2 or not 0 < top_p <= 1:
        raise Refused(f"temperature={temperature!r}, top_p={top_p!r}; give a temperature from 0 to 2 and a top_p above 0, at most 1")
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=float(temperature), top_p=float(top_p), greedy=temperature == 0)
