"""The integration rules' Kafka sink (persistence/integration_sink.py) on a real
Kafka (Tansu): what end-to-end tests cannot drive, the bound on publishes waiting
for the producer. End to end: tests/faults/test_integrations.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator

import pytest
from aiokafka import AIOKafkaConsumer

from broker.config import IntegrationRule, Settings
from broker.integrations import IntegrationRecord, Refusal
from persistence.integration_sink import (
    KafkaIntegrationSink,
    _TopicList,
    kafka_client_options,
    make_integration_producer,
)
from persistence.kafka_path import ensure_topic
from tests.kafka_fixtures import (
    bootstrap_of,
    freeze,
    start_tansu,
    stop_tansu,
    tansu,  # noqa: F401  (pytest fixture)
)


async def _values(bootstrap: str, topic: str, count: int) -> list[bytes]:
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", fetch_max_wait_ms=20
    )
    await consumer.start()
    try:
        values: list[bytes] = []
        for _ in range(100):  # up to 20 s
            if len(values) >= count:
                break
            for batch in (await consumer.getmany(timeout_ms=200)).values():
                values.extend(r.value for r in batch)
        return values
    finally:
        await consumer.stop()


async def test_past_max_waiting_a_publish_fails_at_once_and_the_others_land(
    tansu: str,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    topic = f"sink.{uuid.uuid4().hex[:8]}"
    await ensure_topic(tansu, topic, 1)
    rule = IntegrationRule("burst", "#", topic)
    settings = dataclasses.replace(Settings(), integrations=(rule,))
    sink = KafkaIntegrationSink(
        make_integration_producer(settings, tansu),
        settings.integrations,
        30.0,
        _TopicList(kafka_client_options(settings, tansu)),
        max_waiting=3,
    )
    await sink.start()
    try:
        outcomes: list[bool | None] = [None] * 5
        refusals: list[Refusal | None] = []
        with caplog.at_level(logging.WARNING, "devicemq.integrations"):
            for i in range(5):  # in one go: the sender has not taken any yet

                def told(ok: bool, i: int = i) -> None:
                    outcomes[i] = ok

                record = IntegrationRecord("burst", topic, None, b"m%d" % i)
                refusals.append(sink.submit([record], told))
        # Refused at once, no deadline, and no callback: the caller answers.
        assert refusals == [None, None, None, Refusal.FULL, Refusal.FULL]
        assert "integration rule 'burst': 3 publishes (6 bytes) wait for kafka" in caplog.text
        await sink.drain()
        assert outcomes == [True, True, True, None, None]
        assert sink.counts() == {"burst": (3, 2)}
        assert await _values(tansu, topic, 3) == [b"m0", b"m1", b"m2"]
    finally:
        await sink.close()


@pytest.fixture
def own_tansu() -> Iterator[subprocess.Popen[bytes]]:
    """A Tansu of this test's own, to freeze (SIGSTOP) without holding up the others."""
    proc = start_tansu()
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        stop_tansu(proc)


async def _frozen_sink(
    proc: subprocess.Popen[bytes], **bounds: int
) -> tuple[KafkaIntegrationSink, str]:
    bootstrap = bootstrap_of(proc)
    topic = f"sink.{uuid.uuid4().hex[:8]}"
    await ensure_topic(bootstrap, topic, 1)
    rule = IntegrationRule("b", "#", topic)
    settings = dataclasses.replace(Settings(), integrations=(rule,))
    sink = KafkaIntegrationSink(
        make_integration_producer(settings, bootstrap),
        settings.integrations,
        600.0,  # no deadline within the test: what waits, waits
        _TopicList(kafka_client_options(settings, bootstrap)),
        **bounds,
    )
    await sink.start()
    return sink, topic


