"""MQTT 5.0 broker conformance, case by case after the Eclipse Paho interoperability
suite (paho.mqtt.testing, ``interoperability/client_test5.py``).

Each test is named after the Paho case it mirrors and checks the same broker
behaviour, written afresh with paho-mqtt 2.x as the client (and a raw socket
where paho cannot express the situation). Timings are shortened (keep-alive
2 s, expiry 1-2 s) so the suite stays fast.
"""

from __future__ import annotations

import time

import pytest
from paho.mqtt.packettypes import PacketTypes

from broker.codec import encode, encode_remaining_length
from broker.packets import (
    ConnAck,
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
    Will,
)
from tests.e2e.clients import Paho, SubscribeOptions, props
from tests.e2e.conftest import devicemq_only, is_mosquitto

pytestmark = pytest.mark.e2e

# Paho's topic set, each under the test's own prefix
TOPICS = ("TopicA", "TopicA/B", "Topic/C", "TopicA/C", "/TopicA")
WILDTOPICS = ("TopicA/+", "+/C", "#", "/#", "/+", "+/+", "TopicA/#")
USER_PROPS = [("a", "2"), ("c", "3")]


class Topics:
    """Paho's topics under the test's own prefix, plus markers used as barriers."""

    def __init__(self, names):
        self.t = [names.topic(t) for t in TOPICS]
        self.w = [names.topic(w) for w in WILDTOPICS]
        self.marker = names.topic("marker")
        self.wild_marker = names.topic("zz/marker")  # matches w[5] (+/+), never retained
        self.invalid = self.t[0] + "/#/x"  # '#' not last (MQTT-4.7.1-1)

    def will(self, suffix: str) -> str:
        return self.t[0] + "/will/" + suffix


def clear_retained(client: Paho, topics: list[str]) -> None:
    for topic in topics:
        client.publish(topic, b"", 1, retain=True)


def test_basic(broker, clients, names):
    """Paho client_test5 ``test_basic``: connect, subscribe, QoS 0/1/2 round trip;
    a second CONNECT on one connection and a wrong protocol name are refused."""
    t = Topics(names)
    a = clients.paho(broker, names.client("a"))
    assert a.connect().reason_code == 0
    a.disconnect()

    ack = a.connect()
    assert ack.reason_code == 0
    assert not ack.session_present
    assert a.subscribe(t.t[0], 2) == [2]
    for qos in range(3):
        a.publish(t.t[0], f"qos {qos}", qos)
    got = a.get_n(3)
    assert [(m.payload, m.qos) for m in got] == [(b"qos 0", 0), (b"qos 1", 1), (b"qos 2", 2)]
    a.disconnect()

    # a second CONNECT on the same network connection is a protocol error (MQTT-3.1.0-2)
    raw = clients.raw(broker)
    assert raw.connect(names.client("raw")).reason_code == 0
    raw.send_bytes(encode(_connect_packet(names.client("raw")), 5))
    after = raw.expect_close()
    assert all(isinstance(p, Disconnect) and p.reason_code >= 0x80 for p in after), after

    # a wrong protocol name: the connection is closed, nothing is accepted (MQTT-3.1.2-1)
    raw = clients.raw(broker)
    raw.send_bytes(_connect_with_protocol_name(b"hj", names.client("hj")))
    after = raw.expect_close()
    assert not any(isinstance(p, ConnAck) and p.reason_code == 0 for p in after), after


def _connect_packet(client_id: str):
    from broker.packets import Connect

    return Connect(client_id, protocol_level=5)


def _connect_with_protocol_name(name: bytes, client_id: str) -> bytes:
    """A v5 CONNECT whose protocol name is ``name`` (the codec always writes MQTT)."""
    data = encode(_connect_packet(client_id), 5)
    body = data[2:]  # a short CONNECT: one byte of remaining length
    assert body.startswith(b"\x00\x04MQTT")
    body = len(name).to_bytes(2, "big") + name + body[6:]
    return b"\x10" + encode_remaining_length(len(body)) + body


def test_retained_message(broker, clients, names):
    """Paho ``test_retained_message``: retained messages at QoS 0/1/2 with user
    properties reach a later wildcard subscriber; an empty retained message clears."""
    t = Topics(names)
    a = clients.paho(broker, names.client("a"))
    a.connect()
    pub_props = props(PacketTypes.PUBLISH, UserProperty=USER_PROPS)
    for qos, topic in enumerate(t.t[1:4]):
        a.publish(topic, f"qos {qos}", qos, retain=True, properties=pub_props)
    a.subscribe(t.w[5], 2)
    got = a.get_n(3)
    assert sorted(m.qos for m in got) == [0, 1, 2]
    for m in got:
        assert m.retain
        assert m.properties.UserProperty == USER_PROPS
    a.assert_no_message(0.2)
    a.disconnect()

    # clearing: empty payload, retain set -> nothing retained any more (MQTT-3.3.1-6)
    a.connect()
    clear_retained(a, t.t[1:4])
    a.subscribe(t.w[5], 2)
    a.publish(t.wild_marker, b"m", 2)
    assert a.until(t.wild_marker) == []
    a.disconnect()


