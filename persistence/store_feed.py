"""A durable session's messages, fed from the persisted-message store.

Messages reach a durable session only through Redis: the consumer stores them
(assigning packet ids and scores) and offers them to the session's
:class:`StoreFeed`; on a new connection the feed pages the backlog in from
Redis instead of holding it in memory. The protocol rules (window, DUP,
PUBREL, re-sends) are the session's :class:`broker.outflow.Outflow`; this
module keeps only the paging and the Redis writes, through one
:class:`StoreWriter` for all sessions:

- a message is marked *sent* in Redis before its first send, so a replay sets
  DUP on every message that may have been seen; a message stored for a client
  that can take it at once is stored marked (:meth:`StoreFeed.room`), saving
  the separate write. A message waiting behind a full window is not marked
  ahead of its send: should the client go, the next connection would send it
  with DUP though it never went (tests/faults/test_window_backlog_dup.py);
- PUBACK and PUBCOMP delete it; PUBREC rewrites it as PUBREL, keeping its
  lifetime (a sent message lives as long as the session).

A progress write that is lost (Redis down, broker killed) only means a replay
re-sends with DUP what the client may already have: never a loss.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from broker.outflow import Outflow, Outgoing
from persistence.coalescing import CoalescingWriter, Retry
from persistence.delivery_codec import stored_delivery
from persistence.events import NO_EVENTS, EventSink
from persistence.format import Stage, StoredRecord
from persistence.redis_store import PersistedMessageStore

if TYPE_CHECKING:
    from broker.message import Delivery
    from broker.stats import BrokerStats

log = logging.getLogger("devicemq.outflow")
_PUBREL = Stage.PUBREL  # per record: a look-up on the Enum class costs ~120 ns on 3.11


MarksDone = Callable[[Collection[int]], None]


@dataclass(slots=True)
class _Progress:
    """Delivery-progress writes asked, per client, oldest first, and who waits."""

    marks: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # (id, score)
    pubrels: dict[str, list[int]] = field(default_factory=dict)
    acks: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # (id, score)
    mark_callbacks: list[tuple[str, list[tuple[int, int]], MarksDone]] = field(default_factory=list)
    callbacks: list[Callable[[], None]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.marks) + len(self.pubrels) + len(self.acks)

    @staticmethod
    def merge(older: _Progress, newer: _Progress) -> _Progress:
        for client_id, sent in newer.marks.items():
            older.marks.setdefault(client_id, []).extend(sent)
        for client_id, acked in newer.acks.items():
            older.acks.setdefault(client_id, []).extend(acked)
        for client_id, ids in newer.pubrels.items():
            older.pubrels.setdefault(client_id, []).extend(ids)
        older.mark_callbacks += newer.mark_callbacks
        older.callbacks += newer.callbacks
        return older


class StoreWriter:
    """Delivery progress of every durable session: sent marks, PUBREL stages, acks.

    What is asked in one event-loop iteration is handed over together; everything
    asked while one write is under way goes into the next, as one pipelined round
    trip for all clients (:meth:`write_progress`): under load the batches grow
    instead of the number of Redis calls. A failed write is tried again
    (persistence/coalescing.py) until it lands, since messages wait for their
    sent mark and PUBRELs for their stage; acks are idempotent, so writing them
    again is harmless.
    """

    def __init__(self, store: PersistedMessageStore) -> None:
        self._store = store
        self._asked = _Progress()
        self._scheduled = False
        self._writer = CoalescingWriter(
            self._write, _Progress.merge, _Progress, Retry("delivery_progress")
        )
        self.replay_retry = Retry("replay_reads")  # a session's page read that failed
        self.errors = 0

    @property
    def retry(self) -> Retry:
        return self._writer.retry

    def ack(self, client_id: str, packet_id: int, score: int) -> None:
        """Forget the message read with ``score`` under ``packet_id`` (ack.lua)."""
        self._asked.acks.setdefault(client_id, []).append((packet_id, score))
        self._schedule()

    def mark_pubrel(self, client_id: str, packet_id: int, then: Callable[[], None]) -> None:
        self._asked.pubrels.setdefault(client_id, []).append(packet_id)
        self._asked.callbacks.append(then)
        self._schedule()

    def mark_sent(self, client_id: str, sent: list[tuple[int, int]], then: MarksDone) -> None:
        """Mark (packet id, score read with) pairs, then ``then(ids marked)``: an id
        left out is no longer stored, or is another message's now."""
        self._asked.marks.setdefault(client_id, []).extend(sent)
        self._asked.mark_callbacks.append((client_id, sent, then))
        self._schedule()

    async def flush(self) -> None:
        """Wait until everything asked so far is written."""
        self._hand_over()
        await self._writer.drain()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._hand_over)

    def _hand_over(self) -> None:
        self._scheduled = False
        if len(self._asked):
            asked, self._asked = self._asked, _Progress()
            self._writer.add(asked)

    async def _write(self, progress: _Progress) -> _Progress:
        try:
            marked = await self._store.write_progress(
                progress.marks, progress.pubrels, progress.acks
            )
        except Exception as error:  # redis errors vary by client mode
            self.errors += 1
            log.warning("redis delivery-progress write failed, retrying: %s", error)
            return progress
        # A callback that raises must not end the writer with work left behind.
        for client_id, sent, then in progress.mark_callbacks:
            done = marked.get(client_id, set())
            try:
                then([pid for pid, score in sent if (pid, score) in done])
            except Exception:
                log.exception("after marking %s sent", client_id)
        for then_ in progress.callbacks:
            try:
                then_()
            except Exception:
                log.exception("after a PUBREL stage was written")
        return _Progress()


