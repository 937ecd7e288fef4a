"""``trellis serve``'s HTTP layer: the Tinker API's routes (``/api/v1/...``) as the tinker SDK 0.38
sends them, on aiohttp. Every route but the health check needs the server's token as the
``X-API-Key`` header (the SDK's API key); a refusal answers 400 with ``{"error", "category"}``."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from pydantic import ValidationError

from trellis_service.errors import QueueFull, UserError
from trellis_service.service import Service
from trellis_service.wire import PROTOBUF, decode_forward_backward, read_body

log = logging.getLogger("trellis")
POLL_SECONDS = 20.0  # retrieve_future holds a request this long before answering try_again (the SDK polls again at once)

# what the SDK's client config handshake gets: no JWT exchange (the token is the key), zstd-compressed
# forward/backward bodies, the httpx transport (loopback needs nothing more), per-request futures
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "proto_compress_fwdbwd": True,
    "use_pyqwest_transport": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}


def refusal(exc: Exception, status: int = 400) -> web.Response:
    category = "user" if isinstance(exc, UserError | ValidationError) else "server"
    return web.json_response({"error": str(exc), "category": category}, status=status)


def make_app(service: Service, token: str) -> web.Application:
    """The aiohttp application serving ``service`` to clients that present ``token``."""

    @web.middleware
    async def guard(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.path != "/api/v1/healthz" and not hmac.compare_digest(request.headers.get("X-API-Key", ""), token):
            return web.json_response({"error": "missing or wrong X-API-Key: give the server's TRELLIS_SERVE_TOKEN as the Tinker API key"}, status=401)
        try:
            return await handler(request)
        except (UserError, ValidationError) as exc:
            return refusal(exc)
        except QueueFull as exc:
            return refusal(exc, status=429)

    async def body(request: web.Request) -> dict:
        try:
            return json.loads(await request.read() or b"{}")
        except json.JSONDecodeError as exc:
            raise UserError(f"the request body is not JSON: {exc}") from exc

    def future(request_id: str, **extra) -> web.Response:
        return web.json_response({"request_id": request_id, **extra})

    def answer(call: Callable[[dict], dict]):
        async def handler(request: web.Request) -> web.Response:
            return web.json_response(call(await body(request)))

        return handler

    def queued(call: Callable[[dict], str]):
        async def handler(request: web.Request) -> web.Response:
            return future(call(await body(request)))

        return handler

    async def forward_backward(request: web.Request) -> web.Response:
        if PROTOBUF not in request.headers.get("Content-Type", ""):
            raise UserError(f"forward_backward takes a {PROTOBUF} body (as the tinker SDK sends it)")
        decoded = decode_forward_backward(read_body(await request.read(), request.headers.get("Content-Encoding")))
        return future(service.forward_backward(decoded), model_id=decoded.model_id)

    async def sample(request: web.Request) -> web.Response:
        request_id, sequence_ids = service.sample(await body(request))
        return future(request_id, sample_sequence_ids=sequence_ids)

    async def retrieve(request: web.Request) -> web.Response:
        request_id = (await body(request)).get("request_id", "")
        outcome = await service.futures.wait(request_id, POLL_SECONDS)
        if outcome is None:
            return web.json_response({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        ok, result = outcome
        if not ok:
            return refusal(result, status=200)  # a failed request is an answer, not a transport error
        if isinstance(result, bytes):
            return web.Response(body=result, content_type=PROTOBUF)
        return web.json_response(result)

    async def capabilities(_: web.Request) -> web.Response:
        return web.json_response(service.capabilities())

    async def sampler(request: web.Request) -> web.Response:
        return web.json_response(service.sampler_info(request.match_info["sampler_id"]))

    async def heartbeat(request: web.Request) -> web.Response:
        if not service.live((await body(request)).get("session_id", "")):
            return web.json_response({"error": "the session is finished or unknown"}, status=410)  # the SDK stops its heartbeat
        return web.json_response({"type": "session_heartbeat"})

    async def finish(request: web.Request) -> web.Response:
        service.finish_session(request.match_info["session_id"])
        return web.json_response({})

    routes = {
        "/client/config": answer(lambda _: CLIENT_CONFIG),
        "/client/dynamic_config": answer(lambda _: {}),
        "/create_session": answer(service.create_session),
        "/session_heartbeat": heartbeat,
        "/telemetry": answer(lambda _: {"status": "accepted"}),
        "/sessions/{session_id}/finish": finish,
        "/create_model": queued(service.create_model),
        "/get_info": answer(service.get_info),
        "/forward_backward": forward_backward,
        "/optim_step": queued(service.optim_step),
        "/save_weights": queued(service.save_weights),
        "/load_weights": queued(service.load_weights),
        "/save_weights_for_sampler": queued(service.save_for_sampler),
        "/create_sampling_session": answer(service.create_sampling_session),
        "/asample": sample,
        "/retrieve_future": retrieve,
    }
    # bodies are read as sent: the zstd of forward/backward requests is undone in wire.read_body
    app = web.Application(middlewares=[guard], client_max_size=1 << 30, handler_args={"auto_decompress": False})
    for path, handler in routes.items():
        app.router.add_post("/api/v1" + path, handler)
    app.on_cleanup.append(lambda _: asyncio.to_thread(service.close))
    app.router.add_get("/api/v1/healthz", lambda _: web.json_response({"status": "ok"}))
    app.router.add_get("/api/v1/get_server_capabilities", capabilities)
    app.router.add_get("/api/v1/samplers/{sampler_id}", sampler)
    return app
