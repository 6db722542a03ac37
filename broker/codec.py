"""Sans-IO MQTT 3.1, 3.1.1 and 5.0 codec: bytes in, packets out, and back.

``PacketDecoder`` turns a byte stream into ``broker.packets`` objects and
raises ``MQTTError`` with the reason code the spec prescribes for the first
malformed or forbidden thing it finds. ``encode`` turns packets into bytes for
a given protocol level. Nothing here touches a socket or an event loop, and
nothing here knows about sessions: rules that need state (a second CONNECT,
topic alias ranges, packet ids in flight, topic filter syntax) belong to the
session layer.

Section numbers and ``[MQTT-x.y.z-n]`` tags refer to the MQTT 5.0 spec unless
noted otherwise.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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

__all__ = [
    "MAX_REMAINING_LENGTH",
    "PUBACK_BYTE",
    "PUBREC_BYTE",
    "UNLIMITED",
    "DecodeLimits",
    "PacketDecoder",
    "decode_variable_int",
    "encode",
    "encode_ack",
    "encode_publish",
    "encode_remaining_length",
]

MAX_REMAINING_LENGTH = 268_435_455
"""The largest Variable Byte Integer: four bytes of seven bits (1.5.5)."""

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_ACK = struct.Struct(">BBH")
_ACK_WITH_REASON = struct.Struct(">BBHB")
_SINGLE_BYTES = tuple(bytes((i,)) for i in range(256))


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """Bounds on the work one packet may cause while it is decoded.

    ``max_packet_size`` bounds its bytes; these bound what many small items
    could cost within those bytes: a 1 MB packet can hold 200 000 empty user
    properties or 250 000 one-byte topic filters, each an object to build.
    Over a limit: :class:`MQTTError` 0x97 Quota exceeded, raised as soon as the
    item past the limit is reached.
    """

    user_properties: int = MAX_REMAINING_LENGTH  # per property list; also Subscription IDs
    topic_filters: int = MAX_REMAINING_LENGTH  # per SUBSCRIBE or UNSUBSCRIBE


UNLIMITED = DecodeLimits()


def _over_limit(what: str, limit: int) -> MQTTError:
    return MQTTError(ReasonCode.QUOTA_EXCEEDED, f"more than {limit} {what} in one packet")


def _malformed(message: str) -> MQTTError:
    return MQTTError(ReasonCode.MALFORMED_PACKET, message)


def _protocol_error(message: str) -> MQTTError:
    return MQTTError(ReasonCode.PROTOCOL_ERROR, message)


# -- Data representation (1.5) ----------------------------------------------


def decode_variable_int(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """Read a Variable Byte Integer at ``pos``; return ``(value, next_pos)``.

    At most four bytes [1.5.5], in the fewest bytes possible [MQTT-1.5.5-1]:
    a longer encoding of the same value is a Malformed Packet here, because a
    receiver that accepts it cannot tell a padded length from garbage.
    """
    value = 0
    shift = 0
    for i in range(pos, min(pos + 4, end)):
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            if byte == 0 and i > pos:
                raise _malformed("variable byte integer not in its shortest form")
            return value, i + 1
        shift += 7
    if end >= pos + 4:
        raise _malformed("variable byte integer longer than four bytes")
    raise _malformed("truncated variable byte integer")


def encode_remaining_length(n: int) -> bytes:
    """Encode ``n`` as a Variable Byte Integer (1.5.5)."""
    if n < 0x80:
        return _SINGLE_BYTES[n]
    if n > MAX_REMAINING_LENGTH:
        raise ValueError(f"{n} does not fit in a variable byte integer")
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_u16(buf: bytes, pos: int, end: int) -> int:
    if pos + 2 > end:
        raise _malformed("truncated two byte integer")
    return (buf[pos] << 8) | buf[pos + 1]


def _read_packet_id(buf: bytes, pos: int, end: int) -> int:
    """A non-zero Packet Identifier [MQTT-2.2.1-3]."""
    packet_id = _read_u16(buf, pos, end)
    if packet_id == 0:
        raise _malformed("packet identifier 0")
    return packet_id


def _read_binary(buf: bytes, pos: int, end: int) -> tuple[bytes, int]:
    """Binary Data (1.5.6): a two byte length, then that many bytes."""
    if pos + 2 > end:
        raise _malformed("truncated length prefix")
    stop = pos + 2 + ((buf[pos] << 8) | buf[pos + 1])
    if stop > end:
        raise _malformed("length prefix runs past the packet")
    return buf[pos + 2 : stop], stop


def _read_string(buf: bytes, pos: int, end: int) -> tuple[str, int]:
    """A UTF-8 Encoded String (1.5.4).

    Python's strict decoder already rejects surrogates and overlong forms
    [MQTT-1.5.4-1] and keeps a leading BOM [MQTT-1.5.4-3]; U+0000 is the one
    code point left to refuse [MQTT-1.5.4-2]. Control characters and
    non-characters are legal, so they pass.
    """
    raw, stop = _read_binary(buf, pos, end)
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise _malformed("string is not well-formed UTF-8") from None
    if "\x00" in text:
        raise _malformed("string contains U+0000")
    return text, stop


def _string(text: str) -> bytes:
    raw = text.encode()
    return _U16.pack(len(raw)) + raw


def _binary(data: bytes) -> bytes:
    return _U16.pack(len(data)) + data


# -- Properties (2.2.2) -------------------------------------------------------

# Value types of table 2.2.2.2. Every Byte property is a 0/1 flag.
_FLAG, _TWO_BYTE, _FOUR_BYTE, _VARIABLE, _STRING, _BINARY, _STRING_PAIR = range(7)

# Properties whose section makes a 0 value a Protocol Error (a flag above 1 is
# one too). Topic Alias 0 has a reason code of its own (3.3.2.3.4).
_NOT_ZERO = frozenset(
    ("receive_maximum", "maximum_packet_size", "topic_alias", "subscription_identifiers")
)

# Where a property may appear: packet type numbers (2.1.2), which also index
# the decoders below, and 0, not a packet type, for Will Properties (3.1.3.2).
# Plain ints, not PacketType members: enum comparisons cost ~100 ns each.
_WILL, _CONNECT, _CONNACK, _PUBLISH, _PUBACK, _PUBREC, _PUBREL, _PUBCOMP = range(8)
_SUBSCRIBE, _SUBACK, _UNSUBSCRIBE, _UNSUBACK, _PINGREQ, _PINGRESP, _DISCONNECT, _AUTH = range(8, 16)

_MESSAGE = frozenset((_PUBLISH, _WILL))
_REASON_STRING_PACKETS = frozenset(
    (_CONNACK, _PUBACK, _PUBREC, _PUBREL, _PUBCOMP, _SUBACK, _UNSUBACK, _DISCONNECT, _AUTH)
)
_USER_PROPERTY_PACKETS = frozenset(range(16)) - {_PINGREQ, _PINGRESP}

_PROPERTY_TABLE: tuple[tuple[int, str, int, frozenset[int]], ...] = (
    (0x01, "payload_format_indicator", _FLAG, _MESSAGE),
    (0x02, "message_expiry_interval", _FOUR_BYTE, _MESSAGE),
    (0x03, "content_type", _STRING, _MESSAGE),
    (0x08, "response_topic", _STRING, _MESSAGE),
    (0x09, "correlation_data", _BINARY, _MESSAGE),
    (0x0B, "subscription_identifiers", _VARIABLE, frozenset((_PUBLISH, _SUBSCRIBE))),
    (0x11, "session_expiry_interval", _FOUR_BYTE, frozenset((_CONNECT, _CONNACK, _DISCONNECT))),
    (0x12, "assigned_client_identifier", _STRING, frozenset((_CONNACK,))),
    (0x13, "server_keep_alive", _TWO_BYTE, frozenset((_CONNACK,))),
    (0x15, "authentication_method", _STRING, frozenset((_CONNECT, _CONNACK, _AUTH))),
    (0x16, "authentication_data", _BINARY, frozenset((_CONNECT, _CONNACK, _AUTH))),
    (0x17, "request_problem_information", _FLAG, frozenset((_CONNECT,))),
    (0x18, "will_delay_interval", _FOUR_BYTE, frozenset((_WILL,))),
    (0x19, "request_response_information", _FLAG, frozenset((_CONNECT,))),
    (0x1A, "response_information", _STRING, frozenset((_CONNACK,))),
    (0x1C, "server_reference", _STRING, frozenset((_CONNACK, _DISCONNECT))),
    (0x1F, "reason_string", _STRING, _REASON_STRING_PACKETS),
    (0x21, "receive_maximum", _TWO_BYTE, frozenset((_CONNECT, _CONNACK))),
    (0x22, "topic_alias_maximum", _TWO_BYTE, frozenset((_CONNECT, _CONNACK))),
    (0x23, "topic_alias", _TWO_BYTE, frozenset((_PUBLISH,))),
    (0x24, "maximum_qos", _FLAG, frozenset((_CONNACK,))),
    (0x25, "retain_available", _FLAG, frozenset((_CONNACK,))),
    (0x26, "user_properties", _STRING_PAIR, _USER_PROPERTY_PACKETS),
    (0x27, "maximum_packet_size", _FOUR_BYTE, frozenset((_CONNECT, _CONNACK))),
    (0x28, "wildcard_subscription_available", _FLAG, frozenset((_CONNACK,))),
    (0x29, "subscription_identifier_available", _FLAG, frozenset((_CONNACK,))),
    (0x2A, "shared_subscription_available", _FLAG, frozenset((_CONNACK,))),
)
_PROPERTIES_BY_ID = {entry[0]: entry for entry in _PROPERTY_TABLE}


def _decode_properties(
    buf: bytes, pos: int, end: int, context: int, limits: DecodeLimits
) -> tuple[Properties | None, int]:
    """Read a Property Length and the properties after it.

    An identifier not allowed in ``context`` is a Malformed Packet (2.2.2.2);
    a property repeated where the spec allows one is a Protocol Error.
    """
    length, pos = decode_variable_int(buf, pos, end)
    if length == 0:
        return None, pos
    stop = pos + length
    if stop > end:
        raise _malformed("property length runs past the packet")
    values: dict[str, object] = {}
    user_properties: list[tuple[str, str]] = []
    subscription_identifiers: list[int] = []
    value: object
    while pos < stop:
        identifier = buf[pos]
        entry = _PROPERTIES_BY_ID.get(identifier)
        if entry is None or context not in entry[3]:
            raise _malformed(f"property 0x{identifier:02x} not allowed in this packet")
        _, name, kind, _ = entry
        pos += 1
        if kind == _STRING_PAIR:
            if len(user_properties) >= limits.user_properties:
                raise _over_limit("user properties", limits.user_properties)
            key, pos = _read_string(buf, pos, stop)
            text, pos = _read_string(buf, pos, stop)
            user_properties.append((key, text))
            continue
        if kind == _VARIABLE:
            number, pos = decode_variable_int(buf, pos, stop)
            if number == 0:
                raise _protocol_error("subscription identifier 0")
            if subscription_identifiers and context != _PUBLISH:
                raise _protocol_error("more than one subscription identifier")
            if len(subscription_identifiers) >= limits.user_properties:
                raise _over_limit("subscription identifiers", limits.user_properties)
            subscription_identifiers.append(number)
            continue
        if name in values:
            raise _protocol_error(f"{name} appears twice")
        if kind == _STRING:
            value, pos = _read_string(buf, pos, stop)
        elif kind == _BINARY:
            value, pos = _read_binary(buf, pos, stop)
        elif kind == _FLAG:
            if pos >= stop:
                raise _malformed("truncated byte property")
            value = buf[pos]
            pos += 1
            if value > 1:
                raise _protocol_error(f"{name} must be 0 or 1")
        elif kind == _TWO_BYTE:
            value = _read_u16(buf, pos, stop)
            pos += 2
        else:
            if pos + 4 > stop:
                raise _malformed("truncated four byte integer")
            value = _U32.unpack_from(buf, pos)[0]
            pos += 4
        if value == 0 and name in _NOT_ZERO:
            if name == "topic_alias":
                raise MQTTError(ReasonCode.TOPIC_ALIAS_INVALID, "topic alias 0")
            raise _protocol_error(f"{name} 0")
        values[name] = value
    if "authentication_data" in values and "authentication_method" not in values:
        raise _protocol_error("authentication data without authentication method")
    properties = Properties(**values)  # type: ignore[arg-type]
    properties.user_properties = tuple(user_properties)
    properties.subscription_identifiers = tuple(subscription_identifiers)
    return properties, pos


def _encode_properties(properties: Properties | None) -> bytes:
    """Property Length and properties, in identifier order (order is free)."""
    if properties is None:
        return b"\x00"
    out = bytearray()
    for identifier, name, kind, _ in _PROPERTY_TABLE:
        value = getattr(properties, name)
        if value is None or value == ():
            continue
        if kind == _STRING_PAIR:
            for key, text in value:
                out.append(identifier)
                out += _string(key)
                out += _string(text)
        elif kind == _VARIABLE:
            for number in value:
                out.append(identifier)
                out += encode_remaining_length(number)
        else:
            out.append(identifier)
            if kind == _STRING:
                out += _string(value)
            elif kind == _BINARY:
                out += _binary(value)
            elif kind == _FLAG:
                out.append(value)
            elif kind == _TWO_BYTE:
                out += _U16.pack(value)
            else:
                out += _U32.pack(value)
    return encode_remaining_length(len(out)) + out


# -- Decoding -------------------------------------------------------------------

# Each packet body decoder gets the whole buffer, the body's bounds, the first
# byte of the fixed header and whether the connection speaks MQTT 5.
_Decoder = Callable[[bytes, int, int, int, bool, DecodeLimits], Packet]


def _read_remaining_length(buf: bytes, pos: int, size: int) -> tuple[int, int] | None:
    """The fixed header's Remaining Length, or None until all of it arrived."""
    for i in range(pos, min(pos + 4, size)):
        if buf[i] < 0x80:
            return decode_variable_int(buf, pos, i + 1)
    if size - pos < 4:
        return None
    raise _malformed("remaining length longer than four bytes")


