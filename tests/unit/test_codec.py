"""Spec rules of the codec, one test per rule where the spec has a tag for it.

Byte strings are written by hand from the spec's packet layouts, so these
tests check the codec against the spec rather than against itself. Tags like
[MQTT-3.3.1-4] are MQTT 5.0 unless the test says 3.1.1.
"""

from __future__ import annotations

import pytest

from broker.codec import (
    MAX_REMAINING_LENGTH,
    PacketDecoder,
    decode_variable_int,
    encode,
    encode_remaining_length,
)
from broker.errors import MQTTError
from broker.packets import (
    Auth,
    ConnAck,
    Connect,
    Disconnect,
    Packet,
    PingReq,
    PingResp,
    Properties,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    ReasonCode,
    SubAck,
    Subscribe,
    Subscription,
    UnsubAck,
    Unsubscribe,
    Will,
)

MALFORMED = ReasonCode.MALFORMED_PACKET
PROTOCOL_ERROR = ReasonCode.PROTOCOL_ERROR


def s(text: str | bytes) -> bytes:
    """A length-prefixed UTF-8 string or binary field (1.5.4, 1.5.6)."""
    raw = text.encode() if isinstance(text, str) else text
    return len(raw).to_bytes(2, "big") + raw


def packet(first: int, body: bytes) -> bytes:
    return bytes((first,)) + encode_remaining_length(len(body)) + body


def decode(data: bytes, level: int | None = 5) -> list[Packet]:
    return PacketDecoder(level).feed(data)


def decode_one(data: bytes, level: int | None = 5) -> Packet:
    packets = decode(data, level)
    assert len(packets) == 1
    return packets[0]


def assert_error(data: bytes, reason: ReasonCode, level: int | None = 5) -> None:
    with pytest.raises(MQTTError) as info:
        decode(data, level)
    assert info.value.reason_code == reason, str(info.value)


def connect_bytes(
    flags: int = 0x02,
    payload: bytes = s("c"),
    level: int = 5,
    name: bytes = b"MQTT",
    properties: bytes = b"\x00",
) -> bytes:
    header = s(name) + bytes((level, flags)) + b"\x00\x3c"
    return packet(0x10, header + (properties if level == 5 else b"") + payload)


# -- Variable Byte Integer (1.5.5) ---------------------------------------------

BOUNDARIES = [
    (0, b"\x00"),
    (127, b"\x7f"),
    (128, b"\x80\x01"),
    (16_383, b"\xff\x7f"),
    (16_384, b"\x80\x80\x01"),
    (2_097_151, b"\xff\xff\x7f"),
    (2_097_152, b"\x80\x80\x80\x01"),
    (268_435_455, b"\xff\xff\xff\x7f"),
]


@pytest.mark.parametrize(("value", "wire"), BOUNDARIES)
def test_variable_byte_integer_boundaries_1_5_5(value: int, wire: bytes) -> None:
    assert encode_remaining_length(value) == wire
    assert decode_variable_int(wire + b"\xaa", 0, len(wire) + 1) == (value, len(wire))


def test_variable_byte_integer_above_maximum_does_not_encode() -> None:
    assert MAX_REMAINING_LENGTH == 268_435_455
    with pytest.raises(ValueError):
        encode_remaining_length(MAX_REMAINING_LENGTH + 1)


@pytest.mark.parametrize(
    "wire",
    [
        b"\xff\xff\xff\xff\x01",  # five bytes
        b"\x80\x00",  # 0 in two bytes [MQTT-1.5.5-1]
        b"\xff\xff\x80\x00",  # 16383 + padding
        b"\x80\x80",  # truncated
    ],
)
def test_bad_variable_byte_integer_is_malformed(wire: bytes) -> None:
    with pytest.raises(MQTTError) as info:
        decode_variable_int(wire, 0, len(wire))
    assert info.value.reason_code == MALFORMED


@pytest.mark.parametrize(("length", "wire"), BOUNDARIES[1:7])
def test_remaining_length_boundaries_in_a_publish(length: int, wire: bytes) -> None:
    """Each remaining length encoding size, through the whole decoder (2.1.4)."""
    publish = decode_one(b"\x30" + wire + s("t") + bytes(length - 3), level=4)
    assert isinstance(publish, Publish)
    assert len(publish.payload) == length - 3


def test_remaining_length_longer_than_four_bytes_is_malformed() -> None:
    assert_error(b"\x30\xff\xff\xff\xff\x7f", MALFORMED)


def test_remaining_length_not_minimal_is_malformed() -> None:
    """[MQTT-1.5.5-1]: 0x80 0x00 spells 0 in two bytes."""
    assert_error(b"\xc0\x80\x00", MALFORMED)


def test_incomplete_remaining_length_waits_for_more() -> None:
    decoder = PacketDecoder(5)
    assert decoder.feed(b"\x30\x85") == []
    assert decoder.feed(b"\x01") == []  # remaining length 133
    assert decoder.feed(s("t") + bytes(129)) == []
    assert decoder.feed(b"\x00") == [Publish("t", bytes(129))]


# -- Fixed header (2.1) --------------------------------------------------------


