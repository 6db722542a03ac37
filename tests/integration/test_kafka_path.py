"""The Kafka leg of the persistent path against a real Tansu: order, acks, deadlines."""

from __future__ import annotations

import asyncio
import gc
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from broker.message import Delivery, Message
from broker.outflow import MemoryFeed
from broker.session import Session
from broker.stats import BrokerStats
from persistence.kafka_path import BATCH_TTL_MS, KafkaPersistentPath, ensure_topic
from persistence.producers import Aiokafka, Confluent, RecordProducer, confluent_settings
from persistence.redis_store import decode_record
from tests.kafka_fixtures import tansu  # noqa: F401  (pytest fixture)

CLIENTS = 4
PER_CLIENT = 600


def _session(client_id: str) -> Session:
    stats = BrokerStats()
    return Session(client_id, 3600, 10, MemoryFeed(100, stats), stats, durable=True)


async def _read_all(bootstrap: str, topic: str, count: int) -> dict[bytes, list[bytes]]:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        partitions = [TopicPartition(topic, p) for p in range(3)]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        by_key: dict[bytes, list[bytes]] = {}
        seen = 0
        while seen < count:
            batches = await consumer.getmany(timeout_ms=2000)
            assert batches, f"only {seen} of {count} records came back"
            for records in batches.values():
                for record in records:
                    assert record.key is not None and record.value is not None
                    by_key.setdefault(record.key, []).append(record.value)
                    seen += 1
        return by_key
    finally:
        await consumer.stop()


