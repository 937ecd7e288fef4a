"""Accepted requests and their results: the Tinker API answers every long request with a future id,
the client polls ``retrieve_future`` for it; each training client's requests run in ``seq_id`` order;
one worker thread runs all the work, so requests of different clients interleave in arrival order."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from trellis_service.errors import QueueFull, UserError

log = logging.getLogger("trellis")
KEEP_RETRIEVED = 1024  # finished results kept after retrieval (a client may ask again after a lost reply)

Result = dict[str, Any] | bytes  # a JSON answer, or a protobuf one


class Lane:
    """One training client's requests, released in ``seq_id`` order (chunks of one call may arrive in
    any order; the SDK numbers every request of a client from 1 in submission order)."""

    def __init__(self, model_id: str, first: int) -> None:
        self.model_id, self.next, self.waiting = model_id, first, {}

    def admit(self, seq_id: int, job: tuple[str, Callable[[], Result]]) -> list[tuple[str, Callable[[], Result]]]:
        """The ``(request id, job)`` pairs now runnable in order, after ``job`` joins the lane."""
        if seq_id < self.next or seq_id in self.waiting:
            raise UserError(
                f"seq_id {seq_id} for model {self.model_id!r} is out of order: it was used already (the next expected is {self.next}); "
                "a training client numbers its requests from 1 in submission order"
            )
        self.waiting[seq_id] = job
        ready = []
        while self.next in self.waiting:
            ready.append(self.waiting.pop(self.next))
            self.next += 1
        return ready


class Futures:
    """Request ids to results, and the one worker thread that computes them."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self.pending: dict[str, asyncio.Future] = {}
        self.finished: OrderedDict[str, tuple[bool, Any]] = OrderedDict()
        self.queued = 0  # accepted and not finished, waiting in lanes included
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trellis-serve")

    def reserve(self) -> str:
        """A new request id, refused while the queue is full."""
        if self.queued >= self.max_queue:
            raise QueueFull(f"the server holds {self.queued} requests, its --max-queue; retry later")
        self.queued += 1
        request_id = uuid.uuid4().hex
        self.pending[request_id] = asyncio.get_running_loop().create_future()
        return request_id

    def release(self, request_id: str) -> None:
        """Undo :meth:`reserve` for a request refused before it was queued."""
        self.queued -= 1
        self.pending.pop(request_id).cancel()

    def run(self, request_id: str, job: Callable[[], Result]) -> None:
        """Run ``job`` on the worker thread after the jobs before it; its result or error answers ``request_id``."""
        loop = asyncio.get_running_loop()

        def done(outcome) -> None:
            self.queued -= 1
            future = self.pending.pop(request_id)
            future.set_result(None)
            self.finished[request_id] = outcome
            while len(self.finished) > KEEP_RETRIEVED + len(self.pending):
                self.finished.popitem(last=False)

        def work() -> None:
            try:
                outcome = (True, job())
            except Exception as exc:  # noqa: BLE001 - every failure answers its request, the server goes on
                if not isinstance(exc, UserError):
                    log.exception("request %s failed", request_id)
                outcome = (False, exc)
            loop.call_soon_threadsafe(done, outcome)

        self.worker.submit(work)

    async def wait(self, request_id: str, timeout: float) -> tuple[bool, Any] | None:
        """The outcome ``(ok, result or error)``, or None if it is not ready within ``timeout`` seconds."""
        if request_id in self.pending:
            try:
                await asyncio.wait_for(asyncio.shield(self.pending[request_id]), timeout)
            except TimeoutError:
                return None
        if request_id not in self.finished:
            raise UserError(f"request_id {request_id!r} is unknown to this server (never accepted, or retrieved long ago)")
        return self.finished[request_id]