@pytest.mark.parametrize(
    "first",
    [
        0x21,  # CONNACK
        0x41,  # PUBACK
        0x58,  # PUBREC
        0x60,  # PUBREL must be 0b0010 [MQTT-3.6.1-1]
        0x63,
        0x74,
        0x80,  # SUBSCRIBE must be 0b0010 [MQTT-3.8.1-1]
        0x91,
        0xA0,  # UNSUBSCRIBE must be 0b0010 [MQTT-3.10.1-1]
        0xB2,
        0xC1,
        0xD2,
        0xE4,
        0xF8,
    ],
)
def test_reserved_fixed_header_flags_are_malformed_2_1_3_1(first: int) -> None:
    """[MQTT-2.1.3-1]: reserved flag bits must have the listed value."""
    assert_error(packet(first, b"\x00\x01\x00"), MALFORMED)


def test_reserved_flags_checked_before_the_body_arrives() -> None:
    assert_error(b"\x41\x10", MALFORMED)


def test_packet_type_0_is_malformed() -> None:
    assert_error(b"\x00\x00", MALFORMED)


def test_auth_does_not_exist_in_3_1_1() -> None:
    assert_error(b"\xf0\x00", MALFORMED, level=4)


def test_first_packet_must_be_connect_3_1_0_1() -> None:
    """[MQTT-3.1.0-1]: decided from the fixed header, before any body."""
    assert_error(b"\x30\x7f", PROTOCOL_ERROR, level=None)
    assert_error(b"\xc0\x00", PROTOCOL_ERROR, level=None)


def test_second_connect_is_decoded_3_1_0_2() -> None:
    """[MQTT-3.1.0-2] is the session layer's: the codec just decodes it."""
    data = connect_bytes()
    decoder = PacketDecoder()
    assert [type(p) for p in decoder.feed(data + data)] == [Connect, Connect]


# -- Maximum packet size -------------------------------------------------------


def test_packet_too_large_rejected_before_its_body_arrives() -> None:
    decoder = PacketDecoder(5, max_packet_size=100)
    with pytest.raises(MQTTError) as info:
        decoder.feed(b"\x30\xe8\x07")  # announces 1000 bytes, sends none
    assert info.value.reason_code == ReasonCode.PACKET_TOO_LARGE


def test_max_packet_size_counts_the_fixed_header() -> None:
    body = s("t") + bytes(94)  # 97 bytes + 2 of fixed header = 99
    assert PacketDecoder(4, max_packet_size=99).feed(packet(0x30, body))
    with pytest.raises(MQTTError) as info:
        PacketDecoder(4, max_packet_size=98).feed(packet(0x30, body))
    assert info.value.reason_code == ReasonCode.PACKET_TOO_LARGE


def test_max_packet_size_can_change_after_connect() -> None:
    decoder = PacketDecoder()
    decoder.feed(connect_bytes())
    decoder.max_packet_size = 10
    with pytest.raises(MQTTError) as info:
        decoder.feed(packet(0x30, s("topic") + b"\x00" + b"payload"))
    assert info.value.reason_code == ReasonCode.PACKET_TOO_LARGE


# -- Buffering ------------------------------------------------------------------

STREAM = [
    Connect("dev-1", protocol_level=5, keep_alive=30),
    Publish("a/b", b"hello", qos=1, packet_id=1),
    PingReq(),
    Subscribe(2, [Subscription("a/#", qos=2, no_local=True)]),
    Publish("big", bytes(300), qos=0),
    PubRel(1, 0x92),
    Disconnect(),
]
STREAM_BYTES = b"".join(encode(p, 5) for p in STREAM)


def test_several_packets_in_one_feed() -> None:
    assert PacketDecoder().feed(STREAM_BYTES) == STREAM


def test_byte_at_a_time() -> None:
    decoder = PacketDecoder()
    out: list[Packet] = []
    for i in range(len(STREAM_BYTES)):
        out += decoder.feed(STREAM_BYTES[i : i + 1])
    assert out == STREAM


@pytest.mark.parametrize("chunk", [2, 3, 7, 64, 1000])
def test_packets_split_across_feeds(chunk: int) -> None:
    decoder = PacketDecoder()
    out: list[Packet] = []
    for i in range(0, len(STREAM_BYTES), chunk):
        out += decoder.feed(STREAM_BYTES[i : i + chunk])
    assert out == STREAM


def test_large_packet_fed_in_small_pieces() -> None:
    publish = Publish("t", bytes(range(256)) * 256, qos=2, packet_id=7)
    data = encode(publish, 4)
    decoder = PacketDecoder(4)
    out: list[Packet] = []
    for i in range(0, len(data), 5):
        out += decoder.feed(data[i : i + 5])
    assert out == [publish]


def test_empty_feed() -> None:
    assert PacketDecoder(5).feed(b"") == []


def test_protocol_level_is_set_by_connect() -> None:
    """Pick the codec path from the CONNECT protocol level: the PUBLISH after a
    v5 CONNECT in the same read carries a property length."""
    decoder = PacketDecoder()
    packets = decoder.feed(connect_bytes(level=5) + packet(0x30, s("t") + b"\x00" + b"x"))
    assert decoder.protocol_level == 5
    assert packets[1] == Publish("t", b"x")
    decoder = PacketDecoder()
    packets = decoder.feed(connect_bytes(level=4) + packet(0x30, s("t") + b"\x00" + b"x"))
    assert decoder.protocol_level == 4
    assert packets[1] == Publish("t", b"\x00x")


