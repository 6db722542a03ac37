"""DISCONNECT from the client (spec 3.14)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from broker.errors import MQTTError
from broker.packets import Disconnect, ReasonCode

if TYPE_CHECKING:
    from broker.config import Settings
    from broker.connection import MQTTConnection


class DisconnectHost(Protocol):
    """What the DISCONNECT handler uses of the broker."""

    @property
    def settings(self) -> Settings: ...


def handle_disconnect(conn: MQTTConnection, packet: Disconnect) -> None:
    """A normal DISCONNECT discards the will (MQTT-3.14.4-3) unless the 5.0 reason
    asks for it (0x04); 5.0 may change the session expiry, but not from 0
    (MQTT-3.14.2-2)."""
    session = conn.session
    properties = packet.properties
    if session is not None and properties is not None:
        requested = properties.session_expiry_interval
        if requested is not None:
            if session.expiry_interval == 0 and requested > 0:
                raise MQTTError(
                    ReasonCode.PROTOCOL_ERROR,
                    "session expiry set on DISCONNECT after CONNECT asked for 0",
                )
            limit = conn.broker.settings.mqtt.max_session_expiry_interval
            session.expiry_interval = min(requested, limit)
    conn.close_reason = conn.close_reason or "normal"
    conn.close(publish_will=packet.reason_code == ReasonCode.DISCONNECT_WITH_WILL)
