"""The outgoing flow of a durable session, read from the persisted-message store.

Messages reach a durable session only through Redis: the consumer stores
them (assigning packet ids and scores) and then offers them to the session's
:class:`StoredOutbox`. The outbox sends in score order within the window
(the smaller of the in-flight cap and the client's Receive Maximum), pages
the backlog in from Redis on reconnect instead of holding it in memory, and
writes delivery progress back through a :class:`StoreWriter`:

- a message is marked *sent* in Redis before it is written to the socket, so
  a replay sets DUP on every message that may have been seen before; a
  message stored for a client that can take it at once is stored marked
  (:meth:`StoredOutbox.room`), saving the separate write;
- PUBACK and PUBCOMP delete it; PUBREC rewrites it as PUBREL, keeping its TTL.

A progress write that is lost (Redis down, broker killed) only means a replay
re-sends with DUP what the client may already have: never a loss.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from broker.message import Delivery
from broker.packets import PubRel
from persistence.events import NO_EVENTS, EventSink
from persistence.records import stored_delivery
from persistence.redis_store import PersistedMessageStore, Stage, StoredRecord

if TYPE_CHECKING:
    from broker.connection import MQTTConnection
    from broker.session import Session
    from broker.stats import BrokerStats

log = logging.getLogger("devicemq.outbox")

RETRY_DELAY = 0.5  # seconds before a failed Redis read or write is tried again


class _State(Enum):
    MARKING = 0  # waiting for the sent mark before going on the wire
    AWAIT_PUBACK = 1
    AWAIT_PUBREC = 2
    AWAIT_PUBCOMP = 3


@dataclass(slots=True)
class _InFlight:
    record: StoredRecord
    state: _State


class StoreWriter:
    """Delivery progress of every durable session: sent marks, PUBREL stages, acks.

    Everything asked while one write is under way goes into the next, as one
    pipelined round trip for all clients (:meth:`write_progress`): under load
    the batches grow instead of the number of Redis calls. A failed write is
    retried after :data:`RETRY_DELAY` until it lands, since messages wait for
    their sent mark and PUBRELs for their stage; acks are idempotent, so
    writing them again is harmless.
    """

    def __init__(self, store: PersistedMessageStore) -> None:
        self._store = store
        self._marks: dict[str, list[int]] = {}
        self._pubrels: dict[str, list[int]] = {}
        self._acks: dict[str, list[int]] = {}
        self._callbacks: list[Callable[[], None]] = []
        self._scheduled = False
        self._task: asyncio.Task[None] | None = None
        self.errors = 0
        self.events: EventSink = NO_EVENTS  # delivery events (persistence/events.py)

    def ack(self, client_id: str, packet_id: int) -> None:
        self._acks.setdefault(client_id, []).append(packet_id)
        self._schedule()

    def mark_pubrel(self, client_id: str, packet_id: int, then: Callable[[], None]) -> None:
        self._pubrels.setdefault(client_id, []).append(packet_id)
        self._callbacks.append(then)
        self._schedule()

    def mark_sent(self, client_id: str, packet_ids: list[int], then: Callable[[], None]) -> None:
        self._marks.setdefault(client_id, []).extend(packet_ids)
        self._callbacks.append(then)
        self._schedule()

    async def flush(self) -> None:
        """Wait until everything asked so far is written."""
        while self._task is not None or self._has_work():
            if self._task is None:
                self._start()
            if self._task is not None:
                await asyncio.shield(self._task)

    def _has_work(self) -> bool:
        return bool(self._marks or self._pubrels or self._acks)

    def _schedule(self) -> None:
        if not self._scheduled and self._task is None:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._start)

    def _start(self) -> None:
        self._scheduled = False
        if self._task is not None or not self._has_work():
            return
        marks, self._marks = self._marks, {}
        pubrels, self._pubrels = self._pubrels, {}
        acks, self._acks = self._acks, {}
        callbacks, self._callbacks = self._callbacks, []
        self._task = asyncio.get_running_loop().create_task(
            self._write(marks, pubrels, acks, callbacks)
        )

    async def _write(
        self,
        marks: dict[str, list[int]],
        pubrels: dict[str, list[int]],
        acks: dict[str, list[int]],
        callbacks: list[Callable[[], None]],
    ) -> None:
        try:
            while True:
                try:
                    await self._store.write_progress(marks, pubrels, acks)
                    break
                except Exception as error:  # redis errors vary by client mode
                    self.errors += 1
                    log.warning("redis delivery-progress write failed, retrying: %s", error)
                    await asyncio.sleep(RETRY_DELAY)
            for then in callbacks:
                then()
        finally:
            self._task = None
            if self._has_work():
                self._schedule()


class StoredOutbox:
    def __init__(
        self,
        session: Session,
        store: PersistedMessageStore,
        writer: StoreWriter,
        max_inflight: int,
        page_size: int,
        stats: BrokerStats,
        clock: Callable[[], float],
        wall_clock: Callable[[], float] = time.time,
        settled: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._session = session
        self._settled = settled  # session-state writes to wait for before reading
        self._store = store
        self._writer = writer
        self.max_inflight = max_inflight
        self._page_size = page_size
        self._stats = stats
        self._clock = clock
        self._wall_clock = wall_clock
        self.inflight: dict[int, _InFlight] = {}
        self._buffer: deque[StoredRecord] = deque()
        self._cursor = 0  # highest score taken into the buffer on this connection
        self._caught_up = False  # the buffer holds everything stored up to now
        self._loading = False
        self._missed = False  # something was stored while a page was loading
        self._generation = 0  # bumped per connection; stale async results are dropped
        # Taken from the buffer, waiting for a sent mark (or behind one that is), in
        # order: mark writes can land out of order, the wire must not.
        self._marking: deque[StoredRecord] = deque()
        self._marked_ids: set[int] = set()

    # -- the Outbox interface --------------------------------------------------------

    def deliver(self, delivery: Delivery) -> None:
        raise RuntimeError("durable sessions receive messages through the store")

    def resume(self) -> None:
        """New connection: forget this process's view and re-read the store in order."""
        self._generation += 1
        self.inflight.clear()
        self._buffer.clear()
        self._marking.clear()
        self._marked_ids.clear()
        self._cursor = 0
        self._caught_up = False
        self._missed = False
        self._loading = False
        self.pump()

    def pump(self) -> None:
        conn = self._session.connection
        if conn is None:
            return
        batch: list[StoredRecord] = []
        buffer = self._buffer
        while buffer and self._window_open(conn):
            record = buffer.popleft()
            if record.stage is Stage.PUBREL:
                self.inflight[record.packet_id] = _InFlight(record, _State.AWAIT_PUBCOMP)
                conn.send(PubRel(record.packet_id))
            elif (record.sent or record.marked) and not self._marking:
                self._send(conn, record)
            else:
                self.inflight[record.packet_id] = _InFlight(record, _State.MARKING)
                self._marking.append(record)
                if record.sent or record.marked:
                    self._marked_ids.add(record.packet_id)  # only waits for its turn
                else:
                    batch.append(record)
        if batch:
            generation = self._generation
            self._writer.mark_sent(
                self._session.client_id,
                [r.packet_id for r in batch],
                lambda: self._marked(batch, generation),
            )
        if not buffer and not self._caught_up and not self._loading:
            self._load()

    def acknowledge(self, packet_id: int) -> bool:
        return self._finish(packet_id, _State.AWAIT_PUBACK)

    def received(self, packet_id: int, failed: bool) -> bool:
        entry = self.inflight.get(packet_id)
        if entry is None or entry.state is not _State.AWAIT_PUBREC:
            return False
        if failed:
            return self._finish(packet_id, _State.AWAIT_PUBREC)
        entry.state = _State.AWAIT_PUBCOMP
        # PUBREL only once the store says so: sent earlier, a crash would replay the
        # PUBLISH the client already completed, and it would be delivered twice.
        generation = self._generation
        self._writer.mark_pubrel(
            self._session.client_id, packet_id, lambda: self._pubrel_stored(packet_id, generation)
        )
        return True

    def _pubrel_stored(self, packet_id: int, generation: int) -> None:
        conn = self._session.connection
        entry = self.inflight.get(packet_id)
        if generation != self._generation or conn is None or entry is None:
            return  # the next connection replays it from the store
        if entry.state is _State.AWAIT_PUBCOMP:
            conn.send(PubRel(packet_id))

    def completed(self, packet_id: int) -> bool:
        return self._finish(packet_id, _State.AWAIT_PUBCOMP)

    def room(self) -> int:
        """How many messages stored now would go out at once (see :meth:`stored`).

        The consumer stores that many already marked sent. Should the client
        vanish before they go out, a replay sends them with DUP=1: a message
        that may have been seen, which is never wrong.
        """
        conn = self._session.connection
        if (
            conn is None
            or conn.congested
            or not self._caught_up
            or self._loading
            or self._buffer
            or self._marking
        ):
            return 0
        window = min(self.max_inflight, conn.client_receive_maximum)
        return max(0, window - len(self.inflight))

    def pending(self) -> int:
        return len(self.inflight) + len(self._buffer)

    def discard(self) -> None:
        self._generation += 1
        self.inflight.clear()
        self._buffer.clear()
        self._marking.clear()
        self._marked_ids.clear()

    # -- fed by the persistence consumer ---------------------------------------------

    def stored(self, records: list[StoredRecord]) -> None:
        """Messages just saved for this session, in score order.

        Followed live only if they continue the cursor without a gap: a store
        whose reply was lost (Redis restarting) reports those messages as
        already saved on the retry, and nobody offers them here; a gap (or an
        empty offer) sends the page reader to fetch them from the cursor.
        """
        if self._session.connection is None:
            return
        if (
            records
            and self._caught_up
            and not self._loading
            and len(self._buffer) < self._page_size
            and records[0].score == self._cursor + 1
        ):
            self._buffer.extend(records)
            self._cursor = records[-1].score
        else:
            # Not followed live: the page reader will find them from the cursor.
            self._caught_up = False
            self._missed = True
        self.pump()

    # -- internals ----------------------------------------------------------------------

    def _window_open(self, conn: MQTTConnection) -> bool:
        if conn.congested:
            return False
        return len(self.inflight) < min(self.max_inflight, conn.client_receive_maximum)

    def _marked(self, records: list[StoredRecord], generation: int) -> None:
        conn = self._session.connection
        if generation != self._generation or conn is None:
            return  # that connection is gone; the next one replays from the store
        # Writes of separate batches may finish in any order: send in the order taken.
        waiting, marked = self._marking, self._marked_ids
        marked.update(r.packet_id for r in records)
        while waiting and waiting[0].packet_id in marked:
            record = waiting.popleft()
            marked.discard(record.packet_id)
            self._send(conn, record)

    def _send(self, conn: MQTTConnection, record: StoredRecord) -> None:
        assert record.message is not None
        wall = self._wall_clock()
        delivery = stored_delivery(record.message, wall, self._clock())
        state = _State.AWAIT_PUBACK if delivery.qos == 1 else _State.AWAIT_PUBREC
        if conn.send_delivery(delivery, record.packet_id, dup=record.sent):
            self.inflight[record.packet_id] = _InFlight(record, state)
            self._writer.events.delivered(self._session.client_id, record)
            stats = self._stats
            stats.persisted_delivered += 1
            if not record.sent:  # end to end: the publisher's PUBLISH -> this first send
                stats.delivery_latency.observe(wall - record.message.publish_time)
        else:
            self._stats.persisted_undeliverable += 1
            # Expired, or too large for this client: it will never be delivered.
            self.inflight.pop(record.packet_id, None)
            self._writer.events.discarded(self._session.client_id, record)
            self._writer.ack(self._session.client_id, record.packet_id)

    def _finish(self, packet_id: int, expected: _State) -> bool:
        entry = self.inflight.get(packet_id)
        if entry is None or entry.state is not expected:
            return False
        del self.inflight[packet_id]
        self._writer.events.acked(self._session.client_id, entry.record)
        self._writer.ack(self._session.client_id, packet_id)
        self._stats.persisted_acked += 1
        self.pump()
        return True

    def _load(self) -> None:
        self._loading = True
        self._missed = False
        asyncio.get_running_loop().create_task(self._load_page(self._generation))

    async def _load_page(self, generation: int) -> None:
        try:
            await self._writer.flush()  # acks first, so the page holds no acked message
            if self._settled is not None:
                await self._settled()  # a clean start's delete first
            page = await self._store.load_page(
                self._session.client_id, self._cursor, self._page_size
            )
        except Exception as error:
            log.warning("replay read for %s failed: %s", self._session.client_id, error)
            await asyncio.sleep(RETRY_DELAY)
            page = None
        if generation != self._generation:
            return
        self._loading = False
        if page is None:
            self.pump()
            return
        self._stats.replay_pages.observe(len(page))
        for record in page:
            if record.score > self._cursor and record.packet_id not in self.inflight:
                self._buffer.append(record)
                self._cursor = record.score
        self._caught_up = len(page) < self._page_size and not self._missed
        self.pump()
