"""The persistent path's second leg: Kafka records into Redis, then to the client.

One consumer group inside the broker reads ``devicemq.device.persisted`` in
batches (``getmany``), groups each batch by subscriber (the record key), and
stores each client's part with one script call, all of a batch in one round
trip. Offsets are committed only after Redis stored the batch, so a crash
re-reads it; the store skips offsets it already has, so re-reading never
stores twice. The commit runs beside delivery, not before it: the messages
are in Redis already, and a commit that is lost only means a re-read.

Offsets restart at 0 when the topic is created anew (the embedded Kafka keeps
no data across restarts; an operator may recreate the topic). The store's
offset record is therefore keyed by ``<epoch>:<partition>``, where the epoch
counts how often devicemq created the topic: stale records of an earlier
incarnation never make new messages look already stored. A
batch Redis cannot take is retried until it can: the consumer stalls, it
never skips (tbmq#320).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError

from persistence.events import NO_EVENTS, EventSink
from persistence.redis_store import (
    ClientBatch,
    PersistedMessageStore,
    SaveResult,
    Stage,
    StoredRecord,
    decode_record,
)

log = logging.getLogger("devicemq.consumer")

RETRY_DELAY = 0.5  # seconds between attempts to store a batch Redis refused

StoredHandler = Callable[[str, Callable[[], list[StoredRecord]]], None]
RoomFor = Callable[[str], int]  # client id -> messages it can be sent right now


@dataclass(slots=True)
class ConsumerStats:
    records_consumed: int = 0
    messages_stored: int = 0
    duplicates_skipped: int = 0
    messages_trimmed: int = 0
    expired_on_arrival: int = 0
    save_errors: int = 0
    commit_errors: int = 0
    committed: dict[int, int] = field(default_factory=dict)  # partition -> next offset


def make_consumer(bootstrap: str, topic: str, group: str) -> AIOKafkaConsumer:
    """A group member with DESIGN.md's settings for Tansu's slow joins and low latency."""
    return AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=2000,
        heartbeat_interval_ms=500,
        fetch_max_wait_ms=20,
        max_poll_interval_ms=3_600_000,  # a stalled Redis must not cost the assignment
    )


class PersistenceConsumer:
    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        store: PersistedMessageStore,
        on_stored: StoredHandler,
        max_records: int,
        epoch: int = 0,
        room_for: RoomFor = lambda client_id: 0,
    ) -> None:
        self._consumer = consumer
        self._room_for = room_for
        self._epoch = epoch
        self._store = store
        self._on_stored = on_stored
        self._max_records = max_records
        self.stats = ConsumerStats()
        self.events: EventSink = NO_EVENTS  # delivery events (persistence/events.py)
        self._to_commit: dict[TopicPartition, int] = {}
        self._committer: asyncio.Task[None] | None = None

    async def run(self) -> None:
        while True:
            batches = await self._consumer.getmany(timeout_ms=100, max_records=self._max_records)
            if batches:
                await self.process(batches)

    async def process(self, batches: dict[TopicPartition, list[ConsumerRecord]]) -> None:
        client_batches: list[ClientBatch] = []
        commit: dict[TopicPartition, int] = {}
        for tp, records in batches.items():
            by_client: dict[str, tuple[list[bytes], list[int]]] = {}
            for record in records:
                values, offsets = by_client.setdefault(record.key.decode(), ([], []))
                values.append(record.value)
                offsets.append(record.offset)
            log_id = f"{self._epoch}:{tp.partition}"
            room_for = self._room_for
            client_batches.extend(
                # Stored marked sent, as many as go out at once: no mark write for them.
                ClientBatch(client_id, values, log_id, offsets, room_for(client_id))
                for client_id, (values, offsets) in by_client.items()
            )
            commit[tp] = records[-1].offset + 1
            self.stats.records_consumed += len(records)
        results = await self._save(client_batches)
        self._commit_soon(commit)
        for batch, result in zip(client_batches, results, strict=True):
            self._account(result)
            self.events.stored(batch, result)
            if result.saved or result.duplicates:
                # Duplicates too: a save whose reply was lost stored them, unseen.
                self._on_stored(batch.client_id, _records_of(batch, result))

    async def _save(self, batches: list[ClientBatch]) -> list[SaveResult]:
        while True:
            try:
                return await self._store.save_many(batches)
            except Exception as error:  # BatchSaveError, connection errors, cluster errors
                self.stats.save_errors += 1
                log.warning("storing %d client batches failed, retrying: %s", len(batches), error)
                await asyncio.sleep(RETRY_DELAY)

    async def commits_done(self) -> None:
        """Wait until every offset handed to Kafka so far is committed (or failed)."""
        while self._committer is not None:
            await asyncio.shield(self._committer)

    def _commit_soon(self, offsets: dict[TopicPartition, int]) -> None:
        """One commit in flight; offsets asked meanwhile go together in the next."""
        self._to_commit.update(offsets)
        if self._committer is None:
            self._committer = asyncio.get_running_loop().create_task(self._commit_pending())

    async def _commit_pending(self) -> None:
        try:
            while self._to_commit:
                offsets, self._to_commit = self._to_commit, {}
                await self._commit(offsets)
        finally:
            self._committer = None

    async def _commit(self, offsets: dict[TopicPartition, int]) -> None:
        try:
            await self._consumer.commit(offsets)
        except KafkaError as error:
            # Lost the assignment (rebalance): the next owner re-reads these
            # records and the store skips them as already saved.
            self.stats.commit_errors += 1
            log.warning("offset commit failed: %s", error)
            return
        for tp, offset in offsets.items():
            self.stats.committed[tp.partition] = offset

    def _account(self, result: SaveResult) -> None:
        stats = self.stats
        stats.messages_stored += result.saved
        stats.duplicates_skipped += result.duplicates
        stats.messages_trimmed += result.trimmed
        stats.expired_on_arrival += result.expired


def _records_of(batch: ClientBatch, result: SaveResult) -> Callable[[], list[StoredRecord]]:
    """The stored records, decoded only if someone wants them (the client is here)."""

    def decode() -> list[StoredRecord]:
        records: list[StoredRecord] = []
        premarked = batch.premark
        for value, assigned in zip(batch.messages, result.assigned, strict=True):
            if assigned is not None:
                assert isinstance(value, bytes)
                record = decode_record(
                    assigned.packet_id, assigned.score, value, marked=len(records) < premarked
                )
                assert record.stage is Stage.PUBLISH
                records.append(record)
        return records

    return decode