# -- UTF-8 Encoded Strings (1.5.4) -------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b"\xed\xa0\x80",  # U+D800, a surrogate [MQTT-1.5.4-1]
        b"\xc0\xaf",  # overlong '/'
        b"\xff",
        b"a\xe2\x82",  # truncated sequence
    ],
)
def test_ill_formed_utf8_is_malformed_1_5_4_1(raw: bytes) -> None:
    assert_error(packet(0x30, s(raw) + b"\x00"), MALFORMED)
    assert_error(connect_bytes(payload=s(raw)), MALFORMED, level=None)


def test_null_character_is_malformed_1_5_4_2() -> None:
    assert_error(packet(0x30, s("a\x00b") + b"\x00"), MALFORMED)
    assert_error(connect_bytes(flags=0x82, payload=s("c") + s("us\x00er")), MALFORMED, level=None)
    subscribe = packet(0x82, b"\x00\x01\x00" + s("a/\x00") + b"\x00")
    assert_error(subscribe, MALFORMED)


@pytest.mark.parametrize("text", ["\x01\x1f", "\x7f\x9f", "\ufffe\uffff", "\U0010ffff"])
def test_control_and_non_characters_are_allowed_1_5_4(text: str) -> None:
    publish = decode_one(packet(0x30, s(text) + b"\x00"))
    assert isinstance(publish, Publish)
    assert publish.topic == text


def test_bom_is_not_stripped_1_5_4_3() -> None:
    publish = decode_one(packet(0x30, s("\ufeffa") + b"\x00"))
    assert isinstance(publish, Publish)
    assert publish.topic == "\ufeffa"


def test_string_running_past_the_packet_is_malformed() -> None:
    assert_error(packet(0x30, b"\x00\x09abc"), MALFORMED)


# -- CONNECT (3.1) ---------------------------------------------------------------


def test_connect_bytes_3_1_1() -> None:
    """Clean session, keep alive 60, client id "abc" (3.1.1 section 3.1)."""
    wire = bytes.fromhex("100f00044d5154540402003c0003616263")
    connect = Connect("abc", protocol_level=4, clean_start=True, keep_alive=60)
    assert decode_one(wire, level=None) == connect
    assert encode(connect, 4) == wire


def test_connect_bytes_5() -> None:
    wire = bytes.fromhex("101000044d5154540502003c00" + "0003616263")
    connect = Connect("abc", protocol_level=5, clean_start=True, keep_alive=60)
    assert decode_one(wire, level=None) == connect
    assert encode(connect, 5) == wire


def test_connect_mqisdp_3_1() -> None:
    wire = bytes.fromhex("100f00064d514973647003000000000178")
    connect = Connect("x", protocol_level=3, clean_start=False, keep_alive=0)
    connect.protocol_name = "MQIsdp"
    decoder = PacketDecoder()
    assert decoder.feed(wire) == [connect]
    assert decoder.protocol_level == 3
    assert encode(connect, 3) == wire


def test_connect_full_payload_order_3_1_3() -> None:
    """Client id, will properties, will topic, will payload, user name, password."""
    will_props = b"\x05" + b"\x18\x00\x00\x00\x0a"  # will delay 10
    payload = s("c") + will_props + s("w/t") + s(b"bye") + s("user") + s(b"\x00pw")
    connect = decode_one(connect_bytes(flags=0xF6, payload=payload), level=None)
    assert connect == Connect(
        "c",
        protocol_level=5,
        keep_alive=60,
        username="user",
        password=b"\x00pw",
        will=Will("w/t", b"bye", qos=2, retain=True, properties=Properties(will_delay_interval=10)),
    )


def test_unknown_protocol_name_is_malformed() -> None:
    assert_error(connect_bytes(name=b"MQTX"), MALFORMED, level=None)
    assert_error(connect_bytes(name=b"mqtt"), MALFORMED, level=None)


@pytest.mark.parametrize(("name", "level"), [(b"MQTT", 3), (b"MQTT", 6), (b"MQIsdp", 4)])
def test_unsupported_protocol_level_3_1_2_2(name: bytes, level: int) -> None:
    """[MQTT-3.1.2-2]: answered with CONNACK 0x84 (v5) or return code 1 (3.1.1)."""
    data = connect_bytes(name=name, level=level)
    assert_error(data, ReasonCode.UNSUPPORTED_PROTOCOL_VERSION, level=None)


def test_reserved_connect_flag_is_malformed_3_1_2_3() -> None:
    assert_error(connect_bytes(flags=0x03), MALFORMED, level=None)


def test_will_qos_without_will_flag_is_malformed_3_1_2_11() -> None:
    assert_error(connect_bytes(flags=0x0A), MALFORMED, level=None)


def test_will_qos_3_is_malformed_3_1_2_12() -> None:
    payload = s("c") + b"\x00" + s("t") + s(b"")
    assert_error(connect_bytes(flags=0x1E, payload=payload), MALFORMED, level=None)