def test_will_message(broker, clients, names):
    """Paho ``test_will_message``: a client that drops without DISCONNECT has its
    will, with its user properties in order, published to subscribers."""
    t = Topics(names)
    b = clients.paho(broker, names.client("b"))
    b.connect()
    b.subscribe(t.t[2], 2)

    a = clients.paho(broker, names.client("a"))
    will_props = props(PacketTypes.WILLMESSAGE, WillDelayInterval=0, UserProperty=USER_PROPS)
    a.connect(keepalive=2, will=(t.t[2], b"will message", 1, False), will_properties=will_props)
    a.terminate()

    m = b.get()
    assert (m.topic, m.payload) == (t.t[2], b"will message")
    assert m.properties.UserProperty == USER_PROPS
    b.assert_no_message(0.2)
    b.disconnect()


def test_will_not_sent_on_normal_disconnect(broker, clients, names):
    """Complement of Paho ``test_will_message``: a normal DISCONNECT discards the
    will (MQTT-3.14.4-3), DISCONNECT 0x04 asks for it to be sent."""
    t = Topics(names)
    b = clients.paho(broker, names.client("b"))
    b.connect()
    b.subscribe(t.t[2], 2)
    b.subscribe(t.marker, 2)

    a = clients.paho(broker, names.client("a"))
    a.connect(will=(t.t[2], b"not wanted", 1, False))
    a.disconnect()
    b.publish(t.marker, b"m", 2)
    assert b.until(t.marker) == []

    a.connect(will=(t.t[2], b"wanted", 1, False))
    a.disconnect(reason_code=0x04)
    assert b.get().payload == b"wanted"


def test_zero_length_clientid(broker, clients, names):
    """Paho ``test_zero_length_clientid``: in MQTT 5 an empty client id is accepted
    even with clean start 0, and the server assigns one (MQTT-3.1.3-6, -7)."""
    client0 = clients.paho(broker, "")
    ack = client0.connect(clean_start=False)
    assert ack.reason_code == 0
    assert ack.prop("AssignedClientIdentifier")
    client0.disconnect()
    ack = client0.connect(clean_start=True)
    assert ack.reason_code == 0
    client0.disconnect()


def test_assigned_clientid(broker, clients):
    """Paho ``test_assigned_clientid``: CONNACK carries a non-empty Assigned Client
    Identifier for a client that sent none, a different one each time."""
    c = clients.paho(broker, "")
    first = c.connect().prop("AssignedClientIdentifier")
    c.disconnect()
    second = c.connect().prop("AssignedClientIdentifier")
    c.disconnect()
    assert first and second and first != second


def test_offline_message_queueing(broker, clients, names):
    """Paho ``test_offline_message_queueing``: QoS 1 and 2 messages published while a
    persistent session is offline are delivered when it reconnects (QoS 0 may be)."""
    t = Topics(names)
    expiry = props(PacketTypes.CONNECT, SessionExpiryInterval=300)
    a = clients.paho(broker, names.client("a"))
    a.connect(clean_start=True, properties=expiry)
    a.subscribe(t.w[5], 2)
    a.disconnect()

    b = clients.paho(broker, names.client("b"))
    b.connect()
    for qos, topic in enumerate(t.t[1:4]):
        b.publish(topic, f"qos {qos}", qos)
    b.disconnect()

    ack = a.connect(clean_start=False, properties=expiry)
    assert ack.session_present
    a.publish(t.wild_marker, b"m", 2)  # queued messages go out before anything new
    payloads = sorted(m.payload for m in a.until(t.wild_marker))
    assert payloads in ([b"qos 1", b"qos 2"], [b"qos 0", b"qos 1", b"qos 2"]), payloads
    a.disconnect(properties=props(PacketTypes.DISCONNECT, SessionExpiryInterval=0))


def test_overlapping_subscriptions(broker, clients, names):
    """Paho ``test_overlapping_subscriptions``: two matching subscriptions give either
    one message at the highest QoS or one per subscription (MQTT-3.3.4-2)."""
    t = Topics(names)
    a = clients.paho(broker, names.client("a"))
    a.connect()
    assert a.subscribe([(t.w[6], 2), (t.w[0], 1)]) == [2, 1]
    a.publish(t.t[3], b"overlapping topic filters", 2)
    got = [a.get()]
    # a second copy, if the broker sends one per subscription, follows at once;
    # no barrier here: a marker could overtake it when the copies differ in QoS
    got += a.get_optional()
    qoss = sorted(m.qos for m in got)
    assert qoss in ([2], [1, 2]), qoss
    a.disconnect()


