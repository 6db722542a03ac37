"""persistence/store_feed.py StoreWriter: delivery progress coalesced into writes."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from persistence.store_feed import StoreWriter


class Progress:
    """Records each write_progress call (a stand-in for Redis: no store semantics)."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, list[int]], ...]] = []
        self.gate = asyncio.Event()  # the first write waits for it

    async def write_progress(
        self,
        marks: Mapping[str, Sequence[tuple[int, int]]],
        pubrels: Mapping[str, Sequence[int]],
        acks: Mapping[str, Sequence[tuple[int, int]]],
    ) -> dict[str, set[tuple[int, int]]]:
        self.calls.append(({**marks}, {**pubrels}, {**acks}))  # type: ignore[arg-type]
        await self.gate.wait()
        return {cid: set(sent) for cid, sent in marks.items()}


async def test_a_callback_that_raises_does_not_leave_progress_unwritten() -> None:
    """Found in review: a mark's callback that raised ended the writer's task, and
    what was asked meanwhile waited for the next ask (flush returned at once)."""
    store = Progress()
    writer = StoreWriter(store)  # type: ignore[arg-type]

    def broken(ids: object) -> None:
        raise RuntimeError("a bug after marking")

    writer.mark_sent("c", [(1, 1)], broken)
    while not store.calls:  # handed over, and the write is under way
        await asyncio.sleep(0)
    writer.ack("c", 7, 7)  # asked while it runs: goes into the next write
    await asyncio.sleep(0)
    store.gate.set()
    await asyncio.wait_for(writer.flush(), 5)
    assert [call[2] for call in store.calls] == [{}, {"c": [(7, 7)]}]