def _decode_connect(buf: bytes, pos: int, end: int, limits: DecodeLimits) -> Connect:
    """CONNECT (3.1). Its protocol level decides how everything after it reads."""
    name, pos = _read_binary(buf, pos, end)
    if name == b"MQTT":
        supported: tuple[int, ...] = (4, 5)
    elif name == b"MQIsdp":
        supported = (3,)
    else:
        raise _malformed(f"unknown protocol name {name!r}")
    if pos + 4 > end:
        raise _malformed("truncated CONNECT variable header")
    level, flags = buf[pos], buf[pos + 1]
    if level not in supported:
        # [MQTT-3.1.2-2]: answered with CONNACK 0x84 / return code 1.
        raise MQTTError(
            ReasonCode.UNSUPPORTED_PROTOCOL_VERSION, f"unsupported protocol level {level}"
        )
    keep_alive = (buf[pos + 2] << 8) | buf[pos + 3]
    pos += 4
    if flags & 0x01:
        raise _malformed("reserved connect flag set [MQTT-3.1.2-3]")
    will_flag = flags & 0x04
    will_qos = (flags >> 3) & 0x03
    will_retain = bool(flags & 0x20)
    if not will_flag and (will_qos or will_retain):
        raise _malformed("will QoS or retain without a will [MQTT-3.1.2-11, -13]")
    if will_qos == 3:
        raise _malformed("will QoS 3 [MQTT-3.1.2-12]")
    if level < 5 and flags & 0xC0 == 0x40:
        raise _malformed("password without user name (3.1.1 [MQTT-3.1.2-22])")
    properties = None
    if level == 5:
        properties, pos = _decode_properties(buf, pos, end, _CONNECT, limits)
    client_id, pos = _read_string(buf, pos, end)
    will = None
    if will_flag:
        will_properties = None
        if level == 5:
            will_properties, pos = _decode_properties(buf, pos, end, _WILL, limits)
        topic, pos = _read_string(buf, pos, end)
        payload, pos = _read_binary(buf, pos, end)
        will = Will(topic, payload, will_qos, will_retain, will_properties)
    username = password = None
    if flags & 0x80:
        username, pos = _read_string(buf, pos, end)
    if flags & 0x40:
        password, pos = _read_binary(buf, pos, end)
    if pos != end:
        raise _malformed("trailing bytes after CONNECT payload")
    return Connect(
        client_id,
        level,
        bool(flags & 0x02),
        keep_alive,
        username,
        password,
        will,
        properties,
        name.decode(),
    )


