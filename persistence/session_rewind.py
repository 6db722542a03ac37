"""Rewinding a persistent session to a time: its records read back from Kafka.

Every message routed to a persistent session is a record of the persisted
topic, keyed by the session's client ID, so all of one client's records are in
one partition, in order. An operator's rewind (``POST
/api/v1/sessions/{client_id}/rewind``) reads that partition from its start,
keeps the records routed to the client's *current* session (its generation:
not an ended session's, not another owner's) published at or after ``since``,
and stores them again as new messages flagged ``REPLAY`` (persistence/format.py):
after what waits already, in their order, each sent with DUP at its first send
while limits, the ACL and message expiry apply to it as to any message.

A rewind never makes room: it stores at most what the client's limit has room
for now, the newest of the matched records, and says how many did not fit
(``over_limit``); the backlog waiting for the client is never trimmed for it.

What it can give is what Kafka still holds: on a real Kafka the topic's
``retention.ms`` / ``retention.bytes``; on the embedded Kafka of a single
broker only what came since its last compaction
(``persistence.embedded_kafka_compact_after`` records, persistence/compaction.py).
The answer says how far back the partition reaches (``oldest``). Reading the
partition from its start costs its size; only the client's records are
decoded, and at most the room's worth are kept in memory.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, replace

from aiokafka import AIOKafkaConsumer, TopicPartition

from persistence.consumer import stop_consumer
from persistence.format import (
    BYTES_FIELD,
    Stage,
    client_keys,
    decode_record,
    encode_message,
    header_fields,
    is_queue_record,
    partition_of,
    record_id,
)
from persistence.kafka_security import PLAINTEXT, KafkaSecurity
from persistence.redis_store import RedisMessageStore

CHUNK = 1000  # messages stored per save script call
IDLE_LIMIT = 10.0  # seconds without a fetch answer before the read gives up


class RewindUnderWay(Exception):
    """A rewind of this client's session is already running."""


@dataclass(frozen=True, slots=True)
class Rewound:
    read: int  # records of the partition read
    matched: int  # the session's records published at or after ``since``
    stored: int  # stored again
    over_limit: int  # matched, but beyond the room the client's limit left
    oldest: float | None  # publish time of the partition's oldest record read


async def read_client_records(
    bootstrap: str,
    topic: str,
    client_id: str,
    generation: int,
    since: float,
    keep: int,
    security: KafkaSecurity = PLAINTEXT,
) -> tuple[list[bytes], int, int, float | None]:
    """The last ``keep`` values of ``client_id``'s records routed to its session of
    ``generation`` and published at or after ``since``, in partition order; how many
    matched; how many records were read; the oldest publish time seen."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=50,
        **security.aiokafka(),
    )
    await consumer.start()
    try:
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            await consumer.topics()
            partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            return [], 0, 0, None
        tp = TopicPartition(topic, partition_of(client_id, len(partitions)))
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        key = client_id.encode()
        found: deque[bytes] = deque(maxlen=keep) if keep > 0 else deque(maxlen=0)
        read = matched = 0
        oldest: float | None = None
        idle_since = time.monotonic()
        while True:
            batches = await consumer.getmany(tp, timeout_ms=200, max_records=5000)
            records = batches.get(tp, [])
            # The high watermark comes with every fetch answer (on Tansu too, whose
            # ListOffsets counts batches): the read is done once the position is there.
            highwater = consumer.highwater(tp)
            for record in records:
                read += 1
                value = record.value
                if oldest is None and value:
                    oldest = _published(value)
                if record.key != key or not value or is_queue_record(value):
                    continue  # another client's, or its $ECQ queue's (same key)
                published = _published(value)
                if published is None or published < since:
                    continue
                if record_id(value).generation != generation:
                    continue  # routed to an ended session (or another owner's)
                matched += 1
                found.append(value)
            if highwater is not None and await consumer.position(tp) >= highwater:
                return list(found), matched, read, oldest
            if records:
                idle_since = time.monotonic()
                await asyncio.sleep(0)  # a long partition does not hold the loop
            elif time.monotonic() - idle_since > IDLE_LIMIT:
                raise TimeoutError(f"{topic}[{tp.partition}]: no fetch answer from {bootstrap}")
    finally:
        await stop_consumer(consumer)


def _published(value: bytes) -> float | None:
    try:
        return header_fields(value)[2]
    except (ValueError, IndexError, UnicodeDecodeError):
        return None  # a value in no format this broker reads: not the session's


async def rewind_session(
    store: RedisMessageStore,
    bootstrap: str,
    topic: str,
    client_id: str,
    since: float,
    security: KafkaSecurity = PLAINTEXT,
) -> Rewound:
    """Store again, flagged REPLAY, the session's records published since ``since``,
    as many as its limit has room for (the newest of them)."""
    keys = client_keys(client_id)
    generation = int(await store.redis.get(keys.generation) or 0)
    room = max(0, store.limit - await store.pending_count(client_id))
    values, matched, read, oldest = await read_client_records(
        bootstrap, topic, client_id, generation, since, room, security
    )
    if store.max_bytes:  # the byte limit leaves room too: the newest that fit
        free = store.max_bytes - int(await store.redis.hget(keys.values, BYTES_FIELD) or 0)
        while values and sum(len(v) for v in values) > free:
            values.pop(0)
    stored = 0
    for start in range(0, len(values), CHUNK):
        chunk = []
        for value in values[start : start + CHUNK]:
            record = decode_record(0, 0, value)
            if record.stage is not Stage.PUBLISH or record.message is None:
                continue
            # No record identity (a second rewind gives it again), this session's
            # generation (a clean start meanwhile drops the copies).
            copy = replace(record.message, producer=0, seq=0, generation=generation)
            chunk.append(encode_message(copy, replay=True))
        result = await store.save_batch(client_id, chunk, "rewind")
        stored += result.saved
    return Rewound(read, matched, stored, matched - len(values), oldest)
