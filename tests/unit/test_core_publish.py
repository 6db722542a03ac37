"""PUBLISH and its acknowledgement flows (MQTT 5.0 spec 3.3-3.7, 4.3, 4.5, 4.6)."""

from __future__ import annotations

from broker.packets import (
    Disconnect,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    ReasonCode,
    Subscription,
)
from tests.unit.core_harness import V311, Harness, payloads, publishes

# -- QoS 0 / 1 / 2 towards the broker and on to a subscriber --------------------------


def test_qos0_exact_sequence() -> None:
    h = Harness()
    sub = h.connected("sub")
    sub.subscribe("t", qos=2)
    pub = h.connected("pub")
    pub.publish("t", b"hi", qos=0)
    assert pub.read() == []
    assert sub.read() == [Publish("t", b"hi", 0, False, False, None, None)]


def test_qos1_exact_sequence() -> None:
    """MQTT-4.3.2-2 (server as receiver: PUBACK), MQTT-4.3.2-1 (as sender: new id, QoS 1)."""
    h = Harness()
    sub = h.connected("sub")
    sub.subscribe("t", qos=1)
    pub = h.connected("pub")
    pub.publish("t", b"hi", qos=1, packet_id=77)
    assert pub.read() == [PubAck(77, 0)]
    assert sub.read() == [Publish("t", b"hi", 1, False, False, 1, None)]
    sub.send(PubAck(1))
    assert sub.read() == []
    assert h.broker.sessions["sub"].outflow.inflight == {}


def test_qos2_receiver_flow_exact_sequence() -> None:
    """MQTT-4.3.3-8..-11: PUBREC, PUBREL -> PUBCOMP; routed once on PUBLISH (method A)."""
    h = Harness()
    sub = h.connected("sub")
    sub.subscribe("t", qos=0)
    pub = h.connected("pub")
    pub.publish("t", b"hi", qos=2, packet_id=5)
    assert pub.read() == [PubRec(5, 0)]
    assert payloads(sub.read()) == [b"hi"]
    # A retransmission before PUBREL (DUP=1, same id) is acknowledged, not routed again.
    pub.send(Publish("t", b"hi", 2, False, True, 5))
    assert pub.read() == [PubRec(5, 0)]
    assert sub.read() == []
    pub.send(PubRel(5))
    assert pub.read() == [PubComp(5, 0)]
    # After PUBCOMP the id is free: the same id is a new message.
    pub.publish("t", b"again", qos=2, packet_id=5)
    assert pub.read() == [PubRec(5, 0)]
    assert payloads(sub.read()) == [b"again"]


def test_pubrel_for_unknown_id_gets_pubcomp_0x92() -> None:
    """Spec 3.7.2.1: 0x92 Packet Identifier not found."""
    c = Harness().connected("c")
    c.send(PubRel(9))
    assert c.read() == [PubComp(9, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND)]
    assert not c.closed


def test_qos2_sender_flow_exact_sequence() -> None:
    """MQTT-4.3.3-1..-7: PUBLISH, PUBREC -> PUBREL, PUBCOMP ends the flow."""
    h = Harness()
    sub = h.connected("sub")
    sub.subscribe("t", qos=2)
    pub = h.connected("pub")
    pub.publish_acked("t", b"hi", qos=2)
    assert sub.read() == [Publish("t", b"hi", 2, False, False, 1, None)]
    sub.send(PubRec(1))
    assert sub.read() == [PubRel(1, 0)]
    assert h.broker.sessions["sub"].outflow.inflight[1].state.name == "AWAIT_PUBCOMP"
    sub.send(PubComp(1))
    assert sub.read() == []
    assert h.broker.sessions["sub"].outflow.inflight == {}


