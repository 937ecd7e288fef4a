"""The server's worker slots go to waiting requests strictly in arrival order."""

from __future__ import annotations

import asyncio

from trellis_sandbox.server import FifoSlots


def test_a_freed_slot_goes_to_the_longest_waiter_not_to_a_newcomer():
    async def main() -> list[str]:
        slots = FifoSlots(1)
        held = await slots.acquire()
        order: list[str] = []

        async def request(name: str) -> None:
            slot = await slots.acquire()
            order.append(name)
            slots.release(slot)

        first, second = asyncio.create_task(request("first")), asyncio.create_task(request("second"))
        await asyncio.sleep(0)  # both wait now
        slots.release(held)
        newcomer = asyncio.create_task(request("newcomer"))  # arrives before "first" has resumed
        await asyncio.gather(first, second, newcomer)
        return order

    assert asyncio.run(main()) == ["first", "second", "newcomer"]


def test_a_cancelled_waiter_neither_keeps_a_slot_nor_blocks_the_queue():
    async def main() -> tuple[int, int]:
        slots = FifoSlots(1)
        held = await slots.acquire()
        gone = asyncio.create_task(slots.acquire())
        await asyncio.sleep(0)
        slots.release(held)  # handed to `gone`...
        gone.cancel()  # ...which is cancelled before it resumes: the slot must come back
        await asyncio.gather(gone, return_exceptions=True)
        again = await asyncio.wait_for(slots.acquire(), 1)
        waiting = asyncio.create_task(slots.acquire())
        await asyncio.sleep(0)
        waiting.cancel()  # cancelled while still queued: a later request must not queue behind it
        await asyncio.gather(waiting, return_exceptions=True)
        slots.release(again)
        return again, await asyncio.wait_for(slots.acquire(), 1)

    assert asyncio.run(main()) == (0, 0)
