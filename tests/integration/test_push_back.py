"""Publishers wait while the consumer is behind (``persistence.max_unstored_records``).

Kafka accepts records faster than one process stores and delivers them; without
a bound the gap grew for as long as more was offered, and every message waited
behind it (BENCHMARKS.md, "The shape"). Driven here against a real Tansu and
Redis: how far behind the consumer is, and that the path holds new records
while it is that far behind, for a bounded time.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.structs import TopicPartition

from broker.message import Delivery, Message
from persistence import kafka_path
from persistence.kafka_path import KafkaPersistentPath, ensure_topic
from persistence.producers import Aiokafka
from persistence.redis_store import RedisMessageStore
from tests.integration.test_consumer_offset_holes import _consumer, _record
from tests.integration.test_kafka_path import _session
from tests.kafka_fixtures import tansu  # noqa: F401  (pytest fixture)


async def test_unstored_counts_from_what_is_stored_to_the_end_last_fetched(
    tansu: str,  # noqa: F811
    store: RedisMessageStore,
) -> None:
    client = f"dev-{uuid.uuid4().hex[:8]}"
    async with _consumer(tansu, store, [0.0]) as (consumer, kafka, topic):
        tp = TopicPartition(topic, 0)
        producer = AIOKafkaProducer(bootstrap_servers=tansu, acks="all")
        await producer.start()
        try:
            for _ in range(8):
                await producer.send_and_wait(topic, b"x", key=client.encode(), partition=0)
        finally:
            await producer.stop()
        # Nothing stored since the assignment: unknown, so it holds no one back.
        assert consumer.unstored() == 0
        # The real consumer's fetches reach the end (8); one already under way when
        # the records were sent answers with an earlier end.
        for _ in range(40):
            if kafka.highwater(tp) == 8:
                break
            await kafka.getmany(tp, timeout_ms=500)
        assert kafka.highwater(tp) == 8
        await consumer.process({tp: [_record(topic, i, client, i + 1) for i in range(5)]})
        assert consumer.unstored() == 3  # offsets 5-7 in Kafka, not stored
        # After a seek and before anything is stored (a cold start's first poll,
        # being saved): counted from the first offset fetched.
        consumer.read_from_start()
        assert consumer.unstored() == 0  # not fetched since: unknown
        saving, release = asyncio.Event(), asyncio.Event()
        real_save = consumer._save

        async def slow_save(batches):  # type: ignore[no-untyped-def]
            saving.set()
            await release.wait()
            return await real_save(batches)

        consumer._save = slow_save  # type: ignore[method-assign]
        task = asyncio.create_task(
            consumer.process({tp: [_record(topic, i, client, i + 1) for i in range(3)]})
        )
        await saving.wait()
        assert consumer.unstored() == 8  # offsets 0-7, none stored since the seek
        release.set()
        await task
        assert consumer.unstored() == 5
        # A partition no longer assigned does not count (and does not raise).
        kafka.unsubscribe()
        assert consumer.unstored() == 0


async def _path(bootstrap: str) -> tuple[KafkaPersistentPath, AIOKafkaProducer]:
    topic = f"pushback-{uuid.uuid4().hex[:8]}"
    assert await ensure_topic(bootstrap, topic, 1)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    return KafkaPersistentPath(Aiokafka(producer), topic), producer


def _submit(path: KafkaPersistentPath, outcomes: list[bool]) -> None:
    delivery = Delivery(Message("t", b"x", 1, False), 1, False)
    path.submit([(_session("pushed"), delivery)], outcomes.append)


async def test_records_wait_while_the_consumer_is_behind(
    tansu: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kafka_path, "PUSH_BACK_STALL", 600.0)  # only the count can release
    path, producer = await _path(tansu)
    behind = [150]
    path.push_back(lambda: behind[0], 100)
    outcomes: list[bool] = []
    try:
        _submit(path, outcomes)
        await asyncio.sleep(0.3)
        behind[0] = 120  # the consumer stores, still 100 or more behind: held on
        await asyncio.sleep(0.3)
        assert outcomes == [] and path.produced == {}, "sent while the consumer was behind"
        behind[0] = 99
        await path.drain()
    finally:
        await producer.stop()
    assert outcomes == [True]
    assert path.backpressure_holds == 1


async def test_a_consumer_that_stores_nothing_ends_the_wait(
    tansu: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Kafka keeps accepting while Redis is away: a held batch goes once the consumer
    has stored nothing for PUSH_BACK_STALL."""
    monkeypatch.setattr(kafka_path, "PUSH_BACK_STALL", 0.2)
    path, producer = await _path(tansu)
    path.push_back(lambda: 10**9, 100)
    outcomes: list[bool] = []
    try:
        _submit(path, outcomes)
        await path.drain()
        _submit(path, outcomes)
        await path.drain()
    finally:
        await producer.stop()
    assert outcomes == [True, True]
    assert path.backpressure_holds == 2
    assert path.backpressure_seconds >= 0.4


async def test_a_compaction_hold_that_begins_meanwhile_is_kept(
    tansu: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Released by the consumer while the compactor holds the topic: still held."""
    monkeypatch.setattr(kafka_path, "PUSH_BACK_STALL", 600.0)
    path, producer = await _path(tansu)
    behind = [150]
    path.push_back(lambda: behind[0], 100)
    outcomes: list[bool] = []
    try:
        _submit(path, outcomes)
        await asyncio.sleep(0.1)
        path.hold()
        behind[0] = 0
        await asyncio.sleep(0.3)
        assert outcomes == [] and path.produced == {}, "sent during the compactor's hold"
        path.release(new_log=False)
        await path.drain()
    finally:
        await producer.stop()
    assert outcomes == [True]


async def _one_record(bootstrap: str, unstored: Callable[[], int], limit: int) -> int:
    """Submit one record under ``push_back(unstored, limit)``: the holds it took.
    It must be accepted."""
    path, producer = await _path(bootstrap)
    path.push_back(unstored, limit)
    outcomes: list[bool] = []
    try:
        _submit(path, outcomes)
        await path.drain()
    finally:
        await producer.stop()
    assert outcomes == [True]
    return path.backpressure_holds


async def test_a_count_that_fails_holds_no_one(tansu: str) -> None:  # noqa: F811
    def broken() -> int:
        raise AssertionError("partition not assigned")

    await _one_record(tansu, broken, 100)


async def test_no_limit_never_holds(tansu: str) -> None:  # noqa: F811
    # persistence.max_unstored_records: 0
    assert await _one_record(tansu, lambda: 10**9, 0) == 0
