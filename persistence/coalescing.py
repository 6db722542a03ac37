"""The persistent path's background writes: one retry policy, one coalescing shape.

:class:`Retry` is how every background write of the persistent path waits
before trying again (issue 17, item 4): :data:`RETRY_DELAY` at first, doubled
after each failure up to :data:`RETRY_MAX`, with some jitter so that replicas
do not retry in step, and back to the start after a success. It counts the
tries again and what was given up, per writer, for the metrics
(``devicemq_write_retries_total``, ``devicemq_writes_given_up_total``).

:class:`CoalescingWriter` is the shape most of those writes share: a caller on
the hot path asks and returns at once; one task writes what accumulated, then
what accumulated during that write, and ends when nothing is left. A write
answers what it could not write; that is kept ahead of what was asked since and
tried again after the retry's wait. With ``limit``, what waits is bounded: the
oldest is dropped first and counted as given up.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Generic, Protocol, TypeVar

RETRY_DELAY = 0.5  # seconds before the first try again
RETRY_MAX = 2.0  # the longest wait between two tries


class Retry:
    """Waits between tries of one writer, and its counts."""

    __slots__ = ("_delay", "first", "given_up", "most", "name", "retries")

    def __init__(self, name: str, first: float = RETRY_DELAY, most: float = RETRY_MAX) -> None:
        self.name = name  # the metrics' ``writer`` label
        self.first = first
        self.most = max(first, most)
        self._delay = first
        self.retries = 0  # waits before a try again
        self.given_up = 0  # items dropped or writes abandoned

    async def wait(self) -> None:
        """After a failure: wait, longer each time in a row."""
        self.retries += 1
        delay = self._delay
        self._delay = min(delay * 2, self.most)
        await asyncio.sleep(delay * random.uniform(0.8, 1.2))

    def succeeded(self) -> None:
        self._delay = self.first

    def gave_up(self, count: int = 1) -> None:
        self.given_up += count


class _Batch(Protocol):
    def __len__(self) -> int: ...


B = TypeVar("B", bound=_Batch)


class CoalescingWriter(Generic[B]):
    """``write(batch)`` returns what is left to write (empty: all written).

    ``merge(older, newer)`` joins two batches, the newer one winning where they
    overlap; ``empty()`` makes a new empty batch. An exception of ``write``
    ends the task and reaches :meth:`drain`; the callers catch what they retry.
    ``limit`` (with ``trim(batch, n)``, which keeps the newest ``n`` items):
    the most that may wait; what is trimmed counts as given up.
    """

    def __init__(
        self,
        write: Callable[[B], Awaitable[B]],
        merge: Callable[[B, B], B],
        empty: Callable[[], B],
        retry: Retry,
        limit: int = 0,
        trim: Callable[[B, int], B] | None = None,
    ) -> None:
        if limit and trim is None:
            raise ValueError("a limit needs a trim")
        self._write = write
        self._merge = merge
        self._empty = empty
        self.retry = retry
        self._limit = limit
        self._trim = trim
        self._pending = empty()
        self._task: asyncio.Task[None] | None = None

    def add(self, batch: B) -> None:
        """Ask for ``batch`` to be written (from the hot path: returns at once)."""
        self._pending = self._bounded(self._merge(self._pending, batch))
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    @property
    def pending(self) -> B:
        """Asked, and not yet handed to a write."""
        return self._pending

    @property
    def busy(self) -> bool:
        """A write is under way (or waits to retry)."""
        return self._task is not None

    async def drain(self) -> None:
        """Wait until everything asked so far is written (or a write raised)."""
        while self._task is not None:
            await asyncio.shield(self._task)

    def abandon(self) -> None:
        """Drop what waits and cancel the write under way: it is no longer wanted (the
        offsets of a Kafka log that is gone, which would land in its successor)."""
        self._pending = self._empty()
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def _bounded(self, batch: B) -> B:
        over = len(batch) - self._limit
        if self._limit and over > 0 and self._trim is not None:
            self.retry.gave_up(over)
            return self._trim(batch, self._limit)
        return batch

    async def _run(self) -> None:
        try:
            while len(self._pending):
                batch, self._pending = self._pending, self._empty()
                left = await self._write(batch)
                if len(left):
                    self._pending = self._bounded(self._merge(left, self._pending))
                    await self.retry.wait()
                else:
                    self.retry.succeeded()
        finally:
            if self._task is asyncio.current_task():  # not a task abandoned since
                self._task = None
