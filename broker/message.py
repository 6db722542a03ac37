"""An application message as the broker routes it, independent of any connection."""

from __future__ import annotations

from dataclasses import dataclass

from broker.packets import Properties


@dataclass(slots=True)
class Message:
    """A PUBLISH as received, normalised: topic resolved, alias and ids stripped.

    ``properties`` keeps only what is forwarded to subscribers (payload format,
    content type, response topic, correlation data, user properties). Expiry
    is kept as a deadline on the broker clock so every delivery can send the
    remaining interval (MQTT-3.3.2-6).
    """

    topic: str
    payload: bytes
    qos: int
    retain: bool
    origin: str | None = None  # publishing client id; None for broker-made messages
    properties: Properties | None = None
    expires_at: float | None = None

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    def remaining_expiry(self, now: float) -> int | None:
        if self.expires_at is None:
            return None
        return max(0, int(self.expires_at - now + 0.999))


@dataclass(slots=True)
class Delivery:
    """One message on its way to one subscriber, with that subscription's terms."""

    message: Message
    qos: int  # min(published QoS, granted QoS)
    retain: bool  # the RETAIN flag this subscriber sees
    subscription_ids: tuple[int, ...] = ()


def forwarded_properties(properties: Properties | None) -> Properties | None:
    """The PUBLISH properties a subscriber receives unchanged (MQTT-3.3.2-4, -15, -17, -20)."""
    if properties is None or not (
        properties.payload_format_indicator is not None
        or properties.content_type is not None
        or properties.response_topic is not None
        or properties.correlation_data is not None
        or properties.user_properties
    ):
        return None
    return Properties(
        payload_format_indicator=properties.payload_format_indicator,
        content_type=properties.content_type,
        response_topic=properties.response_topic,
        correlation_data=properties.correlation_data,
        user_properties=properties.user_properties,
    )


def is_utf8(payload: bytes) -> bool:
    """Payload Format Indicator 1 promises UTF-8; the broker checks the promise."""
    try:
        payload.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