def _decode_connack(
    buf: bytes, pos: int, end: int, first: int, v5: bool, limits: DecodeLimits
) -> ConnAck:
    if pos + 2 > end:
        raise _malformed("truncated CONNACK")
    ack_flags, reason_code = buf[pos], buf[pos + 1]
    if ack_flags & 0xFE:
        raise _malformed("reserved CONNACK flags set")
    properties = None
    if v5:
        properties, pos = _decode_properties(buf, pos + 2, end, _CONNACK, limits)
    else:
        pos += 2
    if pos != end:
        raise _malformed("trailing bytes in CONNACK")
    return ConnAck(bool(ack_flags), reason_code, properties)


def _decode_publish(
    buf: bytes, pos: int, end: int, first: int, v5: bool, limits: DecodeLimits
) -> Publish:
    """PUBLISH (3.3): the hot path, so its reads are inlined."""
    qos = (first >> 1) & 0x03
    if qos == 3:
        raise _malformed("PUBLISH with QoS 3 [MQTT-3.3.1-4]")
    dup = bool(first & 0x08)
    if dup and not qos:
        raise _malformed("DUP set on a QoS 0 PUBLISH [MQTT-3.3.1-2]")
    if pos + 2 > end:
        raise _malformed("truncated topic name")
    stop = pos + 2 + ((buf[pos] << 8) | buf[pos + 1])
    if stop > end:
        raise _malformed("topic name runs past the packet")
    try:
        topic = buf[pos + 2 : stop].decode()
    except UnicodeDecodeError:
        raise _malformed("topic name is not well-formed UTF-8") from None
    if "\x00" in topic:
        raise _malformed("topic name contains U+0000")
    if "+" in topic or "#" in topic:
        raise MQTTError(ReasonCode.TOPIC_NAME_INVALID, "wildcard in topic name [MQTT-3.3.2-2]")
    pos = stop
    packet_id = None
    if qos:
        if pos + 2 > end:
            raise _malformed("truncated packet identifier")
        packet_id = (buf[pos] << 8) | buf[pos + 1]
        if packet_id == 0:
            raise _malformed("packet identifier 0 [MQTT-2.2.1-3]")
        pos += 2
    properties = None
    if v5:
        if pos < end and buf[pos] == 0:
            pos += 1
        else:
            properties, pos = _decode_properties(buf, pos, end, _PUBLISH, limits)
        if not topic and (properties is None or properties.topic_alias is None):
            raise _protocol_error("empty topic name without a topic alias (3.3.2.1)")
    elif not topic:
        raise _protocol_error("empty topic name (3.1.1 [MQTT-4.7.3-1])")
    return Publish(topic, buf[pos:end], qos, bool(first & 0x01), dup, packet_id, properties)


