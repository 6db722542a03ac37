"""The Kafka path after a broken connection (tests/model/FINDINGS.md, finding 19).

A record acknowledged while the topic probe does not vouch for the topic is
reported only once the probe, asked afterwards, sees the topic listed and no
topic was made since. The orders of events that matter are driven here by a
producer whose answers and a probe whose replies the test releases; the
same path against a real restarted Tansu is in
tests/integration/test_kafka_path.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiokafka.structs import RecordMetadata

from broker.message import Delivery, Message
from broker.outflow import MemoryFeed
from broker.session import Session
from broker.stats import BrokerStats
from persistence.kafka_path import KafkaPersistentPath


class Producer:
    """Hands out a future per record; the test answers them."""

    def __init__(self) -> None:
        self.sent: list[tuple[asyncio.Future[Any], int | None]] = []

    def partitions_for_topic(self, topic: str) -> set[int]:
        return {0}

    async def send(
        self, topic: str, value: bytes, key: bytes, partition: int | None
    ) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.sent.append((future, partition))
        return future

    def ack(self, i: int, offset: int) -> None:
        future, _ = self.sent[i]
        future.set_result(RecordMetadata("t", 0, None, offset, 0, None, 0))


class Probe:
    """A connection broke (it does not vouch); each answer waits for the test."""

    forgets_topics = True
    closed = False

    def __init__(self) -> None:
        self.vouching = False
        self.questions: asyncio.Queue[asyncio.Future[int | None]] = asyncio.Queue()

    def vouches(self) -> bool:
        return self.vouching

    async def partitions(self) -> int | None:
        answer: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        await self.questions.put(answer)
        return await answer


def _session(client_id: str) -> Session:
    stats = BrokerStats()
    return Session(client_id, 3600, 10, MemoryFeed(100, stats), stats, durable=True)


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.002)
    raise AssertionError("never happened")


def _submit(path: KafkaPersistentPath, accepted: list[bool], settled: list[bool]) -> None:
    delivery = Delivery(Message("t", b"x", 2, False), 2, False)
    path.submit([(_session("c"), delivery)], accepted.append, settled.append)


async def test_a_publish_failed_at_its_deadline_is_not_settled_as_taken_before_vouched() -> None:
    """Its deadline passes while the probe's answer is awaited: the publisher hears
    failure, and the record is not settled as taken (a 3.1.1 QoS 2 publisher's
    packet id would be kept and its re-send answered without routing). The topic
    is not listed: it is sent again, and settled once that copy is vouched for."""
    producer, probe = Producer(), Probe()
    path = KafkaPersistentPath(producer, "t", timeout=0.05, probe=probe)  # type: ignore[arg-type]
    accepted: list[bool] = []
    settled: list[bool] = []
    _submit(path, accepted, settled)
    await _until(lambda: len(producer.sent) == 1)
    producer.ack(0, 0)  # acknowledged into a log Kafka may have lost
    question = await probe.questions.get()
    await _until(lambda: accepted == [False])  # the deadline, while the question is out
    assert settled == []
    question.set_result(None)  # not listed: the log was lost
    await _until(lambda: len(producer.sent) == 2)  # sent again
    assert settled == []
    probe.vouching = True
    producer.ack(1, 1)
    await _until(lambda: settled == [True])
    assert accepted == [False]


async def test_a_topic_made_again_during_the_question_does_not_vouch() -> None:
    """The probe finds the topic listed, but it was made again (a restore's describe,
    delete and create) after the record was acknowledged: sent again, and the
    publisher hears success only for the copy in the new topic."""
    producer, probe = Producer(), Probe()
    path = KafkaPersistentPath(producer, "t", timeout=5.0, probe=probe)  # type: ignore[arg-type]
    accepted: list[bool] = []
    _submit(path, accepted, [])
    await _until(lambda: len(producer.sent) == 1)
    producer.ack(0, 0)
    question = await probe.questions.get()
    path.hold()
    path.release(new_log=True)  # a restore made the topic again meanwhile
    question.set_result(1)  # listed: the new topic, so it asks again, after it
    (await probe.questions.get()).set_result(1)
    await _until(lambda: len(producer.sent) == 2)
    assert accepted == []
    probe.vouching = True
    producer.ack(1, 0)
    await _until(lambda: accepted == [True])


async def test_success_is_reported_once_the_probe_sees_the_topic() -> None:
    producer, probe = Producer(), Probe()
    path = KafkaPersistentPath(producer, "t", timeout=5.0, probe=probe)  # type: ignore[arg-type]
    accepted: list[bool] = []
    _submit(path, accepted, [])
    await _until(lambda: len(producer.sent) == 1)
    producer.ack(0, 0)
    question = await probe.questions.get()
    await asyncio.sleep(0.01)
    assert accepted == []  # not before the answer
    question.set_result(1)
    await _until(lambda: accepted == [True])
    assert len(producer.sent) == 1
