"""CONNECT and CONNACK (MQTT 5.0 spec 3.1, 3.2; 3.1.1 spec 3.1, 3.2)."""

from __future__ import annotations

from broker.codec import PacketDecoder, encode
from broker.connection import ConnectionState
from broker.packets import (
    ConnAck,
    Connect,
    ConnectReturnCode,
    Disconnect,
    PingReq,
    PingResp,
    Properties,
    Publish,
    ReasonCode,
    Will,
)
from tests.unit.core_harness import V5, V311, Harness


def test_v5_connect_accepted_with_connack_success() -> None:
    h = Harness()
    c = h.client()
    ack = c.connect("dev-1")
    assert ack == ConnAck(False, ReasonCode.SUCCESS, ack.properties)
    assert c.conn.state is ConnectionState.CONNECTED
    assert not c.closed


def test_v311_connect_accepted_with_return_code_0() -> None:
    h = Harness()
    c = h.client(V311)
    ack = c.connect("dev-1")
    assert ack == ConnAck(False, ConnectReturnCode.ACCEPTED, None)


def test_v311_empty_client_id_with_clean_session_0_is_identifier_rejected() -> None:
    """MQTT-3.1.3-8: CONNACK return code 0x02, then close."""
    h = Harness()
    c = h.client(V311)
    ack = c.connect("", clean_start=False, check=False)
    assert ack.reason_code == ConnectReturnCode.IDENTIFIER_REJECTED
    assert ack.session_present is False
    assert c.closed


def test_v311_empty_client_id_with_clean_session_1_is_accepted() -> None:
    """MQTT-3.1.3-6: the server assigns an identifier."""
    h = Harness()
    c = h.client(V311)
    assert c.connect("").reason_code == 0
    assert c.conn.client_id


def test_v5_empty_client_id_gets_assigned_client_identifier() -> None:
    """MQTT-3.2.2-16: an assigned identifier is returned in CONNACK."""
    h = Harness()
    c1, c2 = h.client(), h.client()
    a1 = c1.connect("")
    a2 = c2.connect("")
    assert a1.properties is not None and a2.properties is not None
    id1 = a1.properties.assigned_client_identifier
    id2 = a2.properties.assigned_client_identifier
    assert id1 and id2 and id1 != id2
    assert c1.conn.client_id == id1
    assert not c1.closed  # no takeover between the two


def test_assigned_identifiers_are_random_and_fit_the_length_limit() -> None:
    """Issue 19: assigned IDs were ``devicemq-<start ms>-N``, so one told the next."""
    h = Harness(max_client_id_length=23)
    ids = [h.broker.assign_client_id() for _ in range(50)]
    assert len(set(ids)) == 50
    assert all(i.startswith("devicemq-") and len(i) == 23 for i in ids)
    assert len({i[9:12] for i in ids}) > 40  # no shared counter or clock prefix
    c = h.client()
    ack = c.connect("")
    assert ack.reason_code == 0 and ack.properties is not None
    assert len(ack.properties.assigned_client_identifier or "") == 23
    assert len(Harness().broker.assign_client_id()) == len("devicemq-") + 32


def test_v5_client_id_given_means_no_assigned_identifier() -> None:
    ack = Harness().client().connect("mine")
    assert ack.properties is not None
    assert ack.properties.assigned_client_identifier is None


def test_client_id_too_long_is_refused_v5_0x85() -> None:
    h = Harness(max_client_id_length=23)
    c = h.client()
    ack = c.connect("x" * 24, check=False)
    assert ack.reason_code == ReasonCode.CLIENT_IDENTIFIER_NOT_VALID
    assert c.closed
    ok = h.client()
    assert ok.connect("x" * 23).reason_code == 0


def test_client_id_too_long_is_refused_v311_rc2() -> None:
    h = Harness(max_client_id_length=23)
    c = h.client(V311)
    ack = c.connect("x" * 24, check=False)
    assert ack.reason_code == ConnectReturnCode.IDENTIFIER_REJECTED
    assert c.closed


def test_unsupported_protocol_level_gets_connack_rc1_then_close() -> None:
    """MQTT-3.1.2-2: return code 0x01 (unacceptable protocol level), then close."""
    h = Harness()
    c = h.client(V311)
    raw = bytearray(encode(Connect("c", protocol_level=4), 4))
    level_at = raw.index(b"MQTT") + 4
    raw[level_at] = 6
    c.send_raw(bytes(raw))
    out = PacketDecoder(protocol_level=4).feed(c.conn.data_to_send())
    assert out == [ConnAck(False, ConnectReturnCode.UNACCEPTABLE_PROTOCOL_VERSION)]
    assert c.closed
    assert h.broker.sessions == {}