_AckType = type[PubAck] | type[PubRec] | type[PubRel] | type[PubComp]


def _ack_decoder(cls: _AckType, context: int) -> _Decoder:
    """PUBACK, PUBREC, PUBREL, PUBCOMP (3.4-3.7) share one layout.

    In MQTT 5 the reason code and the properties may be left off (3.4.2.1):
    a remaining length of 2 means Success, of 3 means no properties.
    ``context`` is its packet type number (where its properties are checked).
    """

    def decode(
        buf: bytes, pos: int, end: int, first: int, v5: bool, limits: DecodeLimits
    ) -> Packet:
        if pos + 2 > end:
            raise _malformed("truncated packet identifier")
        packet_id = (buf[pos] << 8) | buf[pos + 1]
        if packet_id == 0:
            raise _malformed("packet identifier 0 [MQTT-2.2.1-3]")
        if end - pos == 2:
            return cls(packet_id)
        if not v5:
            raise _malformed("trailing bytes after packet identifier")
        reason_code = buf[pos + 2]
        if end - pos == 3:
            return cls(packet_id, reason_code)
        properties, pos = _decode_properties(buf, pos + 3, end, context, limits)
        if pos != end:
            raise _malformed("trailing bytes after properties")
        return cls(packet_id, reason_code, properties)

    return decode


