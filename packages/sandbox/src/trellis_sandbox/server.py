"""The HTTP server: ``POST /run_code`` (Sandbox Fusion's API), ``GET /v1/ping`` and ``GET /stats``.

With a token (see ``auth``), every path but ``/v1/ping`` answers 401 to a request without it.

At most ``workers`` programs run at once, each in its own slot; up to ``queue_size`` more requests
wait, and past that the server answers 503 (a client retries those: nothing was run). Waiting requests
get a slot strictly in arrival order, so a request's wait is bounded by the ones ahead of it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
from dataclasses import dataclass

from aiohttp import web

from trellis_sandbox.api import SANDBOX_ERROR, RequestError, RunRequest, RunResponse
from trellis_sandbox.auth import OPEN_PATHS, refusal
from trellis_sandbox.runner import Runner

logger = logging.getLogger("trellis.sandbox")


@dataclass(frozen=True)
class ServerConfig:
    workers: int = 2
    queue_size: int = 256
    max_timeout_s: float = 60.0
    max_request_mb: int = 16
    token: str | None = None  # None: no authentication (loopback only, or --unsafe-no-token)


class FifoSlots:
    """Worker slots handed out in arrival order: a freed slot goes straight to the longest waiter.
    (An ``asyncio.Queue`` lets a newcomer take a freed slot before the woken waiter runs, and that waiter
    then queues again at the back: the tail latency grew with the load.)"""

    def __init__(self, n: int) -> None:
        self.free = collections.deque(range(n))
        self.waiters: collections.deque[asyncio.Future[int]] = collections.deque()

    def any_free(self) -> bool:
        return bool(self.free)

    async def acquire(self) -> int:
        if self.free and not self.waiters:
            return self.free.popleft()
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(waiter.result())  # handed a slot just as it was cancelled: pass it on
            elif waiter in self.waiters:  # a release may already have dropped it
                self.waiters.remove(waiter)
            raise

    def release(self, slot: int) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(slot)
                return
        self.free.append(slot)


class SandboxServer:
    def __init__(self, runner: Runner, config: ServerConfig) -> None:
        self.runner = runner
        self.config = config
        self.slots = FifoSlots(config.workers)
        self.waiting = 0
        self.running = 0
        self.counts: collections.Counter[str] = collections.Counter(requests=0, runs=0, rejected_busy=0)

    def app(self) -> web.Application:
        middlewares = [self.authenticate] if self.config.token is not None else []
        app = web.Application(client_max_size=self.config.max_request_mb << 20, middlewares=middlewares)
        app.router.add_post("/run_code", self.run_code)
        app.router.add_get("/v1/ping", self.ping)
        app.router.add_get("/stats", self.stats)
        return app

    @web.middleware
    async def authenticate(self, request: web.Request, handler) -> web.StreamResponse:
        reason = None if request.path in OPEN_PATHS else refusal(request.headers.get("Authorization"), self.config.token)
        if reason is not None:
            return self._refuse(401, reason, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    async def ping(self, request: web.Request) -> web.Response:
        return web.Response(text="pong")

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "isolation": self.runner.isolation.kind,
                "languages": sorted(self.runner.languages),
                "workers": self.config.workers,
                "running": self.running,
                "waiting": self.waiting,
                "work_root": str(self.runner.root),
                "uids": [self.runner.uid(s) for s in range(self.config.workers)] if self.runner.as_root else [],
                "leftovers_killed": self.runner.leftovers_killed,
                **dict(self.counts),
            }
        )

    async def run_code(self, request: web.Request) -> web.Response:
        self.counts["requests"] += 1
        try:
            body = await request.json(loads=json.loads)
        except web.HTTPRequestEntityTooLarge:
            return self._refuse(413, f"the request is larger than the server's limit of {self.config.max_request_mb} MB (--max-request-mb)")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return self._refuse(400, f"the body is not valid JSON ({exc}); send a JSON object with 'code' and 'language'")
        try:
            req = RunRequest.from_json(body, max_timeout=self.config.max_timeout_s)
            self.runner.check(req)
        except RequestError as exc:
            return self._refuse(400, str(exc))
        if not self.slots.any_free() and self.waiting >= self.config.queue_size:
            self.counts["rejected_busy"] += 1
            return web.json_response(
                {"status": SANDBOX_ERROR, "message": f"the server is busy: {self.waiting} requests are waiting (--queue-size)"},
                status=503,
                headers={"Retry-After": "1"},
            )
        self.waiting += 1
        try:
            slot = await self.slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            response = await self.runner.execute(req, slot)
        except RequestError as exc:
            return self._refuse(400, str(exc))
        except Exception as exc:  # the sandbox failed, not the program: say so, keep serving
            logger.exception("run failed inside the sandbox server")
            response = RunResponse(SANDBOX_ERROR, f"{type(exc).__name__}: {exc}")
        finally:
            self.running -= 1
            self.slots.release(slot)
        self.counts["runs"] += 1
        self.counts[f"status_{response.status}"] += 1
        return web.json_response(response.to_json())

    def _refuse(self, code: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
        self.counts[f"refused_{code}"] += 1
        return web.json_response({"status": SANDBOX_ERROR, "message": message}, status=code, headers=headers)
