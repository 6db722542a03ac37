"""The queue feed (persistence/queue_feed.py) against a store whose replies the test
releases: the orders of events a real Redis gives only by chance, made to happen.

An acknowledgement handled while a page read is on its way must not bring the
entry back; one queue's page read must not wait for every other queue's
acknowledgements to be written.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from broker.stats import BrokerStats
from persistence.format import StoredMessage, encode_message
from persistence.queue_feed import QueueAcks, QueueFeed
from persistence.queue_store import QueueEntry


class GatedStore:
    """Pending entries in memory; a read takes its snapshot when asked and answers
    when the test opens ``gate``; acknowledgements take ``ack_delay`` seconds."""

    def __init__(self) -> None:
        self.pending: dict[str, tuple[int, bytes]] = {}
        self.last = 0
        self.gate: asyncio.Event | None = None
        self.ack_delay = 0.0

    def put(self, cid: str, key: str) -> None:
        self.last += 1
        value = encode_message(StoredMessage(f"$ECQ/{cid}/{key}", key.encode(), 1))
        self.pending[key] = (self.last, value)

    async def load(self, cid: str, after: int, limit: int) -> tuple[list[QueueEntry], int]:
        entries = [QueueEntry(k, s, v) for k, (s, v) in self.pending.items() if s > after]
        entries.sort(key=lambda e: e.seq)
        last = self.last
        if self.gate is not None:
            await self.gate.wait()
        return entries[:limit], last

    async def ack(self, cid: str, triples: Iterable[tuple[str, int, int]]) -> int:
        if self.ack_delay:
            await asyncio.sleep(self.ack_delay)
        for key, seq, _packet_id in triples:
            if self.pending.get(key, (0, b""))[0] == seq:
                del self.pending[key]
        return 0


class Outflow:
    connection = object()

    def pump(self) -> None:
        pass


def _feed(store: GatedStore) -> tuple[QueueFeed, QueueAcks]:
    acks = QueueAcks(store)  # type: ignore[arg-type]
    feed = QueueFeed(
        "c", store, acks, BrokerStats(), page_size=10, with_seq=True,  # type: ignore[arg-type]
        clock=lambda: 0.0, wall_clock=lambda: 0.0,
    )  # fmt: skip
    feed.outflow = Outflow()  # type: ignore[assignment]
    return feed, acks


async def _turns() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_an_acknowledgement_during_a_page_read_does_not_bring_the_entry_back() -> None:
    store = GatedStore()
    store.put("c", "a")
    store.put("c", "b")
    feed, acks = _feed(store)
    feed.restart()
    feed.take(10)  # the first read
    await _turns()
    first = feed.take(10)
    assert [item.ref.key for item in first] == ["a", "b"]  # type: ignore[attr-defined]
    for item in first:
        feed.sent(item, False)
    store.gate = asyncio.Event()
    feed.stored([])  # read again from the start (a rewind, another replica's save)
    await _turns()
    feed.finished(first[0])  # "a" acknowledged while that read's answer is on its way
    store.gate.set()
    await _turns()
    await acks.flush()
    assert feed.take(10) == []
    assert "a" not in store.pending


async def test_a_page_read_does_not_wait_for_other_queues_acknowledgements() -> None:
    store = GatedStore()
    store.ack_delay = 0.01
    store.put("c", "a")
    feed, acks = _feed(store)
    busy = True

    async def other_consumers() -> None:
        n = 0
        while busy:
            n += 1
            acks.ack(f"other{n % 50}", "k", n)
            await asyncio.sleep(0.002)

    task = asyncio.create_task(other_consumers())
    try:
        await asyncio.sleep(0.05)
        feed.restart()
        feed.take(10)
        got: list[object] = []
        for _ in range(100):  # the read needs no more than a few loop turns
            await asyncio.sleep(0.001)
            got = feed.take(10)
            if got:
                break
        assert [item.ref.key for item in got] == ["a"]  # type: ignore[attr-defined]
    finally:
        busy = False
        await task
