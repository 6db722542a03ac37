"""One write in flight; what is asked meanwhile goes together into the next.

The shape the persistent path repeats for its background writes (issue 17,
item 4): a caller on the hot path asks and returns at once; one task writes
what accumulated, then what accumulated during that write, and ends when
nothing is left. A write answers what it could not write; that is kept ahead
of what was asked since and tried again after :data:`RETRY_DELAY`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, Protocol, TypeVar

RETRY_DELAY = 0.5  # seconds before what a write could not write is tried again


class _Batch(Protocol):
    def __len__(self) -> int: ...


B = TypeVar("B", bound=_Batch)


class CoalescingWriter(Generic[B]):
    """``write(batch)`` returns what is left to write (empty: all written).

    ``merge(older, newer)`` joins two batches, the newer one winning where they
    overlap; ``empty()`` makes a new empty batch. An exception of ``write``
    ends the task and reaches :meth:`drain`; the callers catch what they retry.
    """

    def __init__(
        self,
        write: Callable[[B], Awaitable[B]],
        merge: Callable[[B, B], B],
        empty: Callable[[], B],
        retry_delay: float = RETRY_DELAY,
    ) -> None:
        self._write = write
        self._merge = merge
        self._empty = empty
        self._retry_delay = retry_delay
        self._pending = empty()
        self._task: asyncio.Task[None] | None = None

    def add(self, batch: B) -> None:
        """Ask for ``batch`` to be written (from the hot path: returns at once)."""
        self._pending = self._merge(self._pending, batch)
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

    async def _run(self) -> None:
        try:
            while len(self._pending):
                batch, self._pending = self._pending, self._empty()
                left = await self._write(batch)
                if len(left):
                    self._pending = self._merge(left, self._pending)
                    await asyncio.sleep(self._retry_delay)
        finally:
            self._task = None
