"""MQTT 3.1.1 broker conformance, case by case after the Eclipse Paho interoperability
suite (paho.mqtt.testing, ``interoperability/client_test.py``).

Each test is named after the Paho case it mirrors and checks the same broker
behaviour, written afresh with paho-mqtt 2.x speaking MQTT 3.1.1 (and a raw
socket where paho cannot express the situation).
"""

from __future__ import annotations

import time

import pytest

from broker.codec import encode, encode_remaining_length
from broker.packets import (
    ConnAck,
    Connect,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    Subscription,
    Will,
)
from tests.e2e.clients import V311
from tests.e2e.conftest import devicemq_only, is_mosquitto

pytestmark = pytest.mark.e2e

TOPICS = ("TopicA", "TopicA/B", "Topic/C", "TopicA/C", "/TopicA")
WILDTOPICS = ("TopicA/+", "+/C", "#", "/#", "/+", "+/+", "TopicA/#")


class Topics:
    """Paho's topics under the test's own prefix, plus markers used as barriers."""

    def __init__(self, names):
        self.t = [names.topic(t) for t in TOPICS]
        self.w = [names.topic(w) for w in WILDTOPICS]
        self.marker = names.topic("marker")
        self.wild_marker = names.topic("zz/marker")  # matches w[5] (+/+)


def paho(clients, broker, client_id):
    return clients.paho(broker, client_id, version=V311)


def test_basic(broker, clients, names):
    """Paho client_test ``testBasic``: connect, subscribe, QoS 0/1/2 round trip; a
    second CONNECT (MQTT-3.1.0-2) and a wrong protocol name (MQTT-3.1.2-1) close
    the connection."""
    t = Topics(names)
    a = paho(clients, broker, names.client("a"))
    assert a.connect().reason_code == 0
    a.disconnect()
    ack = a.connect()
    assert ack.reason_code == 0 and not ack.session_present
    assert a.subscribe(t.t[0], 2) == [2]
    for qos in range(3):
        a.publish(t.t[0], f"qos {qos}", qos)
    got = a.get_n(3)
    assert [(m.payload, m.qos) for m in got] == [(b"qos 0", 0), (b"qos 1", 1), (b"qos 2", 2)]
    a.disconnect()

    raw = clients.raw(broker, level=4)
    assert raw.connect(names.client("raw")).reason_code == 0
    raw.send(Connect(names.client("raw"), protocol_level=4))
    assert raw.expect_close() == []  # 3.1.1 has no DISCONNECT from the server

    raw = clients.raw(broker, level=4)
    data = encode(Connect(names.client("hj"), protocol_level=4), 4)
    body = b"\x00\x02hj" + data[2:][6:]
    raw.send_bytes(b"\x10" + encode_remaining_length(len(body)) + body)
    after = raw.expect_close()
    assert not any(isinstance(p, ConnAck) and p.reason_code == 0 for p in after), after


def test_retained_messages(broker, clients, names):
    """Paho ``test_retained_messages``: retained messages at QoS 0/1/2 reach a later
    wildcard subscriber with RETAIN set (MQTT-3.3.1-8); empty ones clear them."""
    t = Topics(names)
    a = paho(clients, broker, names.client("a"))
    ack = a.connect()
    assert not ack.session_present
    for qos, topic in enumerate(t.t[1:4]):
        a.publish(topic, f"qos {qos}", qos, retain=True)
    a.subscribe(t.w[5], 2)
    got = a.get_n(3)
    assert sorted(m.qos for m in got) == [0, 1, 2]
    assert all(m.retain for m in got)
    a.disconnect()

    a.connect()
    for qos, topic in enumerate(t.t[1:4]):
        a.publish(topic, b"", qos, retain=True)
    a.subscribe(t.w[5], 2)
    a.publish(t.wild_marker, b"m", 2)
    assert a.until(t.wild_marker) == []
    a.disconnect()


def test_will_message(broker, clients, names):
    """Paho ``will_message_test``: the will of a client whose connection drops is
    published (MQTT-3.1.2-8)."""
    t = Topics(names)
    b = paho(clients, broker, names.client("b"))
    b.connect()
    b.subscribe(t.t[2], 2)
    a = paho(clients, broker, names.client("a"))
    a.connect(keepalive=2, will=(t.t[2], b"client not disconnected", 1, False))
    a.terminate()
    m = b.get()
    assert (m.topic, m.payload, m.qos) == (t.t[2], b"client not disconnected", 1)
    b.disconnect()


def test_zero_length_clientid(broker, clients, names):
    """Paho ``test_zero_length_clientid``: an empty client id with clean session 0
    is rejected with return code 2 (MQTT-3.1.3-8); with clean session 1 it is
    accepted (MQTT-3.1.3-6)."""
    raw = clients.raw(broker, level=4)  # paho will not send this CONNECT
    ack = raw.connect("", clean_start=False)
    assert ack == ConnAck(False, 2)
    assert raw.expect_close() == []

    client0 = paho(clients, broker, "")
    assert client0.connect(clean_start=True).reason_code == 0
    client0.disconnect()


def test_offline_message_queueing(broker, clients, names):
    """Paho ``test_offline_message_queueing``: a clean-session-0 client gets, on
    reconnect with session present, the QoS 1 and 2 messages it missed (QoS 0 may
    be dropped) (MQTT-3.1.2-5)."""
    t = Topics(names)
    a = paho(clients, broker, names.client("a"))
    a.connect(clean_start=False)
    a.subscribe(t.w[5], 2)
    a.disconnect()

    b = paho(clients, broker, names.client("b"))
    assert not b.connect().session_present
    for qos, topic in enumerate(t.t[1:4]):
        b.publish(topic, f"qos {qos}", qos)
    b.disconnect()

    ack = a.connect(clean_start=False)
    assert ack.session_present
    a.publish(t.wild_marker, b"m", 2)
    payloads = sorted(m.payload for m in a.until(t.wild_marker))
    assert payloads in ([b"qos 1", b"qos 2"], [b"qos 0", b"qos 1", b"qos 2"]), payloads
    a.disconnect()
    a.connect(clean_start=True)  # discard the session
    a.disconnect()