def test_keepalive(broker, clients, names):
    """Paho ``test_keepalive``: a client silent for 1.5 x its keep-alive is
    disconnected (MQTT-3.1.2-22) and its will is published."""
    t = Topics(names)
    b = clients.paho(broker, names.client("b"))
    b.connect(keepalive=0)
    b.subscribe(t.t[4], 2)

    raw = clients.raw(broker)
    ack = raw.connect(names.client("a"), keep_alive=2, will=Will(t.t[4], b"keepalive expiry", 1))
    assert ack.reason_code == 0
    start = time.monotonic()
    after = raw.expect_close(timeout=8)
    elapsed = time.monotonic() - start
    assert 2.5 <= elapsed <= 6, elapsed
    # the server may say why first (0x8D Keep Alive timeout)
    assert all(isinstance(p, Disconnect) and p.reason_code == 0x8D for p in after), after
    m = b.get()
    assert (m.topic, m.payload) == (t.t[4], b"keepalive expiry")
    b.disconnect()


def test_keepalive_kept_by_pings(broker, clients, names):
    """Complement of Paho ``test_keepalive``: PINGREQ within the keep-alive keeps
    the connection open and is answered with PINGRESP."""
    raw = clients.raw(broker)
    assert raw.connect(names.client("a"), keep_alive=1).reason_code == 0
    for _ in range(4):
        time.sleep(0.6)  # the client's own pacing, as a real client's timer
        raw.ping()
        assert raw.recv().type.name == "PINGRESP"
    raw.disconnect()


def test_redelivery_on_reconnect(broker, clients, names):
    """Paho ``test_redelivery_on_reconnect``: QoS 1 and 2 messages not acknowledged
    before the connection ended are re-sent, DUP set, on reconnect (MQTT-4.4.0-1,
    MQTT-3.3.1-1); an unanswered PUBREL is re-sent too."""
    t = Topics(names)
    session = Properties(session_expiry_interval=300)
    cid = names.client("b")
    raw = clients.raw(broker)
    assert raw.connect(cid, clean_start=True, properties=session).reason_code == 0
    raw.send(Subscribe(1, [Subscription(t.w[6], 2)]))
    assert raw.recv().reason_codes == [2]
    # publish to ourselves; complete our own outgoing flows, leave incoming ones hanging
    raw.send(Publish(t.t[1], b"", 1, packet_id=1))
    raw.send(Publish(t.t[3], b"", 2, packet_id=2))
    incoming = {}
    own_flows = 2
    while len(incoming) < 2 or own_flows:
        packet = raw.recv()
        if isinstance(packet, Publish):
            incoming[packet.qos] = packet
        elif isinstance(packet, PubRec):
            raw.send(PubRel(packet.packet_id))
        elif isinstance(packet, PubComp | PubAck):
            own_flows -= 1
    raw.disconnect()

    b = clients.paho(broker, cid)
    ack = b.connect(
        clean_start=False, properties=props(PacketTypes.CONNECT, SessionExpiryInterval=300)
    )
    assert ack.session_present
    got = b.get_n(2)
    assert sorted((m.topic, m.qos) for m in got) == [(t.t[1], 1), (t.t[3], 2)]
    assert all(m.dup for m in got), [(m.topic, m.dup) for m in got]
    b.assert_no_message(0.3)
    b.disconnect(properties=props(PacketTypes.DISCONNECT, SessionExpiryInterval=0))

    # QoS 2 with PUBREC sent but PUBCOMP missing: the reconnect gets PUBREL again
    cid2 = names.client("c")
    raw = clients.raw(broker)
    raw.connect(cid2, properties=session)
    raw.send(Subscribe(1, [Subscription(t.t[0], 2)]))
    raw.recv()
    pub = clients.paho(broker, names.client("p"))
    pub.connect()
    pub.publish(t.t[0], b"q2", 2)
    packet = raw.recv()
    assert isinstance(packet, Publish) and packet.qos == 2
    raw.send(PubRec(packet.packet_id))
    assert raw.recv() == PubRel(packet.packet_id)
    raw.disconnect()
    raw = clients.raw(broker)
    ack = raw.connect(cid2, clean_start=False, properties=session)
    assert ack.session_present
    assert raw.recv() == PubRel(packet.packet_id)
    raw.send(PubComp(packet.packet_id))
    assert raw.recv_or_none(0.3) is None
    raw.disconnect()
    pub.disconnect()


@devicemq_only("which subscriptions the server refuses is configuration")
def test_subscribe_failure(broker, broker_factory, clients, names):
    """Paho ``test_subscribe_failure``: a refused subscription gets a failure reason
    code (>= 0x80) in SUBACK. Paho's case uses a topic the broker's ACL forbids;
    devicemq refuses wildcards when wildcard subscriptions are off (0xA2) and
    malformed filters always (0x8F)."""
    t = Topics(names)
    no_wildcards = broker_factory({"mqtt.wildcard_subscriptions": False})
    a = clients.paho(no_wildcards, names.client("a"))
    ack = a.connect()
    assert ack.prop("WildcardSubscriptionAvailable") == 0
    assert a.subscribe([(t.w[0], 2), (t.t[0], 2)]) == [0xA2, 2]
    a.disconnect()

    raw = clients.raw(broker)  # paho refuses to send a malformed filter
    raw.connect(names.client("b"))
    raw.send(Subscribe(1, [Subscription(t.invalid, 1), Subscription(t.t[0], 1)]))
    assert raw.recv() == SubAck(1, [0x8F, 1])
    raw.disconnect()