def test_authentication_method_is_refused_with_0x8c() -> None:
    """devicemq offers no enhanced authentication (spec 4.12): CONNACK 0x8C."""
    h = Harness()
    c = h.client()
    ack = c.connect("c", check=False, authentication_method="SCRAM-SHA-1")
    assert ack.reason_code == ReasonCode.BAD_AUTHENTICATION_METHOD
    assert c.closed
    assert "c" not in h.broker.sessions


def test_will_topic_with_wildcard_is_refused() -> None:
    """A will topic is a topic name: no wildcards (MQTT-3.1.3-11 / 3.3.2-2)."""
    h = Harness()
    c = h.client()
    ack = c.connect("c", will=Will("a/+", b"gone"), check=False)
    assert ack.reason_code == ReasonCode.TOPIC_NAME_INVALID
    assert c.closed


def test_will_qos_above_maximum_qos_is_refused_0x9b() -> None:
    """MQTT-3.2.2-12: a will QoS the server does not support gets 0x9B."""
    h = Harness(maximum_qos=1)
    c = h.client()
    ack = c.connect("c", will=Will("w", b"gone", qos=2), check=False)
    assert ack.reason_code == ReasonCode.QOS_NOT_SUPPORTED
    assert c.closed


def test_will_retain_when_retain_unavailable_is_refused_0x9a() -> None:
    """MQTT-3.2.2-13."""
    h = Harness(retain_available=False)
    c = h.client()
    ack = c.connect("c", will=Will("w", b"gone", retain=True), check=False)
    assert ack.reason_code == ReasonCode.RETAIN_NOT_SUPPORTED


def test_v311_refusal_without_v311_code_just_closes() -> None:
    """3.1.1 has no code for a bad will topic: no CONNACK, the socket closes."""
    h = Harness()
    c = h.client(V311)
    c.send(Connect("c", protocol_level=4, will=Will("a/#", b"x")))
    assert c.read() == []
    assert c.closed


def test_second_connect_is_a_protocol_error() -> None:
    """MQTT-3.1.0-2: a second CONNECT is a Protocol Error: DISCONNECT 0x82, close."""
    h = Harness()
    c = h.connected("c")
    c.send(Connect("c"))
    assert c.read() == [Disconnect(ReasonCode.PROTOCOL_ERROR)]
    assert c.closed
    assert "c" not in h.broker.sessions


def test_second_connect_v311_closes_without_disconnect() -> None:
    h = Harness()
    c = h.connected("c", V311)
    c.send(Connect("c", protocol_level=4))
    assert c.read() == []
    assert c.closed


def test_first_packet_not_connect_closes_without_answer() -> None:
    """MQTT-3.1.0-1: the first packet must be CONNECT."""
    h = Harness()
    c = h.client()
    c.send(PingReq())
    assert c.read() == []
    assert c.closed
    c2 = h.client()
    c2.send(Publish("t", b"x"))
    assert c2.read() == []
    assert c2.closed


def test_pingreq_gets_pingresp() -> None:
    """MQTT-3.12.4-1."""
    c = Harness().connected("c")
    c.send(PingReq())
    assert c.read() == [PingResp()]


# -- Session Present (MQTT-3.2.2-1..3) -----------------------------------------------


def test_session_present_0_on_clean_start_and_1_on_resume_v5() -> None:
    h = Harness()
    c = h.connected("c", session_expiry_interval=60)
    assert c.conn.session is not None
    c.disconnect()
    again = h.client()
    assert again.connect("c", clean_start=False).session_present is True
    again.disconnect()
    fresh = h.client()
    assert fresh.connect("c", clean_start=True).session_present is False


def test_session_present_0_when_no_session_exists() -> None:
    """MQTT-3.2.2-3: clean start 0 with no stored session still answers 0."""
    h = Harness()
    assert h.client().connect("c", clean_start=False).session_present is False


def test_session_present_v311_clean_session_0() -> None:
    h = Harness()
    c = h.client(V311)
    assert c.connect("c", clean_start=False).session_present is False
    c.disconnect()
    c2 = h.client(V311)
    assert c2.connect("c", clean_start=False).session_present is True
    c2.disconnect()
    c3 = h.client(V311)
    assert c3.connect("c", clean_start=True).session_present is False