def _decode_subscribe(
    buf: bytes, pos: int, end: int, first: int, v5: bool, limits: DecodeLimits
) -> Subscribe:
    """SUBSCRIBE (3.8). Topic filter syntax is the session layer's to judge,
    so it can refuse one filter in the SUBACK instead of the whole packet."""
    packet_id = _read_packet_id(buf, pos, end)
    pos += 2
    properties = None
    if v5:
        properties, pos = _decode_properties(buf, pos, end, _SUBSCRIBE, limits)
    subscriptions: list[Subscription] = []
    while pos < end:
        if len(subscriptions) >= limits.topic_filters:
            raise _over_limit("topic filters", limits.topic_filters)
        topic_filter, pos = _read_string(buf, pos, end)
        if pos >= end:
            raise _malformed("topic filter without subscription options")
        options = buf[pos]
        pos += 1
        qos = options & 0x03
        if v5:
            if options & 0xC0:
                raise _malformed("reserved subscription option bits set [MQTT-3.8.3-5]")
            if qos == 3:
                raise _protocol_error("maximum QoS 3 in subscription options (3.8.3.1)")
            retain_handling = options >> 4
            if retain_handling == 3:
                raise _protocol_error("retain handling 3 (3.8.3.1)")
            subscriptions.append(
                Subscription(
                    topic_filter, qos, bool(options & 0x04), bool(options & 0x08), retain_handling
                )
            )
        else:
            if options & 0xFC or qos == 3:
                raise _malformed("invalid requested QoS byte (3.1.1 [MQTT-3-8.3-4])")
            subscriptions.append(Subscription(topic_filter, qos))
    if not subscriptions:
        raise _protocol_error("SUBSCRIBE without topic filters [MQTT-3.8.3-2]")
    return Subscribe(packet_id, subscriptions, properties)


def _decode_suback(
    buf: bytes, pos: int, end: int, first: int, v5: bool, limits: DecodeLimits
) -> SubAck:
    packet_id = _read_packet_id(buf, pos, end)
    pos += 2
    properties = None
    if v5:
        properties, pos = _decode_properties(buf, pos, end, _SUBACK, limits)
    return SubAck(packet_id, list(buf[pos:end]), properties)


def _decode_unsubscribe(
    buf: bytes, pos: int, end: int, first: int, v5: bool, limits: DecodeLimits
) -> Unsubscribe:
    packet_id = _read_packet_id(buf, pos, end)
    pos += 2
    properties = None
    if v5:
        properties, pos = _decode_properties(buf, pos, end, _UNSUBSCRIBE, limits)
    topic_filters: list[str] = []
    while pos < end:
        if len(topic_filters) >= limits.topic_filters:
            raise _over_limit("topic filters", limits.topic_filters)
        topic_filter, pos = _read_string(buf, pos, end)
        topic_filters.append(topic_filter)
    if not topic_filters:
        raise _protocol_error("UNSUBSCRIBE without topic filters [MQTT-3.10.3-2]")
    return Unsubscribe(packet_id, topic_filters, properties)


def _decode_unsuback(
    buf: bytes, pos: int, end: int, first: int, v5: bool, limits: DecodeLimits
) -> UnsubAck:
    """UNSUBACK (3.11); in 3.1.1 it is only a packet identifier."""
    packet_id = _read_packet_id(buf, pos, end)
    pos += 2
    if not v5:
        if pos != end:
            raise _malformed("trailing bytes in 3.1.1 UNSUBACK")
        return UnsubAck(packet_id)
    properties, pos = _decode_properties(buf, pos, end, _UNSUBACK, limits)
    return UnsubAck(packet_id, list(buf[pos:end]), properties)