def test_will_retain_without_will_flag_is_malformed_3_1_2_13() -> None:
    assert_error(connect_bytes(flags=0x22), MALFORMED, level=None)


def test_password_without_user_name_3_1_1_is_malformed_3_1_2_22() -> None:
    """3.1.1 [MQTT-3.1.2-22]; MQTT 5 allows a password alone (3.1.2.9)."""
    data = connect_bytes(flags=0x42, payload=s("c") + s(b"pw"), level=4)
    assert_error(data, MALFORMED, level=None)
    connect = decode_one(connect_bytes(flags=0x42, payload=s("c") + s(b"pw")), level=None)
    assert isinstance(connect, Connect)
    assert (connect.username, connect.password) == (None, b"pw")


def test_connect_trailing_bytes_are_malformed() -> None:
    assert_error(connect_bytes(payload=s("c") + b"\x00"), MALFORMED, level=None)


def test_connect_truncated_payload_is_malformed() -> None:
    assert_error(connect_bytes(flags=0x82, payload=s("c")), MALFORMED, level=None)


def test_connect_property_not_for_connect_is_malformed_2_2_2_2() -> None:
    """Topic Alias (0x23) belongs to PUBLISH only."""
    data = connect_bytes(properties=b"\x03\x23\x00\x01")
    assert_error(data, MALFORMED, level=None)


def test_will_delay_outside_will_properties_is_malformed_2_2_2_2() -> None:
    data = connect_bytes(properties=b"\x05\x18\x00\x00\x00\x01")
    assert_error(data, MALFORMED, level=None)


def test_session_expiry_in_will_properties_is_malformed_2_2_2_2() -> None:
    payload = s("c") + b"\x05\x11\x00\x00\x00\x01" + s("t") + s(b"")
    assert_error(connect_bytes(flags=0x06, payload=payload), MALFORMED, level=None)


@pytest.mark.parametrize(
    ("properties", "reason"),
    [
        (b"\x03\x21\x00\x00", PROTOCOL_ERROR),  # receive maximum 0 (3.1.2.11.3)
        (b"\x05\x27\x00\x00\x00\x00", PROTOCOL_ERROR),  # maximum packet size 0
        (b"\x02\x17\x02", PROTOCOL_ERROR),  # request problem information 2
        (b"\x02\x19\x02", PROTOCOL_ERROR),  # request response information 2
        (b"\x03\x11\x00\x00", MALFORMED),  # session expiry truncated
        (b"\x0a\x11\x00\x00\x00\x01\x11\x00\x00\x00\x02", PROTOCOL_ERROR),  # twice
        (b"\x04\x16" + s(b"x"), PROTOCOL_ERROR),  # auth data without method
        (b"\x05\x21\x00\x01", MALFORMED),  # property length past the packet
    ],
)
def test_connect_property_values(properties: bytes, reason: ReasonCode) -> None:
    assert_error(connect_bytes(properties=properties), reason, level=None)


# -- CONNACK (3.2) -------------------------------------------------------------


def test_connack_bytes_3_1_1() -> None:
    assert decode_one(b"\x20\x02\x01\x00", level=4) == ConnAck(True, 0)
    assert decode_one(b"\x20\x02\x00\x05", level=4) == ConnAck(False, 5)
    assert encode(ConnAck(False, 5), 4) == b"\x20\x02\x00\x05"


def test_connack_bytes_5() -> None:
    wire = b"\x20\x06\x00\x00\x03\x21\x00\x0a"
    connack = ConnAck(False, 0, Properties(receive_maximum=10))
    assert decode_one(wire) == connack
    assert encode(connack, 5) == wire
    assert encode(ConnAck(), 5) == b"\x20\x03\x00\x00\x00"


def test_connack_reserved_flags_are_malformed_3_2_2_1() -> None:
    assert_error(b"\x20\x02\x02\x00", MALFORMED, level=4)


def test_connack_5_without_property_length_is_malformed() -> None:
    assert_error(b"\x20\x02\x00\x00", MALFORMED)


@pytest.mark.parametrize("identifier", [0x24, 0x25, 0x28, 0x29, 0x2A])
def test_connack_flag_properties_above_1_are_protocol_errors(identifier: int) -> None:
    """Maximum QoS, Retain / Wildcard / Subscription Identifier / Shared
    Subscription Available: 0 or 1 (3.2.2.3)."""
    assert_error(bytes((0x20, 5, 0, 0, 2, identifier, 2)), PROTOCOL_ERROR)


# -- PUBLISH (3.3) ---------------------------------------------------------------


def test_publish_bytes_3_1_1() -> None:
    wire = bytes.fromhex("3209" + "0003612f62" + "000a" + "6869")
    publish = Publish("a/b", b"hi", qos=1, packet_id=10)
    assert decode_one(wire, level=4) == publish
    assert encode(publish, 4) == wire


def test_publish_bytes_5() -> None:
    wire = bytes.fromhex("3b0a" + "0003612f62" + "000a" + "00" + "6869")
    publish = Publish("a/b", b"hi", qos=1, retain=True, dup=True, packet_id=10)
    assert decode_one(wire) == publish
    assert encode(publish, 5) == wire