def test_dollar_topics(broker, clients, names):
    """Paho ``test_dollar_topics``: filters starting with a wildcard do not match
    topics starting with '$' (MQTT-4.7.2-1); a filter starting with '$' does."""
    unique = names.prefix.split("/")[-1]
    dollar = f"$e2e/{unique}/TopicA/B"
    plain = f"e2e/{unique}/TopicA/B"
    b = clients.paho(broker, names.client("b"))
    b.connect(keepalive=0)
    b.subscribe([(f"+/{unique}/+/+", 2), (f"+/{unique}/#", 2)])
    b.publish(dollar, b"", 1)
    b.publish(plain, b"marker", 2)
    assert b.until(plain) == []

    b.subscribe(f"$e2e/{unique}/#", 2)
    b.publish(dollar, b"dollar", 1)
    m = b.get()
    while m.topic == plain:  # a second copy of the marker (one per matching filter)
        m = b.get()
    assert m.topic == dollar
    b.disconnect()


def test_unsubscribe(broker, clients, names):
    """Paho ``test_unsubscribe``: after UNSUBSCRIBE no more messages for that filter;
    the others stay. UNSUBACK says whether a subscription existed (0x00 / 0x11)."""
    t = Topics(names)
    b = clients.paho(broker, names.client("b"))
    b.connect()
    for topic in (*t.t[:3], t.marker):
        b.subscribe(topic, 2)
    assert b.unsubscribe(t.t[0]) == [0x00]
    assert b.unsubscribe(t.t[0]) == [0x11]

    a = clients.paho(broker, names.client("a"))
    a.connect()
    a.publish(t.t[0], b"topic 0 - unsubscribed", 1)
    a.publish(t.t[1], b"topic 1", 1)
    a.publish(t.t[2], b"topic 2", 1)
    a.publish(t.marker, b"m", 2)
    got = b.until(t.marker)
    assert [m.payload for m in got] == [b"topic 1", b"topic 2"]
    a.disconnect()
    b.disconnect()


def test_session_expiry(broker, clients, names):
    """Paho ``test_session_expiry``: expiry 0 ends the session with the connection;
    a positive expiry keeps it that long and no longer; DISCONNECT may change it."""
    t = Topics(names)
    a = clients.paho(broker, names.client("a"))

    def connect(clean: bool, expiry: int) -> bool:
        ack = a.connect(
            clean_start=clean, properties=props(PacketTypes.CONNECT, SessionExpiryInterval=expiry)
        )
        assert ack.reason_code == 0
        return ack.session_present

    assert not connect(True, 0)
    a.subscribe(t.t[0], 2)
    a.disconnect()
    assert not connect(False, 0), "expiry 0: the session ends with the connection"
    a.disconnect()

    assert not connect(True, 2)
    a.subscribe(t.t[0], 2)
    a.disconnect()
    assert connect(False, 2), "expiry 2: the session outlives the connection"
    a.disconnect()
    time.sleep(3.0)  # the interval itself is what is tested
    assert not connect(False, 2), "expiry 2: gone after 3 s"
    a.disconnect()

    assert not connect(True, 1)
    a.subscribe(t.t[0], 2)
    a.disconnect(properties=props(PacketTypes.DISCONNECT, SessionExpiryInterval=4))
    time.sleep(1.8)
    assert connect(False, 1), "DISCONNECT raised the expiry from 1 to 4 s"
    a.disconnect(properties=props(PacketTypes.DISCONNECT, SessionExpiryInterval=0))
    assert not connect(False, 1), "DISCONNECT set expiry 0: ended at once"
    a.disconnect()


def test_user_properties(broker, clients, names):
    """Paho ``test_user_properties``: user properties reach the subscriber unchanged
    and in order (MQTT-3.3.2-17, -18) at every QoS."""
    t = Topics(names)
    a = clients.paho(broker, names.client("a"))
    a.connect()
    a.subscribe(t.t[0], 2)
    pub_props = props(PacketTypes.PUBLISH, UserProperty=[*USER_PROPS, ("a", "dup")])
    for qos in range(3):
        a.publish(t.t[0], b"", qos, properties=pub_props)
    got = a.get_n(3)
    assert sorted(m.qos for m in got) == [0, 1, 2]
    for m in got:
        assert m.properties.UserProperty == [*USER_PROPS, ("a", "dup")]
    a.disconnect()