def _decode_pingreq(
    buf: bytes, pos: int, end: int, first: int, v5: bool, limits: DecodeLimits
) -> PingReq:
    if pos != end:
        raise _malformed("PINGREQ has no body")
    return PingReq()


def _decode_pingresp(
    buf: bytes, pos: int, end: int, first: int, v5: bool, limits: DecodeLimits
) -> PingResp:
    if pos != end:
        raise _malformed("PINGRESP has no body")
    return PingResp()


def _decode_reason_and_properties(
    buf: bytes, pos: int, end: int, context: int, limits: DecodeLimits
) -> tuple[int, Properties | None]:
    """DISCONNECT and AUTH bodies (3.14.2, 3.15.2): a remaining length of 0
    means Success, of 1 means no properties."""
    if pos == end:
        return 0, None
    reason_code = buf[pos]
    if pos + 1 == end:
        return reason_code, None
    properties, pos = _decode_properties(buf, pos + 1, end, context, limits)
    if pos != end:
        raise _malformed("trailing bytes after properties")
    return reason_code, properties


def _decode_disconnect(
    buf: bytes, pos: int, end: int, first: int, v5: bool, limits: DecodeLimits
) -> Disconnect:
    if not v5:
        if pos != end:
            raise _malformed("3.1.1 DISCONNECT has no body")
        return Disconnect()
    return Disconnect(*_decode_reason_and_properties(buf, pos, end, _DISCONNECT, limits))


def _decode_auth(
    buf: bytes, pos: int, end: int, first: int, v5: bool, limits: DecodeLimits
) -> Auth:
    if not v5:
        raise _malformed("packet type 15 is reserved in MQTT 3.1.1")
    return Auth(*_decode_reason_and_properties(buf, pos, end, _AUTH, limits))


_BY_TYPE: tuple[_Decoder | None, ...] = (
    None,  # 0 is reserved
    None,  # CONNECT is decoded by PacketDecoder itself: it sets the level
    _decode_connack,
    _decode_publish,
    _ack_decoder(PubAck, _PUBACK),
    _ack_decoder(PubRec, _PUBREC),
    _ack_decoder(PubRel, _PUBREL),
    _ack_decoder(PubComp, _PUBCOMP),
    _decode_subscribe,
    _decode_suback,
    _decode_unsubscribe,
    _decode_unsuback,
    _decode_pingreq,
    _decode_pingresp,
    _decode_disconnect,
    _decode_auth,
)


def _valid_fixed_header_flags(first: int) -> bool:
    """The flags each packet type must carry (2.1.3, [MQTT-2.1.3-1]).

    PUBLISH carries DUP, QoS and RETAIN, checked where it is decoded.
    """
    kind, flags = first >> 4, first & 0x0F
    if kind == _PUBLISH:
        return True
    return flags == (0b0010 if kind in (_PUBREL, _SUBSCRIBE, _UNSUBSCRIBE) else 0)


# Indexed by the whole first byte, so one lookup checks type and flags.
_DECODERS = tuple(
    _BY_TYPE[first >> 4] if _valid_fixed_header_flags(first) else None for first in range(256)
)
_CONNECT_BYTE = 0x10


