"""Session state across connections (MQTT 5.0 spec 4.1, 4.4; 3.1.1 spec 4.1, 4.4)."""

from __future__ import annotations

import pytest

from broker.packets import Disconnect, PubAck, PubComp, Publish, PubRec, PubRel, ReasonCode
from tests.unit.core_harness import V5, V311, Client, Harness, payloads, publishes


def _persistent(h: Harness, level: int, client_id: str = "dev", **kw: object) -> Client:
    if level == V5:
        kw.setdefault("session_expiry_interval", 3600)
        return h.connected(client_id, level, clean_start=False, **kw)
    return h.connected(client_id, level, clean_start=False)


def _reconnect(h: Harness, level: int, client_id: str = "dev", **kw: object) -> Client:
    c = h.client(level)
    if level == V5:
        kw.setdefault("session_expiry_interval", 3600)
    ack = c.connect(client_id, clean_start=False, **kw)
    assert ack.session_present
    return c


@pytest.mark.parametrize("level", [V311, V5])
def test_persistent_session_keeps_subscriptions_and_queues_qos1_qos2_not_qos0(level: int) -> None:
    """MQTT-3.1.2-4/-5 (3.1.1), spec 4.1: subscriptions and QoS 1/2 messages are kept;
    QoS 0 while offline need not be, and devicemq does not keep them."""
    h = Harness()
    dev = _persistent(h, level)
    dev.subscribe("t", qos=2)
    dev.disconnect()
    pub = h.connected("pub")
    pub.publish("t", b"q0", qos=0)
    pub.publish_acked("t", b"q1", qos=1)
    pub.publish_acked("t", b"q2", qos=2)
    back = _reconnect(h, level)
    got = publishes(back.pending)
    assert [(p.payload, p.qos, p.dup) for p in got] == [(b"q1", 1, False), (b"q2", 2, False)]
    # The subscription is still there for live traffic.
    pub.publish("t", b"live")
    assert payloads(back.read()) == [b"live"]


@pytest.mark.parametrize("level", [V311, V5])
def test_inflight_resent_with_dup_and_same_packet_ids(level: int) -> None:
    """MQTT-4.4.0-1 and MQTT-3.3.1-1: unacknowledged PUBLISH resent, DUP=1, same ids."""
    h = Harness()
    dev = _persistent(h, level)
    dev.subscribe("t", qos=2)
    pub = h.connected("pub")
    pub.publish_acked("t", b"a", qos=1)
    pub.publish_acked("t", b"b", qos=2)
    first = publishes(dev.read())
    assert [(p.payload, p.dup) for p in first] == [(b"a", False), (b"b", False)]
    dev.conn.connection_lost()
    back = _reconnect(h, level)
    again = publishes(back.pending)
    assert [(p.payload, p.packet_id, p.dup) for p in again] == [
        (b"a", first[0].packet_id, True),
        (b"b", first[1].packet_id, True),
    ]
    back.ack(again[0])
    back.ack(again[1])
    assert h.broker.sessions["dev"].outflow.inflight == {}


@pytest.mark.parametrize("level", [V311, V5])
def test_pubrel_resent_for_messages_awaiting_pubcomp(level: int) -> None:
    """MQTT-4.4.0-1: after PUBREC the server resends PUBREL, not the PUBLISH."""
    h = Harness()
    dev = _persistent(h, level)
    dev.subscribe("t", qos=2)
    h.connected("pub").publish_acked("t", b"x", qos=2)
    (msg,) = publishes(dev.read())
    dev.send(PubRec(msg.packet_id))
    assert dev.read() == [PubRel(msg.packet_id)]
    dev.conn.connection_lost()
    back = _reconnect(h, level)
    assert back.pending == [PubRel(msg.packet_id)]
    back.send(PubComp(msg.packet_id))
    assert back.read() == []
    assert h.broker.sessions["dev"].outflow.inflight == {}


def test_queued_messages_after_inflight_are_sent_in_order_on_reconnect() -> None:
    h = Harness()
    dev = _persistent(h, V5, receive_maximum=2)
    dev.subscribe("t", qos=1)
    pub = h.connected("pub")
    for i in range(5):
        pub.publish_acked("t", bytes([i]), qos=1)
    assert [p.payload[0] for p in publishes(dev.read())] == [0, 1]
    dev.conn.connection_lost()
    back = _reconnect(h, V5, receive_maximum=10)
    got = publishes(back.pending)
    assert [(p.payload[0], p.dup) for p in got] == [
        (0, True),
        (1, True),
        (2, False),
        (3, False),
        (4, False),
    ]


def test_incoming_qos2_state_survives_reconnect() -> None:
    """MQTT-4.3.3-9..-11 across connections: the PUBLISH is not routed again and
    PUBREL for an id received before the disconnect completes with success."""
    h = Harness()
    sub = h.connected("sub")
    sub.subscribe("t")
    dev = _persistent(h, V5)
    dev.publish("t", b"once", qos=2, packet_id=7)
    assert dev.read() == [PubRec(7)]
    dev.conn.connection_lost()
    back = _reconnect(h, V5)
    back.send(Publish("t", b"once", 2, False, True, 7))
    assert back.read() == [PubRec(7)]
    back.send(PubRel(7))
    assert back.read() == [PubComp(7, 0)]
    assert payloads(sub.read()) == [b"once"]