async def test_the_bound_counts_what_the_sender_took_too(
    own_tansu: subprocess.Popen[bytes],
) -> None:
    """Kafka frozen: the records the sender already handed to the producer wait as much
    as those it has not taken yet. With a bound of 3, exactly 3 wait (6 did, issue 18)."""
    sink, topic = await _frozen_sink(own_tansu, max_waiting=3)
    try:
        freeze(own_tansu)
        refusals = []
        for _ in range(10):
            record = IntegrationRecord("b", topic, b"k", b"x" * 1000)
            refusals.append(sink.submit([record], lambda ok: None))
            for _ in range(20):  # let the sender take what is pending
                await asyncio.sleep(0)
        assert refusals == [None] * 3 + [Refusal.FULL] * 7
        assert sink.counts() == {"b": (0, 7)}
    finally:
        os.kill(own_tansu.pid, signal.SIGCONT)
        await sink.close()


async def test_past_the_byte_budget_a_publish_fails_at_once(
    own_tansu: subprocess.Popen[bytes],
) -> None:
    """persistence.integrations_max_waiting_bytes bounds the keys and values waiting for
    Kafka, whatever their count: the count bound alone let a QoS 0 flood of large
    messages take hundreds of MB (issue 18). The first always goes (one message larger
    than the budget would never pass otherwise); once Kafka is back, those admitted land."""
    sink, topic = await _frozen_sink(own_tansu, max_waiting_bytes=25_000)
    try:
        freeze(own_tansu)
        told: dict[int, bool] = {}
        refusals = []
        for i in range(10):
            record = IntegrationRecord("b", topic, b"key", b"%d" % i + b"x" * 9_996)  # 10 kB
            refusals.append(sink.submit([record], lambda ok, i=i: told.__setitem__(i, ok)))
            for _ in range(20):
                await asyncio.sleep(0)
        assert refusals == [None, None] + [Refusal.FULL] * 8
        huge = IntegrationRecord("b", topic, None, b"y" * 100_000)
        assert sink.submit([huge], lambda ok: None) is Refusal.FULL
        os.kill(own_tansu.pid, signal.SIGCONT)
        await sink.drain()
        assert told == {0: True, 1: True}
        assert sink.counts() == {"b": (2, 9)}
        # Once nothing waits, even a message above the budget goes.
        assert sink.submit([huge], lambda ok: told.__setitem__(99, ok)) is None
        await sink.drain()
        assert told[99] is True
        values = await _values(bootstrap_of(own_tansu), topic, 3)
        assert [v[:1] for v in values] == [b"0", b"1", b"y"]
    finally:
        os.kill(own_tansu.pid, signal.SIGCONT)
        await sink.close()


async def test_a_qos0_message_makes_the_records_it_can(
    tansu: str,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """best_effort (QoS 0, wills: no re-send comes): a rule whose topic is missing loses
    its record, counted failed for it alone, and the healthy rule's record is made. A
    QoS 1/2 submission is refused as a whole, counted failed for the missing rule only."""
    present, missing = f"sink.{uuid.uuid4().hex[:8]}", f"sink.missing.{uuid.uuid4().hex[:8]}"
    await ensure_topic(tansu, present, 1)
    rules = (IntegrationRule("good", "#", present), IntegrationRule("gone", "#", missing))
    settings = dataclasses.replace(Settings(), integrations=rules)
    sink = KafkaIntegrationSink(
        make_integration_producer(settings, tansu),
        settings.integrations,
        30.0,
        _TopicList(kafka_client_options(settings, tansu)),
    )
    await sink.start()
    try:
        told: list[bool] = []
        records = [
            IntegrationRecord("good", present, None, b"q0"),
            IntegrationRecord("gone", missing, None, b"q0"),
        ]
        with caplog.at_level(logging.WARNING, "devicemq.integrations"):
            assert sink.submit(records, told.append, best_effort=True) is None
            await sink.drain()
            assert told == [True]
            assert sink.counts() == {"good": (1, 0), "gone": (0, 1)}
            records = [
                IntegrationRecord("good", present, None, b"q1"),
                IntegrationRecord("gone", missing, None, b"q1"),
            ]
            assert sink.submit(records, told.append) is Refusal.MISSING_TOPIC
        assert told == [True]
        assert sink.counts() == {"good": (1, 0), "gone": (0, 2)}
        assert f"integration rule 'gone': kafka topic '{missing}' does not exist" in caplog.text
        assert "integration rule 'good'" not in caplog.text
        assert await _values(tansu, present, 1) == [b"q0"]
    finally:
        await sink.close()
