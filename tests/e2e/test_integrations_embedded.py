"""Integration rules on the one-command broker: with no Kafka configured (and
persistence off), ``devicemq run`` starts its embedded Kafka for the rules and
creates their topics there (docs/integrations.md). The rules on a
Kafka of the user's: tests/faults/test_integrations.py."""

from __future__ import annotations

import asyncio
import json

from aiokafka import AIOKafkaConsumer

from app.embedded_services import EmbeddedServices
from tests.e2e.conftest import devicemq_only

pytestmark = devicemq_only("integration rules are devicemq's")


def _records(bootstrap: str, topic: str, count: int) -> list[tuple[bytes | None, bytes]]:
    async def read() -> list[tuple[bytes | None, bytes]]:
        consumer = AIOKafkaConsumer(
            topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", fetch_max_wait_ms=20
        )
        await consumer.start()
        try:
            records: list[tuple[bytes | None, bytes]] = []
            for _ in range(100):  # 100 polls of up to 200 ms: 20 s at most
                if len(records) >= count:
                    break
                for batch in (await consumer.getmany(timeout_ms=200)).values():
                    records.extend((r.key, r.value) for r in batch)
            return records
        finally:
            await consumer.stop()

    return asyncio.run(read())


def test_rules_use_the_embedded_kafka_and_create_their_topics(broker_factory, clients, names):  # type: ignore[no-untyped-def]
    topic = "embedded." + names.prefix[-8:].replace("/", "-")
    rules = [{"topic_filter": names.topic("#"), "kafka_topic": topic, "key": "{topic[-1]}"}]
    broker = broker_factory({"persistence.enabled": False, "integrations": json.dumps(rules)})
    assert f"created kafka topic '{topic}'" in broker.log()
    pub = clients.paho(broker, names.client("pub"))
    pub.connect()
    assert pub.publish(names.topic("a/left"), b"1", qos=1) == 0
    assert pub.publish(names.topic("b/right"), b"2", qos=1) == 0
    kafka = next(s for s in EmbeddedServices(broker.data_dir).status() if s.name == "kafka")
    assert kafka.port is not None
    assert _records(f"127.0.0.1:{kafka.port}", topic, 2) == [(b"left", b"1"), (b"right", b"2")]
