"""A topic made again at another size is read whole (tests/model/FINDINGS.md, finding 27).

Against a real Tansu: the persistence consumer holds the 4 partitions of a
topic, which is then deleted and made again at 12 (as the compactor restores
a topic Tansu made at its own size). Told to read the topic's partitions, the
consumer must be assigned all 12. Tansu answers the rejoin that aiokafka
starts on the metadata change with the member's old assignment (its group
generation stays 0): without a new member's join, partitions 4-11 would
never be read.
"""

from __future__ import annotations

import asyncio
import uuid

from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from persistence.consumer import PersistenceConsumer, make_consumer
from persistence.kafka_path import replace_topic
from tests.kafka_fixtures import tansu  # noqa: F401  (pytest fixture)


async def _until(condition: object, timeout: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, f"no {what} in {timeout} s"
        await asyncio.sleep(0.05)


async def test_a_consumer_is_assigned_every_partition_of_a_topic_made_again_larger(
    tansu: str,  # noqa: F811
) -> None:
    topic, group = f"resized.{uuid.uuid4().hex[:8]}", f"resized-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=tansu)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 4, 1)])
    finally:
        await admin.close()
    kafka = make_consumer(tansu, group)
    consumer = PersistenceConsumer(kafka, topic, None, lambda c, r: None, 100)  # type: ignore[arg-type]
    await kafka.start()
    polling = asyncio.create_task(_poll(kafka))
    try:
        await _until(lambda: len(kafka.assignment()) == 4, 30, "first assignment")
        await replace_topic(tansu, topic, 12)
        await asyncio.wait_for(consumer.read_partitions(12), 10)
        await _until(lambda: len(kafka.assignment()) == 12, 30, "assignment of all 12")
    finally:
        polling.cancel()
        await kafka.stop()


async def _poll(kafka: object) -> None:
    """The consumer's fetch loop, as PersistenceConsumer.run drives it: joins and
    rebalances go on only while it polls."""
    while True:
        await kafka.getmany(timeout_ms=100)  # type: ignore[attr-defined]
