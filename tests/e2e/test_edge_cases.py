"""Beyond the Paho suite: session, QoS and subscription rules that interoperability
suites rarely reach, checked against the running process."""

from __future__ import annotations

import time

import pytest
from paho.mqtt.packettypes import PacketTypes

from broker.packets import (
    Disconnect,
    Properties,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    Subscription,
)
from tests.e2e.clients import props
from tests.e2e.conftest import devicemq_only, is_mosquitto

pytestmark = pytest.mark.e2e

SESSION = Properties(session_expiry_interval=300)


def test_takeover_resends_inflight_with_dup(broker, clients, names):
    """A takeover with clean start 0 keeps the session: the QoS 1 message the old
    connection never acknowledged is re-sent, DUP set, same packet id (MQTT-4.4.0-1)."""
    cid, topic = names.client("dev"), names.topic()
    old = clients.raw(broker)
    assert old.connect(cid, properties=SESSION).reason_code == 0
    old.send(Subscribe(1, [Subscription(topic, 1)]))
    assert old.recv() == SubAck(1, [1])
    pub = clients.paho(broker, names.client("pub"))
    pub.connect()
    pub.publish(topic, b"unacked", 1)
    first = old.recv()
    assert isinstance(first, Publish) and not first.dup

    new = clients.raw(broker)
    ack = new.connect(cid, clean_start=False, properties=SESSION)
    assert ack.reason_code == 0 and ack.session_present
    again = new.recv()
    assert (again.packet_id, again.payload, again.dup) == (first.packet_id, b"unacked", True)
    new.send(PubAck(again.packet_id))
    assert new.recv_or_none(0.3) is None
    after = old.expect_close()
    assert all(isinstance(p, Disconnect) and p.reason_code == 0x8E for p in after), after
    new.disconnect(0)
    new = clients.raw(broker)
    new.connect(cid)  # clean start: discard
    new.disconnect()
    pub.disconnect()


def test_qos2_exactly_once_across_reconnect(broker, clients, names):
    """QoS 2 from a client: PUBLISH, PUBREC, connection lost, PUBLISH again with
    DUP, PUBREL: subscribers get exactly one copy (MQTT-4.3.3-10, 4.4)."""
    cid, topic = names.client("sender"), names.topic()
    sub = clients.paho(broker, names.client("sub"))
    sub.connect()
    sub.subscribe(topic, 2)
    sub.subscribe(names.topic("marker"), 2)

    raw = clients.raw(broker)
    raw.connect(cid, properties=SESSION)
    raw.send(Publish(topic, b"once", 2, packet_id=7))
    assert raw.recv() == PubRec(7)
    raw.close()  # no PUBREL, no DISCONNECT

    raw = clients.raw(broker)
    assert raw.connect(cid, clean_start=False, properties=SESSION).session_present
    raw.send(Publish(topic, b"once", 2, dup=True, packet_id=7))
    assert raw.recv() == PubRec(7)
    raw.send(PubRel(7))
    assert raw.recv() == PubComp(7)
    raw.send(Publish(names.topic("marker"), b"m", 2, packet_id=8))
    assert raw.recv() == PubRec(8)
    raw.send(PubRel(8))
    assert raw.recv() == PubComp(8)
    assert [m.payload for m in sub.until(names.topic("marker"))] == [b"once"]
    raw.disconnect()
    raw = clients.raw(broker)
    raw.connect(cid)
    raw.disconnect()


@devicemq_only("mosquitto 2.0.11 re-sends more than Receive Maximum on reconnect")
def test_offline_queue_respects_receive_maximum(broker, clients, names):
    """Twenty QoS 1 messages queued for an offline session come back in order, never
    more than the client's Receive Maximum (2) unacknowledged (MQTT-3.3.4-9)."""
    cid, topic = names.client("dev"), names.topic()
    small_window = Properties(session_expiry_interval=300, receive_maximum=2)
    raw = clients.raw(broker)
    raw.connect(cid, properties=small_window)
    raw.send(Subscribe(1, [Subscription(topic, 1)]))
    raw.recv()
    raw.disconnect()
    pub = clients.paho(broker, names.client("pub"))
    pub.connect()
    for i in range(20):
        pub.publish(topic, f"m{i:02d}", 1)
    pub.disconnect()

    raw = clients.raw(broker)
    assert raw.connect(cid, clean_start=False, properties=small_window).session_present
    got = []
    while len(got) < 20:
        window = [raw.recv(), raw.recv()] if len(got) < 19 else [raw.recv()]
        assert raw.recv_or_none(0.1) is None, "more than Receive Maximum in flight"
        for p in window:
            got.append(p.payload.decode())
            raw.send(PubAck(p.packet_id))
    assert got == [f"m{i:02d}" for i in range(20)]
    raw.disconnect()
    raw = clients.raw(broker)
    raw.connect(cid)
    raw.disconnect()


