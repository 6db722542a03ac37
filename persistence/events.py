"""Delivery events: what happened to every persisted message, for the audit pipeline.

The broker appends compact positional events to the Kafka topic ``devicemq.events``
(``events.topic``), each client's in the partition its client id would be
keyed to (``partition_of`` of persistence/format.py, Kafka's default
partitioner), so one client's events stay in one partition, in the order they
happened, beside its persisted records' partition number. ``pipeline/`` reads them back
(audit, traffic). Events, by their ``ev`` field:

=================  ==========================================================
``persisted``      stored in Redis: ``pid``, ``sc`` (score), ``part``/``off``
                   (Kafka record of ``devicemq.device.persisted``), ``ep``
                   (topic epoch), ``topic``, ``size`` (payload bytes),
                   ``pub`` (publish time), ``exp`` (absolute expiry or null)
``delivered``      written to the client: ``pid``, ``sc``, ``dup``
``acked``          PUBACK / PUBCOMP (or a failed PUBREC): removed from Redis
``expired``        ``at``: ``arrival`` (expired before it was stored; ``part``,
                   ``off``, ``ep``, no ``pid``) or ``delivery`` (``pid``, ``sc``)
``dropped``        too large for the client (Maximum Packet Size): removed
``trimmed``        removed by the per-client limit: ``pids``, oldest first; or
                   ``at``: ``arrival`` (``part``/``off``/``ep``): not stored, the
                   limit being full of messages in flight
``discarded``      ``at``: ``arrival`` (``part``/``off``/``ep``): routed for a
                   session that had ended (an older generation): not stored
``duplicate``      (``part``/``off``/``ep``) a record stored before: read
                   again, or produced twice by a retried request
``purged``         removed by an operator's backlog purge: ``pid``, ``sc``
``admin``          an operator's write through the admin API: ``action``
                   (``kick``, ``delete_session``, ``purge``, ``block``,
                   ``unblock``, ``delete_retained``, ``purge_queue``: a
                   queue or group store, its id as ``cid``) and ``detail``;
                   ``cid`` is the client concerned, or empty
``connected``, ``disconnected``, ``session_expired``, ``session_ended``
                   session lifecycle of durable sessions
``gap``            ``n`` events were dropped (Kafka too slow, buffer full)
``compacted``      a queue entry replaced by a newer value of its key before it
                   was acknowledged (``by``: the newer one's ``sc``)
=================  ==========================================================

Exclusive compacted queues (broker/ecq.py) report with the same kinds under
the consumer's ``cid``; their ``sc`` is the entry's sequence number
*negated* (a session's scores are positive, so one client's messages and
its queue's never share an ``sc``), ``pid`` is 0 and ``q`` names the key.
An entry that retention removed unacknowledged is ``expired`` (``at``:
``retention``), one the key or byte limit removed is ``trimmed`` with an
``sc``; a write refused at the byte limit (``ecq.max_bytes``) is ``trimmed``
``at`` ``arrival``.

Every event has ``ev``, ``cid`` and ``ts`` (epoch seconds). A Kafka record
carries the events of one flush for one partition's clients, in the order they
happened (so each client's in order), laid out by position: ``[2, event, ...]``,
each event an array of its layout's number, ``cid``, ``ts`` and the layout's
fields (persistence/format.py, "Delivery event record" and ``EVENT_LAYOUTS``:
which layout is which kind, and with which fields in which order). A layout
stands for the kind and its fixed fields (``expired`` ``at`` ``delivery`` is
one, ``at`` ``arrival`` another), so neither field names nor kinds are written;
records written before 2026-11-29 hold the same events as JSON objects by name,
and :func:`persistence.format.decode_event_record` reads both, as the pipeline
does. A record per partition and flush, not per client or event (a send costs
far more than encoding; with thousands of devices a message each, one per
client was the broker's largest cost, BENCHMARKS.md "The fleet shape"), split
into several records of at most 256 KiB when a flush is larger. Its key is
empty: readers take the client from each event's ``cid``. Should the producer
not know the topic's partitions, a flush writes a record per client, keyed by
its id, as before. A record Kafka refuses is counted in a ``gap`` event: the
audit sees a gap, never a false ``lost``.

Off the hot path: an emitting call appends the event's tuple, as it will be
written, to a list and returns (a consumer's save is unfolded into its events
at the flush); one task wakes every ``interval`` seconds, encodes what
accumulated (one ``orjson.dumps`` per record: no dict, no per-event work but
finding its partition) and hands it to its own producer (acks=1: an event is a
record, not a promise to a publisher). Nothing on the delivery path ever awaits it. The buffer is
bounded: while Kafka is too slow, events over ``max_buffer`` are counted in
:attr:`EventLog.dropped` and a ``gap`` event tells the audit about them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from persistence.format import (
    EV_ACKED,
    EV_ADMIN,
    EV_CONNECTED,
    EV_DELIVERED,
    EV_DISCARDED_ARRIVAL,
    EV_DISCONNECTED,
    EV_DROPPED,
    EV_DUPLICATE,
    EV_EXPIRED_ARRIVAL,
    EV_EXPIRED_DELIVERY,
    EV_GAP,
    EV_PERSISTED,
    EV_PURGED,
    EV_Q_ACKED,
    EV_Q_COMPACTED,
    EV_Q_DELIVERED,
    EV_Q_DROPPED,
    EV_Q_EXPIRED,
    EV_Q_PERSISTED,
    EV_Q_PURGED,
    EV_Q_REFUSED,
    EV_Q_TRIMMED,
    EV_SESSION_ENDED,
    EV_SESSION_EXPIRED,
    EV_TRIMMED,
    EV_TRIMMED_ARRIVAL,
    EVENTS_LAYOUT,
    header_fields,
    partition_of,
)
from persistence.kafka_security import PLAINTEXT, KafkaSecurity
from persistence.queue_store import DUPLICATE as QUEUE_DUPLICATE
from persistence.queue_store import REFUSED, RETENTION
from persistence.redis_store import DISCARDED, DUPLICATE, UNSTORED

if TYPE_CHECKING:
    from aiokafka import AIOKafkaProducer

    from broker.config import Settings
    from broker.session import Session
    from persistence.format import StoredRecord
    from persistence.queue_store import QueueBatch, QueueSaveResult
    from persistence.redis_store import ClientBatch, SaveResult

__all__ = [
    "NO_EVENTS",
    "EventLog",
    "EventSink",
    "NullEvents",
    "end_kind",
    "header_fields",
    "make_event_producer",
    "open_event_log",
]

log = logging.getLogger("devicemq.events")

DEFAULT_INTERVAL = 0.05  # seconds between flushes
DEFAULT_MAX_BUFFER = 100_000  # events waiting for Kafka before new ones are dropped
# One record's value at most: well under Kafka's default message.max.bytes (1 MB) and
# the producer's max_request_size, so a busy client's flush never fails as too large.
MAX_RECORD_BYTES = 256 * 1024


class EventSink(Protocol):
    """Where the persistent path reports what it did (all calls return at once)."""

    def stored(self, batch: ClientBatch, result: SaveResult) -> None: ...

    def delivered(self, client_id: str, record: StoredRecord) -> None: ...

    def acked(self, client_id: str, record: StoredRecord) -> None: ...

    def discarded(self, client_id: str, record: StoredRecord) -> None: ...

    def session(self, client_id: str, kind: str) -> None: ...

    def purged(self, client_id: str, packet_id: int, score: int) -> None: ...

    def admin(self, client_id: str, action: str, detail: Any) -> None: ...

    def queue_stored(self, batch: QueueBatch, result: QueueSaveResult) -> None: ...

    def queue(self, client_id: str, kind: str, seq: int, key: str, dup: bool = False) -> None:
        """``delivered``, ``acked`` or ``discarded`` of the queue entry ``seq``."""


class NullEvents:
    """Events turned off: every call does nothing."""

    def stored(self, batch: ClientBatch, result: SaveResult) -> None:
        pass

    def delivered(self, client_id: str, record: StoredRecord) -> None:
        pass

    def acked(self, client_id: str, record: StoredRecord) -> None:
        pass

    def discarded(self, client_id: str, record: StoredRecord) -> None:
        pass

    def session(self, client_id: str, kind: str) -> None:
        pass

    def purged(self, client_id: str, packet_id: int, score: int) -> None:
        pass

    def admin(self, client_id: str, action: str, detail: Any) -> None:
        pass

    def queue_stored(self, batch: QueueBatch, result: QueueSaveResult) -> None:
        pass

    def queue(self, client_id: str, kind: str, seq: int, key: str, dup: bool = False) -> None:
        pass


NO_EVENTS = NullEvents()

# Buffered entries: (layout number, client id, time, its fields...), the event as it is
# written (persistence/format.py, "Delivery event record"), or a consumer's save to
# unfold at the flush: (_STORED or _QUEUE_STORED, client id, time, batch, result).
_Entry = tuple[Any, ...]
_STORED, _QUEUE_STORED = -1, -2
_SESSION_KINDS = {
    "connected": EV_CONNECTED,
    "disconnected": EV_DISCONNECTED,
    "session_expired": EV_SESSION_EXPIRED,
    "session_ended": EV_SESSION_ENDED,
}
_QUEUE_KINDS = {
    "delivered": EV_Q_DELIVERED,
    "acked": EV_Q_ACKED,
    "discarded": EV_Q_DROPPED,  # too large for the client (expired: not asked)
    "purged": EV_Q_PURGED,
}
_RECORD_START = b"[%d," % EVENTS_LAYOUT  # a record: the layout, then its events


class EventLog:
    """:class:`EventSink` writing to a Kafka topic, batched, never blocking.

    It owns ``producer`` (started by the caller, stopped by :meth:`close`).
    """

    def __init__(
        self,
        producer: AIOKafkaProducer,
        topic: str,
        *,
        epoch: int = 0,
        default_ttl: float = 7 * 24 * 3600,
        interval: float = DEFAULT_INTERVAL,
        max_buffer: int = DEFAULT_MAX_BUFFER,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._producer = producer
        self.topic = topic
        # The persisted topic's epoch now (it changes when a log reset is announced).
        self.epoch_of: Callable[[], int] = lambda: epoch
        self._default_ttl = default_ttl
        self._interval = interval
        self._max_buffer = max_buffer
        self._clock = clock
        self._buffer: list[_Entry] = []
        self._connected: dict[str, bool] = {}
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.written = 0  # records written (one per partition and flush)
        self.dropped = 0  # events lost to a full buffer, records to produce errors
        self.errors = 0  # produce failures
        self._gap = 0  # dropped since the last gap event
        self.bytes_in_topic = 0  # written since the start or the last rotate()
        self.rotations = 0
        self._flushing = asyncio.Lock()  # a flush and a rotation never overlap

    # -- EventSink (hot path: append and return) ----------------------------------------
    # Each call appends the event as it will be written: the flush only sorts the
    # entries by partition and encodes them, field names and kinds are never written.

    def _full(self) -> bool:
        if len(self._buffer) < self._max_buffer:
            return False
        self.dropped += 1
        self._gap += 1
        return True

    def stored(self, batch: ClientBatch, result: SaveResult) -> None:
        if not self._full():
            self._buffer.append((_STORED, batch.client_id, self._clock(), batch, result))

    def delivered(self, client_id: str, record: StoredRecord) -> None:
        if not self._full():
            self._buffer.append(
                (
                    EV_DELIVERED,
                    client_id,
                    self._clock(),
                    record.packet_id,
                    record.score,
                    record.sent,
                )
            )

    def acked(self, client_id: str, record: StoredRecord) -> None:
        if not self._full():
            self._buffer.append(
                (EV_ACKED, client_id, self._clock(), record.packet_id, record.score)
            )

    def discarded(self, client_id: str, record: StoredRecord) -> None:
        if self._full():
            return
        message = record.message
        expiry = None if message is None else message.expiry
        now = self._clock()
        layout = EV_EXPIRED_DELIVERY if expiry is not None and expiry <= now else EV_DROPPED
        self._buffer.append((layout, client_id, now, record.packet_id, record.score))

    def session(self, client_id: str, kind: str) -> None:
        """``connected``/``disconnected`` (only on a change), ``session_expired``/``_ended``."""
        if kind in ("connected", "disconnected"):
            now = kind == "connected"
            if self._connected.get(client_id) == now:
                return  # a state save that is not a connect or disconnect
            self._connected[client_id] = now
        else:
            self._connected.pop(client_id, None)
        if not self._full():
            self._buffer.append((_SESSION_KINDS[kind], client_id, self._clock()))

    def purged(self, client_id: str, packet_id: int, score: int) -> None:
        if not self._full():
            self._buffer.append((EV_PURGED, client_id, self._clock(), packet_id, score))

    def admin(self, client_id: str, action: str, detail: Any) -> None:
        if not self._full():
            self._buffer.append((EV_ADMIN, client_id, self._clock(), action, detail))

    def queue_stored(self, batch: QueueBatch, result: QueueSaveResult) -> None:
        if not self._full():
            self._buffer.append((_QUEUE_STORED, batch.client_id, self._clock(), batch, result))

    def queue(self, client_id: str, kind: str, seq: int, key: str, dup: bool = False) -> None:
        if self._full():
            return
        layout = _QUEUE_KINDS[kind]
        if layout == EV_Q_DELIVERED:
            self._buffer.append((layout, client_id, self._clock(), -seq, key, dup))
        else:
            self._buffer.append((layout, client_id, self._clock(), -seq, key))

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        """Let the task finish its flush, write what is left, stop the producer."""
        self._closing = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.flush()
        with contextlib.suppress(Exception):
            await self._producer.stop()

    async def _run(self) -> None:
        # Never cancelled mid-flush: entries taken from the buffer are always sent.
        while not self._closing:
            await asyncio.sleep(self._interval)
            if self._buffer or self._gap:
                try:
                    await self.flush()
                except Exception:  # a broken flush must not end event logging
                    log.exception("writing delivery events failed")

    async def rotate(self, replace: Callable[[], Awaitable[object]]) -> None:
        """Empty the topic with ``replace`` (delete it and create it again) between two
        flushes: events meanwhile wait in the buffer, none is sent to a topic being
        deleted (persistence/compaction.py, for an embedded Kafka)."""
        async with self._flushing:
            await replace()
            self.bytes_in_topic = 0
            self.rotations += 1

    async def flush(self) -> None:
        """Encode and produce everything buffered; wait for Kafka's answer."""
        async with self._flushing:
            await self._flush()

    async def _flush(self) -> None:
        entries, self._buffer = self._buffer, []
        records = self.encode(entries, await self._partitions())
        if self._gap:
            gap = (EV_GAP, "", self._clock(), self._gap)
            records.append((None, b"", orjson.dumps([EVENTS_LAYOUT, gap])))
            self._gap = 0
        futures = []
        sizes = []
        for partition, key, value in records:
            try:
                futures.append(
                    await self._producer.send(
                        self.topic, value=value, key=key or None, partition=partition
                    )
                )
                sizes.append(len(key) + len(value))
            except Exception as error:
                self._failed(error)
        results = await asyncio.gather(*futures, return_exceptions=True)
        for result, size in zip(results, sizes, strict=True):
            if isinstance(result, BaseException):
                self._failed(result)
            else:
                self.written += 1
                self.bytes_in_topic += size

    def _failed(self, error: BaseException) -> None:
        # A record carries several events; the gap counts records (a lower bound).
        self.errors += 1
        self.dropped += 1
        self._gap += 1
        if self.errors == 1 or self.errors % 1000 == 0:
            log.warning("delivery event not written (%d so far): %s", self.errors, error)

    async def _partitions(self) -> int:
        """The topic's partitions as the producer knows them (it fetches the metadata
        once); 0 when it cannot tell: a record per client then."""
        try:
            known = await self._producer.partitions_for(self.topic)
        except Exception as error:
            log.debug("partitions of %s unknown: %s", self.topic, error)
            return 0
        return len(known) if known and known == set(range(len(known))) else 0

    # -- encoding -------------------------------------------------------------------------

    def encode(
        self, entries: Sequence[_Entry], partitions: int = 0
    ) -> list[tuple[int | None, bytes, bytes]]:
        """Buffered entries -> (partition, key, events record) records: one per
        partition of ``partitions`` holding its clients' events, in the order they
        happened (so each client's in order); with ``partitions`` 0, one per client
        keyed by its id.

        A Kafka send costs far more than encoding: per partition, not per client or
        event, the cost of a flush does not grow with the clients it covers.
        """
        epoch = self.epoch_of()
        groups: dict[Any, list[_Entry]] = {}
        if partitions == 1:  # the embedded Kafka of a single broker: one group
            single: list[_Entry] = []
            groups[0] = single
            for entry in entries:
                if entry[0] >= 0:
                    single.append(entry)
                elif entry[0] == _STORED:
                    self._stored_events(entry, epoch, single)
                else:
                    self._queue_stored_events(entry, epoch, single)
            entries = ()
        where: dict[str, Any] = {}  # client id -> its group, for this flush
        for entry in entries:
            cid = entry[1]
            group = where.get(cid)
            if group is None:
                group = where[cid] = partition_of(cid, partitions) if partitions else cid
            out = groups.get(group)
            if out is None:
                out = groups[group] = []
            if entry[0] >= 0:
                out.append(entry)
            elif entry[0] == _STORED:
                self._stored_events(entry, epoch, out)
            else:
                self._queue_stored_events(entry, epoch, out)
        records: list[tuple[int | None, bytes, bytes]] = []
        for group, events in groups.items():
            if not events:
                continue
            if partitions:
                records.extend((group, b"", value) for value in _records(events))
            else:
                key = group.encode()
                records.extend((None, key, value) for value in _records(events))
        return records

    def _stored_events(self, entry: _Entry, epoch: int, out: list[_Entry]) -> None:
        _, client_id, ts, batch, result = entry
        partition = int(batch.partition)
        offsets = batch.offsets
        outcomes = result.outcomes
        for i, value in enumerate(batch.messages):
            if not isinstance(value, bytes):
                continue  # only the consumer's raw records are reported
            outcome = outcomes[i]
            offset = offsets[i] if offsets is not None else -1
            if outcome == DUPLICATE:
                # Stored before (a record read again, or produced twice).
                out.append((EV_DUPLICATE, client_id, ts, partition, offset, epoch))
                continue
            topic, size, published, expiry = header_fields(value)
            if outcome > 0:
                assigned = result.assigned[i]
                assert assigned is not None
                if expiry is None:
                    expiry = ts + self._default_ttl
                out.append(
                    (EV_PERSISTED, client_id, ts, assigned.packet_id, assigned.score,
                     partition, offset, epoch, topic, size, published, expiry)
                )  # fmt: skip
                continue
            if outcome == DISCARDED:
                layout = EV_DISCARDED_ARRIVAL  # routed for a session that had ended
            elif outcome == UNSTORED:
                layout = EV_TRIMMED_ARRIVAL  # over the limit, every stored one in flight
            else:
                layout = EV_EXPIRED_ARRIVAL
            out.append((layout, client_id, ts, partition, offset, epoch, topic, size, published))
        if result.trimmed_ids:
            out.append((EV_TRIMMED, client_id, ts, result.trimmed_ids))

    def _queue_stored_events(self, entry: _Entry, epoch: int, out: list[_Entry]) -> None:
        _, client_id, ts, batch, result = entry
        partition, offsets = int(batch.partition), batch.offsets
        for i, value in enumerate(batch.values):
            offset = offsets[i] if offsets else -1
            seq = result.seqs[i]
            if seq == QUEUE_DUPLICATE:
                out.append((EV_DUPLICATE, client_id, ts, partition, offset, epoch))
                continue
            if seq == REFUSED:  # not stored: the queue was at its byte limit
                out.append((EV_Q_REFUSED, client_id, ts, partition, offset, epoch))
                continue
            topic, size, published, _expiry = header_fields(value)
            key = result.keys[i]
            out.append(
                (EV_Q_PERSISTED, client_id, ts, -seq, key, partition, offset, epoch,
                 topic, size, published)
            )  # fmt: skip
            if result.replaced[i]:
                out.append((EV_Q_COMPACTED, client_id, ts, -result.replaced[i], -seq, key))
        for removed in result.removed:
            if not removed.pending:
                continue  # acknowledged already: only what a rewind could give went
            layout = EV_Q_EXPIRED if removed.why == RETENTION else EV_Q_TRIMMED
            out.append((layout, client_id, ts, -removed.seq, removed.key))


