"""Property-based round trips: decode(encode(packet)) == packet.

Strategies generate every packet type with every property the spec allows in
it (table 2.2.2.2, written out here independently of the codec's table), for
MQTT 3.1.1 and 5 (and 3.1 for CONNECT). Values outside what a level can carry
are not generated: a 3.1.1 PUBACK has no reason code to round-trip.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.codec import MAX_REMAINING_LENGTH, PacketDecoder, encode
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
    SubAck,
    Subscribe,
    Subscription,
    UnsubAck,
    Unsubscribe,
    Will,
)

# Moderate: the whole file runs in well under 30 s on two cores.
CODEC = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# UTF-8 Encoded Strings: any code point but surrogates and U+0000 (1.5.4).
text = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=12)
binary = st.binary(max_size=24)
flag = st.integers(0, 1)
two_byte = st.integers(0, 0xFFFF)
four_byte = st.integers(0, 0xFFFF_FFFF)
packet_id = st.integers(1, 0xFFFF)
reason_code = st.integers(0, 0xFF)
qos = st.integers(0, 2)

FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "payload_format_indicator": flag,
    "message_expiry_interval": four_byte,
    "content_type": text,
    "response_topic": text,
    "correlation_data": binary,
    "subscription_identifiers": st.lists(
        st.integers(1, MAX_REMAINING_LENGTH), min_size=1, max_size=3
    ).map(tuple),
    "session_expiry_interval": four_byte,
    "assigned_client_identifier": text,
    "server_keep_alive": two_byte,
    "authentication_method": text,
    "authentication_data": binary,
    "request_problem_information": flag,
    "will_delay_interval": four_byte,
    "request_response_information": flag,
    "response_information": text,
    "server_reference": text,
    "reason_string": text,
    "receive_maximum": st.integers(1, 0xFFFF),
    "topic_alias_maximum": two_byte,
    "topic_alias": st.integers(1, 0xFFFF),
    "maximum_qos": flag,
    "retain_available": flag,
    "user_properties": st.lists(st.tuples(text, text), min_size=1, max_size=3).map(tuple),
    "maximum_packet_size": st.integers(1, 0xFFFF_FFFF),
    "wildcard_subscription_available": flag,
    "subscription_identifier_available": flag,
    "shared_subscription_available": flag,
}

ACK = ("reason_string", "user_properties")
ALLOWED = {
    "CONNECT": (
        *("session_expiry_interval", "authentication_method", "authentication_data"),
        *("request_problem_information", "request_response_information", "receive_maximum"),
        *("topic_alias_maximum", "user_properties", "maximum_packet_size"),
    ),
    "CONNACK": (
        *("session_expiry_interval", "assigned_client_identifier", "server_keep_alive"),
        *("authentication_method", "authentication_data", "response_information"),
        *("server_reference", "reason_string", "receive_maximum", "topic_alias_maximum"),
        *("maximum_qos", "retain_available", "user_properties", "maximum_packet_size"),
        *("wildcard_subscription_available", "subscription_identifier_available"),
        "shared_subscription_available",
    ),
    "PUBLISH": (
        *("payload_format_indicator", "message_expiry_interval", "content_type"),
        *("response_topic", "correlation_data", "subscription_identifiers", "topic_alias"),
        "user_properties",
    ),
    "WILL": (
        *("payload_format_indicator", "message_expiry_interval", "content_type"),
        *("response_topic", "correlation_data", "will_delay_interval", "user_properties"),
    ),
    "ACK": ACK,
    "SUBSCRIBE": ("subscription_identifiers", "user_properties"),
    "UNSUBSCRIBE": ("user_properties",),
    "DISCONNECT": ("session_expiry_interval", "server_reference", *ACK),
    "AUTH": ("authentication_method", "authentication_data", *ACK),
}


def _build_properties(values: dict[str, Any]) -> Properties | None:
    if "authentication_data" in values:  # needs a method (4.12)
        values.setdefault("authentication_method", "m")
    return Properties(**values) if values else None


def properties(context: str, level: int = 5) -> st.SearchStrategy[Properties | None]:
    """None or a Properties with at least one property allowed in ``context``."""
    if level < 5:
        return st.none()
    fields = {name: FIELDS[name] for name in ALLOWED[context]}
    if context == "SUBSCRIBE":  # at most one (3.8.2.1.2)
        fields["subscription_identifiers"] = st.integers(1, MAX_REMAINING_LENGTH).map(
            lambda n: (n,)
        )
    return st.fixed_dictionaries({}, optional=fields).map(_build_properties)


@st.composite
def connects(draw: st.DrawFn, level: int) -> Connect:
    will = None
    if draw(st.booleans()):
        will = Will(
            draw(text),
            draw(binary),
            draw(qos),
            draw(st.booleans()),
            draw(properties("WILL", level)),
        )
    username = draw(st.none() | text)
    # 3.1.1 [MQTT-3.1.2-22]: no password without a user name.
    password = draw(st.none() | binary) if username is not None or level == 5 else None
    return Connect(
        client_id=draw(text),
        protocol_level=level,
        clean_start=draw(st.booleans()),
        keep_alive=draw(two_byte),
        username=username,
        password=password,
        will=will,
        properties=draw(properties("CONNECT", level)),
        protocol_name="MQIsdp" if level == 3 else "MQTT",
    )


topic_name = st.text(
    st.characters(exclude_categories=["Cs"], exclude_characters="\x00+#"), min_size=1, max_size=12
)


@st.composite
def publishes(draw: st.DrawFn, level: int) -> Publish:
    level_qos = draw(qos)
    props = draw(properties("PUBLISH", level))
    topic = draw(topic_name)
    if props is not None and props.topic_alias is not None and draw(st.booleans()):
        topic = ""  # the alias stands for it (3.3.2.3.4)
    return Publish(
        topic=topic,
        payload=draw(st.binary(max_size=300)),
        qos=level_qos,
        retain=draw(st.booleans()),
        dup=level_qos > 0 and draw(st.booleans()),
        packet_id=draw(packet_id) if level_qos else None,
        properties=props,
    )


def acks(cls: type[PubAck | PubRec | PubRel | PubComp], level: int) -> st.SearchStrategy[Packet]:
    if level < 5:
        return st.builds(cls, packet_id)
    return st.builds(cls, packet_id, reason_code, properties("ACK"))


def subscriptions(level: int) -> st.SearchStrategy[Subscription]:
    if level < 5:
        return st.builds(Subscription, text, qos)
    return st.builds(Subscription, text, qos, st.booleans(), st.booleans(), st.integers(0, 2))


def strategies(level: int) -> dict[str, st.SearchStrategy[Packet]]:
    """One strategy per packet type that exists at ``level``."""
    v5 = level == 5
    suback_codes = reason_code if v5 else st.sampled_from([0x00, 0x01, 0x02, 0x80])
    found: dict[str, st.SearchStrategy[Packet]] = {
        "CONNECT": connects(level),
        "CONNACK": st.builds(
            ConnAck,
            st.booleans(),
            reason_code if v5 else st.integers(0, 5),
            properties("CONNACK", level),
        ),
        "PUBLISH": publishes(level),
        "PUBACK": acks(PubAck, level),
        "PUBREC": acks(PubRec, level),
        "PUBREL": acks(PubRel, level),
        "PUBCOMP": acks(PubComp, level),
        "SUBSCRIBE": st.builds(
            Subscribe,
            packet_id,
            st.lists(subscriptions(level), min_size=1, max_size=4),
            properties("SUBSCRIBE", level),
        ),
        "SUBACK": st.builds(
            SubAck, packet_id, st.lists(suback_codes, max_size=5), properties("ACK", level)
        ),
        "UNSUBSCRIBE": st.builds(
            Unsubscribe,
            packet_id,
            st.lists(text, min_size=1, max_size=4),
            properties("UNSUBSCRIBE", level),
        ),
        "UNSUBACK": st.builds(
            UnsubAck,
            packet_id,
            st.lists(reason_code, max_size=5) if v5 else st.just([]),
            properties("ACK", level),
        ),
        "PINGREQ": st.builds(PingReq),
        "PINGRESP": st.builds(PingResp),
        "DISCONNECT": (
            st.builds(Disconnect, reason_code, properties("DISCONNECT"))
            if v5
            else st.builds(Disconnect)
        ),
    }
    if v5:
        found["AUTH"] = st.builds(Auth, reason_code, properties("AUTH"))
    return found


CASES = [(level, name) for level in (4, 5) for name in strategies(level)]
CASES.append((3, "CONNECT"))


@pytest.mark.parametrize(("level", "name"), CASES)
@settings(CODEC)
@given(data=st.data())
def test_round_trip(level: int, name: str, data: st.DataObject) -> None:
    packet = data.draw(strategies(level)[name], label=name)
    wire = encode(packet, level)
    decoder = PacketDecoder(None if name == "CONNECT" else level)
    assert decoder.feed(wire) == [packet]
    if name == "CONNECT":
        assert decoder.protocol_level == level


def any_packet(level: int) -> st.SearchStrategy[Packet]:
    return st.one_of([s for name, s in strategies(level).items() if name != "CONNECT"])


@pytest.mark.parametrize("level", [4, 5])
@settings(CODEC)
@given(data=st.data())
def test_stream_round_trip_in_arbitrary_pieces(level: int, data: st.DataObject) -> None:
    """Whatever way the bytes arrive, the same packets come out, in order."""
    packets = [data.draw(connects(level))]
    packets += data.draw(st.lists(any_packet(level), max_size=8))
    wire = b"".join(encode(p, level) for p in packets)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=10)))
    decoder = PacketDecoder()
    out: list[Packet] = []
    for start, stop in zip([0, *cuts], [*cuts, len(wire)], strict=True):
        out += decoder.feed(wire[start:stop])
    assert out == packets


@st.composite
def damaged(draw: st.DrawFn, level: int) -> bytes:
    """A valid packet with some bytes overwritten and maybe its tail cut off."""
    wire = bytearray(encode(draw(any_packet(level)), level))
    for _ in range(draw(st.integers(1, 3))):
        wire[draw(st.integers(0, len(wire) - 1))] = draw(st.integers(0, 255))
    return bytes(wire[: draw(st.integers(1, len(wire)))])


@pytest.mark.parametrize("level", [4, 5])
@settings(CODEC, max_examples=300)
@given(data=st.data())
def test_damaged_bytes_raise_only_mqtt_error(level: int, data: st.DataObject) -> None:
    """A peer cannot make the decoder fail any other way than MQTTError."""
    wire = data.draw(st.binary(max_size=64) | damaged(level))
    with contextlib.suppress(MQTTError):
        PacketDecoder(level).feed(wire)
    with contextlib.suppress(MQTTError):
        PacketDecoder().feed(wire)
