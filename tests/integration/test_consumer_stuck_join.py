"""A group join that never completes is given up and started again as a new member.

Issue 16, 5: replicas restarted against a Tansu whose old members were still
leaving rejoined every 3 s at the same generation and never got their
partitions. The fault itself (a coordinator that never completes a SyncGroup)
cannot be made to happen on demand with a real Tansu; what is driven here,
deterministically, is the consumer's side: a join under way (the rebalance
listener's revoke, no assignment after it) with a clock moved past
STUCK_JOIN_AFTER. The consumer then says why it is not ready and rejoins as a
new member of the real group on Tansu, which assigns it its partitions again.
"""

from __future__ import annotations

import asyncio
import uuid

from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from persistence.consumer import STUCK_JOIN_AFTER, PersistenceConsumer, make_consumer
from tests.kafka_fixtures import tansu  # noqa: F401  (pytest fixture)


async def _until(condition: object, timeout: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, f"no {what} in {timeout} s"
        await asyncio.sleep(0.05)


async def test_a_stuck_join_rejoins_as_a_new_member_and_is_not_ready_meanwhile(
    tansu: str,  # noqa: F811
) -> None:
    topic, group = f"stuck.{uuid.uuid4().hex[:8]}", f"stuck-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=tansu)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 2, 1)])
    finally:
        await admin.close()
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