def test_pubrec_with_failure_reason_ends_the_flow() -> None:
    """MQTT-4.3.3-4 / spec 4.3.3: a PUBREC reason >= 0x80 ends the flow, no PUBREL."""
    h = Harness()
    sub = h.connected("sub", receive_maximum=1)
    sub.subscribe("t", qos=2)
    pub = h.connected("pub")
    pub.publish("t", b"1", qos=2)
    pub.publish("t", b"2", qos=2)
    first = publishes(sub.read())
    assert [p.payload for p in first] == [b"1"]
    sub.send(PubRec(first[0].packet_id, ReasonCode.QUOTA_EXCEEDED))
    # The window re-opens and the next message flows; no PUBREL for the refused one.
    nxt = sub.read()
    assert payloads(nxt) == [b"2"]


def test_delivered_qos_is_min_of_published_and_granted() -> None:
    """MQTT-3.8.4-8 (spec 3.3.4)."""
    h = Harness()
    subs = {}
    for granted in (0, 1, 2):
        subs[granted] = h.connected(f"s{granted}")
        subs[granted].subscribe("t", qos=granted)
    pub = h.connected("pub")
    for published in (0, 1, 2):
        if published:
            pub.publish_acked("t", bytes([published]), qos=published)
        else:
            pub.publish("t", bytes([published]))
    for granted, client in subs.items():
        got = publishes(client.read())
        assert [(p.payload[0], p.qos) for p in got] == [(q, min(q, granted)) for q in (0, 1, 2)]


def test_puback_0x10_when_no_matching_subscribers_v5() -> None:
    pub = Harness().connected("pub")
    assert pub.publish_acked("nobody", qos=1) == ReasonCode.NO_MATCHING_SUBSCRIBERS
    assert pub.publish_acked("nobody", qos=2) == ReasonCode.NO_MATCHING_SUBSCRIBERS


def test_puback_without_reason_v311_when_no_subscribers() -> None:
    pub = Harness().connected("pub", V311)
    pub.publish("nobody", qos=1, packet_id=3)
    assert pub.read() == [PubAck(3, 0)]


def test_messages_delivered_in_order() -> None:
    """MQTT-4.6.0-5 / spec 4.6: ordered topic, same QoS, arrives in order."""
    h = Harness()
    sub = h.connected("sub")
    sub.subscribe("t", qos=1)
    pub = h.connected("pub")
    for i in range(50):
        pub.publish("t", str(i).encode(), qos=1)
    got = publishes(sub.read())
    assert [p.payload for p in got] == [str(i).encode() for i in range(50)]
    assert [p.packet_id for p in got] == list(range(1, 51))


def test_overlapping_subscriptions_one_copy_highest_qos_all_ids() -> None:
    """MQTT-3.3.4-2, -3 and -5: one message, the highest QoS, every subscription identifier."""
    h = Harness()
    sub = h.connected("sub")
    sub.subscribe("a/+", qos=1, sub_id=1)
    sub.subscribe("a/b", qos=2, sub_id=2)
    sub.subscribe("#", qos=0)
    pub = h.connected("pub")
    pub.publish_acked("a/b", b"m", qos=2)
    got = publishes(sub.read())
    assert len(got) == 1
    assert got[0].qos == 2
    assert got[0].properties is not None
    assert sorted(got[0].properties.subscription_identifiers) == [1, 2]


def test_subscription_identifier_only_on_matching_subscription() -> None:
    h = Harness()
    sub = h.connected("sub")
    sub.subscribe("a/#", sub_id=9)
    sub.subscribe("b/#")
    pub = h.connected("pub")
    pub.publish("a/x")
    pub.publish("b/x")
    a, b = publishes(sub.read())
    assert a.properties is not None and a.properties.subscription_identifiers == (9,)
    assert b.properties is None or b.properties.subscription_identifiers == ()


def test_no_local() -> None:
    """MQTT-3.8.3-3: with No Local, a client's own messages are not sent back to it."""
    h = Harness()
    c = h.connected("c")
    c.subscribe(Subscription("t", 1, no_local=True))
    other = h.connected("other")
    other.subscribe("t")
    c.publish_acked("t", b"mine")
    assert c.read() == []
    assert payloads(other.read()) == [b"mine"]
    other.publish("t", b"theirs")
    assert payloads(c.read()) == [b"theirs"]


