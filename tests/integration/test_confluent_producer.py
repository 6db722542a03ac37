"""The librdkafka producer's life cycle against a real Tansu (persistence/producers.py).

Found by a review of its first version: a stop right after a send waited
forever, a stop with records still out left their futures unanswered, and
every producer left librdkafka's threads and connections behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from typing import Any

from persistence.kafka_path import ensure_topic, make_producer
from persistence.producers import Confluent
from tests.kafka_fixtures import bootstrap_of, freeze, start_tansu, stop_tansu, tansu  # noqa: F401


def _threads() -> int:
    """librdkafka's threads in this process (it names them rdk:...)."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                count += comm.read().startswith("rdk:")
        except (FileNotFoundError, ProcessLookupError):
            pass  # the thread ended between the listing and the read: not running
    return count


async def _producer(bootstrap: str) -> tuple[Confluent, str]:
    topic = f"cf-{uuid.uuid4().hex[:8]}"
    assert await ensure_topic(bootstrap, topic, 1)
    producer = make_producer(bootstrap, 10_000, 1, "confluent")
    assert isinstance(producer, Confluent)
    await producer.start()
    return producer, topic


async def test_a_stop_right_after_a_send_returns(tansu: str) -> None:  # noqa: F811
    """The poll task idles between sends; a send wakes it in the same loop step as
    stop cancels it. Python 3.11's wait_for swallowed that cancel: stop hung."""
    producer, topic = await _producer(tansu)
    await (await producer.send(topic, b"a", b"k", 0))  # answered: the poll task idles
    last = await producer.send(topic, b"b", b"k", 0)  # wakes it
    stopping = asyncio.ensure_future(producer.stop())
    # A hang shows as this bound passing (stop's own wait for records is 30 s);
    # asyncio.wait does not cancel the stop, which swallowed a cancel before.
    done, _ = await asyncio.wait({stopping}, timeout=20)
    assert stopping in done, "stop did not return"
    assert last.done()


async def test_a_stop_with_records_out_answers_every_one() -> None:
    """Kafka frozen: at stop's deadline what is out is purged and every future
    fails; none is left for a report nobody reads any more."""
    server = start_tansu()
    try:
        producer, topic = await _producer(bootstrap_of(server))
        freeze(server)
        try:
            futures = [await producer.send(topic, b"%d" % i, b"k", 0) for i in range(3)]
            await producer.stop(timeout=1.0)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert all(f.done() for f in futures)
        errors: list[Any] = [f.exception() for f in futures]
        assert all(e is not None for e in errors), errors
    finally:
        stop_tansu(server)


async def test_stopped_producers_leave_no_threads(tansu: str) -> None:  # noqa: F811
    before = _threads()
    assert before == 0, "another test left a producer running"
    for _ in range(3):
        producer, topic = await _producer(tansu)
        await (await producer.send(topic, b"x", b"k", 0))
        await producer.stop()
    assert _threads() == before


async def test_a_producer_that_cannot_start_leaves_no_threads() -> None:
    from aiokafka.errors import KafkaConnectionError

    from app.embedded_services import free_port

    before = _threads()
    producer = Confluent({"bootstrap.servers": f"127.0.0.1:{free_port()}"}, start_timeout=1.0)
    try:
        await producer.start()
    except KafkaConnectionError:
        pass
    else:
        raise AssertionError("started without a Kafka")
    await producer.stop()
    assert _threads() == before