def test_retained_will(broker, clients, names):
    """A will with RETAIN set is kept as the topic's retained message (MQTT-3.1.2-17)."""
    topic = names.topic("status")
    a = clients.paho(broker, names.client("a"))
    a.connect(will=(topic, b"offline", 1, True))
    a.terminate()
    late = clients.paho(broker, names.client("late"))
    late.connect()
    late.subscribe(topic, 1)
    m = late.get()
    assert (m.payload, m.retain) == (b"offline", True)
    late.publish(topic, b"", 1, retain=True)
    late.disconnect()


@devicemq_only("mosquitto 2.0.11 keeps waiting out the will delay")
def test_will_published_when_clean_start_ends_the_session(broker, clients, names):
    """A delayed will is published as soon as its session ends, here because the
    client came back with clean start 1 (MQTT-3.1.3-9, 3.1.2.5)."""
    cid, topic = names.client("dev"), names.topic("will")
    watcher = clients.paho(broker, names.client("watch"))
    watcher.connect()
    watcher.subscribe(topic, 1)
    a = clients.paho(broker, cid)
    a.connect(
        properties=props(PacketTypes.CONNECT, SessionExpiryInterval=60),
        will=(topic, b"gone", 1, False),
        will_properties=props(PacketTypes.WILLMESSAGE, WillDelayInterval=30),
    )
    a.terminate()
    watcher.assert_no_message(0.3)
    start = time.monotonic()
    a.connect(clean_start=True)
    assert watcher.get(timeout=3).payload == b"gone"
    assert time.monotonic() - start < 1.5
    a.disconnect()


def test_shared_subscription_rules(broker, clients, names):
    """Invalid share names are refused in SUBACK (4.8.2); No Local on a shared
    subscription is a Protocol Error (MQTT-3.8.3-4); retained messages are not sent
    for a new shared subscription (devicemq's reading of 4.8.2)."""
    topic = names.topic()
    raw = clients.raw(broker)
    raw.connect(names.client("a"))
    bad = ["$share/g", "$share//" + topic, "$share/g+/" + topic, "$share/g#/" + topic]
    if not is_mosquitto():  # mosquitto 2.0.11 disconnects (0x81) instead
        raw.send(Subscribe(1, [Subscription(f, 1) for f in bad]))
        assert raw.recv() == SubAck(1, [0x8F] * len(bad))

    pub = clients.paho(broker, names.client("pub"))
    pub.connect()
    pub.publish(topic, b"retained", 1, retain=True)
    raw.send(Subscribe(2, [Subscription(f"$share/g/{topic}", 1), Subscription(topic + "/m", 2)]))
    assert raw.recv() == SubAck(2, [1, 2])
    pub.publish(topic + "/m", b"marker", 2)
    got = raw.recv()
    if is_mosquitto() and got.retain:
        pytest.skip("mosquitto 2.0.11 sends retained messages to a new shared subscription")
    assert isinstance(got, Publish) and got.topic == topic + "/m", got

    raw.send(Subscribe(3, [Subscription(f"$share/g/{topic}", 1, no_local=True)]))
    assert raw.expect_close() == [Disconnect(0x82)]
    pub.publish(topic, b"", 1, retain=True)
    pub.disconnect()


def test_shared_subscription_unsubscribe(broker, clients, names):
    """After UNSUBSCRIBE from the shared filter, the group's other member gets all."""
    topic = names.topic()
    shared = f"$share/g/{topic}"
    a = clients.paho(broker, names.client("a"))
    b = clients.paho(broker, names.client("b"))
    for c in (a, b):
        c.connect()
        c.subscribe(shared, 1)
    assert a.unsubscribe(shared) == [0]
    for i in range(6):
        a.publish(topic, f"{i}", 1)
    assert [m.payload for m in b.get_n(6)] == [f"{i}".encode() for i in range(6)]
    a.assert_no_message(0.2)


