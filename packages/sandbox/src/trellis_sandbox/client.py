"""Async client for a Sandbox Fusion ``/run_code`` endpoint, shared by everything in the process.

``get_client(url)`` returns the one client for that URL. It runs its own event loop in a daemon
thread and holds there the run-wide limit on requests in flight (an ``asyncio.Semaphore``) and the
HTTP connection pool, so rewards scored from a thread pool and tools called from the agent loop's
event loop share one limit. Call ``await client.run(req)`` from any event loop or
``client.run_sync(req)`` from any thread.

Retries, with exponential backoff, only on infrastructure errors (connection refused or dropped, HTTP
5xx: nothing was judged); a program that failed, timed out or crashed is never run again. The HTTP
timeout is ``compile_timeout + run_timeout + slack_s``. A server that cannot be reached is logged
once per client, naming the URL; its requests come back as ``SandboxError`` responses, and while it
stays down each request tries once instead of retrying. The server's token, when it has one, comes
from ``TRELLIS_SANDBOX_TOKEN`` (never from a config: it would be saved with the run); a server that
refuses it (HTTP 401) is logged once too, with the reason.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import threading
from typing import Any

import aiohttp

from trellis_sandbox.api import SANDBOX_ERROR, RunRequest, RunResponse
from trellis_sandbox.auth import TOKEN_ENV

logger = logging.getLogger("trellis.sandbox")

_CLIENTS: dict[str, SandboxClient] = {}
_CLIENTS_LOCK = threading.Lock()


def normalize_url(url: str) -> str:
    """``http://host:port`` from that or from the full ``.../run_code`` address (verl's form)."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"sandbox url={url!r}; give the server's address, e.g. http://127.0.0.1:8080 (start one with `trellis-sandbox serve`)")
    url = url.rstrip("/")
    return url[: -len("/run_code")] if url.endswith("/run_code") else url


def get_client(url: str, max_concurrency: int = 32, **kwargs: Any) -> SandboxClient:
    """The process's client for ``url``; the first call fixes its ``max_concurrency`` (the run-wide limit)."""
    base = normalize_url(url)
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(base)
        if client is None:
            client = _CLIENTS[base] = SandboxClient(base, max_concurrency, **kwargs)
        elif client.max_concurrency != max_concurrency:
            raise ValueError(
                f"the sandbox client for {base} already allows {client.max_concurrency} requests at once, not {max_concurrency}: "
                "one limit holds for the whole run; give the reward and the tool the same max_concurrency"
            )
        return client


class SandboxClient:
    def __init__(
        self, url: str, max_concurrency: int = 32, *, token: str | None = None, retries: int = 4, backoff_s: float = 0.5, slack_s: float = 30.0
    ) -> None:
        """token: the server's bearer token (default: ``TRELLIS_SANDBOX_TOKEN``; none sent when neither is set)."""
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency}; give at least 1")
        self.url = normalize_url(url)
        self.max_concurrency = max_concurrency
        token = token if token is not None else os.environ.get(TOKEN_ENV)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.retries, self.backoff_s, self.slack_s = retries, backoff_s, slack_s
        self.requests = 0  # HTTP requests sent, retries included
        self._down = False
        self._reported: set[str] = set()  # the kinds of failure already logged: "down", "refused"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve_loop, name=f"sandbox-client {self.url}", daemon=True)
        self._thread.start()
        self._ready.wait()
        atexit.register(self.close)

    def _serve_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._open())
        finally:
            self._ready.set()
        self._loop.run_forever()

    async def _open(self) -> None:
        self._semaphore = asyncio.Semaphore(self.max_concurrency)
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.max_concurrency), headers=self._headers)

    async def run(self, req: RunRequest) -> RunResponse:
        """Runs ``req`` on the server; callable from any event loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._run(req), self._loop))

    def run_sync(self, req: RunRequest) -> RunResponse:
        """Runs ``req`` on the server; blocks the calling thread (not the client's loop)."""
        return asyncio.run_coroutine_threadsafe(self._run(req), self._loop).result()

    def run_many_sync(self, reqs: list[RunRequest]) -> list[RunResponse]:
        """Runs ``reqs`` concurrently (within the limit); the responses in order."""
        futures = [asyncio.run_coroutine_threadsafe(self._run(r), self._loop) for r in reqs]
        return [f.result() for f in futures]

    def close(self) -> None:
        if self._loop.is_closed() or not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._session.close(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    async def _run(self, req: RunRequest) -> RunResponse:
        timeout = aiohttp.ClientTimeout(total=req.compile_timeout + req.run_timeout + self.slack_s)
        body = req.to_json()
        async with self._semaphore:
            attempts = 1 if self._down else self.retries + 1
            for attempt in range(attempts):
                if attempt:
                    await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
                self.requests += 1
                try:
                    async with self._session.post(f"{self.url}/run_code", json=body, timeout=timeout) as resp:
                        if resp.status >= 500:
                            problem = f"HTTP {resp.status} from {self.url}: {(await resp.text())[:300]}"
                            continue
                        payload = await resp.json(content_type=None)
                        self._down = False
                        if resp.status != 200:  # the server refused the request: retrying cannot help
                            problem = f"HTTP {resp.status} from {self.url}: {payload.get('message', payload)}"
                            if resp.status == 401:  # every request will be refused: say so once, loudly
                                self._report("refused", "%s; its requests score as sandbox errors", problem)
                            return RunResponse(SANDBOX_ERROR, problem)
                        return RunResponse.from_json(payload)
                except aiohttp.ClientConnectionError as exc:
                    problem = f"cannot reach the sandbox at {self.url}: {type(exc).__name__}: {exc}"
                except asyncio.TimeoutError:
                    return RunResponse(SANDBOX_ERROR, f"no answer from the sandbox at {self.url} within {timeout.total:g} s")
            self._down = True
            self._report("down", "%s (after %d attempts); its requests fail (reward/errors) until it answers", problem, attempts)
            return RunResponse(SANDBOX_ERROR, problem)

    def _report(self, kind: str, message: str, *args: Any) -> None:
        """Logs ``message`` the first time this kind of failure happens on this client."""
        if kind not in self._reported:
            self._reported.add(kind)
            logger.error(message, *args)
