"""Delivering an exclusive compacted queue ($ECQ) to its consumer.

A :class:`QueueFeed` is the side feed of the consumer's outflow
(broker/outflow.py) while it is subscribed to ``$ECQ/{cid}/#``. It reads the
queue's pending entries in sequence order (persistence/queue_store.py) and
follows what the persistence consumer stores for it live; a newer value of a
key waiting in its buffer replaces the older one (compacted: never sent).
Acknowledgements are written together for every queue (:class:`QueueAcks`);
an entry acknowledged leaves the pending set unless a newer value replaced
it meanwhile, so a reconnect or a new subscription resumes after what was
acknowledged and never delivers it again. The record is the truth: a new
connection re-reads it (what may have been seen goes with DUP).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, TypeVar

from broker.ecq import SEQ_PROPERTY
from broker.message import Delivery
from broker.outflow import Outgoing
from broker.packets import Properties
from persistence.coalescing import CoalescingWriter, Retry
from persistence.delivery_codec import stored_delivery
from persistence.events import NO_EVENTS, EventSink
from persistence.format import decode_record
from persistence.queue_store import QueueEntry, QueueStore

if TYPE_CHECKING:
    from broker.outflow import Outflow
    from broker.stats import BrokerStats

log = logging.getLogger("devicemq.persistence")


T = TypeVar("T")


class AckBatch(dict[str, list[T]]):
    """Acknowledgements per queue (client id or group store), for a CoalescingWriter."""

    def __len__(self) -> int:
        return sum(len(v) for v in self.values())


def merge_acks(older: AckBatch[T], newer: AckBatch[T]) -> AckBatch[T]:
    out: AckBatch[T] = AckBatch({k: list(v) for k, v in older.items()})
    for queue, items in newer.items():
        out.setdefault(queue, []).extend(items)
    return out


_AckBatch = AckBatch[tuple[str, int, int]]  # key, seq, packet id recorded (0: none)


def entry_delivery(
    entry: QueueEntry, wall_now: float, clock_now: float, subscription_ids: tuple[int, ...]
) -> Delivery:
    """A queue entry as it goes out: QoS 1, never retained, with the subscription's ids."""
    record = decode_record(0, entry.seq, entry.value)
    assert record.message is not None
    delivery = stored_delivery(record.message, wall_now, clock_now)
    delivery.qos = 1
    delivery.retain = False
    delivery.subscription_ids = subscription_ids
    return delivery


class QueueAcks:
    """Every queue's acknowledgements, one write per queue per round, retried until
    they land (an acknowledgement is idempotent); and which entries this process
    sent and saw no acknowledgement for (:meth:`sent`), so that a new connection
    or session of the consumer gets them with DUP."""

    def __init__(self, store: QueueStore) -> None:
        self._store = store
        self._sent: dict[str, set[tuple[str, int]]] = {}
        self._unwritten: dict[str, set[tuple[str, int]]] = {}  # asked, not yet in Redis
        self._tasks: set[asyncio.Task[None]] = set()
        self._writer: CoalescingWriter[_AckBatch] = CoalescingWriter(
            self._write, merge_acks, _AckBatch, Retry("queue_acks")
        )

    @property
    def retry(self) -> Retry:
        return self._writer.retry

    def ack(self, client_id: str, key: str, seq: int, packet_id: int = 0) -> None:
        """The entry is done with; ``packet_id``: the one it was recorded in flight
        under (0: none)."""
        self.forget(client_id, key, seq)
        self._unwritten.setdefault(client_id, set()).add((key, seq))
        self._writer.add(_AckBatch({client_id: [(key, seq, packet_id)]}))

    def record(
        self,
        client_id: str,
        generation: int,
        sent: list[tuple[int, QueueEntry]],
        done: Callable[[], None],
    ) -> None:
        """Record entries in flight under their packet ids, then ``done()`` (tried
        until it lands: they wait for it before they go out)."""
        asyncio.get_running_loop().create_task(self._record(client_id, generation, sent, done))

    def unrecord(self, client_id: str, never_sent: list[tuple[int, QueueEntry]]) -> None:
        """Forget records of entries that never went out (best effort: a record left
        gives the entry again with DUP after a restart, never loses one)."""
        task = asyncio.get_running_loop().create_task(self._unrecord(client_id, never_sent))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _unrecord(self, client_id: str, never_sent: list[tuple[int, QueueEntry]]) -> None:
        try:
            await self._store.unrecord_inflight(client_id, never_sent)
        except Exception as error:  # left: at worst a DUP after a restart
            log.info("forgetting queue records of %s failed: %s", client_id, error)

    async def _record(
        self,
        client_id: str,
        generation: int,
        sent: list[tuple[int, QueueEntry]],
        done: Callable[[], None],
    ) -> None:
        while True:
            try:
                await self._store.record_inflight(client_id, generation, sent)
                self.retry.succeeded()
                break
            except Exception as error:  # connection errors, cluster errors: again
                log.warning("recording queue entries of %s failed: %s", client_id, error)
                await self.retry.wait()
        done()

    def unwritten(self, client_id: str) -> set[tuple[str, int]]:
        """The queue's acknowledgements not in Redis yet: a read may still hold them
        as pending (a page read does not wait for every queue's writes)."""
        return set(self._unwritten.get(client_id, ()))

    def sent(self, client_id: str) -> set[tuple[str, int]]:
        """(key, seq) of the queue's entries sent and not acknowledged, as far as this
        process knows (a restart or another replica does not: ``seq`` tells)."""
        sent = self._sent.get(client_id)
        if sent is None:
            sent = self._sent[client_id] = set()
        return sent

    def forget(self, client_id: str, key: str, seq: int) -> None:
        sent = self._sent.get(client_id)
        if sent is not None:
            sent.discard((key, seq))
            if not sent:
                del self._sent[client_id]

    async def flush(self) -> None:
        await self._writer.drain()

    async def _write(self, batch: _AckBatch) -> _AckBatch:
        left = _AckBatch()
        for cid, pairs in batch.items():
            try:
                await self._store.ack(cid, pairs)
                unwritten = self._unwritten.get(cid)
                if unwritten is not None:
                    unwritten.difference_update((key, seq) for key, seq, _ in pairs)
                    if not unwritten:
                        del self._unwritten[cid]
            except Exception as error:  # connection errors, cluster errors: retried
                log.warning(
                    "acknowledging %d entries of queue %s failed: %s", len(pairs), cid, error
                )
                left[cid] = pairs
        return left


