"""Durable group queues ($queue/{group}/{filter}, broker/group_queue.py) on a real
broker with its embedded Redis and Kafka, driven by paho-mqtt and raw-socket clients.

What must hold: a message is kept once for the group and goes to one member;
it waits while no member is online; what a member leaves unacknowledged (its
connection closes, it unsubscribes) goes to another member with DUP; what a
member acknowledged goes to no one again; a broker restart loses nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from broker.packets import (
    ConnAck,
    Properties,
    PubAck,
    Publish,
    SubAck,
    Subscribe,
    Subscription,
    Unsubscribe,
)
from tests.e2e.clients import V5, Paho, Raw
from tests.e2e.conftest import BrokerProcess, Clients, Names, devicemq_only, start_broker

pytestmark = devicemq_only("$queue group queues are devicemq's")

UNSPECIFIED = 0x80
IMPLEMENTATION_SPECIFIC = 0x83
EXPIRY = Properties(session_expiry_interval=600)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    """A persistent broker whose claims lapse fast (a kill test waits the lease out)."""
    process = start_broker(
        tmp_path_factory.mktemp("groups"),
        {"persistence.enabled": True, "group_queues.lease": 2.0},
    )
    try:
        yield process
    finally:
        process.stop()


def _member(clients: Clients, broker: BrokerProcess, cid: str, topic_filter: str) -> Raw:
    """A raw MQTT 5 member with a persistent session, subscribed (its SUBACK read)."""
    raw = clients.raw(broker)
    connack = raw.connect(cid, clean_start=False, properties=EXPIRY)
    assert isinstance(connack, ConnAck) and connack.reason_code == 0
    raw.send(Subscribe(1, [Subscription(topic_filter, 1)]))
    suback = raw.recv()
    assert isinstance(suback, SubAck) and suback.reason_codes == [1]
    return raw


def _publishes(raw: Raw, n: int, ack: bool = True) -> list[Publish]:
    """The next ``n`` PUBLISH packets (acknowledged if ``ack``)."""
    got: list[Publish] = []
    while len(got) < n:
        packet = raw.recv()
        if isinstance(packet, Publish):
            got.append(packet)
            if ack:
                assert packet.packet_id is not None
                raw.send(PubAck(packet.packet_id))
    return got


def _quiet(raw: Raw, seconds: float = 1.0) -> list[Any]:
    """What arrives within ``seconds`` (PUBLISHes acknowledged)."""
    out = []
    while (packet := raw.recv_or_none(seconds)) is not None:
        out.append(packet)
        if isinstance(packet, Publish) and packet.packet_id is not None:
            raw.send(PubAck(packet.packet_id))
    return out


def _producer(clients: Clients, broker: BrokerProcess, names: Names) -> Paho:
    producer = clients.paho(broker, names.client("producer"), V5)
    producer.connect()
    return producer


def _send(producer: Paho, topic: str, payloads: list[str], qos: int = 1) -> None:
    for payload in payloads:
        assert producer.publish(topic, payload, qos=qos) == (0 if qos else None)


def test_a_message_goes_to_one_member_and_a_plain_subscriber_still_gets_every_one(
    broker: BrokerProcess, clients: Clients, names: Names
) -> None:
    topic, group = names.topic("t"), f"$queue/g/{names.topic('#')}"
    a = _member(clients, broker, names.client("a"), group)
    b = _member(clients, broker, names.client("b"), group)
    plain = clients.paho(broker, names.client("plain"), V5)
    plain.connect()
    assert plain.subscribe(topic, qos=1) == [1]
    producer = _producer(clients, broker, names)
    payloads = [f"m{i}" for i in range(20)]
    _send(producer, topic, payloads)
    assert sorted(m.payload.decode() for m in plain.get_n(20)) == sorted(payloads)
    got = [p.payload.decode() for p in _quiet(a, 1.5) + _quiet(b, 0.5) if isinstance(p, Publish)]
    assert sorted(got) == sorted(payloads)  # each one to one member, none twice


def test_messages_wait_while_no_member_is_online_and_come_in_order(
    broker: BrokerProcess, clients: Clients, names: Names
) -> None:
    topic, group = names.topic("t"), f"$queue/g/{names.topic('#')}"
    member = _member(clients, broker, names.client("m"), group)
    member.close()
    producer = _producer(clients, broker, names)
    payloads = [f"m{i}" for i in range(10)]
    _send(producer, topic, payloads, qos=2)
    back = clients.raw(broker)
    connack = back.connect(names.client("m"), clean_start=False, properties=EXPIRY)
    assert isinstance(connack, ConnAck) and connack.session_present
    got = _publishes(back, 10)
    assert [p.payload.decode() for p in got] == payloads
    assert all(p.qos == 1 and not p.dup for p in got)
    assert not [p for p in _quiet(back) if isinstance(p, Publish)]  # acknowledged: gone


def test_what_a_member_leaves_unacknowledged_goes_to_another_with_dup(
    broker: BrokerProcess, clients: Clients, names: Names
) -> None:
    topic, group = names.topic("t"), f"$queue/g/{names.topic('#')}"
    a = _member(clients, broker, names.client("a"), group)
    producer = _producer(clients, broker, names)
    payloads = [f"m{i}" for i in range(3)]
    _send(producer, topic, payloads)
    held = _publishes(a, 3, ack=False)  # in flight to a, never acknowledged
    assert [p.payload.decode() for p in held] == payloads
    b = _member(clients, broker, names.client("b"), group)
    assert not [p for p in _quiet(b, 0.5) if isinstance(p, Publish)]  # a's claims hold
    a.close()  # a leaves
    again = _publishes(b, 3)
    assert sorted(p.payload.decode() for p in again) == payloads
    assert all(p.dup for p in again)  # they may have been seen
    # a's session resumes: it re-sends what a had not acknowledged, under the same
    # packet identifiers (MQTT-4.4.0-1), with DUP; b's acknowledgements already removed
    # them from the group, so a's are no-ops, and nothing else comes.
    a2 = clients.raw(broker)
    connack = a2.connect(names.client("a"), clean_start=False, properties=EXPIRY)
    assert isinstance(connack, ConnAck) and connack.session_present
    resent = _publishes(a2, 3)
    assert sorted((p.packet_id, p.payload.decode(), p.dup) for p in resent) == sorted(
        (p.packet_id, p.payload.decode(), True) for p in held
    )
    assert not [p for p in _quiet(a2) if isinstance(p, Publish)]
    assert not [p for p in _quiet(b, 0.5) if isinstance(p, Publish)]  # once each there


def test_an_unsubscribed_member_gives_back_what_it_had_not_acknowledged(
    broker: BrokerProcess, clients: Clients, names: Names
) -> None:
    topic, group = names.topic("t"), f"$queue/g/{names.topic('#')}"
    a = _member(clients, broker, names.client("a"), group)
    producer = _producer(clients, broker, names)
    _send(producer, topic, ["x", "y"])
    _publishes(a, 2, ack=False)
    b = _member(clients, broker, names.client("b"), group)
    a.send(Unsubscribe(2, [group]))
    again = _publishes(b, 2)
    assert sorted(p.payload.decode() for p in again) == ["x", "y"]


def test_qos_0_is_refused_and_qos_0_messages_are_not_queued(
    broker: BrokerProcess, clients: Clients, names: Names
) -> None:
    topic, group = names.topic("t"), f"$queue/g/{names.topic('#')}"
    raw = clients.raw(broker)
    raw.connect(names.client("zero"))
    raw.send(Subscribe(1, [Subscription(group, 0)]))
    suback = raw.recv()
    assert isinstance(suback, SubAck) and suback.reason_codes == [UNSPECIFIED]
    member = _member(clients, broker, names.client("m"), group)
    producer = _producer(clients, broker, names)
    _send(producer, topic, ["at-most-once"], qos=0)
    _send(producer, topic, ["kept"], qos=1)
    got = [p.payload for p in _publishes(member, 1)]
    assert got == [b"kept"]
    assert not [p for p in _quiet(member) if isinstance(p, Publish)]


def test_without_persistence_a_group_queue_is_refused(
    tmp_path_factory: pytest.TempPathFactory, clients: Clients, names: Names
) -> None:
    plain = start_broker(tmp_path_factory.mktemp("nogroups"), {"persistence.enabled": False})
    try:
        raw = clients.raw(plain)
        raw.connect(names.client("m"))
        raw.send(Subscribe(1, [Subscription(f"$queue/g/{names.topic('#')}", 1)]))
        suback = raw.recv()
        assert isinstance(suback, SubAck) and suback.reason_codes == [IMPLEMENTATION_SPECIFIC]
    finally:
        plain.stop()


def test_a_message_too_large_for_one_member_goes_to_another(
    broker: BrokerProcess, clients: Clients, names: Names
) -> None:
    """Found by review: it was discarded for the whole group. MQTT 5 section 3.1.2.24
    lets a shared subscription send it to a member that can take it."""
    topic, group = names.topic("t"), f"$queue/g/{names.topic('#')}"
    small = clients.raw(broker)
    small.connect(
        names.client("small"),
        clean_start=False,
        properties=Properties(session_expiry_interval=600, maximum_packet_size=200),
    )
    small.send(Subscribe(1, [Subscription(group, 1)]))
    assert isinstance(small.recv(), SubAck)
    producer = _producer(clients, broker, names)
    _send(producer, topic, ["x" * 1000, "tiny"])
    got_small = [p.payload for p in _publishes(small, 1)]
    assert got_small == [b"tiny"]  # the big one is not for it, nor lost
    big = _member(clients, broker, names.client("big"), group)
    (got,) = _publishes(big, 1)
    assert got.payload == b"x" * 1000
    assert not [p for p in _quiet(small) if isinstance(p, Publish)]