def test_qos2_retransmission_at_receive_maximum_is_not_0x93() -> None:
    """MQTT-4.3.3-10 / spec 4.9: a resent QoS 2 PUBLISH (DUP=1, id already held)
    is not a new message, so it cannot exceed the Receive Maximum."""
    h = Harness(receive_maximum=1)
    h.connected("sub").subscribe("t", qos=2)
    dev = _persistent(h, V5)
    dev.publish("t", b"once", qos=2, packet_id=1)
    assert dev.read() == [PubRec(1)]
    dev.conn.connection_lost()
    back = _reconnect(h, V5)
    back.send(Publish("t", b"once", 2, False, True, 1))
    assert back.read() == [PubRec(1)]
    assert not back.closed


def test_clean_start_discards_stored_messages() -> None:
    h = Harness()
    dev = _persistent(h, V5)
    dev.subscribe("t", qos=1)
    dev.disconnect()
    h.connected("pub").publish_acked("t", qos=1)
    fresh = h.client()
    assert fresh.connect("dev", clean_start=True).session_present is False
    assert fresh.pending == []
    assert fresh.read() == []


def test_session_expiry_removes_the_session() -> None:
    """Spec 3.1.2.11.2: the session ends when the interval passes after the close."""
    h = Harness()
    dev = _persistent(h, V5, session_expiry_interval=30)
    dev.subscribe("t", qos=1)
    dev.disconnect()
    h.advance(29)
    assert "dev" in h.broker.sessions
    h.advance(1)
    assert "dev" not in h.broker.sessions
    assert h.broker.subscriptions.match("t").entries == []
    c = h.client()
    assert c.connect("dev", clean_start=False).session_present is False


def test_v311_persistent_session_expires_after_configured_maximum() -> None:
    h = Harness(max_session_expiry_interval=100)
    dev = h.connected("dev", V311, clean_start=False)
    dev.disconnect()
    h.advance(99)
    assert "dev" in h.broker.sessions
    h.advance(1)
    assert "dev" not in h.broker.sessions


def test_session_expiry_never_expires_value() -> None:
    """0xFFFFFFFF means the session does not expire (spec 3.1.2.11.2)."""
    h = Harness(max_session_expiry_interval=0xFFFFFFFF)
    dev = h.connected("dev", session_expiry_interval=0xFFFFFFFF)
    dev.disconnect()
    h.advance(10 * 365 * 24 * 3600)
    assert "dev" in h.broker.sessions


def test_session_expiry_timer_restarts_on_reconnect() -> None:
    h = Harness()
    _persistent(h, V5, session_expiry_interval=10).disconnect()
    h.advance(8)
    back = _reconnect(h, V5, session_expiry_interval=10)
    h.advance(8)
    back.disconnect()
    h.advance(8)
    assert "dev" in h.broker.sessions
    h.advance(2)
    assert "dev" not in h.broker.sessions


def test_disconnect_setting_expiry_from_zero_is_protocol_error() -> None:
    """MQTT-3.14.2-2: expiry 0 at CONNECT may not become non-zero on DISCONNECT."""
    h = Harness()
    c = h.connected("dev")
    c.disconnect(session_expiry_interval=60)
    assert c.read() == [Disconnect(ReasonCode.PROTOCOL_ERROR)]
    assert c.closed
    assert "dev" not in h.broker.sessions


def test_disconnect_may_shorten_expiry_to_zero() -> None:
    h = Harness()
    c = _persistent(h, V5)
    c.disconnect(session_expiry_interval=0)
    assert "dev" not in h.broker.sessions


def test_disconnect_may_change_nonzero_expiry() -> None:
    h = Harness()
    c = _persistent(h, V5, session_expiry_interval=10)
    c.disconnect(session_expiry_interval=100)
    h.advance(50)
    assert "dev" in h.broker.sessions


@pytest.mark.parametrize("level", [V311, V5])
def test_max_queued_messages_bounds_the_offline_queue(level: int) -> None:
    h = Harness(max_queued_messages=3)
    dev = _persistent(h, level)
    dev.subscribe("t", qos=1)
    dev.disconnect()
    pub = h.connected("pub")
    for i in range(6):
        pub.publish_acked("t", bytes([i]), qos=1)
    back = _reconnect(h, level)
    assert [p.payload[0] for p in publishes(back.pending)] == [0, 1, 2]
    assert h.broker.stats.dropped["queue_full"] == 3


def test_non_persistent_session_does_not_queue_after_disconnect() -> None:
    h = Harness()
    dev = h.connected("dev")
    dev.subscribe("t", qos=1)
    dev.disconnect()
    pub = h.connected("pub")
    assert pub.publish_acked("t", qos=1) == ReasonCode.NO_MATCHING_SUBSCRIBERS


def test_puback_for_unknown_id_is_ignored() -> None:
    c = Harness().connected("dev")
    c.send(PubAck(123), PubComp(9))
    assert c.read() == []
    assert not c.closed


def test_pubrec_for_unknown_id_gets_pubrel_0x92() -> None:
    """Spec 3.6.2.1: PUBREL 0x92 Packet Identifier not found."""
    c = Harness().connected("dev")
    c.send(PubRec(55))
    assert c.read() == [PubRel(55, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND)]


def test_resume_respects_a_lower_receive_maximum() -> None:
    """MQTT-3.3.4-9: never more unacknowledged PUBLISH than the Receive Maximum of
    the connection, also when resending after reconnect with a smaller one."""
    h = Harness()
    dev = _persistent(h, V5, receive_maximum=5)
    dev.subscribe("t", qos=1)
    pub = h.connected("pub")
    for i in range(5):
        pub.publish_acked("t", bytes([i]), qos=1)
    assert len(dev.read()) == 5
    dev.conn.connection_lost()
    back = _reconnect(h, V5, receive_maximum=2)
    assert len(back.pending) == 2
