"""The judge engine (``reward.judge``): a frozen rollout engine the ``rl`` recipe starts itself, served
on loopback as OpenAI-compatible ``/v1/chat/completions`` (the policy endpoint's wire format,
``trellis.multiturn.openai_api``) to the ``judge`` rewards that name no url.

The engine is built and driven by one thread of its own, which runs the server's event loop (an
engine is driven from the thread that built it: vLLM's rule); the reward's threads call the server
over HTTP like any judge server. It lives in the driver process for the whole run, never sleeps and
never takes a weight sync.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer

from trellis.batch import Batch
from trellis.config import ConfigError, instantiate_options, validate
from trellis.data import encode_text, render_chat
from trellis.interfaces.rollout import RolloutEngine, RolloutSpec, SamplingParams
from trellis.multiturn.openai_api import Refused, assistant_message, chat_reply, chat_request, error_body, request_body
from trellis.rewards import JudgeEngineConfig, RewardConfig, RewardResult, judges, served_judges

log = logging.getLogger("trellis")

COUNTS = ("requests", "refused", "prompt_tokens", "completion_tokens")  # the server's figures, logged as judge/<name>


def check_judge_engine(cfg: DictConfig, registry: Any) -> None:
    """``reward.judge`` of an ``rl`` config checked before any model is built: an engine with a
    judge to serve, a model folder with a chat template, the engine's options. Raises a
    ``ConfigError`` naming the key and the fix."""
    reward = instantiate_options(cfg.reward, RewardConfig)
    spec = reward.judge
    if not spec.engine:
        if spec.model or spec.options:
            raise ConfigError(
                f"config key 'reward.judge.model' is {spec.model!r} (options {spec.options}) but reward.judge.engine is not set; "
                "set reward.judge.engine to a rollout engine (hf, vllm, sglang) to serve it, or unset reward.judge"
            )
        return
    used, served = judges(reward), served_judges(reward)
    if not used:
        raise ConfigError(
            f"config key 'reward.judge.engine' is {spec.engine!r}, but no judge reward is in use (reward.name={reward.name!r}, "
            f"terms {[t.name for t in reward.terms]}); score with reward.name=judge or a term {{name: judge}}, or unset reward.judge.engine"
        )
    if not served:
        urls = ", ".join(f"{key}.kwargs.url={source.kwargs['url']!r}" for key, source in used)
        raise ConfigError(
            f"config key 'reward.judge.engine' is {spec.engine!r}, but every judge names its own server ({urls}), so the engine "
            "would serve none; drop kwargs.url from the judge the engine should serve, or unset reward.judge.engine"
        )
    for key, source in served:
        asked = (source.kwargs or {}).get("model")
        if asked is not None and asked != spec.model:
            raise ConfigError(
                f"config key '{key}.kwargs.model' is {asked!r}, but this judge is served by reward.judge.engine, whose model is "
                f"reward.judge.model={spec.model!r}; drop {key}.kwargs.model"
            )
    if not spec.model or not (Path(spec.model) / "config.json").is_file():
        raise ConfigError(
            f"config key 'reward.judge.model' is {spec.model!r}, which is not a Hugging Face model folder (no config.json); "
            "give the judge model's folder"
        )
    engine_options(spec, registry)
    if not getattr(AutoTokenizer.from_pretrained(spec.model), "chat_template", None):
        raise ConfigError(
            f"config key 'reward.judge.model' is {spec.model!r}, whose tokenizer has no chat template, which the judge's "
            "messages are rendered with; choose an instruction-tuned model folder with chat_template.jinja"
        )


def engine_options(spec: JudgeEngineConfig, registry: Any) -> Any:
    """The factory of ``spec.engine`` and its options instance from ``reward.judge.options``
    (checked as under ``rollout``; None when the engine declares no options)."""
    entry = registry.get("rollout", spec.engine)
    if entry.options is None:
        if spec.options:
            raise ConfigError(f"config key 'reward.judge.options': rollout {spec.engine!r} takes no options, got {sorted(spec.options)}")
        return entry.obj, None
    checked = validate(OmegaConf.create(dict(spec.options)), entry.options, registry, "reward.judge.options.")
    return entry.obj, instantiate_options(checked, entry.options)


def start_judge(spec: JudgeEngineConfig, registry: Any, seed: int) -> JudgeServer:
    """The judge engine ``spec`` names, built and served (see :class:`JudgeServer`)."""
    make_engine, options = engine_options(spec, registry)
    tokenizer = AutoTokenizer.from_pretrained(spec.model)
    build = RolloutSpec(spec.model, options, tokenizer, seed=seed)
    server = JudgeServer(lambda: make_engine(build), tokenizer, spec.model, spec.max_new_tokens, spec.chat_template_kwargs)
    server.start()
    log.info("judge engine %r serving %s at %s", spec.engine, spec.model, server.url)
    return server


def with_served_judges(cfg: RewardConfig, server: JudgeServer) -> RewardConfig:
    """``cfg`` with every judge that names no url sent to ``server`` (its url, bearer token and model name)."""
    served = {id(source) for _, source in served_judges(cfg)}
    extra = {"url": server.url, "api_key": server.token, "model": server.name}

    def point(source: Any) -> Any:
        return dataclasses.replace(source, kwargs={**source.kwargs, **extra}) if id(source) in served else source

    return dataclasses.replace(point(cfg), terms=[point(t) for t in cfg.terms])


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


class JudgedReward:
    """A run's reward whose judges ``server`` serves: ``reward.score(batch)`` plus the server's
    figures while the batch was scored, ``judge/<count>`` (:data:`COUNTS`: requests served,
    requests refused, prompt and completion tokens)."""

    def __init__(self, reward: Any, server: JudgeServer) -> None:
        self.reward, self.server = reward, server

    def score(self, batch: Batch) -> RewardResult:
        before = self.server.counts()
        result = self.reward.score(batch)
        after = self.server.counts()
        return result._replace(metrics={**result.metrics, **{f"judge/{k}": float(after[k] - before[k]) for k in COUNTS}})