def test_v5_session_expiry_0_session_is_gone_after_disconnect() -> None:
    """MQTT-3.1.2-23 / spec 3.1.2.11.2: expiry 0 ends the session with the connection."""
    h = Harness()
    c = h.connected("c")
    c.disconnect()
    assert "c" not in h.broker.sessions
    assert h.client().connect("c", clean_start=False).session_present is False


# -- CONNACK properties reflecting settings (spec 3.2.2.3) ------------------------------


def test_connack_properties_reflect_settings() -> None:
    h = Harness(
        receive_maximum=10,
        maximum_qos=1,
        retain_available=False,
        max_packet_size=4096,
        topic_alias_maximum=5,
        wildcard_subscriptions=False,
        shared_subscriptions=False,
        subscription_identifiers=False,
    )
    props = h.client().connect("c").properties
    assert props is not None
    assert props.receive_maximum == 10
    assert props.maximum_qos == 1
    assert props.retain_available == 0
    assert props.maximum_packet_size == 4096
    assert props.topic_alias_maximum == 5
    assert props.wildcard_subscription_available == 0
    assert props.shared_subscription_available == 0
    assert props.subscription_identifier_available == 0


def test_connack_defaults_leave_out_what_is_the_spec_default() -> None:
    """Absent Receive Maximum means 65535, absent Maximum QoS means 2, etc."""
    h = Harness(receive_maximum=65535, topic_alias_maximum=0)
    props = h.client().connect("c").properties
    assert props is not None
    assert props.receive_maximum is None
    assert props.maximum_qos is None
    assert props.retain_available is None
    assert props.topic_alias_maximum is None
    assert props.server_keep_alive is None
    assert props.session_expiry_interval is None


def test_server_keep_alive_when_client_asks_more_than_max() -> None:
    """MQTT-3.2.2-21: the client must use the Server Keep Alive."""
    h = Harness(max_keep_alive=30)
    c = h.client()
    props = c.connect("c", keep_alive=120).properties
    assert props is not None and props.server_keep_alive == 30
    assert c.conn.keep_alive == 30
    c2 = h.client()
    props2 = c2.connect("d", keep_alive=30).properties
    assert props2 is not None and props2.server_keep_alive is None


def test_session_expiry_capped_and_announced() -> None:
    """Spec 3.2.2.3.2: the server's Session Expiry Interval overrides the client's."""
    h = Harness(max_session_expiry_interval=100)
    c = h.client()
    props = c.connect("c", session_expiry_interval=1000).properties
    assert props is not None and props.session_expiry_interval == 100
    assert h.broker.sessions["c"].expiry_interval == 100
    c2 = h.client()
    props2 = c2.connect("d", session_expiry_interval=50).properties
    assert props2 is not None and props2.session_expiry_interval is None


def test_connack_is_the_first_packet_sent() -> None:
    """MQTT-3.2.0-1: CONNACK is the first packet from the server."""
    h = Harness()
    c = h.client()
    c.send(Connect("c", properties=Properties(session_expiry_interval=10)))
    data = c.conn.data_to_send()
    assert isinstance(PacketDecoder(protocol_level=V5).feed(data)[0], ConnAck)


def test_client_id_length_is_counted_in_utf8_bytes() -> None:
    """max_client_id_length is in bytes (as MQTT-3.1.3-5 counts 23 UTF-8 bytes)."""
    h = Harness(max_client_id_length=23)
    c = h.client()
    ack = c.connect("é" * 12, check=False)  # 12 characters, 24 bytes
    assert ack.reason_code == ReasonCode.CLIENT_IDENTIFIER_NOT_VALID
    assert h.client().connect("é" * 11 + "x").reason_code == 0  # 23 bytes


def test_will_payload_not_utf8_with_format_indicator_is_refused_0x99() -> None:
    """Spec 3.1.3.2.3 / 3.2.2.2: Payload Format Indicator 1 promises UTF-8: 0x99."""
    h = Harness()
    c = h.client()
    will = Will("w", b"\xff", properties=Properties(payload_format_indicator=1))
    ack = c.connect("c", will=will, check=False)
    assert ack.reason_code == ReasonCode.PAYLOAD_FORMAT_INVALID
    assert c.closed