class PacketDecoder:
    """Turns the bytes of one connection into packets.

    ``protocol_level`` is None until a CONNECT has been decoded (server side);
    a client sets it up front. ``max_packet_size`` bounds the whole packet,
    fixed header included, and is checked as soon as the fixed header is
    complete, so an oversized packet is refused before its body is buffered.
    ``limits`` bounds the items one packet may hold (:class:`DecodeLimits`).

    With ``pause_after_connect`` (the broker's connections) decoding stops
    after a CONNECT: what follows stays buffered until the connection calls
    ``feed`` again, once the CONNECT is accepted (and has raised
    ``max_packet_size`` from its pre-CONNECT value). So the bytes of a client
    that is not yet authenticated are not decoded. :meth:`buffer` keeps
    bytes without decoding them (while the CONNECT is being decided).

    After ``feed`` raises, the decoder is spent: the connection must close.
    """

    __slots__ = (
        "_buffer",
        "_wanted",
        "limits",
        "max_packet_size",
        "pause_after_connect",
        "protocol_level",
    )

    def __init__(
        self,
        protocol_level: int | None = None,
        max_packet_size: int = MAX_REMAINING_LENGTH + 5,
        limits: DecodeLimits = UNLIMITED,
        pause_after_connect: bool = False,
    ) -> None:
        self.protocol_level = protocol_level
        self.max_packet_size = max_packet_size
        self.limits = limits
        self.pause_after_connect = pause_after_connect
        self._buffer = bytearray()
        self._wanted = 0  # bytes the buffered packet needs before decoding is worth trying

    @property
    def buffered(self) -> int:
        """Bytes received and not decoded yet."""
        return len(self._buffer)

    def buffer(self, data: bytes) -> None:
        """Keep ``data`` for the next :meth:`feed`, without decoding anything."""
        self._buffer += data
        self._wanted = 0

    def feed(self, data: bytes) -> list[Packet]:
        """Buffer ``data``; return every packet it completes, in order."""
        buffer = self._buffer
        if buffer:
            buffer += data
            if len(buffer) < self._wanted:
                return []
            data = bytes(buffer)
            buffer.clear()
        packets: list[Packet] = []
        level = self.protocol_level
        v5 = level == 5
        limits = self.limits
        size = len(data)
        pos = 0
        wanted = 0
        while size - pos >= 2:
            first = data[pos]
            body = pos + 2
            length = data[pos + 1]
            if length >= 0x80:
                header = _read_remaining_length(data, pos + 1, size)
                if header is None:
                    break
                length, body = header
            end = body + length
            if end - pos > self.max_packet_size:
                raise MQTTError(
                    ReasonCode.PACKET_TOO_LARGE,
                    f"packet of {end - pos} bytes exceeds the maximum of {self.max_packet_size}",
                )
            decoder = _DECODERS[first]
            if decoder is None:
                if first != _CONNECT_BYTE:
                    raise _malformed(f"reserved packet type or invalid flags in 0x{first:02x}")
            elif level is None:
                raise _protocol_error("first packet must be CONNECT [MQTT-3.1.0-1]")
            if end > size:
                wanted = end - pos
                break
            if decoder is not None:
                packets.append(decoder(data, body, end, first, v5, limits))
            else:
                connect = _decode_connect(data, body, end, limits)
                level = self.protocol_level = connect.protocol_level
                v5 = level == 5
                packets.append(connect)
                if self.pause_after_connect:
                    pos = end
                    wanted = -1  # decode the rest at the next feed, whatever it brings
                    break
            pos = end
        if pos < size:
            buffer += memoryview(data)[pos:]
            self._wanted = max(0, wanted) if wanted else len(buffer) + 1
        return packets


# -- Encoding -------------------------------------------------------------------


def _packet(first_byte: int, body: bytes) -> bytes:
    return _SINGLE_BYTES[first_byte] + encode_remaining_length(len(body)) + body


def _encode_connect(packet: Connect, level: int) -> bytes:
    v5 = level == 5
    will = packet.will
    flags = packet.clean_start << 1
    if will is not None:
        flags |= 0x04 | will.qos << 3 | will.retain << 5
    if packet.username is not None:
        flags |= 0x80
    if packet.password is not None:
        flags |= 0x40
    parts = [
        b"\x00\x06MQIsdp" if level == 3 else b"\x00\x04MQTT",
        bytes((level, flags)),
        _U16.pack(packet.keep_alive),
    ]
    if v5:
        parts.append(_encode_properties(packet.properties))
    parts.append(_string(packet.client_id))
    if will is not None:
        if v5:
            parts.append(_encode_properties(will.properties))
        parts.append(_string(will.topic))
        parts.append(_binary(will.payload))
    if packet.username is not None:
        parts.append(_string(packet.username))
    if packet.password is not None:
        parts.append(_binary(packet.password))
    return _packet(0x10, b"".join(parts))


def _encode_connack(packet: ConnAck, level: int) -> bytes:
    body = bytes((packet.session_present, packet.reason_code))
    if level == 5:
        body += _encode_properties(packet.properties)
    return _packet(0x20, body)


def _encode_publish(packet: Publish, level: int) -> bytes:
    return encode_publish(
        packet.topic,
        packet.payload,
        packet.qos,
        packet.retain,
        packet.dup,
        packet.packet_id,
        packet.properties,
        level,
    )


def encode_publish(
    topic_name: str,
    payload: bytes,
    qos: int,
    retain: bool,
    dup: bool,
    packet_id: int | None,
    properties: Properties | None,
    level: int,
) -> bytes:
    """PUBLISH (3.3), from its fields: the hot path (a delivery makes no
    :class:`Publish` to encode), so it is one join of its parts."""
    topic = topic_name.encode()
    packet_id_bytes = _U16.pack(packet_id) if qos else b""
    encoded_properties = b""
    if level == 5:
        encoded_properties = b"\x00" if properties is None else _encode_properties(properties)
    length = 2 + len(topic) + len(packet_id_bytes) + len(encoded_properties) + len(payload)
    return b"".join(
        (
            _SINGLE_BYTES[0x30 | dup << 3 | qos << 1 | retain],
            _SINGLE_BYTES[length] if length < 0x80 else encode_remaining_length(length),
            _U16.pack(len(topic)),
            topic,
            packet_id_bytes,
            encoded_properties,
            payload,
        )
    )


