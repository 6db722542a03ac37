"""MQTT control packets as plain data.

These classes are the vocabulary shared by the codec (bytes <-> packets) and
the session layer (packets -> routing decisions). They carry no behaviour and
no I/O. One class per packet type, field names as in the MQTT 5.0 spec; MQTT
3.1.1 packets use the same classes with ``properties=None`` and reason codes
mapped by the codec.

Each packet's ``type`` (its :class:`PacketType`) is a read-only property, not
a class attribute: compiled with mypyc (docs/development.md), a dataclass's
class attributes become fields, and a ``ClassVar`` one too, which ``__init__``
then cannot set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum


class PacketType(IntEnum):
    CONNECT = 1
    CONNACK = 2
    PUBLISH = 3
    PUBACK = 4
    PUBREC = 5
    PUBREL = 6
    PUBCOMP = 7
    SUBSCRIBE = 8
    SUBACK = 9
    UNSUBSCRIBE = 10
    UNSUBACK = 11
    PINGREQ = 12
    PINGRESP = 13
    DISCONNECT = 14
    AUTH = 15


class ProtocolLevel(IntEnum):
    MQTT_3_1 = 3
    MQTT_3_1_1 = 4
    MQTT_5 = 5


class ReasonCode(IntEnum):
    """MQTT 5.0 reason codes (spec 2.4). 0x00 doubles as Success/Granted QoS 0."""

    SUCCESS = 0x00
    GRANTED_QOS_1 = 0x01
    GRANTED_QOS_2 = 0x02
    DISCONNECT_WITH_WILL = 0x04
    NO_MATCHING_SUBSCRIBERS = 0x10
    NO_SUBSCRIPTION_EXISTED = 0x11
    CONTINUE_AUTHENTICATION = 0x18
    REAUTHENTICATE = 0x19
    UNSPECIFIED_ERROR = 0x80
    MALFORMED_PACKET = 0x81
    PROTOCOL_ERROR = 0x82
    IMPLEMENTATION_SPECIFIC_ERROR = 0x83
    UNSUPPORTED_PROTOCOL_VERSION = 0x84
    CLIENT_IDENTIFIER_NOT_VALID = 0x85
    BAD_USER_NAME_OR_PASSWORD = 0x86
    NOT_AUTHORIZED = 0x87
    SERVER_UNAVAILABLE = 0x88
    SERVER_BUSY = 0x89
    BANNED = 0x8A
    SERVER_SHUTTING_DOWN = 0x8B
    BAD_AUTHENTICATION_METHOD = 0x8C
    KEEP_ALIVE_TIMEOUT = 0x8D
    SESSION_TAKEN_OVER = 0x8E
    TOPIC_FILTER_INVALID = 0x8F
    TOPIC_NAME_INVALID = 0x90
    PACKET_IDENTIFIER_IN_USE = 0x91
    PACKET_IDENTIFIER_NOT_FOUND = 0x92
    RECEIVE_MAXIMUM_EXCEEDED = 0x93
    TOPIC_ALIAS_INVALID = 0x94
    PACKET_TOO_LARGE = 0x95
    MESSAGE_RATE_TOO_HIGH = 0x96
    QUOTA_EXCEEDED = 0x97
    ADMINISTRATIVE_ACTION = 0x98
    PAYLOAD_FORMAT_INVALID = 0x99
    RETAIN_NOT_SUPPORTED = 0x9A
    QOS_NOT_SUPPORTED = 0x9B
    USE_ANOTHER_SERVER = 0x9C
    SERVER_MOVED = 0x9D
    SHARED_SUBSCRIPTIONS_NOT_SUPPORTED = 0x9E
    CONNECTION_RATE_EXCEEDED = 0x9F
    MAXIMUM_CONNECT_TIME = 0xA0
    SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED = 0xA1
    WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED = 0xA2


class ConnectReturnCode(IntEnum):
    """MQTT 3.1.1 CONNACK return codes (spec 3.2.2.3)."""

    ACCEPTED = 0
    UNACCEPTABLE_PROTOCOL_VERSION = 1
    IDENTIFIER_REJECTED = 2
    SERVER_UNAVAILABLE = 3
    BAD_USER_NAME_OR_PASSWORD = 4
    NOT_AUTHORIZED = 5


@dataclass(slots=True)
class Properties:
    """MQTT 5.0 properties (spec 2.2.2.2). ``None`` / empty means absent.

    Which property may appear in which packet is the codec's rule; this class
    only holds values.
    """

    payload_format_indicator: int | None = None  # 0x01
    message_expiry_interval: int | None = None  # 0x02
    content_type: str | None = None  # 0x03
    response_topic: str | None = None  # 0x08
    correlation_data: bytes | None = None  # 0x09
    subscription_identifiers: tuple[int, ...] = ()  # 0x0B, repeated in PUBLISH
    session_expiry_interval: int | None = None  # 0x11
    assigned_client_identifier: str | None = None  # 0x12
    server_keep_alive: int | None = None  # 0x13
    authentication_method: str | None = None  # 0x15
    authentication_data: bytes | None = None  # 0x16
    request_problem_information: int | None = None  # 0x17
    will_delay_interval: int | None = None  # 0x18
    request_response_information: int | None = None  # 0x19
    response_information: str | None = None  # 0x1A
    server_reference: str | None = None  # 0x1C
    reason_string: str | None = None  # 0x1F
    receive_maximum: int | None = None  # 0x21
    topic_alias_maximum: int | None = None  # 0x22
    topic_alias: int | None = None  # 0x23
    maximum_qos: int | None = None  # 0x24
    retain_available: int | None = None  # 0x25
    user_properties: tuple[tuple[str, str], ...] = ()  # 0x26, repeated, order kept
    maximum_packet_size: int | None = None  # 0x27
    wildcard_subscription_available: int | None = None  # 0x28
    subscription_identifier_available: int | None = None  # 0x29
    shared_subscription_available: int | None = None  # 0x2A


@dataclass(slots=True)
class Will:
    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    properties: Properties | None = None


@dataclass(slots=True)
class Connect:
    client_id: str
    protocol_level: int = ProtocolLevel.MQTT_5
    clean_start: bool = True
    keep_alive: int = 60
    username: str | None = None
    password: bytes | None = None
    will: Will | None = None
    properties: Properties | None = None
    protocol_name: str = "MQTT"  # "MQIsdp" for protocol level 3

    @property
    def type(self) -> PacketType:
        return PacketType.CONNECT


@dataclass(slots=True)
class ConnAck:
    """``reason_code`` is the MQTT 5 reason code, or the 3.1.1 return code."""

    session_present: bool = False
    reason_code: int = 0
    properties: Properties | None = None

    @property
    def type(self) -> PacketType:
        return PacketType.CONNACK


@dataclass(slots=True)
class Publish:
    """``topic`` may be "" in MQTT 5 when ``properties.topic_alias`` is set."""

    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None  # present iff qos > 0
    properties: Properties | None = None

    @property
    def type(self) -> PacketType:
        return PacketType.PUBLISH


@dataclass(slots=True)
class PubAck:
    packet_id: int
    reason_code: int = 0
    properties: Properties | None = None

    @property
    def type(self) -> PacketType:
        return PacketType.PUBACK


@dataclass(slots=True)
class PubRec:
    packet_id: int
    reason_code: int = 0
    properties: Properties | None = None

    @property
    def type(self) -> PacketType:
        return PacketType.PUBREC


@dataclass(slots=True)
class PubRel:
    packet_id: int
    reason_code: int = 0
    properties: Properties | None = None

    @property
    def type(self) -> PacketType:
        return PacketType.PUBREL


@dataclass(slots=True)
class PubComp:
    packet_id: int
    reason_code: int = 0
    properties: Properties | None = None

    @property
    def type(self) -> PacketType:
        return PacketType.PUBCOMP


@dataclass(slots=True)
class Subscription:
    """One topic filter of a SUBSCRIBE with its options (spec 3.8.3.1)."""

    topic_filter: str
    qos: int = 0
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0


@dataclass(slots=True)
class Subscribe:
    packet_id: int
    subscriptions: list[Subscription] = field(default_factory=list)
    properties: Properties | None = None

    @property
    def type(self) -> PacketType:
        return PacketType.SUBSCRIBE


@dataclass(slots=True)
class SubAck:
    """``reason_codes``: granted QoS or failure code; 3.1.1 failure is 0x80."""

    packet_id: int
    reason_codes: list[int] = field(default_factory=list)
    properties: Properties | None = None

    @property
    def type(self) -> PacketType:
        return PacketType.SUBACK


@dataclass(slots=True)
class Unsubscribe:
    packet_id: int
    topic_filters: list[str] = field(default_factory=list)
    properties: Properties | None = None

    @property
    def type(self) -> PacketType:
        return PacketType.UNSUBSCRIBE


@dataclass(slots=True)
class UnsubAck:
    """``reason_codes`` is empty on MQTT 3.1.1 (the packet has no payload)."""

    packet_id: int
    reason_codes: list[int] = field(default_factory=list)
    properties: Properties | None = None

    @property
    def type(self) -> PacketType:
        return PacketType.UNSUBACK


@dataclass(slots=True)
class PingReq:
    @property
    def type(self) -> PacketType:
        return PacketType.PINGREQ


@dataclass(slots=True)
class PingResp:
    @property
    def type(self) -> PacketType:
        return PacketType.PINGRESP


@dataclass(slots=True)
class Disconnect:
    reason_code: int = 0
    properties: Properties | None = None

    @property
    def type(self) -> PacketType:
        return PacketType.DISCONNECT


@dataclass(slots=True)
class Auth:
    reason_code: int = 0
    properties: Properties | None = None

    @property
    def type(self) -> PacketType:
        return PacketType.AUTH


Packet = (
    Connect
    | ConnAck
    | Publish
    | PubAck
    | PubRec
    | PubRel
    | PubComp
    | Subscribe
    | SubAck
    | Unsubscribe
    | UnsubAck
    | PingReq
    | PingResp
    | Disconnect
    | Auth
)