def test_payload_format(broker, clients, names):
    """Paho ``test_payload_format``: Payload Format Indicator and Content Type are
    forwarded unchanged (MQTT-3.3.2-4, -20)."""
    t = Topics(names)
    a = clients.paho(broker, names.client("a"))
    a.connect()
    a.subscribe(t.t[0], 2)
    pub_props = props(PacketTypes.PUBLISH, PayloadFormatIndicator=1, ContentType="My name")
    for qos in range(3):
        a.publish(t.t[0], "é", qos, properties=pub_props)
    got = a.get_n(3)
    assert sorted(m.qos for m in got) == [0, 1, 2]
    for m in got:
        assert m.properties.ContentType == "My name"
        assert m.properties.PayloadFormatIndicator == 1
    a.disconnect()


@devicemq_only("validating a payload's format is optional (spec 3.3.2.3.2)")
def test_payload_format_invalid(broker, clients, names):
    """Beyond Paho ``test_payload_format``: devicemq checks the UTF-8 promise and
    answers 0x99 Payload format invalid, without forwarding the message."""
    t = Topics(names)
    a = clients.paho(broker, names.client("a"))
    a.connect()
    a.subscribe(t.t[0], 2)
    a.subscribe(t.marker, 2)
    bad = props(PacketTypes.PUBLISH, PayloadFormatIndicator=1)
    assert a.publish(t.t[0], b"\xff\xfe", 1, properties=bad) == 0x99
    a.publish(t.marker, b"m", 2)
    assert a.until(t.marker) == []
    assert a.connected
    a.disconnect()


def test_publication_expiry(broker, clients, names):
    """Paho ``test_publication_expiry``: a message whose expiry passed while queued
    is not delivered (MQTT-3.3.2-5); a live one carries the remaining interval
    (MQTT-3.3.2-6). Also a retained message expires."""
    t = Topics(names)
    session = props(PacketTypes.CONNECT, SessionExpiryInterval=300)
    b = clients.paho(broker, names.client("b"))
    b.connect(properties=session)
    b.subscribe(t.t[0], 2)
    b.disconnect()

    a = clients.paho(broker, names.client("a"))
    a.connect()
    short = props(PacketTypes.PUBLISH, MessageExpiryInterval=1)
    long = props(PacketTypes.PUBLISH, MessageExpiryInterval=30)
    a.publish(t.t[0], b"qos 1 - expire", 1, properties=short)
    a.publish(t.t[0], b"qos 2 - expire", 2, properties=short)
    a.publish(t.t[0], b"qos 1 - don't expire", 1, properties=long)
    a.publish(t.t[0], b"qos 2 - don't expire", 2, properties=long)
    a.publish(t.t[1], b"retained - expire", 1, retain=True, properties=short)
    time.sleep(2.1)  # letting the expiry pass is the point

    b.connect(clean_start=False, properties=session)
    got = b.get_n(2)
    assert [m.payload for m in got] == [b"qos 1 - don't expire", b"qos 2 - don't expire"]
    for m in got:
        assert 0 < m.properties.MessageExpiryInterval < 30
    b.subscribe(t.t[1], 1)
    b.subscribe(t.marker, 2)
    a.publish(t.marker, b"m", 2)
    assert b.until(t.marker) == [], "the expired retained message was sent"
    b.disconnect(properties=props(PacketTypes.DISCONNECT, SessionExpiryInterval=0))
    a.disconnect()


def test_subscribe_options(broker, clients, names):
    """Paho ``test_subscribe_options``: No Local (MQTT-3.8.3-3), Retain As Published
    (MQTT-3.3.1-12, -13) and Retain Handling 0/1/2 (MQTT-3.3.1-9, -10, -11)."""
    t = Topics(names)
    a = clients.paho(broker, names.client("a"))
    b = clients.paho(broker, names.client("b"))

    # noLocal
    a.connect()
    b.connect()
    a.subscribe(t.t[0], SubscribeOptions(2, noLocal=True))
    a.subscribe(t.marker, 2)
    b.subscribe(t.t[0], SubscribeOptions(2, noLocal=True))
    a.publish(t.t[0], b"noLocal test", 1)
    a.publish(t.marker, b"m", 2)
    assert a.until(t.marker) == []
    assert b.get().payload == b"noLocal test"
    a.disconnect()
    b.disconnect()

    # retainAsPublished, and without it the flag is cleared on live messages
    a.connect()
    a.subscribe(t.t[0], SubscribeOptions(2, retainAsPublished=True))
    a.subscribe(t.t[4], SubscribeOptions(2, retainAsPublished=False))
    a.publish(t.t[0], b"retain as published false", 1)
    a.publish(t.t[0], b"retain as published true", 1, retain=True)
    a.publish(t.t[4], b"rap off", 1, retain=True)
    got = a.get_n(3)
    assert [(m.payload, m.retain) for m in got] == [
        (b"retain as published false", False),
        (b"retain as published true", True),
        (b"rap off", False),
    ]
    clear_retained(a, [t.t[0], t.t[4]])
    assert [m.payload for m in a.get_n(2)] == [b"", b""]  # the clearing messages, live
    a.disconnect()

    # retainHandling
    a.connect()
    for qos, topic in enumerate(t.t[1:4]):
        a.publish(topic, f"qos {qos}", qos, retain=True)
    a.subscribe(t.w[5], SubscribeOptions(2, retainHandling=1))
    got = a.get_n(3)
    assert sorted(m.qos for m in got) == [0, 1, 2]
    a.subscribe(t.w[5], SubscribeOptions(2, retainHandling=1))  # exists already: none
    a.publish(t.wild_marker, b"m", 2)
    assert a.until(t.wild_marker) == []
    a.disconnect()

    a.connect()
    for _ in range(2):
        a.subscribe(t.w[5], SubscribeOptions(2, retainHandling=2))
        a.publish(t.wild_marker, b"m", 2)
        assert a.until(t.wild_marker) == []
    a.disconnect()

    a.connect()
    for _ in range(2):
        a.subscribe(t.w[5], SubscribeOptions(2, retainHandling=0))
        got = a.get_n(3)
        assert sorted(m.qos for m in got) == [0, 1, 2]
        assert all(m.retain for m in got)
    clear_retained(a, t.t[1:4])
    a.disconnect()