def test_publish_qos0_has_no_packet_identifier_2_2_1_2() -> None:
    wire = bytes.fromhex("3007" + "0003612f62" + "6869")
    publish = Publish("a/b", b"hi")
    assert decode_one(wire, level=4) == publish
    assert encode(publish, 4) == wire


def test_publish_qos_3_is_malformed_3_3_1_4() -> None:
    assert_error(packet(0x36, s("t") + b"\x00\x01\x00"), MALFORMED)


def test_publish_qos0_with_dup_is_malformed_3_3_1_2() -> None:
    assert_error(packet(0x38, s("t") + b"\x00"), MALFORMED)


@pytest.mark.parametrize("qos_flags", [0x32, 0x34])
def test_publish_packet_identifier_0_is_malformed_2_2_1_3(qos_flags: int) -> None:
    assert_error(packet(qos_flags, s("t") + b"\x00\x00\x00"), MALFORMED)


@pytest.mark.parametrize("topic", ["a/+", "#", "a/#", "+/b", "sport+"])
def test_publish_wildcard_in_topic_name_3_3_2_2(topic: str) -> None:
    assert_error(packet(0x30, s(topic) + b"\x00"), ReasonCode.TOPIC_NAME_INVALID)


def test_publish_empty_topic_3_1_1_is_protocol_error_4_7_3_1() -> None:
    assert_error(packet(0x30, s("") + b"x"), PROTOCOL_ERROR, level=4)


def test_publish_empty_topic_without_alias_is_protocol_error_3_3_2_1() -> None:
    assert_error(packet(0x30, s("") + b"\x00x"), PROTOCOL_ERROR)


def test_publish_empty_topic_with_alias_3_3_2_3_4() -> None:
    publish = decode_one(packet(0x30, s("") + b"\x03\x23\x00\x07x"))
    assert publish == Publish("", b"x", properties=Properties(topic_alias=7))


def test_publish_topic_alias_0_3_3_2_3_4() -> None:
    """ "A Topic Alias value of 0 ... is a Protocol Error" with reason 0x94."""
    data = packet(0x30, s("t") + b"\x03\x23\x00\x00")
    assert_error(data, ReasonCode.TOPIC_ALIAS_INVALID)


def test_publish_payload_is_opaque() -> None:
    """Payload Format Indicator 1 with invalid UTF-8: the session layer's call."""
    publish = decode_one(packet(0x30, s("t") + b"\x02\x01\x01" + b"\xff\xfe"))
    assert publish == Publish("t", b"\xff\xfe", properties=Properties(payload_format_indicator=1))


def test_publish_payload_format_indicator_above_1_is_protocol_error() -> None:
    assert_error(packet(0x30, s("t") + b"\x02\x01\x02"), PROTOCOL_ERROR)


def test_publish_repeated_subscription_identifiers_3_3_2_3_8() -> None:
    publish = decode_one(packet(0x30, s("t") + b"\x05\x0b\x01\x0b\x80\x01"))
    assert isinstance(publish, Publish)
    assert publish.properties == Properties(subscription_identifiers=(1, 128))


def test_publish_subscription_identifier_0_is_protocol_error() -> None:
    assert_error(packet(0x30, s("t") + b"\x02\x0b\x00"), PROTOCOL_ERROR)


def test_publish_property_twice_is_protocol_error() -> None:
    props = b"\x0a" + b"\x02\x00\x00\x00\x01" * 2
    assert_error(packet(0x30, s("t") + props), PROTOCOL_ERROR)


def test_publish_user_properties_keep_order_and_repeats() -> None:
    props = b"\x26" + s("k") + s("1") + b"\x26" + s("k") + s("2") + b"\x26" + s("a") + s("")
    publish = decode_one(packet(0x30, s("t") + bytes((len(props),)) + props))
    assert isinstance(publish, Publish)
    assert publish.properties is not None
    assert publish.properties.user_properties == (("k", "1"), ("k", "2"), ("a", ""))


@pytest.mark.parametrize(
    "properties",
    [
        b"",  # no property length at all
        b"\x05\x02\x00\x00",  # length past the packet
        b"\x02\x7f\x00",  # unknown identifier
        b"\x01\x02",  # four byte integer truncated
        b"\x03\x08\x00\x05",  # string truncated
        b"\x05\x11\x00\x00\x00\x01",  # session expiry does not belong in PUBLISH
    ],
)
def test_publish_bad_properties_are_malformed_2_2_2_2(properties: bytes) -> None:
    assert_error(packet(0x30, s("t") + properties), MALFORMED)


def test_publish_without_properties_has_properties_none() -> None:
    publish = decode_one(packet(0x30, s("t") + b"\x00"))
    assert isinstance(publish, Publish)
    assert publish.properties is None


def test_publish_truncated_topic_is_malformed() -> None:
    assert_error(packet(0x30, b"\x00"), MALFORMED)
    assert_error(packet(0x32, s("t") + b"\x00"), MALFORMED)


# -- PUBACK, PUBREC, PUBREL, PUBCOMP (3.4-3.7) --------------------------------

ACKS = [(PubAck, 0x40), (PubRec, 0x50), (PubRel, 0x62), (PubComp, 0x70)]
AckClass = type[PubAck] | type[PubRec] | type[PubRel] | type[PubComp]