class QueueFeed:
    """:class:`broker.outflow.Feed` of the queue ``client_id`` consumes (as a side feed).

    ``_buffer`` holds entries read or offered live and not yet taken, key ->
    entry in sequence order; ``_cursor`` is the highest sequence number put
    in it on this connection; ``_out`` the entries taken and not yet
    acknowledged (key -> seq).
    """

    durable = True
    decline = None  # its messages are its consumer's alone (broker/outflow.py SideFeed)

    def __init__(
        self,
        client_id: str,
        store: QueueStore,
        acks: QueueAcks,
        stats: BrokerStats,
        *,
        page_size: int,
        with_seq: bool,
        clock: Callable[[], float],
        wall_clock: Callable[[], float] = time.time,
        events: EventSink = NO_EVENTS,
        subscription_ids: Callable[[], tuple[int, ...]] = tuple,
        generation: int | None = None,
        on_live: Callable[[QueueFeed, bool], None] | None = None,
    ) -> None:
        """``subscription_ids()``: those of the queue's subscription now (MQTT-3.3.4-3).
        ``generation``: the persistent session's, whose entries in flight are recorded
        under their packet ids (None: a session that ends with its connection).
        ``on_live(feed, live)``: told when the outflow restarts it (True) and when it
        is discarded (False; persistence/feed_bridge.py)."""
        self._on_live = on_live
        self._subscription_ids = subscription_ids
        self._generation = generation
        # Until the record of what was in flight is read (a new process resuming the
        # session), the outflow gives out no packet identifier (Outflow._take).
        self.restoring = False
        self._restored = generation is None
        # The client holds the queue's subscription; False: only what it had in
        # flight completes (a session resumed without it, Broker.restore_queue_inflight).
        self.consuming = True
        self.client_id = client_id
        self.outflow: Outflow | None = None
        self._store = store
        self._acks = acks
        self._stats = stats
        self._page_size = page_size
        self._with_seq = with_seq  # MQTT 5: the user property ``seq``
        self._clock = clock
        self._wall_clock = wall_clock
        self._events = events
        self._buffer: dict[str, QueueEntry] = {}
        self._cursor = 0
        self._out: dict[str, int] = {}
        # Acknowledged while a page read was under way: that read may still hold them.
        self._done: set[tuple[str, int]] = set()
        self._caught_up = False
        self._loading = False
        self._missed = False
        self._epoch = 0
        self._active = False  # restarted and not discarded: reads and takes

    # -- Feed ----------------------------------------------------------------------------

    def offer(self, delivery: Delivery) -> None:
        raise RuntimeError("a queue receives messages through the store")

    def take(self, n: int) -> list[Outgoing]:
        if not self._active or not self.consuming or self.restoring:
            return []
        buffer, items = self._buffer, list[Outgoing]()
        while buffer and len(items) < n:
            key = next(iter(buffer))
            entry = buffer.pop(key)
            self._out[key] = entry.seq
            items.append(
                Outgoing(
                    0,
                    self._delivery(entry),
                    sent=(key, entry.seq) in self._acks.sent(self.client_id),
                    # A persistent session's entries go out once recorded (mark).
                    marked=self._generation is None,
                    ref=entry,
                )
            )
        if not buffer and not self._caught_up and not self._loading:
            self._load()
        return items

    def mark(self, items: list[Outgoing], done: Callable[[Collection[int]], None]) -> None:
        """Record them in flight under their packet ids (a persistent session's)."""
        ids = [item.packet_id for item in items]
        if self._generation is None:
            done(ids)
            return
        sent = [(item.packet_id, self._entry(item)) for item in items]

        def landed() -> None:
            # One whose connection ended meanwhile never went out (the outflow takes
            # it again under another id): its record must not bring it back later.
            outflow = self.outflow
            inflight = outflow.inflight if outflow is not None else {}
            gone = [
                (item.packet_id, self._entry(item))
                for item in items
                if (held := inflight.get(item.packet_id)) is None or held.item is not item
            ]
            if gone:
                self._acks.unrecord(self.client_id, gone)
            done(ids)

        self._acks.record(self.client_id, self._generation, sent, landed)

    def release(self, item: Outgoing, done: Callable[[], None]) -> None:
        done()  # QoS 1 only

    def never_sent(self, item: Outgoing) -> None:
        """Taken and never sent (its connection ended while it waited for its record):
        the record, if it landed, goes; the entry is taken again under another id."""
        if self._generation is not None:
            self._acks.unrecord(self.client_id, [(item.packet_id, self._entry(item))])

    def finished(self, item: Outgoing) -> None:
        entry = self._entry(item)
        if self._out.get(entry.key) == entry.seq:
            del self._out[entry.key]
        if self._loading:
            self._done.add((entry.key, entry.seq))
        self._acks.ack(self.client_id, entry.key, entry.seq, self._recorded_id(item))
        self._events.queue(self.client_id, "acked", entry.seq, entry.key)
        self._stats.queue_acked += 1

    def undeliverable(self, item: Outgoing) -> None:
        # Expired before its first send, or too large for the client: never delivered.
        entry = self._entry(item)
        self._out.pop(entry.key, None)
        self._acks.ack(self.client_id, entry.key, entry.seq, self._recorded_id(item))
        self._events.queue(self.client_id, "discarded", entry.seq, entry.key)

    def sent(self, item: Outgoing, dup: bool) -> None:
        entry = self._entry(item)
        self._acks.sent(self.client_id).add((entry.key, entry.seq))
        self._events.queue(self.client_id, "delivered", entry.seq, entry.key, dup=dup)
        self._stats.queue_delivered += 1

    def restart(self) -> None:
        """A new connection or subscription: re-read the pending entries in order
        (those in flight, ``_out``, the outflow sends again itself). The first time,
        for a persistent session, what was in flight before (a restart of the
        broker) is read back first and handed to the outflow to send again."""
        self._epoch += 1
        self._active = True
        if self._on_live is not None:
            self._on_live(self, True)
        self._buffer.clear()
        self._cursor = 0
        self._caught_up = False
        self._missed = False
        self._loading = False
        outflow = self.outflow
        if outflow is not None:
            # In flight: what the outflow holds of this feed's now (an entry that
            # still waited for its record when the connection went is taken again).
            self._out = {}
            for held in outflow.inflight.values():
                if held.item.side is self:
                    entry = self._entry(held.item)
                    self._out[entry.key] = max(self._out.get(entry.key, 0), entry.seq)
        if not self._restored:
            self._restored = True
            self.restoring = True
            asyncio.get_running_loop().create_task(self._restore())

    def discard(self) -> None:
        self._epoch += 1
        self._active = False
        self._buffer.clear()
        if self._on_live is not None:
            self._on_live(self, False)

    def queued(self) -> int:
        return len(self._buffer)

    # -- fed by the persistence consumer -------------------------------------------------

    def stored(self, entries: list[QueueEntry]) -> None:
        """Entries just saved for this queue, in sequence order. Followed live only if
        they continue the cursor; otherwise the reader fetches from the cursor. Empty
        (saved by another replica, or a rewind): read again from the start."""
        outflow = self.outflow
        if not self._active or outflow is None or outflow.connection is None:
            return
        if not entries:
            self.reread()
            return
        if self.restoring:
            return  # read once the record of what was in flight is
        if (
            entries
            and self._caught_up
            and not self._loading
            and len(self._buffer) < self._page_size
            and entries[0].seq == self._cursor + 1
        ):
            for entry in entries:
                self._add(entry)
        else:
            self._caught_up = False
            self._missed = True
            if not self._buffer and not self._loading:
                self._load()
        outflow.pump()

    def reread(self) -> None:
        """Read the pending entries again from the first: a rewind made entries below
        the cursor pending again. Cheap: pending holds only what is unacknowledged, and
        what is in flight is skipped."""
        if not self._active or self.restoring:
            return  # (restoring: it reads from the start once done)
        self._epoch += 1
        self._buffer.clear()
        self._cursor = 0
        self._caught_up = False
        self._load()
        if self.outflow is not None:
            self.outflow.pump()

    # -- internals -----------------------------------------------------------------------

    async def _restore(self) -> None:
        assert self._generation is not None
        while True:
            try:
                inflight = await self._store.inflight(self.client_id, self._generation)
                break
            except Exception as error:  # Redis away: the outflow waits meanwhile
                log.warning("reading what was in flight to %s failed: %s", self.client_id, error)
                await self._acks.retry.wait()
        self.restoring = False
        outflow = self.outflow
        if outflow is None:
            return
        # Whatever happened meanwhile (a reconnect, a re-read, an unsubscribe): the
        # client may hold these ids, so they go back in flight under them.
        items = [
            Outgoing(packet_id, self._delivery(entry), sent=True, marked=True, ref=entry)
            for packet_id, entry in sorted(inflight.items(), key=lambda p: p[1].seq)
        ]
        taken = outflow.restore_side(self, items)
        for item in taken:
            entry = self._entry(item)
            self._out[entry.key] = max(self._out.get(entry.key, 0), entry.seq)
            self._acks.sent(self.client_id).add((entry.key, entry.seq))
            held = self._buffer.get(entry.key)
            if held is not None and held.seq <= entry.seq:
                del self._buffer[entry.key]
        if not self.consuming:
            if outflow.side is self:
                outflow.detach_side()  # nothing more from the queue: it completes
            if not taken and outflow.detached_side is self:
                outflow.detached_side = None  # nothing in flight: a million sessions keep no feed
        elif self._active and not self._loading:
            self._caught_up = False
            self._load()
        outflow.pump()

    def _recorded_id(self, item: Outgoing) -> int:
        """The packet id its in-flight record is under (0: a session not recorded)."""
        return item.packet_id if self._generation is not None else 0

    def _add(self, entry: QueueEntry) -> None:
        buffer = self._buffer
        self._cursor = max(self._cursor, entry.seq)
        held = buffer.get(entry.key)
        if held is not None:
            if held.seq >= entry.seq:
                return
            del buffer[entry.key]  # replaced before it was sent: compacted
        out = self._out.get(entry.key)
        if out is not None and out < entry.seq:
            # Replaced while in flight: it completes, and is never sent again.
            self._acks.forget(self.client_id, entry.key, out)
        if self._out.get(entry.key, 0) < entry.seq:
            buffer[entry.key] = entry

    def _delivery(self, entry: QueueEntry) -> Delivery:
        delivery = entry_delivery(
            entry, self._wall_clock(), self._clock(), self._subscription_ids()
        )
        if self._with_seq:
            message = delivery.message
            properties = message.properties or Properties()
            properties.user_properties = (
                *properties.user_properties,
                (SEQ_PROPERTY, str(entry.seq)),
            )
            message.properties = properties
        return delivery

    @staticmethod
    def _entry(item: Outgoing) -> QueueEntry:
        entry = item.ref
        assert isinstance(entry, QueueEntry)
        return entry

    def _load(self) -> None:
        self._loading = True
        self._missed = False
        asyncio.get_running_loop().create_task(self._load_page(self._epoch))

    async def _load_page(self, epoch: int) -> None:
        self._done.clear()
        # Acknowledged and not yet written: the read may still find them pending.
        unwritten = self._acks.unwritten(self.client_id)
        try:
            entries, last_seq = await self._store.load(
                self.client_id, self._cursor, self._page_size
            )
            self._acks.retry.succeeded()
        except Exception as error:
            log.warning("queue read for %s failed: %s", self.client_id, error)
            await self._acks.retry.wait()
            entries, last_seq = None, 0
        if epoch != self._epoch:
            return
        self._loading = False
        outflow = self.outflow
        if entries is None:
            if outflow is not None:
                outflow.pump()
            return
        done, self._done = self._done, set()
        done |= unwritten | self._acks.unwritten(self.client_id)
        for entry in entries:
            if (entry.key, entry.seq) not in done:
                self._add(entry)
        if len(entries) < self._page_size and not self._missed:
            self._caught_up = True
            self._cursor = max(self._cursor, last_seq)
        if outflow is not None:
            outflow.pump()