class StoreFeed:
    """:class:`broker.outflow.Feed` of one durable session, read from the store.

    The buffer holds messages read (a page) or offered live (just stored), in
    score order, not yet taken by the outflow; ``_cursor`` is the highest
    score taken into it on this connection. Messages the consumer stored
    already marked for this connection (:meth:`room`) are *reserved*: should
    the page reader find them rather than the live offer, they still go out
    as first sends (no DUP).
    """

    durable = True

    def __init__(
        self,
        client_id: str,
        store: PersistedMessageStore,
        writer: StoreWriter,
        page_size: int,
        stats: BrokerStats,
        clock: Callable[[], float],
        wall_clock: Callable[[], float] = time.time,
        events: EventSink = NO_EVENTS,
        on_discard: Callable[[StoreFeed], None] | None = None,
    ) -> None:
        """``on_discard``: told when the session ends (persistence/feed_bridge.py)."""
        self.client_id = client_id
        self.outflow: Outflow | None = None
        self._on_discard = on_discard
        self._store = store
        self._writer = writer
        self._page_size = page_size
        self._stats = stats
        self._clock = clock
        self._wall_clock = wall_clock
        self._events = events
        self._buffer: deque[StoredRecord] = deque()
        self._cursor = 0
        self._caught_up = False  # the buffer holds everything stored up to now
        self._loading = False
        self._missed = False  # something was stored while a page was loading
        self._reserved: dict[int, int] = {}  # packet id -> score, stored marked for us
        self._epoch = 0  # bumped per connection: stale page reads are dropped
        # A new connection's pages have not shown yet where what was sent before ends:
        # the identifiers the client may still hold are unknown (the outflow gives a
        # queue or a group none meanwhile).
        self.replaying = False

    # -- Feed ----------------------------------------------------------------------------

    def offer(self, delivery: Delivery) -> None:
        raise RuntimeError("a durable session receives messages through the store")

    def take(self, n: int) -> list[Outgoing]:
        buffer = self._buffer
        items: list[Outgoing] = []
        while buffer and len(items) < n:
            items.append(self._outgoing(buffer.popleft()))
        if not self._caught_up and not self._loading:
            outflow = self.outflow
            if not buffer or (outflow is not None and len(buffer) <= outflow.window()):
                # What is left goes in one window: read the next page meanwhile.
                self._load()
        return items

    def mark(self, items: list[Outgoing], done: MarksDone) -> None:
        self._writer.mark_sent(
            self.client_id, [(item.packet_id, self._record(item).score) for item in items], done
        )

    def release(self, item: Outgoing, done: Callable[[], None]) -> None:
        self._writer.mark_pubrel(self.client_id, item.packet_id, done)

    def finished(self, item: Outgoing) -> None:
        self._writer.ack(self.client_id, item.packet_id, self._record(item).score)
        self._events.acked(self.client_id, self._record(item))
        self._stats.persisted_acked += 1

    def undeliverable(self, item: Outgoing) -> None:
        # Expired, or too large for this client: it will never be delivered.
        self._stats.persisted_undeliverable += 1
        self._events.discarded(self.client_id, self._record(item))
        self._writer.ack(self.client_id, item.packet_id, self._record(item).score)

    def sent(self, item: Outgoing, dup: bool) -> None:
        record = self._record(item)
        record.sent = dup
        self._events.delivered(self.client_id, record)
        stats = self._stats
        stats.persisted_delivered += 1
        if not dup and not record.replay and record.message is not None:
            # End to end: the publisher's PUBLISH -> this first send (a rewind's copy
            # is no measure of it).
            stats.delivery_latency.observe(self._wall_clock() - record.message.publish_time)

    def restart(self) -> None:
        """New connection: forget this process's view; re-read the store in order."""
        self._epoch += 1
        self._buffer.clear()
        self._reserved.clear()
        self._cursor = 0
        self._caught_up = False
        self._missed = False
        self._loading = False
        self.replaying = True

    def discard(self) -> None:
        self._epoch += 1
        self._buffer.clear()
        self._reserved.clear()
        if self._on_discard is not None:
            self._on_discard(self)

    def queued(self) -> int:
        return len(self._buffer)

    # -- fed by the persistence consumer -------------------------------------------------

    def room(self) -> int:
        """How many messages stored now would go out at once (see :meth:`stored`).

        The consumer stores that many already marked sent. Should the client
        vanish before they go out, a replay sends them with DUP=1: a message
        that may have been seen, which is never wrong.
        """
        outflow = self.outflow
        if outflow is None or not self._caught_up or self._loading or self._buffer:
            return 0
        return outflow.room()

    def stored(self, records: list[StoredRecord]) -> None:
        """Messages just saved for this session, in score order.

        Followed live only if they continue the cursor without a gap: a store
        whose reply was lost (Redis restarting) reports those messages as
        already saved on the retry, and nobody offers them here; a gap (or an
        empty offer) sends the page reader to fetch them from the cursor.
        """
        outflow = self.outflow
        if outflow is None or outflow.connection is None:
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
            for record in records:
                if record.marked:
                    self._reserved[record.packet_id] = record.score
            self._caught_up = False
            self._missed = True
        outflow.pump()

    # -- internals -----------------------------------------------------------------------

    def _outgoing(self, record: StoredRecord) -> Outgoing:
        if record.stage is _PUBREL:
            return Outgoing(record.packet_id, None, sent=True, ref=record)
        assert record.message is not None
        # Stored marked for this connection and never sent: a first send, no DUP.
        reserved = self._reserved.pop(record.packet_id, None) == record.score
        delivery = stored_delivery(record.message, self._wall_clock(), self._clock())
        return Outgoing(
            record.packet_id,
            delivery,
            sent=record.sent and not reserved,
            marked=record.marked or reserved,
            ref=record,
            replay=record.replay,
        )

    @staticmethod
    def _record(item: Outgoing) -> StoredRecord:
        record = item.ref
        assert isinstance(record, StoredRecord)
        return record

    def _load(self) -> None:
        self._loading = True
        self._missed = False
        asyncio.get_running_loop().create_task(self._load_page(self._epoch))

    async def _load_page(self, epoch: int) -> None:
        try:
            await self._writer.flush()  # acks first, so the page holds no acked message
            page = await self._store.load_page(self.client_id, self._cursor, self._page_size)
            self._writer.replay_retry.succeeded()
        except Exception as error:
            log.warning("replay read for %s failed: %s", self.client_id, error)
            await self._writer.replay_retry.wait()
            page = None
        if epoch != self._epoch:
            return
        self._loading = False
        outflow = self.outflow
        if page is None:
            if outflow is not None:
                outflow.pump()
            return
        records = page.records
        if self.replaying and (
            len(records) < self._page_size
            or any(not record.sent and record.stage is not _PUBREL for record in records)
        ):
            # Past what the client may hold from before (sent, in score order): an id
            # the outflow gives a side message now is none of those (finding 44).
            self.replaying = False
        self._stats.replay_pages.observe(len(records))
        inflight = outflow.inflight if outflow is not None else {}
        for record in records:
            # One in flight as this feed's is being handled; one whose identifier a
            # queue's message holds is not (broker/outflow.py parks it).
            held = inflight.get(record.packet_id)
            if record.score > self._cursor and (held is None or held.item.side is not None):
                self._buffer.append(record)
                self._cursor = record.score
        if len(records) < self._page_size and not self._missed:
            # Everything stored so far is read: the next live offer continues from the
            # counter, not from the last message read (acked ones leave gaps).
            self._caught_up = True
            self._cursor = max(self._cursor, page.last_score)
        if outflow is not None:
            outflow.pump()
