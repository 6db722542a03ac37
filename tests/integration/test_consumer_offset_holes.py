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
import uuid

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


async def test_a_record_fetched_past_a_hole_waits_for_the_hole(
    tansu: str,  # noqa: F811
    store: RedisMessageStore,
) -> None:
    topic, group = f"holes.{uuid.uuid4().hex[:8]}", f"holes-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=tansu)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 1, 1)])
    finally:
        await admin.close()
    now = [0.0]
    kafka = make_consumer(tansu, group)
    consumer = PersistenceConsumer(
        kafka, topic, store, lambda c, r: None, 100, clock=lambda: now[0]
    )
    client, other = f"dev-{uuid.uuid4().hex[:8]}", f"dev-{uuid.uuid4().hex[:8]}"
    tp = TopicPartition(topic, 0)
    await kafka.start()
    try:
        deadline = asyncio.get_running_loop().time() + 30
        while not kafka.assignment():
            assert asyncio.get_running_loop().time() < deadline, "no assignment"
            await asyncio.sleep(0.05)

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
    finally:
        await kafka.stop()
