"""The persisted-message record: one format for the Kafka value and the Redis value.

A record is a 17-byte header followed by the message as an MQTT 5.0 PUBLISH
packet, encoded by the broker's own codec. Kafka carries it, the consumer
stores it in Redis unchanged (DESIGN.md: keep the message opaque, no JSON in
Lua), and delivery decodes it with the same codec. Packet identifier, DUP and
topic alias are per delivery and are not part of the record.

Header (big-endian): version u8, publish time f64 (epoch seconds), expiry f64
(epoch seconds, 0 = never).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace

from broker.codec import PacketDecoder, encode
from broker.message import Delivery, Message
from broker.packets import Properties, ProtocolLevel, Publish

VERSION = 1
_HEADER = struct.Struct(">Bdd")


@dataclass(slots=True)
class PersistedRecord:
    publish: Publish  # packet_id None; QoS and RETAIN as this subscriber receives them
    published_at: float  # epoch seconds
    expires_at: float | None  # epoch seconds

    def delivery(self, wall_now: float, clock_now: float) -> Delivery:
        """The record as a delivery on the broker clock (expiry converted)."""
        publish = self.publish
        properties = publish.properties
        message = Message(
            publish.topic,
            publish.payload,
            publish.qos,
            publish.retain,
            properties=replace(properties, subscription_identifiers=())
            if properties is not None and properties.subscription_identifiers
            else properties,
            expires_at=None
            if self.expires_at is None
            else clock_now + (self.expires_at - wall_now),
        )
        ids = properties.subscription_identifiers if properties is not None else ()
        return Delivery(message, publish.qos, publish.retain, ids)


def encode_record(delivery: Delivery, wall_now: float, clock_now: float) -> bytes:
    message = delivery.message
    properties = message.properties
    if delivery.subscription_ids:
        properties = replace(
            properties or Properties(), subscription_identifiers=delivery.subscription_ids
        )
    expires_at = 0.0
    if message.expires_at is not None:
        expires_at = wall_now + (message.expires_at - clock_now)
    publish = Publish(
        message.topic,
        message.payload,
        delivery.qos,
        delivery.retain,
        False,
        1 if delivery.qos else None,  # any valid id: the real one is assigned in Redis
        properties,
    )
    return _HEADER.pack(VERSION, wall_now, expires_at) + encode(publish, ProtocolLevel.MQTT_5)


def decode_record(data: bytes) -> PersistedRecord:
    version, published_at, expires_at = _HEADER.unpack_from(data)
    if version != VERSION:
        raise ValueError(f"unknown persisted record version {version}")
    decoder = PacketDecoder(protocol_level=ProtocolLevel.MQTT_5)
    (packet,) = decoder.feed(data[_HEADER.size :])
    assert isinstance(packet, Publish)
    packet.packet_id = None
    return PersistedRecord(packet, published_at, expires_at or None)