def test_without_no_local_own_messages_come_back() -> None:
    c = Harness().connected("c")
    c.subscribe("t")
    c.publish("t", b"echo")
    assert payloads(c.read()) == [b"echo"]


def test_retain_as_published() -> None:
    """MQTT-3.3.1-12, -13: live deliveries keep RETAIN only with Retain As Published."""
    h = Harness()
    rap = h.connected("rap")
    rap.subscribe(Subscription("t", 0, retain_as_published=True))
    plain = h.connected("plain")
    plain.subscribe("t")
    pub = h.connected("pub")
    pub.publish("t", b"r", retain=True)
    pub.publish("t", b"n", retain=False)
    assert [(p.payload, p.retain) for p in publishes(rap.read())] == [(b"r", True), (b"n", False)]
    assert [(p.payload, p.retain) for p in publishes(plain.read())] == [
        (b"r", False),
        (b"n", False),
    ]


def test_user_properties_and_content_type_forwarded_unchanged() -> None:
    """MQTT-3.3.2-17, -20: user properties and content type reach subscribers as sent."""
    h = Harness()
    sub = h.connected("sub")
    sub.subscribe("t")
    pub = h.connected("pub")
    pub.publish(
        "t",
        b"{}",
        content_type="application/json",
        user_properties=(("a", "1"), ("b", "2"), ("a", "3")),
        response_topic="reply/here",
        correlation_data=b"\x01\x02",
    )
    (got,) = publishes(sub.read())
    assert got.properties is not None
    assert got.properties.content_type == "application/json"
    assert got.properties.user_properties == (("a", "1"), ("b", "2"), ("a", "3"))
    assert got.properties.response_topic == "reply/here"
    assert got.properties.correlation_data == b"\x01\x02"


def test_v311_subscriber_gets_v5_message_without_properties() -> None:
    h = Harness()
    sub = h.connected("sub", V311)
    sub.subscribe("t", qos=1)
    pub = h.connected("pub")
    pub.publish_acked("t", b"x", qos=1, user_properties=(("k", "v"),), message_expiry_interval=60)
    assert sub.read() == [Publish("t", b"x", 1, False, False, 1, None)]


def test_publish_qos_above_maximum_is_disconnect_0x9b() -> None:
    """MQTT-3.2.2-11."""
    c = Harness(maximum_qos=1).connected("c")
    c.publish("t", qos=2)
    assert c.read() == [Disconnect(ReasonCode.QOS_NOT_SUPPORTED)]
    assert c.closed


def test_publish_retain_when_unavailable_is_disconnect_0x9a() -> None:
    """MQTT-3.2.2-14."""
    c = Harness(retain_available=False).connected("c")
    c.publish("t", retain=True)
    assert c.read() == [Disconnect(ReasonCode.RETAIN_NOT_SUPPORTED)]


def test_payload_format_indicator_invalid_utf8_gets_0x99() -> None:
    """Spec 3.3.2.3.2: a payload not matching its format indicator: PUBACK/PUBREC 0x99."""
    h = Harness()
    sub = h.connected("sub")
    sub.subscribe("t", qos=2)
    pub = h.connected("pub")
    pub.publish("t", b"\xff\xfe", qos=1, packet_id=4, payload_format_indicator=1)
    assert pub.read() == [PubAck(4, ReasonCode.PAYLOAD_FORMAT_INVALID)]
    pub.publish("t", b"\xff\xfe", qos=2, packet_id=5, payload_format_indicator=1)
    assert pub.read() == [PubRec(5, ReasonCode.PAYLOAD_FORMAT_INVALID)]
    assert sub.read() == []
    assert not pub.closed
    pub.publish_acked("t", "ünïcode".encode(), qos=1, payload_format_indicator=1)
    (got,) = publishes(sub.read())
    assert got.properties is not None and got.properties.payload_format_indicator == 1


def test_topic_name_with_wildcard_is_disconnect_0x90() -> None:
    """MQTT-3.3.2-2."""
    c = Harness().connected("c")
    c.send_raw(b"\x30\x05\x00\x03a/+")
    assert c.read() == [Disconnect(ReasonCode.TOPIC_NAME_INVALID)]