@pytest.mark.parametrize(("cls", "first"), ACKS)
def test_ack_short_forms_3_4_2_1(cls: AckClass, first: int) -> None:
    """Remaining length 2: Success, no properties; 3: no properties."""
    assert decode_one(bytes((first, 2, 0, 9))) == cls(9)
    assert decode_one(bytes((first, 3, 0, 9, 0x92))) == cls(9, 0x92)
    assert decode_one(bytes((first, 4, 0, 9, 0x10, 0))) == cls(9, 0x10)
    assert encode(cls(9), 5) == bytes((first, 2, 0, 9))
    assert encode(cls(9, 0x92), 5) == bytes((first, 3, 0, 9, 0x92))


@pytest.mark.parametrize(("cls", "first"), ACKS)
def test_ack_with_properties(cls: AckClass, first: int) -> None:
    wire = bytes((first, 9, 0, 9, 0x80, 5, 0x1F)) + s("no")
    ack = cls(9, 0x80, Properties(reason_string="no"))
    assert decode_one(wire) == ack
    assert encode(ack, 5) == wire


@pytest.mark.parametrize(("cls", "first"), ACKS)
def test_ack_3_1_1_is_only_a_packet_identifier(cls: AckClass, first: int) -> None:
    assert decode_one(bytes((first, 2, 0x12, 0x34)), level=4) == cls(0x1234)
    assert_error(bytes((first, 3, 0, 1, 0)), MALFORMED, level=4)
    assert encode(cls(9, 0x80, Properties(reason_string="x")), 4) == bytes((first, 2, 0, 9))


@pytest.mark.parametrize(("cls", "first"), ACKS)
def test_ack_packet_identifier_0_is_malformed(cls: AckClass, first: int) -> None:
    assert_error(bytes((first, 2, 0, 0)), MALFORMED)


@pytest.mark.parametrize(("cls", "first"), ACKS)
def test_ack_truncated_is_malformed(cls: AckClass, first: int) -> None:
    assert_error(bytes((first, 1, 1)), MALFORMED)
    assert_error(bytes((first, 5, 0, 1, 0, 2, 0x1F)), MALFORMED)


def test_puback_reason_string_twice_is_protocol_error() -> None:
    props = b"\x1f" + s("a") + b"\x1f" + s("b")
    assert_error(packet(0x40, b"\x00\x01\x80" + bytes((len(props),)) + props), PROTOCOL_ERROR)


# -- SUBSCRIBE (3.8) ------------------------------------------------------------


def test_subscribe_bytes_3_1_1() -> None:
    """The two-filter example of 3.1.1 section 3.8.3."""
    wire = bytes.fromhex("820e" + "000a" + "0003612f6201" + "0003632f6402")
    subscribe = Subscribe(10, [Subscription("a/b", 1), Subscription("c/d", 2)])
    assert decode_one(wire, level=4) == subscribe
    assert encode(subscribe, 4) == wire


def test_subscribe_options_5_3_8_3_1() -> None:
    wire = bytes.fromhex("8209" + "000a" + "00" + "0003612f62" + "2e")
    subscribe = Subscribe(
        10, [Subscription("a/b", 2, no_local=True, retain_as_published=True, retain_handling=2)]
    )
    assert decode_one(wire) == subscribe
    assert encode(subscribe, 5) == wire


def test_subscribe_filter_syntax_is_not_the_codecs() -> None:
    subscribe = decode_one(packet(0x82, b"\x00\x01\x00" + s("a/#/b") + b"\x00" + s("") + b"\x01"))
    assert isinstance(subscribe, Subscribe)
    assert [sub.topic_filter for sub in subscribe.subscriptions] == ["a/#/b", ""]


def test_subscribe_reserved_option_bits_are_malformed_3_8_3_5() -> None:
    assert_error(packet(0x82, b"\x00\x01\x00" + s("a") + b"\x40"), MALFORMED)


def test_subscribe_qos_3_is_protocol_error_3_8_3_1() -> None:
    """MQTT 5 3.8.3.1: "a Protocol Error if the Maximum QoS field has the value 3"."""
    assert_error(packet(0x82, b"\x00\x01\x00" + s("a") + b"\x03"), PROTOCOL_ERROR)


def test_subscribe_retain_handling_3_is_protocol_error_3_8_3_1() -> None:
    assert_error(packet(0x82, b"\x00\x01\x00" + s("a") + b"\x30"), PROTOCOL_ERROR)


@pytest.mark.parametrize("options", [b"\x03", b"\x04", b"\x81"])
def test_subscribe_3_1_1_requested_qos_byte_is_malformed_3_8_3_4(options: bytes) -> None:
    """3.1.1 [MQTT-3.8.3-4]: upper six bits reserved, QoS 3 invalid."""
    assert_error(packet(0x82, b"\x00\x01" + s("a") + options), MALFORMED, level=4)


@pytest.mark.parametrize("level", [4, 5])
def test_subscribe_without_filters_is_protocol_error_3_8_3_2(level: int) -> None:
    body = b"\x00\x01" + (b"\x00" if level == 5 else b"")
    assert_error(packet(0x82, body), PROTOCOL_ERROR, level=level)


