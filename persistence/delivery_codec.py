"""Deliveries to and from the stored-message format.

One format carries a persistent delivery end to end: the Kafka record value
is :func:`persistence.format.encode_message` of the delivery, the
consumer passes it to Redis untouched, and delivery decodes it back. Packet
identifier, DUP and topic alias are per send and are not part of it. Expiry
travels as an absolute wall-clock time, so it survives restarts; the broker
core keeps its own monotonic clock, and these functions convert between them.
"""

from __future__ import annotations

from broker.message import Delivery, Message
from broker.packets import Properties
from persistence.format import StoredMessage, encode_fields, encode_message


def encode_delivery(
    delivery: Delivery,
    wall_now: float,
    clock_now: float,
    *,
    producer: int = 0,
    seq: int = 0,
    generation: int = 0,
    queue: bool = False,
) -> bytes:
    """The record value of ``delivery``, named (``producer``, ``seq``), for the session
    of ``generation`` (``queue``: for a queue store)."""
    message = delivery.message
    expiry = None
    if message.expires_at is not None:
        expiry = wall_now + (message.expires_at - clock_now)
    properties = message.properties
    if properties is None and not delivery.subscription_ids:
        # The common case (every 3.1.1 message): no properties to encode.
        return encode_fields(
            message.topic,
            message.payload,
            delivery.qos,
            delivery.retain,
            b"",
            wall_now,
            expiry,
            producer,
            seq,
            generation,
            queue=queue,
        )
    properties = properties or _NO_PROPERTIES
    return encode_message(
        StoredMessage(
            topic=message.topic,
            payload=message.payload,
            qos=delivery.qos,
            retain=delivery.retain,
            payload_format_indicator=properties.payload_format_indicator,
            content_type=properties.content_type,
            response_topic=properties.response_topic,
            correlation_data=properties.correlation_data,
            user_properties=properties.user_properties,
            subscription_identifiers=delivery.subscription_ids,
            publish_time=wall_now,
            expiry=expiry,
            producer=producer,
            seq=seq,
            generation=generation,
        ),
        queue=queue,
    )


def stored_delivery(stored: StoredMessage, wall_now: float, clock_now: float) -> Delivery:
    has_properties = (
        stored.payload_format_indicator is not None
        or stored.content_type is not None
        or stored.response_topic is not None
        or stored.correlation_data is not None
        or stored.user_properties
    )
    message = Message(
        stored.topic,
        stored.payload,
        stored.qos,
        stored.retain,
        properties=Properties(
            payload_format_indicator=stored.payload_format_indicator,
            content_type=stored.content_type,
            response_topic=stored.response_topic,
            correlation_data=stored.correlation_data,
            user_properties=stored.user_properties,
        )
        if has_properties
        else None,
        expires_at=None if stored.expiry is None else clock_now + (stored.expiry - wall_now),
    )
    return Delivery(message, stored.qos, stored.retain, stored.subscription_identifiers)


_NO_PROPERTIES = Properties()