# -- Receive Maximum (spec 3.3.4, 4.9) ----------------------------------------------


def test_server_respects_client_receive_maximum() -> None:
    """MQTT-3.3.4-7..-9: never more unacknowledged QoS>0 PUBLISH than Receive Maximum;
    the rest are sent as acknowledgements arrive, in order."""
    h = Harness()
    sub = h.connected("sub", receive_maximum=3)
    sub.subscribe("t", qos=2)
    pub = h.connected("pub")
    for i in range(10):
        pub.publish("t", bytes([i]), qos=1 if i % 2 else 2)
    pub.read()
    received: list[int] = []
    window = publishes(sub.read())
    assert len(window) == 3
    outstanding = list(window)
    while outstanding:
        p = outstanding.pop(0)
        received.append(p.payload[0])
        assert len(h.broker.sessions["sub"].outflow.inflight) <= 3
        sub.ack(p)
        more = publishes(sub.read())
        assert len(more) <= 1
        outstanding.extend(more)
    assert received == list(range(10))


def test_pubrec_does_not_free_the_window_pubcomp_does() -> None:
    """Spec 4.9: a QoS 2 message counts until PUBCOMP."""
    h = Harness()
    sub = h.connected("sub", receive_maximum=1)
    sub.subscribe("t", qos=2)
    pub = h.connected("pub")
    pub.publish("t", b"1", qos=2)
    pub.publish("t", b"2", qos=2)
    (first,) = publishes(sub.read())
    sub.send(PubRec(first.packet_id))
    assert sub.read() == [PubRel(first.packet_id)]
    sub.send(PubComp(first.packet_id))
    assert payloads(sub.read()) == [b"2"]


def test_qos0_not_limited_by_receive_maximum() -> None:
    h = Harness()
    sub = h.connected("sub", receive_maximum=1)
    sub.subscribe("t", qos=0)
    pub = h.connected("pub")
    for _ in range(5):
        pub.publish("t", qos=1)
    assert len(sub.read()) == 5


def test_client_exceeding_server_receive_maximum_gets_0x93() -> None:
    """MQTT-3.3.4-9 / spec 3.2.2.3.3: more than Receive Maximum in flight: DISCONNECT 0x93."""
    h = Harness(receive_maximum=2)
    h.connected("sub").subscribe("t", qos=2)
    c = h.connected("c")
    c.publish("t", qos=2, packet_id=1)
    c.publish("t", qos=2, packet_id=2)
    assert c.read() == [PubRec(1), PubRec(2)]
    c.send(PubRel(1))
    assert c.read() == [PubComp(1)]
    c.publish("t", qos=2, packet_id=3)  # two in flight again: fine
    assert c.read() == [PubRec(3)]
    c.publish("t", qos=1, packet_id=4)
    assert c.read() == [Disconnect(ReasonCode.RECEIVE_MAXIMUM_EXCEEDED)]
    assert c.closed


# -- Topic aliases (spec 3.3.2.3.4) ---------------------------------------------------


def test_incoming_topic_alias_set_then_used() -> None:
    h = Harness(topic_alias_maximum=4)
    sub = h.connected("sub")
    sub.subscribe("a/b")
    pub = h.connected("pub")
    pub.publish("a/b", b"1", topic_alias=2)
    pub.publish("", b"2", topic_alias=2)
    got = publishes(sub.read())
    assert [(p.topic, p.payload) for p in got] == [("a/b", b"1"), ("a/b", b"2")]
    assert all(p.properties is None or p.properties.topic_alias is None for p in got)


def test_incoming_topic_alias_can_be_remapped() -> None:
    h = Harness(topic_alias_maximum=4)
    sub = h.connected("sub")
    sub.subscribe("#")
    pub = h.connected("pub")
    pub.publish("x", b"1", topic_alias=1)
    pub.publish("y", b"2", topic_alias=1)
    pub.publish("", b"3", topic_alias=1)
    assert [p.topic for p in publishes(sub.read())] == ["x", "y", "y"]