def test_subscribe_filter_without_options_is_malformed() -> None:
    assert_error(packet(0x82, b"\x00\x01\x00" + s("a")), MALFORMED)


def test_subscribe_packet_identifier_0_is_malformed_2_2_1_3() -> None:
    assert_error(packet(0x82, b"\x00\x00\x00" + s("a") + b"\x00"), MALFORMED)


def test_subscribe_subscription_identifier_3_8_2_1_2() -> None:
    subscribe = decode_one(packet(0x82, b"\x00\x01\x02\x0b\x05" + s("a") + b"\x00"))
    assert isinstance(subscribe, Subscribe)
    assert subscribe.properties == Properties(subscription_identifiers=(5,))
    twice = packet(0x82, b"\x00\x01\x04\x0b\x05\x0b\x06" + s("a") + b"\x00")
    assert_error(twice, PROTOCOL_ERROR)
    zero = packet(0x82, b"\x00\x01\x02\x0b\x00" + s("a") + b"\x00")
    assert_error(zero, PROTOCOL_ERROR)


# -- SUBACK (3.9) ------------------------------------------------------------------


def test_suback_bytes_3_1_1() -> None:
    wire = bytes.fromhex("9006" + "000a" + "000102" + "80")
    suback = SubAck(10, [0, 1, 2, 0x80])
    assert decode_one(wire, level=4) == suback
    assert encode(suback, 4) == wire


def test_suback_3_1_1_has_one_failure_code_3_9_3() -> None:
    assert encode(SubAck(1, [0x87, 0xA2, 0x01]), 4) == b"\x90\x05\x00\x01\x80\x80\x01"


def test_suback_bytes_5() -> None:
    wire = bytes.fromhex("9006000a000087a2")
    suback = SubAck(10, [0, 0x87, 0xA2])
    assert decode_one(wire) == suback
    assert encode(suback, 5) == wire


# -- UNSUBSCRIBE, UNSUBACK (3.10, 3.11) ------------------------------------------


def test_unsubscribe_bytes_3_1_1() -> None:
    wire = bytes.fromhex("a20c" + "000a" + "0003612f62" + "0003632f64")
    unsubscribe = Unsubscribe(10, ["a/b", "c/d"])
    assert decode_one(wire, level=4) == unsubscribe
    assert encode(unsubscribe, 4) == wire


@pytest.mark.parametrize("level", [4, 5])
def test_unsubscribe_without_filters_is_protocol_error_3_10_3_2(level: int) -> None:
    body = b"\x00\x01" + (b"\x00" if level == 5 else b"")
    assert_error(packet(0xA2, body), PROTOCOL_ERROR, level=level)


def test_unsuback_3_1_1_has_no_payload() -> None:
    assert decode_one(b"\xb0\x02\x00\x0a", level=4) == UnsubAck(10)
    assert_error(b"\xb0\x03\x00\x0a\x00", MALFORMED, level=4)
    assert encode(UnsubAck(10, [0x11]), 4) == b"\xb0\x02\x00\x0a"


def test_unsuback_bytes_5() -> None:
    wire = b"\xb0\x05\x00\x0a\x00\x00\x11"
    unsuback = UnsubAck(10, [0x00, 0x11])
    assert decode_one(wire) == unsuback
    assert encode(unsuback, 5) == wire


# -- PINGREQ, PINGRESP, DISCONNECT, AUTH (3.12-3.15) -----------------------------


@pytest.mark.parametrize("level", [4, 5])
def test_ping_bytes(level: int) -> None:
    assert decode_one(b"\xc0\x00", level) == PingReq()
    assert decode_one(b"\xd0\x00", level) == PingResp()
    assert encode(PingReq(), level) == b"\xc0\x00"
    assert encode(PingResp(), level) == b"\xd0\x00"
    assert_error(b"\xc0\x01\x00", MALFORMED, level)
    assert_error(b"\xd0\x01\x00", MALFORMED, level)


def test_disconnect_3_1_1_has_no_variable_header() -> None:
    assert decode_one(b"\xe0\x00", level=4) == Disconnect()
    assert_error(b"\xe0\x01\x00", MALFORMED, level=4)
    assert encode(Disconnect(0x8E, Properties(reason_string="x")), 4) == b"\xe0\x00"


def test_disconnect_short_forms_3_14_2_1() -> None:
    assert decode_one(b"\xe0\x00") == Disconnect()
    assert decode_one(b"\xe0\x01\x8e") == Disconnect(0x8E)
    assert decode_one(b"\xe0\x02\x04\x00") == Disconnect(0x04)
    assert encode(Disconnect(), 5) == b"\xe0\x00"
    assert encode(Disconnect(0x8E), 5) == b"\xe0\x01\x8e"


def test_disconnect_with_properties() -> None:
    wire = b"\xe0\x07\x00\x05\x11\x00\x00\x00\x00"
    disconnect = Disconnect(0, Properties(session_expiry_interval=0))
    assert decode_one(wire) == disconnect
    assert encode(disconnect, 5) == wire


