"""The integration rules' Kafka sink (persistence/integration_sink.py) on a real
Kafka (Tansu): what end-to-end tests cannot drive, the bound on publishes waiting
for the producer. End to end: tests/faults/test_integrations.py."""

from __future__ import annotations

import dataclasses
import logging
import uuid

import pytest
from aiokafka import AIOKafkaConsumer

from broker.config import IntegrationRule, Settings
from broker.integrations import IntegrationRecord
from persistence.integration_sink import (
    KafkaIntegrationSink,
    _TopicList,
    kafka_client_options,
    make_integration_producer,
)
from persistence.kafka_path import ensure_topic
from tests.kafka_fixtures import tansu  # noqa: F401  (pytest fixture)


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
        with caplog.at_level(logging.WARNING, "devicemq.integrations"):
            for i in range(5):  # in one go: the sender has not taken any yet

                def told(ok: bool, i: int = i) -> None:
                    outcomes[i] = ok

                sink.submit([IntegrationRecord("burst", topic, None, b"m%d" % i)], told)
        assert outcomes == [None, None, None, False, False]  # at once, no deadline
        assert "integration rule 'burst': 3 publishes wait for kafka" in caplog.text
        await sink.drain()
        assert outcomes == [True, True, True, False, False]
        assert sink.counts() == {"burst": (3, 2)}
        assert await _values(tansu, topic, 3) == [b"m0", b"m1", b"m2"]
    finally:
        await sink.close()