def test_incoming_topic_alias_above_maximum_is_0x94() -> None:
    """MQTT-3.3.2-9 (and -10)."""
    c = Harness(topic_alias_maximum=4).connected("c")
    c.publish("t", topic_alias=5)
    assert c.read() == [Disconnect(ReasonCode.TOPIC_ALIAS_INVALID)]
    assert c.closed


def test_incoming_topic_alias_when_disabled_is_0x94() -> None:
    """MQTT-3.3.2-8: Topic Alias Maximum 0 means no alias may be sent."""
    c = Harness(topic_alias_maximum=0).connected("c")
    c.publish("t", topic_alias=1)
    assert c.read() == [Disconnect(ReasonCode.TOPIC_ALIAS_INVALID)]


def test_unknown_topic_alias_with_empty_topic_is_protocol_error() -> None:
    """Spec 3.3.4: an alias never mapped on this connection: Protocol Error 0x82."""
    c = Harness().connected("c")
    c.publish("", topic_alias=3)
    assert c.read() == [Disconnect(ReasonCode.PROTOCOL_ERROR)]


def test_incoming_aliases_do_not_survive_the_connection() -> None:
    """MQTT-3.3.2-7: alias mappings belong to one network connection."""
    h = Harness()
    c = h.connected("c", session_expiry_interval=60)
    c.publish("t", topic_alias=1)
    c.disconnect()
    c2 = h.client()
    c2.connect("c", clean_start=False)
    c2.publish("", topic_alias=1)
    assert c2.read() == [Disconnect(ReasonCode.PROTOCOL_ERROR)]


def test_outgoing_topic_aliases_when_client_announces_maximum() -> None:
    """Spec 3.3.2.3.4: first PUBLISH carries topic + alias, later ones an empty topic."""
    h = Harness()
    sub = h.connected("sub", topic_alias_maximum=2)
    sub.subscribe("#")
    pub = h.connected("pub")
    for topic in ("a", "a", "b", "c", "b", "c", "a"):
        pub.publish(topic, topic.encode())
    got = publishes(sub.read())
    shown = [(p.topic, p.properties.topic_alias if p.properties else None) for p in got]
    assert shown == [
        ("a", 1),
        ("", 1),
        ("b", 2),
        ("c", None),  # MQTT-3.3.2-10 (client side): never above its Topic Alias Maximum
        ("", 2),
        ("c", None),
        ("", 1),
    ]
    assert [p.payload for p in got] == [b"a", b"a", b"b", b"c", b"b", b"c", b"a"]


def test_no_outgoing_aliases_without_client_maximum() -> None:
    """MQTT-3.1.2-26: no Topic Alias towards a client that did not allow any."""
    h = Harness()
    sub = h.connected("sub")
    sub.subscribe("#")
    pub = h.connected("pub")
    pub.publish("a")
    pub.publish("a")
    for p in publishes(sub.read()):
        assert p.topic == "a"
        assert p.properties is None or p.properties.topic_alias is None


def test_outgoing_aliases_restart_on_a_new_connection() -> None:
    """Resent messages after reconnect carry the topic again (aliases are per connection)."""
    h = Harness()
    sub = h.connected("sub", topic_alias_maximum=5, session_expiry_interval=60)
    sub.subscribe("t", qos=1)
    pub = h.connected("pub")
    pub.publish("t", b"1", qos=1)
    pub.publish("t", b"2", qos=1)
    assert [p.topic for p in publishes(sub.read())] == ["t", ""]
    sub.conn.connection_lost()
    sub2 = h.client()
    sub2.connect("sub", clean_start=False, topic_alias_maximum=5, session_expiry_interval=60)
    resent = publishes(sub2.pending)
    assert [p.topic for p in resent] == ["t", ""]
    assert all(p.dup for p in resent)


# -- Maximum Packet Size (spec 3.1.2.11.4, 3.2.2.3.6) ----------------------------------


