"""The persistence consumer joins its group again as a new member, on a real Tansu.

A group join that never completes is given up and started again as a new
member. Issue 16, 5: replicas restarted against a Tansu whose old members were
still leaving rejoined every 3 s at the same generation and never got their
partitions. The fault itself (a coordinator that never completes a SyncGroup)
cannot be made to happen on demand with a real Tansu; what is driven here,
deterministically, is the consumer's side: a join under way (the rebalance
listener's revoke, no assignment after it) with a clock moved past
STUCK_JOIN_AFTER. The consumer then says why it is not ready and rejoins as a
new member of the real group on Tansu, which assigns it its partitions again.

A topic made again at another size is read whole (tests/model/FINDINGS.md,
finding 27): the consumer holds the 4 partitions of a topic, which is then
deleted and made again at 12 (as the compactor restores a topic Tansu made at
its own size). Told to read the topic's partitions, the consumer must be
assigned all 12. Tansu answers the rejoin that aiokafka starts on the metadata
change with the member's old assignment (its group generation stays 0):
without a new member's join, partitions 4-11 would never be read. And a
join during the restore must not undo its reading from the start: aiokafka
starts a newly assigned partition at the group's committed offset, which may be
the lost log's.
"""

from __future__ import annotations

import asyncio
import uuid

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import TopicPartition

from persistence.consumer import STUCK_JOIN_AFTER, PersistenceConsumer, make_consumer
from persistence.kafka_path import replace_topic
from tests.kafka_fixtures import tansu  # noqa: F401  (pytest fixture)


async def _until(condition: object, timeout: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, f"no {what} in {timeout} s"
        await asyncio.sleep(0.05)


async def _topic(bootstrap: str, name: str, partitions: int) -> tuple[str, str]:
    """A new topic of ``partitions`` and a group name for it."""
    topic, group = f"{name}.{uuid.uuid4().hex[:8]}", f"{name}-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, partitions, 1)])
    finally:
        await admin.close()
    return topic, group


async def test_a_stuck_join_rejoins_as_a_new_member_and_is_not_ready_meanwhile(
    tansu: str,  # noqa: F811
) -> None:
    topic, group = await _topic(tansu, "stuck", 2)
    now = [0.0]
    kafka = make_consumer(tansu, group)
    consumer = PersistenceConsumer(
        kafka,
        topic,
        None,
        lambda c, r: None,
        100,
        clock=lambda: now[0],  # type: ignore[arg-type]
    )
    await kafka.start()
    try:
        await _until(lambda: kafka.assignment(), 30, "first assignment")
        assert not consumer.check_join() and consumer.failure is None
        first_member = kafka._coordinator.member_id

        consumer.joining()  # a rebalance began; no assignment follows
        now[0] += STUCK_JOIN_AFTER - 1
        assert not consumer.check_join() and consumer.failure is None
        now[0] += 1
        assert consumer.check_join()
        assert consumer.failure is not None and "stuck" in consumer.failure  # /ready: 503
        assert consumer.stats.stuck_joins == 1

        await _until(lambda: consumer._stuck is None, 30, "completed join")
        assert kafka.assignment()
        assert kafka._coordinator.member_id != first_member
        assert not consumer.check_join()
    finally:
        await kafka.stop()


async def test_a_consumer_is_assigned_every_partition_of_a_topic_made_again_larger(
    tansu: str,  # noqa: F811
) -> None:
    topic, group = await _topic(tansu, "resized", 4)
    kafka = make_consumer(tansu, group)
    consumer = PersistenceConsumer(kafka, topic, None, lambda c, r: None, 100)  # type: ignore[arg-type]
    await kafka.start()
    try:
        await _until(lambda: len(kafka.assignment()) == 4, 30, "first assignment")
        await replace_topic(tansu, topic, 12)
        await asyncio.wait_for(consumer.read_partitions(12), 10)
        await _until(lambda: len(kafka.assignment()) == 12, 30, "assignment of all 12")
    finally:
        await kafka.stop()


async def test_a_join_during_a_restore_still_reads_the_topic_from_its_start(
    tansu: str,  # noqa: F811
) -> None:
    """The restore reads the lost topic from offset 0, then (a topic Tansu made at
    its own size) joins the group as a new member: the new assignment started at
    the committed offset 8 and the records below it were never read (a review of
    finding 27's fix: offsets [8, 9] read, not 0-9)."""
    topic, group = await _topic(tansu, "restored", 4)
    producer = AIOKafkaProducer(bootstrap_servers=tansu)
    await producer.start()
    try:
        for i in range(10):
            await producer.send_and_wait(topic, b"%d" % i, key=b"k", partition=0)
    finally:
        await producer.stop()
    kafka = make_consumer(tansu, group)
    consumer = PersistenceConsumer(kafka, topic, None, lambda c, r: None, 100)  # type: ignore[arg-type]
    await kafka.start()
    try:
        await _until(lambda: len(kafka.assignment()) == 4, 30, "first assignment")
        first_member = kafka._coordinator.member_id
        await kafka.commit({TopicPartition(topic, 0): 8})  # e.g. the lost log's, retried
        consumer.read_from_start()  # as the restore begins
        await consumer.read_partitions(4)  # a new member's join
        await _until(
            lambda: kafka._coordinator.member_id != first_member and len(kafka.assignment()) == 4,
            30,
            "the new member's assignment",
        )
        read: list[int] = []  # read from here on: nothing was polled before
        deadline = asyncio.get_running_loop().time() + 30
        while sorted(set(read)) != list(range(10)):
            assert asyncio.get_running_loop().time() < deadline, f"read only {sorted(set(read))}"
            for tp, records in (await kafka.getmany(timeout_ms=100)).items():
                read.extend(r.offset for r in records if tp.partition == 0)
    finally:
        await kafka.stop()
