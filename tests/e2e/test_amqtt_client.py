"""amqtt 0.12.1's client (MQTT 3.1.1 only) against the broker, and across to paho."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest
from amqtt import client as amqtt_client
from amqtt.mqtt.constants import QOS_0, QOS_1, QOS_2

pytestmark = pytest.mark.e2e

TIMEOUT = 5.0


@pytest.fixture
async def amqtt_factory(broker) -> AsyncIterator[Callable[..., object]]:
    """``await connect(client_id, clean=True)``: a connected amqtt MQTTClient."""
    made = []

    async def connect(client_id: str, clean: bool = True, target=broker):
        client = amqtt_client.MQTTClient(client_id=client_id, config={"auto_reconnect": False})
        made.append(client)
        uri = f"mqtt://{target.host}:{target.port}/"
        assert await asyncio.wait_for(client.connect(uri, cleansession=clean), TIMEOUT) == 0
        return client

    yield connect
    for client in made:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.disconnect(), TIMEOUT)


async def receive(client, count: int) -> list[tuple[str, bytes, int, bool]]:
    got = []
    for _ in range(count):
        message = await client.deliver_message(timeout_duration=TIMEOUT)
        packet = message.publish_packet
        got.append((message.topic, bytes(message.data), message.qos, packet.retain_flag))
    return got


async def test_subscribe_publish_qos012(amqtt_factory, names):
    """amqtt subscribes at QoS 2, publishes at QoS 0, 1 and 2 and gets each back."""
    topic = names.topic("echo")
    client = await amqtt_factory(names.client("a"))
    assert await client.subscribe([(topic, QOS_2)]) == [QOS_2]
    for qos in (QOS_0, QOS_1, QOS_2):
        await client.publish(topic, f"qos {qos}".encode(), qos=qos)
    got = await receive(client, 3)
    assert got == [(topic, f"qos {q}".encode(), q, False) for q in (0, 1, 2)]


async def test_granted_qos_caps_delivery(amqtt_factory, names):
    """Subscribed at QoS 1, a QoS 2 publication is delivered at QoS 1."""
    topic = names.topic("cap")
    sub = await amqtt_factory(names.client("sub"))
    pub = await amqtt_factory(names.client("pub"))
    assert await sub.subscribe([(topic, QOS_1)]) == [QOS_1]
    await pub.publish(topic, b"two", qos=QOS_2)
    assert await receive(sub, 1) == [(topic, b"two", 1, False)]


async def test_retained_and_unsubscribe(amqtt_factory, names):
    """A retained message reaches a later subscriber; after UNSUBSCRIBE nothing comes."""
    topic = names.topic("retained")
    pub = await amqtt_factory(names.client("pub"))
    await pub.publish(topic, b"kept", qos=QOS_1, retain=True)
    sub = await amqtt_factory(names.client("sub"))
    await sub.subscribe([(topic, QOS_1)])
    assert await receive(sub, 1) == [(topic, b"kept", 1, True)]

    await sub.unsubscribe([topic])
    marker = names.topic("marker")
    await sub.subscribe([(marker, QOS_2)])
    await pub.publish(topic, b"after unsubscribe", qos=QOS_1)
    await pub.publish(marker, b"m", qos=QOS_2)
    assert await receive(sub, 1) == [(marker, b"m", 2, False)]
    await pub.publish(topic, b"", qos=QOS_1, retain=True)


async def test_persistent_session(amqtt_factory, names):
    """cleansession=False: QoS 1 messages published while away arrive on return."""
    topic = names.topic("offline")
    cid = names.client("persistent")
    sub = await amqtt_factory(cid, clean=False)
    await sub.subscribe([(topic, QOS_1)])
    await sub.disconnect()
    pub = await amqtt_factory(names.client("pub"))
    for i in range(5):
        await pub.publish(topic, f"m{i}".encode(), qos=QOS_1)
    sub = await amqtt_factory(cid, clean=False)
    got = await receive(sub, 5)
    assert [payload for _, payload, _, _ in got] == [f"m{i}".encode() for i in range(5)]
    await sub.disconnect()
    await amqtt_factory(cid, clean=True)  # discard the session


async def test_amqtt_and_paho_interoperate(broker, amqtt_factory, clients, names):
    """amqtt (3.1.1) to paho (5.0) and back through the broker."""
    to_paho, to_amqtt = names.topic("to-paho"), names.topic("to-amqtt")
    a = await amqtt_factory(names.client("amqtt"))
    await a.subscribe([(to_amqtt, QOS_2)])
    p = clients.paho(broker, names.client("paho"))
    await asyncio.to_thread(p.connect)
    await asyncio.to_thread(p.subscribe, to_paho, 2)

    await a.publish(to_paho, b"from amqtt", qos=QOS_2)
    m = await asyncio.to_thread(p.get)
    assert (m.topic, m.payload, m.qos) == (to_paho, b"from amqtt", 2)

    await asyncio.to_thread(p.publish, to_amqtt, b"from paho", 1)
    assert await receive(a, 1) == [(to_amqtt, b"from paho", 1, False)]
    await asyncio.to_thread(p.disconnect)
