"""The Kafka path's record values: the short ways give what the long ways give."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from broker.message import Delivery, Message
from broker.packets import Properties
from persistence.delivery_codec import encode_delivery
from persistence.format import (
    StoredMessage,
    decode_record,
    encode_message,
    record_id,
    well_formed,
)


def _long_way(delivery: Delivery, wall: float, clock: float, **named: int) -> bytes:
    """The value as encode_delivery made it before its short way: a StoredMessage."""
    message = delivery.message
    expiry = None if message.expires_at is None else wall + (message.expires_at - clock)
    return encode_message(
        StoredMessage(
            topic=message.topic,
            payload=message.payload,
            qos=delivery.qos,
            retain=delivery.retain,
            subscription_identifiers=delivery.subscription_ids,
            publish_time=wall,
            expiry=expiry,
            producer=named["producer"],
            seq=named["seq"],
            generation=named["generation"],
        )
    )


@given(
    topic=st.text(min_size=1, max_size=40),
    payload=st.binary(max_size=100),
    qos=st.integers(1, 2),
    retain=st.booleans(),
    expires_in=st.none() | st.floats(0, 1e6),
    sids=st.sampled_from([(), (7,)]),
    ids=st.tuples(st.integers(0, 2**40), st.integers(0, 2**40), st.integers(0, 2**40)),
)
def test_a_message_without_properties_encodes_as_through_a_stored_message(
    topic: str,
    payload: bytes,
    qos: int,
    retain: bool,
    expires_in: float | None,
    sids: tuple[int, ...],
    ids: tuple[int, int, int],
) -> None:
    """encode_delivery packs a message without properties from its fields (no
    StoredMessage): the same bytes, and it decodes (decode_record's short way when
    there are no properties) to the same message."""
    clock, wall = 100.0, 1_700_000_000.0
    expires_at = None if expires_in is None else clock + expires_in
    delivery = Delivery(
        Message(topic, payload, qos, retain, expires_at=expires_at), qos, retain, sids
    )
    producer, seq, generation = ids
    named = {"producer": producer, "seq": seq, "generation": generation}
    value = encode_delivery(delivery, wall, clock, **named)
    assert value == _long_way(delivery, wall, clock, **named)
    record = decode_record(9, 11, value, marked=True)
    assert (record.packet_id, record.score, record.marked, record.sent) == (9, 11, True, False)
    stored = record.message
    expiry = None if expires_at is None else wall + (expires_at - clock)
    assert stored == StoredMessage(
        topic,
        payload,
        qos,
        retain,
        subscription_identifiers=sids,
        publish_time=wall,
        expiry=expiry,
        producer=producer,
        seq=seq,
        generation=generation,
    )
    assert stored is not None
    assert (stored.topic, stored.payload, stored.qos, stored.retain) == (
        topic,
        payload,
        qos,
        retain,
    )
    assert stored.subscription_identifiers == sids


def test_a_message_with_properties_keeps_them() -> None:
    properties = Properties(content_type="text/plain", user_properties=(("a", "b"),))
    delivery = Delivery(Message("t", b"x", 1, False, properties=properties), 1, False)
    stored = decode_record(1, 1, encode_delivery(delivery, 1.0, 1.0, seq=3)).message
    assert stored is not None
    assert (stored.content_type, stored.user_properties, stored.seq) == (
        "text/plain",
        (("a", "b"),),
        3,
    )


_EDGES = [b"", b"\x02", b"\x01" + b"\x00" * 31, b"\x01" + b"\x00" * 32]
_EDGES += [b"\x02" + b"\x00" * 47, b"\x02" + b"\x00" * 48, b"\x03" + b"\x00" * 60]


@given(st.binary(max_size=80) | st.sampled_from(_EDGES))
def test_well_formed_is_what_record_id_reads(value: bytes) -> None:
    """The consumer's cheap check of a record agrees with reading its header."""
    try:
        record_id(value)
        readable = True
    except (ValueError, IndexError):
        readable = False
    assert well_formed(value) == readable
    assert not well_formed(None)