def test_subscribe_identifiers(broker, clients, names):
    """Paho ``test_subscribe_identifiers``: a message carries the Subscription
    Identifier of every matching subscription (MQTT-3.3.4-3, -4, -5)."""
    t = Topics(names)
    a = clients.paho(broker, names.client("a"))
    a.connect()
    a.subscribe(t.t[0], 2, properties=props(PacketTypes.SUBSCRIBE, SubscriptionIdentifier=456789))

    b = clients.paho(broker, names.client("b"))
    b.connect()
    b.subscribe(t.t[0], 2, properties=props(PacketTypes.SUBSCRIBE, SubscriptionIdentifier=2))
    b.subscribe(t.t[0] + "/#", 2, properties=props(PacketTypes.SUBSCRIBE, SubscriptionIdentifier=3))
    b.subscribe(t.marker, 2)
    b.publish(t.t[0], b"sub identifier test", 1)
    b.publish(t.marker, b"m", 2)

    m = a.get()
    assert m.properties.SubscriptionIdentifier == [456789]
    # one copy with both identifiers, or one copy per subscription (MQTT-3.3.4-4, -5)
    got = b.until(t.marker)
    ids = sorted(i for m in got for i in m.properties.SubscriptionIdentifier)
    assert ids == [2, 3], [m.properties for m in got]
    a.disconnect()
    b.disconnect()


def test_request_response(broker, clients, names):
    """Paho ``test_request_response``: Response Topic and Correlation Data travel
    unchanged (MQTT-3.3.2-15, -16), so a responder can answer the requester."""
    t = Topics(names)
    a = clients.paho(broker, names.client("a"))
    b = clients.paho(broker, names.client("b"))
    a.connect()
    b.connect()
    a.subscribe(t.t[0], SubscribeOptions(2, noLocal=True))
    b.subscribe(t.t[0], SubscribeOptions(2, noLocal=True))

    request = props(PacketTypes.PUBLISH, ResponseTopic=t.t[0], CorrelationData=b"334")
    a.publish(t.t[0], b"request", 1, properties=request)
    m = b.get()
    assert m.properties.ResponseTopic == t.t[0]
    assert m.properties.CorrelationData == b"334"

    response = props(PacketTypes.PUBLISH, CorrelationData=m.properties.CorrelationData)
    b.publish(m.properties.ResponseTopic, b"response", 1, properties=response)
    r = a.get()
    assert (r.payload, r.properties.CorrelationData) == (b"response", b"334")
    a.disconnect()
    b.disconnect()


def test_client_topic_alias(broker, clients, names):
    """Paho ``test_client_topic_alias``: alias 0 and aliases above the server's Topic
    Alias Maximum are refused with 0x94 (MQTT-3.3.2-8, -9); a set alias replaces
    the topic; aliases do not outlive the connection (MQTT-3.3.2-7)."""
    t = Topics(names)
    raw = clients.raw(broker)  # paho will not send alias 0
    ack = raw.connect(names.client("a"))
    maximum = (ack.properties.topic_alias_maximum if ack.properties else None) or 0
    raw.send(
        Publish(t.t[0], b"topic alias 0", 1, packet_id=1, properties=Properties(topic_alias=0))
    )
    after = raw.expect_close()
    assert [type(p) for p in after] == [Disconnect] and after[0].reason_code >= 0x80, after
    if not is_mosquitto():  # mosquitto 2.0.11 says 0x81 Malformed Packet
        assert after[0].reason_code == 0x94
    a = clients.paho(broker, names.client("a"))
    if maximum == 0:
        pytest.skip("the broker accepts no topic aliases")

    a.connect()
    alias = props(PacketTypes.PUBLISH, TopicAlias=maximum + 1)
    a.publish(t.t[0], b"too big", 1, properties=alias, wait=False)
    gone = a.wait_disconnected()
    assert gone.from_server and gone.reason_code == 0x94, gone
    a.close()

    session = props(PacketTypes.CONNECT, TopicAliasMaximum=0, SessionExpiryInterval=300)
    a.connect(properties=session)
    a.subscribe(t.t[0], 2)
    alias1 = props(PacketTypes.PUBLISH, TopicAlias=1)
    a.publish(t.t[0], b"topic alias 1", 1, properties=alias1)
    assert a.get().topic == t.t[0]
    a.publish("", b"topic alias 2", 1, properties=alias1)
    m = a.get()
    assert (m.topic, m.payload) == (t.t[0], b"topic alias 2")
    a.disconnect()

    # a new connection starts without aliases, but keeps the session's subscriptions
    a.connect(clean_start=False, properties=session)
    a.publish(t.t[0], b"topic alias 3", 1)
    assert a.get().payload == b"topic alias 3"
    a.publish("", b"topic alias 4", 1, properties=alias1, wait=False)
    gone = a.wait_disconnected()
    assert gone.from_server and gone.reason_code >= 0x80, gone
    a.close()
    a.connect(properties=props(PacketTypes.CONNECT, SessionExpiryInterval=0))
    a.disconnect()