def test_overlapping_subscriptions(broker, clients, names):
    """Paho ``test_overlapping_subscriptions``: one message at the highest granted
    QoS, or one per matching subscription (MQTT-3.3.5-1)."""
    t = Topics(names)
    a = paho(clients, broker, names.client("a"))
    a.connect()
    assert a.subscribe([(t.w[6], 2), (t.w[0], 1)]) == [2, 1]
    a.publish(t.t[3], b"overlapping topic filters", 2)
    got = [a.get()]
    # a second copy, if the broker sends one per subscription, follows at once;
    # no barrier here: a marker could overtake it when the copies differ in QoS
    got += a.get_optional()
    qoss = sorted(m.qos for m in got)
    if is_mosquitto() and qoss == [1]:
        pytest.xfail("mosquitto 2.0.11 (3.1.1) sends one copy at the lower QoS")
    assert qoss in ([2], [1, 2]), qoss
    a.disconnect()


def test_keepalive(broker, clients, names):
    """Paho ``test_keepalive``: a client silent for 1.5 x keep-alive is disconnected
    (MQTT-3.1.2-24) and its will published."""
    t = Topics(names)
    b = paho(clients, broker, names.client("b"))
    b.connect(keepalive=0)
    b.subscribe(t.t[4], 2)
    raw = clients.raw(broker, level=4)
    ack = raw.connect(names.client("a"), keep_alive=2, will=Will(t.t[4], b"keepalive expiry", 1))
    assert ack.reason_code == 0
    start = time.monotonic()
    assert raw.expect_close(timeout=8) == []
    assert 2.5 <= time.monotonic() - start <= 6
    assert b.get().payload == b"keepalive expiry"
    b.disconnect()


def test_redelivery_on_reconnect(broker, clients, names):
    """Paho ``test_redelivery_on_reconnect``: unacknowledged QoS 1 and 2 messages are
    re-sent with DUP on reconnect with clean session 0 (MQTT-4.4.0-1, MQTT-3.3.1-1)."""
    t = Topics(names)
    cid = names.client("b")
    raw = clients.raw(broker, level=4)
    assert raw.connect(cid, clean_start=False).reason_code == 0
    raw.send(Subscribe(1, [Subscription(t.w[6], 2)]))
    assert raw.recv() == SubAck(1, [2])
    raw.send(Publish(t.t[1], b"", 1, packet_id=1))
    raw.send(Publish(t.t[3], b"", 2, packet_id=2))
    incoming, own_flows = {}, 2
    while len(incoming) < 2 or own_flows:
        packet = raw.recv()
        if isinstance(packet, Publish):
            incoming[packet.qos] = packet  # left unacknowledged
        elif isinstance(packet, PubRec):
            raw.send(PubRel(packet.packet_id))
        elif isinstance(packet, PubAck | PubComp):
            own_flows -= 1
    raw.disconnect()

    b = paho(clients, broker, cid)
    assert b.connect(clean_start=False).session_present
    got = b.get_n(2)
    assert sorted((m.topic, m.qos) for m in got) == [(t.t[1], 1), (t.t[3], 2)]
    assert all(m.dup for m in got)
    b.assert_no_message(0.3)
    b.disconnect()
    b.connect(clean_start=True)
    b.disconnect()


@devicemq_only("which subscriptions the server refuses is configuration")
def test_subscribe_failure(broker_factory, clients, names):
    """Paho ``test_subscribe_failure``: a refused subscription gets return code 0x80
    (MQTT-3.9.3-2). Paho's case relies on an ACL; devicemq refuses wildcard filters
    when wildcard subscriptions are turned off."""
    t = Topics(names)
    server = broker_factory({"mqtt.wildcard_subscriptions": False})
    a = paho(clients, server, names.client("a"))
    a.connect()
    assert a.subscribe([(t.w[0], 2), (t.t[0], 1)]) == [0x80, 1]
    a.disconnect()


def test_dollar_topics(broker, clients, names):
    """Paho ``test_dollar_topics``: filters starting with a wildcard do not match
    topics starting with '$' (MQTT-4.7.2-1)."""
    unique = names.prefix.split("/")[-1]
    dollar = f"$e2e/{unique}/TopicA/B"
    plain = f"e2e/{unique}/TopicA/B"
    b = paho(clients, broker, names.client("b"))
    b.connect(keepalive=0)
    b.subscribe(f"+/{unique}/+/+", 2)
    b.publish(dollar, b"", 1)
    b.publish(plain, b"marker", 2)
    assert b.until(plain) == []
    b.disconnect()


def test_unsubscribe(broker, clients, names):
    """Paho ``test_unsubscribe``: no messages for an unsubscribed filter
    (MQTT-3.10.4-1, -2); the other subscriptions stay."""
    t = Topics(names)
    b = paho(clients, broker, names.client("b"))
    b.connect()
    for topic in (*t.t[:3], t.marker):
        b.subscribe(topic, 2)
    b.unsubscribe(t.t[0])
    a = paho(clients, broker, names.client("a"))
    a.connect()
    for i in range(3):
        a.publish(t.t[i], f"topic {i}", 1)
    a.publish(t.marker, b"m", 2)
    assert [m.payload for m in b.until(t.marker)] == [b"topic 1", b"topic 2"]
    a.disconnect()
    b.disconnect()
