"""A fetch at a position carried across a Kafka restart (tests/model/FINDINGS.md, finding 29).

The checker's seed 1264 lost an acknowledged message under CI's load: a Tansu
restarted empty, and before the consumer had rejoined, it fetched at its old
positions in the new log, whose offsets start at 0 again. The records there
were a producer's later ones; its earlier one, below the old position, came
when the partition was read from its start, and was skipped as stored (its seq
below the last one stored through the partition). The restart and the topic
probe's broken connection are real here (Tansu killed and started again on its
port, the probe's own client); the fetches are driven into the real consumer,
storing into a real Redis, as tests/integration/test_consumer_offset_holes.py
does: which fetch comes when cannot be made to happen on demand in Tansu. Its
Kafka client is assigned the partition by hand, so that no rejoin of its own
changes the assignment meanwhile; what it pauses and resumes is real.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord, TopicPartition

from persistence.consumer import PersistenceConsumer, make_consumer, stop_consumer
from persistence.format import StoredMessage, encode_message
from persistence.kafka_path import TopicProbe, ensure_topic, replace_topic
from persistence.redis_store import RedisMessageStore
from tests.integration.redis_servers import RedisServer
from tests.kafka_fixtures import bootstrap_of, start_tansu, stop_tansu


def _record(topic: str, offset: int, client: str, seq: int) -> ConsumerRecord:
    value = encode_message(
        StoredMessage(topic="t", payload=b"%d" % seq, qos=1, producer=7, seq=seq)
    )
    return ConsumerRecord(topic, 0, offset, 0, 0, client.encode(), value, None, 0, 0, [])


@dataclass
class Restarted:
    consumer: PersistenceConsumer
    probe: TopicProbe
    store: RedisMessageStore
    tp: TopicPartition
    client: str
    bootstrap: str
    kafka: AIOKafkaConsumer

    async def stored(self) -> list[bytes]:
        page = await self.store.load_page(self.client, 0, 100)
        return [r.message.payload for r in page.records if r.message is not None]

    async def fetched(self, first_offset: int, seqs: range) -> None:
        """A fetch from ``first_offset`` returning records of ``seqs``."""
        topic, client = self.tp.topic, self.client
        await self.consumer.process(
            {self.tp: [_record(topic, first_offset + i, client, s) for i, s in enumerate(seqs)]}
        )


@contextlib.asynccontextmanager
async def _restarted(redis_server: RedisServer) -> AsyncIterator[Restarted]:
    """A consumer that stored seqs 1-2 at offsets 0-1 of a one-partition topic
    (its position is 2), then its Kafka restarted empty on the same port; the
    topic probe has seen its connection break."""
    store = RedisMessageStore.from_url(redis_server.url)
    await store.load_scripts()
    server = start_tansu()
    bootstrap = bootstrap_of(server)
    topic, client = f"carried.{uuid.uuid4().hex[:8]}", f"dev-{uuid.uuid4().hex[:8]}"
    probe = TopicProbe(bootstrap, topic, partitions=1)
    try:
        assert await ensure_topic(bootstrap, topic, 1)
        assert await probe.partitions() == 1 and probe.vouches()
        kafka = make_consumer(bootstrap, f"carried-{uuid.uuid4().hex[:8]}")
        consumer = PersistenceConsumer(kafka, topic, store, lambda c, r: None, 100, watch=probe)
        tp = TopicPartition(topic, 0)
        await kafka.start()
        kafka.unsubscribe()
        kafka.assign([tp])  # see the module docstring
        restarted = Restarted(consumer, probe, store, tp, client, bootstrap, kafka)
        await restarted.fetched(0, range(1, 3))
        assert await restarted.stored() == [b"1", b"2"]
        breaks = probe.breaks
        stop_tansu(server)
        server = start_tansu(int(bootstrap.rsplit(":", 1)[1]))  # empty: offsets from 0 again
        for _ in range(500):  # the probe's connection closed with the old process
            if probe.breaks > breaks:
                break
            await asyncio.sleep(0.01)
        assert probe.breaks > breaks and not probe.vouches()
        try:
            yield restarted
        finally:
            await stop_consumer(kafka)
    finally:
        await probe.close()
        stop_tansu(server)
        await store.aclose()


async def test_a_position_carried_across_a_kafka_restart_is_not_read_from(
    redis_server: RedisServer,
) -> None:
    async with _restarted(redis_server) as r:
        # The new log holds seqs 3-6 at offsets 0-3; a fetch at the old position 2
        # returns 5 and 6. Stored now, 3 and 4 would be skipped when read.
        await r.fetched(2, range(5, 7))
        assert await r.stored() == [b"1", b"2"]
        assert r.consumer.stats.fetches_held == 1
        assert r.kafka.paused() == {r.tp}
        # Read from its start (the log went back, or the restore reads it again).
        await r.fetched(0, range(3, 7))
        assert await r.stored() == [b"%d" % i for i in range(1, 7)]
        assert r.consumer.stats.duplicates_skipped == 0
        assert r.kafka.paused() == set()


async def test_a_position_set_after_the_break_is_read_from(redis_server: RedisServer) -> None:
    """The restore reads the lost topic from its start before the consumer fetched
    anything since the break: what it fetches from 0 is stored (a review of the
    first fix: the break, noticed only at that fetch, held the new position too,
    and the restore waited out its limit)."""
    async with _restarted(redis_server) as r:
        r.consumer.read_from_start()  # as the restore begins
        assert await r.kafka.position(r.tp) == 0
        await r.fetched(0, range(3, 5))
        assert await r.stored() == [b"1", b"2", b"3", b"4"]
        assert r.consumer.stats.fetches_held == 0


async def test_a_position_is_read_from_again_once_the_probe_vouches_for_the_topic(
    redis_server: RedisServer,
) -> None:
    """A Kafka that kept its log (durable storage) lists the topic at devicemq's
    size again, with no break since the probe asked: the position is that log's."""
    async with _restarted(redis_server) as r:
        await r.fetched(2, range(3, 5))
        assert r.consumer.stats.fetches_held == 1
        # Made at its size (the consumer's own fetches may have had Tansu make it at
        # its default size meanwhile: finding 26), as the restore makes it.
        await replace_topic(r.bootstrap, r.tp.topic, 1)
        assert await r.probe.partitions() == 1 and r.probe.vouches()
        await r.fetched(2, range(3, 5))
        assert await r.stored() == [b"1", b"2", b"3", b"4"]
        assert r.consumer.stats.fetches_held == 1
        assert r.kafka.paused() == set()