def _records(events: list[_Entry]) -> list[bytes]:
    """Events (one client's, or one partition's clients') as records of at most
    :data:`MAX_RECORD_BYTES` each, in order: one record per flush would outgrow Kafka's
    request size for a busy flush (a single event is far smaller than the limit)."""
    value = _RECORD_START + orjson.dumps(events)[1:]
    if len(value) <= MAX_RECORD_BYTES or len(events) == 1:
        return [value]
    half = len(events) // 2
    return _records(events[:half]) + _records(events[half:])


def make_event_producer(
    bootstrap: str, request_timeout_ms: int, security: KafkaSecurity = PLAINTEXT
) -> AIOKafkaProducer:
    """The events' own producer: a slow events topic never queues persisted records."""
    from aiokafka import AIOKafkaProducer

    return AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        acks=1,
        enable_idempotence=False,
        linger_ms=20,
        request_timeout_ms=request_timeout_ms,
        max_batch_size=512 * 1024,
        **security.aiokafka(),
    )


def end_kind(session: Session, now: float) -> str:
    """``session_expired`` if the session ended as its expiry passed, else ``session_ended``."""
    expires_at = session.expires_at
    return "session_expired" if expires_at is not None and now >= expires_at else "session_ended"


async def open_event_log(
    settings: Settings, bootstrap: str, epoch: int, security: KafkaSecurity = PLAINTEXT
) -> EventLog | None:
    """The configured event log, its topic created and its producer started (None: off)."""
    if not settings.events.enabled:
        return None
    from persistence.kafka_path import ensure_topic

    persistence = settings.persistence
    await ensure_topic(bootstrap, settings.events.topic, persistence.partitions, security=security)
    producer = make_event_producer(bootstrap, persistence.kafka_request_timeout_ms, security)
    await producer.start()
    return EventLog(
        producer, settings.events.topic, epoch=epoch, default_ttl=persistence.default_message_ttl
    )