def test_server_topic_alias(broker, clients, names):
    """Paho ``test_server_topic_alias``: with a client Topic Alias Maximum the server
    may replace a repeated topic by an alias; without one it must not (MQTT-3.3.2-10)."""
    t = Topics(names)
    a = clients.paho(broker, names.client("a"))

    a.connect(properties=props(PacketTypes.CONNECT, TopicAliasMaximum=1))
    a.subscribe(t.t[0], 2)
    for qos in range(3):
        a.publish(t.t[0], b"topic alias 1", qos)
    got = a.get_n(3)
    a.disconnect()
    alias = getattr(got[0].properties, "TopicAlias", None)
    if alias is None:
        pytest.skip("the broker does not use topic aliases towards clients (optional)")
    assert 0 < alias <= 1
    assert got[0].topic == t.t[0]
    for m in got[1:]:
        assert m.properties.TopicAlias == alias
        assert m.topic == ""

    for connect_props in (None, props(PacketTypes.CONNECT, TopicAliasMaximum=0)):
        a.connect(properties=connect_props)
        a.subscribe(t.t[0], 2)
        for qos in range(3):
            a.publish(t.t[0], b"topic alias 1", qos)
        got = a.get_n(3)
        a.disconnect()
        for m in got:
            assert not hasattr(m.properties, "TopicAlias")
            assert m.topic == t.t[0]


