"""The consumer's question to Kafka about a partition's committed offset is bounded
(persistence/consumer.py ``_committed``), whatever the Kafka client does.

Found by CI (``tests/cluster/test_workers.py``, two workers stopping together):
during a rebalance aiokafka's ``committed()`` did not end at a cancel, and
``asyncio.wait_for`` waits for a cancelled call to end: the shutdown drain,
asking it for every partition, hung past the broker's 60 s limit.
"""

from __future__ import annotations

import asyncio
import time

from aiokafka import TopicPartition

import persistence.consumer as consumer_module
from persistence.consumer import PersistenceConsumer


class _Stubborn:
    """A Kafka client whose ``committed()`` shrugs off a cancel and answers only when
    the test lets it (``released``)."""

    def __init__(self) -> None:
        self.released = asyncio.Event()

    async def committed(self, tp: TopicPartition) -> int:
        while not self.released.is_set():
            try:
                await self.released.wait()
            except asyncio.CancelledError:
                continue  # as a call under asyncio.shield would: it goes on
        return 7


async def test_a_committed_offset_kafka_does_not_give_is_none_in_time(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(consumer_module, "COMMITTED_TIMEOUT", 0.2)
    consumer = object.__new__(PersistenceConsumer)
    kafka = _Stubborn()
    consumer._consumer = kafka  # type: ignore[assignment]
    started = time.monotonic()
    try:
        assert await asyncio.wait_for(consumer._committed(TopicPartition("t", 0)), 5) is None
    finally:
        kafka.released.set()
        await asyncio.sleep(0)
    assert time.monotonic() - started < 2.0