def _small_producer(client: str, bootstrap: str) -> RecordProducer:
    """A producer that is full after a few records: sends keep waiting for room."""
    if client == "confluent":
        settings = confluent_settings(bootstrap, 10_000, 1, BATCH_TTL_MS)
        return Confluent({**settings, "batch.size": 1024, "queue.buffering.max.messages": 50})
    return Aiokafka(AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", max_batch_size=1024))


@pytest.mark.parametrize("client", ["aiokafka", "confluent"])
async def test_each_clients_records_keep_submission_order_when_sends_wait(
    tansu: str,  # noqa: F811
    client: str,
) -> None:
    """The producer is full after a few records, so it keeps making sends wait for
    room; submissions made meanwhile must still reach each partition in order,
    and every publisher callback reports success exactly once."""
    topic = f"order-{uuid.uuid4().hex[:8]}"
    assert await ensure_topic(tansu, topic, 3)
    producer = _small_producer(client, tansu)
    await producer.start()
    path = KafkaPersistentPath(producer, topic)
    sessions = [_session(f"client-{c}") for c in range(CLIENTS)]
    outcomes: list[bool] = []
    try:
        for n in range(PER_CLIENT):
            for session in sessions:
                payload = f"{session.client_id}:{n}".encode()
                delivery = Delivery(Message("t", payload, 1, False), 1, False)
                path.submit([(session, delivery)], outcomes.append)
            if n % 50 == 0:
                await asyncio.sleep(0)  # publishes arrive over many loop iterations
        await path.drain()
    finally:
        await producer.stop()
    assert outcomes == [True] * (CLIENTS * PER_CLIENT)
    assert path.produce_errors == 0
    by_key = await _read_all(tansu, topic, CLIENTS * PER_CLIENT)
    for session in sessions:
        values = by_key[session.client_id.encode()]
        payloads = [decode_record(1, 1, v).message.payload for v in values]  # type: ignore[union-attr]
        assert payloads == [f"{session.client_id}:{n}".encode() for n in range(PER_CLIENT)]


async def test_acknowledged_publishes_leave_nothing_for_the_garbage_collector(
    tansu: str,  # noqa: F811
) -> None:
    """Once Kafka acknowledged them, a PUBLISH's records are freed by reference
    counting: a cycle per PUBLISH (a round and its submissions pointing at each
    other) made the cyclic collector hold the event loop 40-150 ms every few
    seconds at 2,000 msg/s (BENCHMARKS.md, "The fleet shape, third round")."""
    topic = f"cycles-{uuid.uuid4().hex[:8]}"
    assert await ensure_topic(tansu, topic, 3)
    producer = Aiokafka(AIOKafkaProducer(bootstrap_servers=tansu, acks="all"))
    await producer.start()
    path = KafkaPersistentPath(producer, topic)
    session = _session("client-gc")
    outcomes: list[bool] = []
    gc.collect()
    gc.disable()
    try:
        for n in range(200):
            delivery = Delivery(Message("t", b"%d" % n, 1, False), 1, False)
            path.submit([(session, delivery)], outcomes.append)
            if n % 20 == 0:
                await asyncio.sleep(0)
        await path.drain()
        gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection would free, kept to be seen
        gc.collect()
        cyclic = [o for o in gc.garbage if type(o).__name__ in ("_Submission", "_Round")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        await producer.stop()
    assert outcomes == [True] * 200
    assert cyclic == []


async def test_records_acknowledged_into_a_topic_kafka_lost_are_sent_again() -> None:
    """Finding 19 (tests/model/FINDINGS.md): a Tansu restarted empty no longer lists
    the topic, yet acknowledges the first records sent to it and loses them; with
    no earlier record of the partition, no offset goes backwards to tell. The
    connection its restart broke makes the path ask before it reports success:
    the topic is gone, so the record is sent again once the topic is made again,
    and only then is the publisher told."""
    from app.embedded_services import free_port
    from persistence.kafka_path import TopicProbe
    from tests.kafka_fixtures import bootstrap_of, start_tansu, stop_tansu

    port = free_port()
    first = start_tansu(port)
    second = None
    bootstrap = bootstrap_of(first)
    topic = f"lost-{uuid.uuid4().hex[:8]}"
    assert await ensure_topic(bootstrap, topic, 3)
    probe = TopicProbe(bootstrap, topic)
    producer = Aiokafka(AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all"))
    try:
        assert await probe.partitions() == 3 and probe.forgets_topics
        await producer.start()
        path = KafkaPersistentPath(
            producer,
            topic,
            probe=probe,
            recreate_topic=lambda: ensure_topic(bootstrap, topic, 3),
        )
        stop_tansu(first)
        second = start_tansu(port)  # same address, empty: the topic is not listed
        outcomes: list[bool] = []
        delivery = Delivery(Message("t", b"after the restart", 1, False), 1, False)
        path.submit([(_session("first-of-its-partition"), delivery)], outcomes.append)
        await path.drain()
        assert outcomes == [True]
        by_key = await _read_all(bootstrap, topic, 1)
        values = by_key[b"first-of-its-partition"]  # twice: once in the lost log
        assert {decode_record(1, 1, v).message.payload for v in values} == {  # type: ignore[union-attr]
            b"after the restart"
        }
    finally:
        await producer.stop()
        await probe.close()
        stop_tansu(first)
        if second is not None:
            stop_tansu(second)


async def test_a_topic_named_between_its_delete_and_create_is_made_at_its_size() -> None:
    """Finding 26 (tests/model/FINDINGS.md): Tansu creates a topic that a metadata
    request names, at its default size (4 partitions). Named in the moment between
    the delete and the create of ``replace_topic`` (the compaction's; the broker's
    own consumer names it when its fetch fails), the topic stayed at 4
    partitions; the producer, which knew 12, wrote to partitions 4-11, which Tansu
    acknowledged and no consumer read. The proxy names the topic every time it
    passes a delete's answer on, twice: the topic must still end at 12."""
    from app.embedded_services import free_port
    from persistence.kafka_path import replace_topic
    from tests.kafka_fixtures import listed_partitions, name_topic, start_tansu, stop_tansu
    from tests.kafka_proxy import DELETE_TOPICS, KafkaProxy

    kafka_port, proxy_port = free_port(), free_port()
    proxy = KafkaProxy(kafka_port)
    await proxy.start(proxy_port)  # first: Tansu is ready once its advertised address answers
    kafka = start_tansu(kafka_port, advertise=proxy_port)
    bootstrap, topic = f"127.0.0.1:{proxy_port}", f"named-{uuid.uuid4().hex[:8]}"
    named = 0

    async def name_it(api_key: int) -> None:
        nonlocal named
        if api_key == DELETE_TOPICS and named < 2:
            named += 1
            await name_topic(bootstrap, topic)
            assert await listed_partitions(bootstrap, topic) == 4  # Tansu's default size

    try:
        assert await ensure_topic(bootstrap, topic, 12)
        proxy.before_answer = name_it
        await replace_topic(bootstrap, topic, 12)
        assert await listed_partitions(bootstrap, topic) == 12
        assert named == 2
    finally:
        await proxy.close()
        stop_tansu(kafka)


async def test_the_probe_reports_a_topic_tansu_made_by_itself_as_not_listed(
    tansu: str,  # noqa: F811
) -> None:
    """Finding 26: a topic a client's metadata request made Tansu create has Tansu's
    size (4), not devicemq's; the probe reports it as not listed (so it is made
    again, and nothing acknowledged after a broken connection is vouched for in
    it), and says what it has. The right size is listed as it is."""
    from persistence.kafka_path import TopicProbe
    from tests.kafka_fixtures import name_topic

    named, made = f"named-{uuid.uuid4().hex[:8]}", f"made-{uuid.uuid4().hex[:8]}"
    await name_topic(tansu, named)
    assert await ensure_topic(tansu, made, 12)
    wrong, right = TopicProbe(tansu, named, partitions=12), TopicProbe(tansu, made, partitions=12)
    try:
        listed = await wrong.partitions()
        if not wrong.forgets_topics:
            pytest.skip("not a Tansu (DEVICEMQ_TEST_KAFKA_BOOTSTRAP): its topics are kept")
        assert listed is None and wrong.misshapen == 4 and not wrong.vouches()
        assert await right.partitions() == 12 and right.misshapen is None and right.vouches()
    finally:
        await wrong.close()
        await right.close()