# The first bytes of PUBACK and PUBREC, for encode_ack.
PUBACK_BYTE, PUBREC_BYTE = 0x40, 0x50
_ACK_FIRST_BYTES: dict[type, int] = {
    PubAck: PUBACK_BYTE,
    PubRec: PUBREC_BYTE,
    PubRel: 0x62,
    PubComp: 0x70,
}


def encode_ack(first: int, packet_id: int, reason_code: int, level: int) -> bytes:
    """A PUBACK, PUBREC, PUBREL or PUBCOMP without properties (``first``: its first
    byte), in its shortest form (3.4.2.1): 3.1.1 has no reason code."""
    if level < 5 or reason_code == 0:
        return _ACK.pack(first, 2, packet_id)
    return _ACK_WITH_REASON.pack(first, 3, packet_id, reason_code)


def _encode_ack(packet: PubAck | PubRec | PubRel | PubComp, level: int) -> bytes:
    """Shortest form that carries the packet (3.4.2.1): 3.1.1 has no more."""
    first = _ACK_FIRST_BYTES[type(packet)]
    if level < 5 or packet.properties is None:
        return encode_ack(first, packet.packet_id, packet.reason_code, level)
    body = (
        _U16.pack(packet.packet_id)
        + _SINGLE_BYTES[packet.reason_code]
        + _encode_properties(packet.properties)
    )
    return _packet(first, body)


def _encode_subscribe(packet: Subscribe, level: int) -> bytes:
    v5 = level == 5
    parts = [_U16.pack(packet.packet_id)]
    if v5:
        parts.append(_encode_properties(packet.properties))
    for sub in packet.subscriptions:
        parts.append(_string(sub.topic_filter))
        options = sub.qos
        if v5:
            options |= sub.no_local << 2 | sub.retain_as_published << 3 | sub.retain_handling << 4
        parts.append(_SINGLE_BYTES[options])
    return _packet(0x82, b"".join(parts))


def _encode_suback(packet: SubAck, level: int) -> bytes:
    if level == 5:
        codes = bytes(packet.reason_codes)
        return _packet(
            0x90, _U16.pack(packet.packet_id) + _encode_properties(packet.properties) + codes
        )
    # 3.1.1 has a single failure return code (3.9.3).
    codes = bytes(code if code < 0x80 else 0x80 for code in packet.reason_codes)
    return _packet(0x90, _U16.pack(packet.packet_id) + codes)


def _encode_unsubscribe(packet: Unsubscribe, level: int) -> bytes:
    parts = [_U16.pack(packet.packet_id)]
    if level == 5:
        parts.append(_encode_properties(packet.properties))
    parts.extend(_string(topic_filter) for topic_filter in packet.topic_filters)
    return _packet(0xA2, b"".join(parts))


def _encode_unsuback(packet: UnsubAck, level: int) -> bytes:
    body = _U16.pack(packet.packet_id)
    if level == 5:
        body += _encode_properties(packet.properties) + bytes(packet.reason_codes)
    return _packet(0xB0, body)


def _encode_pingreq(packet: PingReq, level: int) -> bytes:
    return b"\xc0\x00"


def _encode_pingresp(packet: PingResp, level: int) -> bytes:
    return b"\xd0\x00"


def _encode_reason_and_properties(first: int, packet: Disconnect | Auth) -> bytes:
    """Shortest DISCONNECT / AUTH form (3.14.2.1, 3.15.2.1)."""
    if packet.properties is None:
        if packet.reason_code == 0:
            return bytes((first, 0))
        return bytes((first, 1, packet.reason_code))
    return _packet(first, _SINGLE_BYTES[packet.reason_code] + _encode_properties(packet.properties))


def _encode_disconnect(packet: Disconnect, level: int) -> bytes:
    if level < 5:
        return b"\xe0\x00"
    return _encode_reason_and_properties(0xE0, packet)


def _encode_auth(packet: Auth, level: int) -> bytes:
    if level < 5:
        raise ValueError("AUTH does not exist before MQTT 5")
    return _encode_reason_and_properties(0xF0, packet)


_ENCODERS: dict[type, Callable[[Any, int], bytes]] = {
    Publish: _encode_publish,
    PubAck: _encode_ack,
    PubRec: _encode_ack,
    PubRel: _encode_ack,
    PubComp: _encode_ack,
    Connect: _encode_connect,
    ConnAck: _encode_connack,
    Subscribe: _encode_subscribe,
    SubAck: _encode_suback,
    Unsubscribe: _encode_unsubscribe,
    UnsubAck: _encode_unsuback,
    PingReq: _encode_pingreq,
    PingResp: _encode_pingresp,
    Disconnect: _encode_disconnect,
    Auth: _encode_auth,
}


def encode(packet: Packet, protocol_level: int) -> bytes:
    """Serialize ``packet`` as ``protocol_level`` (3, 4 or 5) spells it.

    For 3.1/3.1.1, properties and reason codes that version lacks are left
    out. The packet is trusted: it comes from the broker, not the network.
    """
    return _ENCODERS[type(packet)](packet, protocol_level)
