"""The queue feed (persistence/queue_feed.py) against a store whose replies the test
releases: the orders of events a real Redis gives only by chance, made to happen.

An acknowledgement handled while a page read is on its way must not bring the
entry back; one queue's page read must not wait for every other queue's
acknowledgements to be written.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import pytest

from broker.packets import PubAck
from broker.stats import BrokerStats
from persistence.format import StoredMessage, encode_message
from persistence.queue_feed import QueueAcks, QueueFeed
from persistence.queue_store import QueueEntry
from tests.unit.core_harness import Client, Harness, publishes
from tests.unit.test_outflow import DeferredFeed, _setup


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
    inflight: dict[int, object] = {}

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


# -- a persistent session's entries in flight, recorded under their packet ids -------------


class RecordingStore(GatedStore):
    """Also the record of entries in flight; its reads wait for ``inflight_gate``, its
    writes for ``record_gate`` when set."""

    def __init__(self) -> None:
        super().__init__()
        self.record: dict[int, QueueEntry] = {}
        self.inflight_gate = asyncio.Event()
        self.record_gate: asyncio.Event | None = None

    def entry(self, key: str) -> QueueEntry:
        self.put("sub", key)
        seq, value = self.pending[key]
        return QueueEntry(key, seq, value)

    async def ack(self, cid: str, triples: Iterable[tuple[str, int, int]]) -> int:
        triples = list(triples)
        for _key, _seq, packet_id in triples:
            self.record.pop(packet_id, None)
        return await super().ack(cid, triples)

    async def inflight(self, cid: str, generation: int) -> dict[int, QueueEntry]:
        await self.inflight_gate.wait()
        return dict(self.record)

    async def record_inflight(
        self, cid: str, generation: int, sent: Iterable[tuple[int, QueueEntry]]
    ) -> None:
        if self.record_gate is not None:
            await self.record_gate.wait()
        for packet_id, entry in sent:
            self.record[packet_id] = entry

    async def unrecord_inflight(
        self, cid: str, never_sent: Iterable[tuple[int, QueueEntry]]
    ) -> None:
        for packet_id, entry in never_sent:
            if self.record.get(packet_id) == entry:
                del self.record[packet_id]


def _session_with_a_recorded_entry(
    store: RecordingStore,
) -> tuple[Harness, DeferredFeed, Client, Client, QueueFeed]:
    """A broker that restarted: the record says the client holds id 2 for entry "k"."""
    h, feed, sub, pub = _setup()
    store.record[2] = store.entry("k")
    side = QueueFeed(
        "sub", store, QueueAcks(store), BrokerStats(), page_size=10,  # type: ignore[arg-type]
        with_seq=True, clock=lambda: 0.0, wall_clock=lambda: 0.0, generation=1,
    )  # fmt: skip
    h.broker.sessions["sub"].outflow.attach_side(side)
    assert side.restoring
    return h, feed, sub, pub, side


@pytest.mark.parametrize("meanwhile", ["reconnect", "reread", "unsubscribe"])
async def test_the_record_is_restored_whatever_happens_while_it_is_read(meanwhile: str) -> None:
    """Found by review: a reconnect, a re-read or an unsubscribe while the record was
    read dropped it, and a stored message took the id the client held."""
    store = RecordingStore()
    h, feed, sub, pub, side = _session_with_a_recorded_entry(store)
    outflow = h.broker.sessions["sub"].outflow
    if meanwhile == "reconnect":
        sub.conn.connection_lost()
        sub = h.connected("sub", session_expiry_interval=3600, clean_start=False)
    elif meanwhile == "reread":
        side.stored([])
    else:
        outflow.detach_side()
    store.inflight_gate.set()
    await _turns()
    first = publishes(sub.read())
    assert [(p.packet_id, p.payload, p.dup) for p in first] == [(2, b"k", True)]
    pub.publish_acked("t", b"s1", qos=1)  # stored with id 1
    pub.publish_acked("t", b"s2", qos=1)  # id 2: held by "k"
    while feed.marks:
        feed.complete_mark()
    assert [(p.packet_id, p.payload) for p in publishes(sub.read())] == [(1, b"s1")]
    sub.send(PubAck(2))  # "k" acknowledged: its id is free
    await _turns()
    while feed.marks:
        feed.complete_mark()
    assert [(p.packet_id, p.payload) for p in publishes(sub.read())] == [(2, b"s2")]


async def test_an_entry_waiting_for_its_record_is_not_sent_by_a_reconnect() -> None:
    """Found by review: a reconnect re-sent an entry whose record had not landed."""
    store = RecordingStore()
    h, _feed, sub, _pub, side = _session_with_a_recorded_entry(store)
    store.record.clear()  # nothing was in flight after all, nothing pending
    store.pending.clear()
    store.inflight_gate.set()
    await _turns()
    store.record_gate = asyncio.Event()
    store.put("sub", "new")
    side.stored([])
    await _turns()
    assert publishes(sub.read()) == []  # "new" waits for its record
    sub.conn.connection_lost()
    again = h.connected("sub", session_expiry_interval=3600, clean_start=False)
    await _turns()
    assert publishes(again.pending + again.read()) == []  # not sent unrecorded
    store.record_gate.set()
    await _turns()
    sent = publishes(again.read())
    assert [p.payload for p in sent] == [b"new"]
    # Recorded under the id it went out with; the record of the id it never went out
    # with is gone (a restart would have sent it again: found by the checker, seed 7505).
    await _turns()
    assert list(store.record) == [sent[0].packet_id]


async def test_a_subscription_while_the_record_of_a_resume_is_read_consumes_the_queue() -> None:
    """Found by the model checker (seed 9101, ``ecq-lost``): a session resumed without
    its queue's subscription reads back what was in flight (a feed that only
    completes those); the client subscribed while that read was under way, and
    ``Broker.consume_queue`` saw a feed attached and left it as it was: once the read
    was done the feed detached itself, and the queue was not delivered."""
    store = RecordingStore()
    h, _feed, sub, _pub = _setup()
    session = h.broker.sessions["sub"]
    store.put("sub", "k")
    side = QueueFeed(
        "sub", store, QueueAcks(store), BrokerStats(), page_size=10,  # type: ignore[arg-type]
        with_seq=True, clock=lambda: 0.0, wall_clock=lambda: 0.0, generation=1,
    )  # fmt: skip
    side.consuming = False  # as Broker.restore_queue_inflight attaches it
    session.outflow.attach_side(side)
    assert side.restoring
    assert h.broker.consume_queue(session)  # the SUBSCRIBE, while the record is read
    store.inflight_gate.set()
    await _turns()
    assert [p.payload for p in publishes(sub.read())] == [b"k"]