def test_auth_short_forms_3_15_2_1() -> None:
    assert decode_one(b"\xf0\x00") == Auth()
    assert decode_one(b"\xf0\x01\x18") == Auth(0x18)
    assert encode(Auth(), 5) == b"\xf0\x00"
    with pytest.raises(ValueError):
        encode(Auth(), 4)


def test_auth_data_without_method_is_protocol_error_4_12() -> None:
    assert_error(b"\xf0\x07\x18\x05\x16" + s(b"xy"), PROTOCOL_ERROR)
    auth = decode_one(b"\xf0\x0b\x18\x09\x15" + s("m") + b"\x16" + s(b"xy"))
    assert auth == Auth(0x18, Properties(authentication_method="m", authentication_data=b"xy"))


# -- Which property may appear where (2.2.2.2) ---------------------------------

# Written from the spec's table, not from the codec's.
ALLOWED = {
    0x01: {"PUBLISH", "WILL"},
    0x02: {"PUBLISH", "WILL"},
    0x03: {"PUBLISH", "WILL"},
    0x08: {"PUBLISH", "WILL"},
    0x09: {"PUBLISH", "WILL"},
    0x0B: {"PUBLISH", "SUBSCRIBE"},
    0x11: {"CONNECT", "CONNACK", "DISCONNECT"},
    0x12: {"CONNACK"},
    0x13: {"CONNACK"},
    0x15: {"CONNECT", "CONNACK", "AUTH"},
    0x16: {"CONNECT", "CONNACK", "AUTH"},
    0x17: {"CONNECT"},
    0x18: {"WILL"},
    0x19: {"CONNECT"},
    0x1A: {"CONNACK"},
    0x1C: {"CONNACK", "DISCONNECT"},
    0x1F: {
        *("CONNACK", "PUBACK", "PUBREC", "PUBREL", "PUBCOMP"),
        *("SUBACK", "UNSUBACK", "DISCONNECT", "AUTH"),
    },
    0x21: {"CONNECT", "CONNACK"},
    0x22: {"CONNECT", "CONNACK"},
    0x23: {"PUBLISH"},
    0x24: {"CONNACK"},
    0x25: {"CONNACK"},
    0x26: {
        *("CONNECT", "CONNACK", "PUBLISH", "WILL", "PUBACK", "PUBREC", "PUBREL"),
        *("PUBCOMP", "SUBSCRIBE", "SUBACK", "UNSUBSCRIBE", "UNSUBACK", "DISCONNECT", "AUTH"),
    },
    0x27: {"CONNECT", "CONNACK"},
    0x28: {"CONNACK"},
    0x29: {"CONNACK"},
    0x2A: {"CONNACK"},
}
FLAG, TWO, FOUR, VARIABLE = b"\x01", b"\x00\x01", b"\x00\x00\x00\x01", b"\x01"
VALUES = {
    **dict.fromkeys((0x01, 0x17, 0x19, 0x24, 0x25, 0x28, 0x29, 0x2A), FLAG),
    **dict.fromkeys((0x02, 0x11, 0x18, 0x27), FOUR),
    **dict.fromkeys((0x13, 0x21, 0x22, 0x23), TWO),
    0x0B: VARIABLE,
    **dict.fromkeys((0x03, 0x08, 0x12, 0x15, 0x1A, 0x1C, 0x1F), s("x")),
    **dict.fromkeys((0x09, 0x16), s(b"x")),
    0x26: s("k") + s("v"),
}


def _with_properties(context: str, props: bytes) -> bytes:
    props = bytes((len(props),)) + props
    if context == "CONNECT":
        return connect_bytes(properties=props)
    if context == "WILL":
        return connect_bytes(flags=0x06, payload=s("c") + props + s("t") + s(b""))
    first, before, after = {
        "CONNACK": (0x20, b"\x00\x00", b""),
        "PUBLISH": (0x30, s("t"), b"payload"),
        "PUBACK": (0x40, b"\x00\x01\x00", b""),
        "PUBREC": (0x50, b"\x00\x01\x00", b""),
        "PUBREL": (0x62, b"\x00\x01\x00", b""),
        "PUBCOMP": (0x70, b"\x00\x01\x00", b""),
        "SUBSCRIBE": (0x82, b"\x00\x01", s("a") + b"\x00"),
        "SUBACK": (0x90, b"\x00\x01", b"\x00"),
        "UNSUBSCRIBE": (0xA2, b"\x00\x01", s("a")),
        "UNSUBACK": (0xB0, b"\x00\x01", b"\x00"),
        "DISCONNECT": (0xE0, b"\x00", b""),
        "AUTH": (0xF0, b"\x00", b""),
    }[context]
    return packet(first, before + props + after)


CONTEXTS = sorted(set().union(*ALLOWED.values()))


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("identifier", sorted(ALLOWED))
def test_property_allowed_only_in_its_packets_2_2_2_2(context: str, identifier: int) -> None:
    props = bytes((identifier,)) + VALUES[identifier]
    if identifier == 0x16:  # authentication data needs a method (4.12)
        props = b"\x15" + s("m") + props
    data = _with_properties(context, props)
    level = None if context in ("CONNECT", "WILL") else 5
    if context in ALLOWED[identifier]:
        assert len(decode(data, level)) == 1
    else:
        assert_error(data, MALFORMED, level)
