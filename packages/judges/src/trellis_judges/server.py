"""The judge engine's server (``reward.judge``): ``/v1/chat/completions`` and ``/v1/models`` on
loopback in front of a frozen rollout engine, driven by one thread of its own (imported only by
runs that start a judge engine)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import threading
from collections.abc import Callable
from typing import Any

from aiohttp import web

from trellis import RolloutEngine, SamplingParams
from trellis.kit.serving import Refused, assistant_message, chat_reply, chat_request, encode_text, error_body, render_chat, request_body

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
    the tokens they read and wrote."""

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
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
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
            params = _sampling(body, min(req.max_tokens, self.max_new_tokens))
            try:
                text = render_chat(self.tokenizer, req.messages, True, self.template_kwargs)
            except Exception as exc:  # noqa: BLE001 - the template's own error is the caller's to read
                raise Refused(f"the judge's chat template cannot render these messages: {type(exc).__name__}: {exc}") from None
        except Refused as exc:
            return self._refuse(exc.status, str(exc))
        ids = encode_text(self.tokenizer, text)
        try:
            gen = await self.engine.agenerate(ids, params)
        except Exception as exc:  # noqa: BLE001 - answered as a server error, which the judge retries and then counts
            log.exception("judge engine failed on a request")
            return self._refuse(500, f"the judge engine failed: {type(exc).__name__}: {exc}")
        content = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        with self._lock:
            self._counts["requests"] += 1
            self._counts["prompt_tokens"] += len(ids)
            self._counts["completion_tokens"] += len(gen.token_ids)
        return web.json_response(chat_reply(assistant_message(content, []), gen, len(ids), self.name))

    def _authorized(self, request: web.Request) -> bool:
        return hmac.compare_digest(request.headers.get("Authorization", "").encode(), f"Bearer {self.token}".encode())

    def _refuse(self, status: int, message: str) -> web.Response:
        with self._lock:
            self._counts["refused"] += 1
        return web.json_response(error_body(status, message), status=status)


def _sampling(body: dict, max_new_tokens: int) -> SamplingParams:
    """The request's ``temperature`` (0 to 2, OpenAI's default 1; 0 is greedy) and ``top_p`` (above 0, at most 1)."""
    temperature, top_p = body.get("temperature", 1.0), body.get("top_p", 1.0)
    temperature, top_p = 1.0 if temperature is None else temperature, 1.0 if top_p is None else top_p
    for key, value, ok in (("temperature", temperature, "0 to 2"), ("top_p", top_p, "above 0, at most 1")):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise Refused(f"{key}={value!r} is not a number; give one {ok}")
    if not 0 <= temperature <= 2 or not 0 < top_p <= 1:
        raise Refused(f"temperature={temperature!r}, top_p={top_p!r}; give a temperature from 0 to 2 and a top_p above 0, at most 1")
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=float(temperature), top_p=float(top_p), greedy=temperature == 0)