def test_maximum_packet_size(broker, broker_factory, clients, names):
    """Paho ``test_maximum_packet_size``: a packet above the server's Maximum Packet
    Size ends the connection with 0x95 (MQTT-3.2.2-15 / 4.13); a message above
    the client's is not sent to it (MQTT-3.1.2-24, -25)."""
    small = broker_factory({"mqtt.max_packet_size": 1000})
    a = clients.paho(small, names.client("a"))
    ack = a.connect()
    server_max = ack.prop("MaximumPacketSize")
    assert server_max == 1000
    a.publish(names.short, b"." * server_max, 0, wait=False)
    gone = a.wait_disconnected()
    assert gone.from_server and gone.reason_code == 0x95, gone
    a.close()

    maximum = 64
    topic = names.short
    a = clients.paho(broker, names.client("b"))
    a.connect(properties=props(PacketTypes.CONNECT, MaximumPacketSize=maximum))
    a.subscribe(topic, 2)
    a.publish(topic, b"." * (maximum // 2), 0)
    assert a.get().payload == b"." * (maximum // 2)
    a.publish(topic, b"x" * maximum, 1)
    a.publish(topic, b"marker", 2)
    assert a.get().payload == b"marker", "the too-large message was delivered"
    a.disconnect()


def test_server_keep_alive(broker_factory, clients, names):
    """Paho ``test_server_keep_alive``: a keep-alive above the server's limit is
    answered with Server Keep Alive (MQTT-3.2.2-21)."""
    server = broker_factory({"mqtt.max_keep_alive": 60})
    a = clients.paho(server, names.client("a"))
    ack = a.connect(keepalive=120)
    assert ack.prop("ServerKeepAlive") == 60
    a.disconnect()


def test_flow_control1(broker, clients, names):
    """Paho ``test_flow_control1``: the server sends no more unacknowledged QoS 1
    PUBLISHes than the client's Receive Maximum (MQTT-3.3.4-7, -9)."""
    t = Topics(names)
    raw = clients.raw(broker)
    ack = raw.connect(names.client("a"), properties=Properties(receive_maximum=2))
    assert ack.reason_code == 0
    raw.send(Subscribe(1, [Subscription(t.t[0], 2)]))
    assert isinstance(raw.recv(), SubAck)

    pub = clients.paho(broker, names.client("p"))
    pub.connect()
    for i in range(1, 4):
        pub.publish(t.t[0], f"message {i}", 1)
    first, second = raw.recv(), raw.recv()
    assert [first.payload, second.payload] == [b"message 1", b"message 2"]
    assert raw.recv_or_none(0.5) is None, "a third PUBLISH exceeded Receive Maximum 2"
    raw.send(PubAck(first.packet_id))
    third = raw.recv()
    assert third.payload == b"message 3" and third.qos == 1
    raw.send(PubAck(second.packet_id))
    raw.send(PubAck(third.packet_id))
    raw.disconnect()
    pub.disconnect()


@devicemq_only("mosquitto 2.0.11 answers PUBREC 0x97 and stays connected (spec 3.2.2.3.3)")
def test_flow_control2(broker, clients, names):
    """Paho ``test_flow_control2``: a client exceeding the server's Receive Maximum
    with unfinished QoS 2 PUBLISHes is disconnected with 0x93 (MQTT-3.3.4-8)."""
    t = Topics(names)
    raw = clients.raw(broker)
    ack = raw.connect(names.client("a"))
    announced = ack.properties.receive_maximum if ack.properties else None
    receive_maximum = announced or 65535  # absent means 65535 (3.2.2.3.3)
    packets = b"".join(
        encode(Publish(t.t[0], f"message {i}".encode(), 2, packet_id=i), 5)
        for i in range(1, receive_maximum + 2)
    )
    raw.send_bytes(packets)
    after = raw.expect_close(timeout=10)
    recs = [p for p in after if isinstance(p, PubRec)]
    assert len(recs) == receive_maximum
    assert isinstance(after[-1], Disconnect), after[-3:]
    assert after[-1].reason_code == 0x93


def test_will_delay(broker, clients, names):
    """Paho ``test_will_delay``: the will is sent after the Will Delay Interval, or
    when the session ends if that is sooner (MQTT-3.1.3-9, 3.1.2.5); a client
    that returns within the delay cancels it."""
    t = Topics(names)
    b = clients.paho(broker, names.client("b"))
    b.connect()
    b.subscribe(t.will("#"), 2)
    # (will delay, session expiry, expected seconds until the will)
    cases = {"delay2": (2, 10, 2.0), "expiry0": (5, 0, 0.0), "expiry1": (5, 1, 1.0)}
    if is_mosquitto():  # mosquitto 2.0.11 waits out the delay although the session ended
        del cases["expiry0"]
    dying = []
    for name, (delay, expiry, _) in cases.items():
        c = clients.paho(broker, names.client(name))
        c.connect(
            properties=props(PacketTypes.CONNECT, SessionExpiryInterval=expiry),
            will=(t.will(name), name.encode(), 1, False),
            will_properties=props(PacketTypes.WILLMESSAGE, WillDelayInterval=delay),
        )
        dying.append(c)
    back = clients.paho(broker, names.client("back"))
    back_session = props(PacketTypes.CONNECT, SessionExpiryInterval=10)
    back.connect(
        properties=back_session,
        will=(t.will("back"), b"back", 1, False),
        will_properties=props(PacketTypes.WILLMESSAGE, WillDelayInterval=2),
    )
    start = time.monotonic()
    for c in [*dying, back]:
        c.terminate()
    assert back.connect(clean_start=False, properties=back_session).session_present

    arrived = {}
    for _ in cases:
        m = b.get(timeout=6)
        arrived[m.payload.decode()] = time.monotonic() - start
    for name, (_, _, expected) in cases.items():
        assert expected - 0.3 <= arrived[name] <= expected + 1.2, (name, arrived)
    b.assert_no_message(0.3)  # "back" reconnected: its will was cancelled
    back.disconnect(properties=props(PacketTypes.DISCONNECT, SessionExpiryInterval=0))
    b.disconnect()


def test_shared_subscriptions(broker, clients, names):
    """Paho ``test_shared_subscriptions``: a message on a shared subscription goes to
    one member of the group (MQTT-4.8.2), an ordinary one to every subscriber."""
    t = Topics(names)
    shared_pub = names.topic("x")
    shared_sub = f"$share/sharename/{shared_pub}"
    a = clients.paho(broker, names.client("a"))
    b = clients.paho(broker, names.client("b"))
    for c in (a, b):
        ack = c.connect()
        assert ack.prop("SharedSubscriptionAvailable", 1) == 1
        assert c.subscribe([(shared_sub, 2), (t.t[0], 2)]) == [2, 2]

    b.publish(t.t[0], b"to both", 0)
    assert a.get().payload == b"to both"
    assert b.get().payload == b"to both"

    count = 10
    for i in range(count):
        b.publish(shared_pub, f"message {i}", 1)
    b.publish(t.t[0], b"marker", 2)
    got = a.until(t.t[0]) + b.until(t.t[0])
    assert sorted(m.payload for m in got) == sorted(f"message {i}".encode() for i in range(count))
    a.disconnect()
    b.disconnect()