def test_shared_subscription_offline_member_gets_queued(broker, clients, names):
    """A shared group whose members are all offline (persistent sessions) still
    takes QoS 1 messages: one member gets each when it returns (4.8.2)."""
    topic = names.topic()
    shared = f"$share/g/{topic}"
    session = props(PacketTypes.CONNECT, SessionExpiryInterval=300)
    members = [clients.paho(broker, names.client(f"m{i}")) for i in range(2)]
    for m in members:
        m.connect(properties=session)
        m.subscribe(shared, 1)
        m.disconnect()
    pub = clients.paho(broker, names.client("pub"))
    pub.connect()
    for i in range(4):
        pub.publish(topic, f"q{i}", 1)
    pub.disconnect()
    for m in members:
        assert m.connect(clean_start=False, properties=session).session_present
    got = []
    deadline = time.monotonic() + 3
    while len(got) < 4 and time.monotonic() < deadline:
        for m in members:
            got += m.get_optional(0.05)
    payloads = sorted(m.payload for m in got)
    assert payloads == [b"q0", b"q1", b"q2", b"q3"], payloads
    for m in members:
        m.disconnect(properties=props(PacketTypes.DISCONNECT, SessionExpiryInterval=0))


def test_resubscribe_replaces_options(broker, clients, names):
    """SUBSCRIBE to an existing filter replaces its options and identifier
    (MQTT-3.8.4-3); the old identifier is not sent any more."""
    topic = names.topic()
    a = clients.paho(broker, names.client("a"))
    a.connect()
    a.subscribe(topic, 2, properties=props(PacketTypes.SUBSCRIBE, SubscriptionIdentifier=1))
    a.subscribe(topic, 1, properties=props(PacketTypes.SUBSCRIBE, SubscriptionIdentifier=2))
    a.publish(topic, b"x", 2)
    m = a.get()
    assert (m.qos, m.properties.SubscriptionIdentifier) == (1, [2])
    a.assert_no_message(0.2)
    a.disconnect()


@devicemq_only("mosquitto 2.0.11 accepts it")
def test_client_publish_with_subscription_identifier(broker, clients, names):
    """A PUBLISH from a client must not carry a Subscription Identifier
    (MQTT-3.3.4-6): it is a Protocol Error, DISCONNECT 0x82."""
    raw = clients.raw(broker)
    raw.connect(names.client("a"))
    raw.send(
        Publish(
            names.topic(),
            b"x",
            1,
            packet_id=1,
            properties=Properties(subscription_identifiers=(5,)),
        )
    )
    after = raw.expect_close()
    assert after == [Disconnect(0x82)]


def test_assigned_id_session_resumes(broker, clients):
    """A client that let the server assign its id can resume that session by
    connecting with the assigned id (MQTT-3.2.2-16)."""
    raw = clients.raw(broker)
    ack = raw.connect("", properties=SESSION)
    assigned = ack.properties.assigned_client_identifier
    assert assigned
    raw.disconnect()
    raw = clients.raw(broker)
    ack = raw.connect(assigned, clean_start=False, properties=SESSION)
    assert ack.session_present
    raw.disconnect()
    raw = clients.raw(broker)
    raw.connect(assigned)
    raw.disconnect()


def test_too_large_retained_not_sent(broker, clients, names):
    """A retained message bigger than the subscriber's Maximum Packet Size is not
    sent; smaller ones are (MQTT-3.1.2-24)."""
    topic = names.short
    pub = clients.paho(broker, names.client("pub"))
    pub.connect()
    pub.publish(topic + "/big", b"B" * 200, 1, retain=True)
    pub.publish(topic + "/small", b"s", 1, retain=True)
    raw = clients.raw(broker)
    raw.connect(names.client("small"), properties=Properties(maximum_packet_size=100))
    raw.send(Subscribe(1, [Subscription(topic + "/+", 1)]))
    assert raw.recv() == SubAck(1, [1])
    got = raw.recv()
    assert (got.topic, got.payload) == (topic + "/small", b"s")
    if got.qos:
        raw.send(PubAck(got.packet_id))
    assert raw.recv_or_none(0.3) is None
    raw.disconnect()
    pub.publish(topic + "/big", b"", 1, retain=True)
    pub.publish(topic + "/small", b"", 1, retain=True)
    pub.disconnect()