def test_incoming_packet_above_server_maximum_is_0x95() -> None:
    """MQTT-3.2.2-15 (the client must not exceed it); the server disconnects with 0x95."""
    h = Harness(max_packet_size=128)
    other = h.connected("other")
    other.subscribe("t")
    c = h.connected("c")
    c.publish("t", b"x" * 200)
    assert c.read() == [Disconnect(ReasonCode.PACKET_TOO_LARGE)]
    assert c.closed
    c2 = h.connected("c2")
    c2.publish("t", b"small")
    assert payloads(other.read()) == [b"small"]


def test_outgoing_publish_above_client_maximum_is_dropped_next_still_delivered() -> None:
    """MQTT-3.1.2-24, -25: a too-large PUBLISH is discarded as if delivered."""
    h = Harness()
    sub = h.connected("sub", maximum_packet_size=64)
    sub.subscribe("t", qos=1)
    pub = h.connected("pub")
    pub.publish("t", b"x" * 100, qos=1)
    pub.publish("t", b"small", qos=1)
    pub.publish("t", b"y" * 100, qos=0)
    pub.publish("t", b"small0", qos=0)
    got = publishes(sub.read())
    assert [p.payload for p in got] == [b"small", b"small0"]
    sub.ack(got[0])
    assert h.broker.sessions["sub"].outflow.inflight == {}
    assert h.broker.stats.dropped["too_large_for_client"] == 2


def test_too_large_does_not_consume_window() -> None:
    h = Harness()
    sub = h.connected("sub", maximum_packet_size=64, receive_maximum=1)
    sub.subscribe("t", qos=1)
    pub = h.connected("pub")
    pub.publish("t", b"x" * 100, qos=1)
    pub.publish("t", b"a", qos=1)
    pub.publish("t", b"b", qos=1)
    (first,) = publishes(sub.read())
    assert first.payload == b"a"
    sub.ack(first)
    assert payloads(sub.read()) == [b"b"]


# -- Message expiry (spec 3.3.2.3.3) ---------------------------------------------------


def test_message_expired_while_queued_is_never_delivered() -> None:
    """MQTT-3.3.2-5."""
    h = Harness()
    sub = h.connected("sub", receive_maximum=1)
    sub.subscribe("t", qos=1)
    pub = h.connected("pub")
    pub.publish("t", b"1", qos=1, message_expiry_interval=10)
    pub.publish("t", b"2", qos=1, message_expiry_interval=10)
    pub.publish("t", b"3", qos=1)
    (first,) = publishes(sub.read())
    h.advance(11)
    sub.ack(first)
    assert payloads(sub.read()) == [b"3"]


def test_remaining_expiry_interval_sent_on_delivery() -> None:
    """MQTT-3.3.2-6: the interval sent is what is left of it."""
    h = Harness()
    sub = h.connected("sub", session_expiry_interval=3600)
    sub.subscribe("t", qos=1)
    sub.disconnect()
    pub = h.connected("pub")
    pub.publish_acked("t", b"m", qos=1, message_expiry_interval=100)
    h.advance(30)
    sub2 = h.client()
    sub2.connect("sub", clean_start=False)
    (got,) = publishes(sub2.pending)
    assert got.properties is not None
    assert got.properties.message_expiry_interval == 70


def test_expired_offline_message_not_delivered_on_reconnect() -> None:
    h = Harness()
    sub = h.connected("sub", session_expiry_interval=3600)
    sub.subscribe("t", qos=1)
    sub.disconnect()
    pub = h.connected("pub")
    pub.publish_acked("t", b"old", qos=1, message_expiry_interval=5)
    pub.publish_acked("t", b"new", qos=1)
    h.advance(6)
    sub2 = h.client()
    sub2.connect("sub", clean_start=False)
    assert payloads(sub2.pending) == [b"new"]


def test_immediate_delivery_carries_full_expiry() -> None:
    h = Harness()
    sub = h.connected("sub")
    sub.subscribe("t")
    h.connected("pub").publish("t", message_expiry_interval=42)
    (got,) = publishes(sub.read())
    assert got.properties is not None and got.properties.message_expiry_interval == 42
