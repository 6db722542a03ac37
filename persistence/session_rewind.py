"""Rewinding a persistent session to a time: its records read back from Kafka.

Every message routed to a persistent session is a record of the persisted
topic, keyed by the session's client ID, so all of one client's records are in
one partition, in order. An operator's rewind (``POST
/api/v1/sessions/{client_id}/rewind``) reads that partition from its start,
keeps the client's records published at or after ``since``, and stores them
again for the session as new messages, marked sent: they go out after what is
already stored, in their original order, with DUP (they may have been seen).

What it can give is what Kafka still holds: on a real Kafka the topic's
``retention.ms`` / ``retention.bytes``; on the embedded Kafka of a single
broker only what came since its last compaction
(``persistence.embedded_kafka_compact_after`` records, persistence/compaction.py).
A record Kafka dropped is not rewound, and the answer says how far back the
partition reaches (``oldest``). Reading the partition from its start costs
its size; the client's own records are a share of it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.partitioner import murmur2

from persistence.format import (
    Stage,
    decode_record,
    encode_message,
    header_fields,
    is_queue_record,
)
from persistence.redis_store import RedisMessageStore

CHUNK = 1000  # messages stored per save script call
IDLE_LIMIT = 10.0  # seconds without a fetch answer before the read gives up


@dataclass(frozen=True, slots=True)
class Rewound:
    read: int  # records of the partition read
    matched: int  # the client's records published at or after ``since``
    stored: int  # stored again (the others: expired, or over the client's limit)
    oldest: float | None  # publish time of the partition's oldest record read


def partition_of(client_id: str, partitions: int) -> int:
    """The partition of a client's records: Kafka's default partitioner on the key,
    as the producer (persistence/kafka_path.py) gives it."""
    return int(murmur2(client_id.encode()) & 0x7FFFFFFF) % partitions


async def read_client_records(
    bootstrap: str, topic: str, client_id: str, since: float
) -> tuple[list[bytes], int, float | None]:
    """The values of ``client_id``'s records published at or after ``since``, in
    partition order; how many records were read; the oldest publish time seen."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=50,
    )
    await consumer.start()
    try:
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            await consumer.topics()
            partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            return [], 0, None
        tp = TopicPartition(topic, partition_of(client_id, len(partitions)))
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        key = client_id.encode()
        found: list[bytes] = []
        read, oldest = 0, None
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
                if value is None:
                    continue
                published = header_fields(value)[2]
                if oldest is None:
                    oldest = published
                if record.key == key and published >= since and not is_queue_record(value):
                    found.append(value)  # a queue's writes share the key: not the session's
            if highwater is not None and await consumer.position(tp) >= highwater:
                return found, read, oldest
            if records:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > IDLE_LIMIT:
                raise TimeoutError(f"{topic}[{tp.partition}]: no fetch answer from {bootstrap}")
    finally:
        await consumer.stop()


async def rewind_session(
    store: RedisMessageStore, bootstrap: str, topic: str, client_id: str, since: float
) -> Rewound:
    """Store again, marked sent, the client's records published since ``since``."""
    values, read, oldest = await read_client_records(bootstrap, topic, client_id, since)
    messages = []
    for value in values:
        record = decode_record(0, 0, value)
        if record.stage is not Stage.PUBLISH or record.message is None:
            continue
        # A copy for the session as it is now: no record identity (a rewind twice
        # gives it twice) and no generation (it is not an ended session's message).
        messages.append(replace(record.message, producer=0, seq=0, generation=0))
    stored = 0
    for start in range(0, len(messages), CHUNK):
        chunk = [encode_message(m, sent=True) for m in messages[start : start + CHUNK]]
        result = await store.save_batch(client_id, chunk, "rewind")
        stored += result.saved
    return Rewound(read, len(values), stored, oldest)
