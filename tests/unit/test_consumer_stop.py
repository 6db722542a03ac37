"""Stopping the Kafka consumer (persistence/consumer.py ``stop_consumer``).

aiokafka's fetcher, closing, cancels a fetch in flight and awaits it: that
cancel came out of ``stop()`` when Kafka had just restarted (CI, the test of
finding 29). The client here does the same in its ``stop()``; the caller's own
cancel must still go through.
"""

from __future__ import annotations

import asyncio

import pytest

from persistence.consumer import stop_consumer


class _Fetching:
    """Stops as aiokafka's fetcher does: cancels its fetch in flight, awaits it."""

    def __init__(self, hold: asyncio.Event | None = None) -> None:
        self.hold = hold
        self.stopped = False

    async def stop(self) -> None:
        fetch = asyncio.ensure_future(asyncio.sleep(60))
        await asyncio.sleep(0)
        fetch.cancel()
        if self.hold is not None:
            await self.hold.wait()  # the caller may be cancelled here
        await fetch  # raises the fetch's cancel
        self.stopped = True


async def test_a_fetch_cancelled_by_stop_does_not_escape() -> None:
    await stop_consumer(_Fetching())  # type: ignore[arg-type]


async def test_a_cancel_of_the_caller_still_goes_through() -> None:
    hold = asyncio.Event()
    stopping = asyncio.ensure_future(stop_consumer(_Fetching(hold)))  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping
