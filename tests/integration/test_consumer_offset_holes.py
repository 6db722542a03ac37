"""A fetch that skips an offset (issue 16, finding 4).

The embedded Kafka (Tansu) numbers a produce request's batch before it writes
it; a fetch meanwhile returns a later batch (another replica's producer) and
not the earlier one. Stored past that hole, the later record made the earlier
one, fetched a moment after, look stored already ((producer, seq) below the
last stored): one acknowledged message lost per stream in that batch. The
race itself cannot be made to happen on demand in Tansu; the fetches it
produces are driven here, deterministically, into the real consumer, storing
into a real Redis (single and cluster) and seeking a real Kafka consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import ConsumerRecord, TopicPartition

from persistence.consumer import HOLE_WAIT, PersistenceConsumer, make_consumer
from persistence.format import StoredMessage, encode_message
from persistence.redis_store import RedisMessageStore
from tests.kafka_fixtures import tansu  # noqa: F401  (pytest fixture)


def _record(topic: str, offset: int, client: str, seq: int) -> ConsumerRecord:
    value = encode_message(
        StoredMessage(topic="t", payload=b"%d" % seq, qos=1, producer=7, seq=seq)
    )
    return ConsumerRecord(topic, 0, offset, 0, 0, client.encode(), value, None, 0, 0, [])


async def _stored(store: RedisMessageStore, client: str) -> list[bytes]:
    page = await store.load_page(client, 0, 100)
    return [r.message.payload for r in page.records if r.message is not None]


@contextlib.asynccontextmanager
async def _consumer(
    bootstrap: str, store: RedisMessageStore, now: list[float]
) -> AsyncIterator[tuple[PersistenceConsumer, AIOKafkaConsumer, str]]:
    """A consumer of a new one-partition topic, assigned it, on a settable clock."""
    topic, group = f"holes.{uuid.uuid4().hex[:8]}", f"holes-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 1, 1)])
    finally:
        await admin.close()
    kafka = make_consumer(bootstrap, group)
    consumer = PersistenceConsumer(
        kafka, topic, store, lambda c, r: None, 100, clock=lambda: now[0]
    )
    await kafka.start()
    try:
        deadline = asyncio.get_running_loop().time() + 30
        while not kafka.assignment():
            assert asyncio.get_running_loop().time() < deadline, "no assignment"
            await asyncio.sleep(0.05)
        yield consumer, kafka, topic
    finally:
        await kafka.stop()


async def test_a_record_fetched_past_a_hole_waits_for_the_hole(
    tansu: str,  # noqa: F811
    store: RedisMessageStore,
) -> None:
    now = [0.0]
    client, other = f"dev-{uuid.uuid4().hex[:8]}", f"dev-{uuid.uuid4().hex[:8]}"
    async with _consumer(tansu, store, now) as (consumer, kafka, topic):
        tp = TopicPartition(topic, 0)
        # Offsets 0-1 fetched; then a fetch shows 3 but not 2 (not yet written).
        await consumer.process({tp: [_record(topic, 0, client, 1), _record(topic, 1, client, 2)]})
        await consumer.process({tp: [_record(topic, 3, client, 4)]})
        assert await kafka.position(tp) == 2  # sought back to the hole
        assert consumer.stats.offset_holes == 1
        # A hole inside one fetch: 2 is there now, 4 is not, 5 is.
        await consumer.process(
            {
                tp: [
                    _record(topic, 2, client, 3),
                    _record(topic, 3, client, 4),
                    _record(topic, 5, other, 1),
                ]
            }
        )
        assert await kafka.position(tp) == 4
        assert consumer.stats.offset_holes == 2
        await consumer.process({tp: [_record(topic, 4, client, 5), _record(topic, 5, other, 1)]})
        assert await _stored(store, client) == [b"1", b"2", b"3", b"4", b"5"]
        assert await _stored(store, other) == [b"1"]
        assert consumer.stats.duplicates_skipped == 0

        # A hole that stays (a Kafka whose log has a real gap) is passed after HOLE_WAIT.
        await consumer.process({tp: [_record(topic, 7, client, 7)]})
        assert await kafka.position(tp) == 6
        now[0] += HOLE_WAIT
        await consumer.process({tp: [_record(topic, 7, client, 7)]})
        assert consumer.stats.offset_holes_passed == 1
        assert (await _stored(store, client))[-1] == b"7"


async def test_holes_after_a_seek_in_a_new_log_and_past_a_passed_one(
    tansu: str,  # noqa: F811
    store: RedisMessageStore,
) -> None:
    """Review of the first fix: the first fetch after a seek, a fetch of a log
    that went back, and the rest of a fetch after a passed hole are looked at
    for holes too."""
    now = [0.0]
    client = f"dev-{uuid.uuid4().hex[:8]}"
    async with _consumer(tansu, store, now) as (consumer, kafka, topic):
        tp = TopicPartition(topic, 0)
        await consumer.process({tp: [_record(topic, i, client, i + 1) for i in range(6)]})
        # A log that went back (Kafka restarted): 0-1 then 3, 2 not yet written.
        await consumer.process(
            {
                tp: [
                    _record(topic, 0, client, 7),
                    _record(topic, 1, client, 8),
                    _record(topic, 3, client, 10),
                ]
            }
        )
        assert consumer.stats.log_resets == 1
        assert await kafka.position(tp) == 2
        # Read from the start again (the topic was lost): a first fetch at 1 skipped 0.
        consumer.read_from_start()
        await consumer.process({tp: [_record(topic, 1, client, 8)]})
        assert await kafka.position(tp) == 0
        assert consumer.stats.offset_holes == 2
        # A hole that stays at 0 is passed after HOLE_WAIT; 2 is still filling.
        await consumer.process({tp: [_record(topic, 1, client, 8), _record(topic, 3, client, 10)]})
        now[0] += HOLE_WAIT
        await consumer.process({tp: [_record(topic, 1, client, 8), _record(topic, 3, client, 10)]})
        assert consumer.stats.offset_holes_passed == 1
        assert await kafka.position(tp) == 2  # stored 1, waits for 2
        await consumer.process({tp: [_record(topic, 2, client, 9), _record(topic, 3, client, 10)]})
        assert await _stored(store, client) == [b"%d" % i for i in range(1, 11)]


async def test_the_first_fetch_of_a_new_assignment_is_checked_against_the_commit(
    tansu: str,  # noqa: F811
    store: RedisMessageStore,
) -> None:
    """A partition assigned (a rebalance: a replica joined) is first fetched from
    the group's committed offset; a fetch that begins past it skipped offsets."""
    now = [0.0]
    client = f"dev-{uuid.uuid4().hex[:8]}"
    async with _consumer(tansu, store, now) as (consumer, kafka, topic):
        tp = TopicPartition(topic, 0)
        await consumer.process({tp: [_record(topic, i, client, i + 1) for i in range(2)]})
        await kafka.commit({tp: 2})
        consumer.forget_position(tp)  # what the rebalance listener does on assignment
        await consumer.process({tp: [_record(topic, 4, client, 5)]})
        assert consumer.stats.offset_holes == 1
        assert await kafka.position(tp) == 2
        await consumer.process({tp: [_record(topic, i, client, i + 1) for i in range(2, 5)]})
        assert await _stored(store, client) == [b"%d" % i for i in range(1, 6)]
        # A committed offset above the first fetch is no hole and no reset.
        await kafka.commit({tp: 9})
        consumer.forget_position(tp)
        await consumer.process({tp: [_record(topic, 5, client, 6)]})
        assert (consumer.stats.offset_holes, consumer.stats.log_resets) == (1, 0)
