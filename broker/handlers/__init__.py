"""One handler per packet type a client may send, as Mosquitto keeps them.

Each module holds the rules of its packet; :data:`HANDLERS` is the dispatch
table the connection uses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from broker.errors import MQTTError
from broker.handlers.acks import AcksHost, handle_puback, handle_pubcomp, handle_pubrec
from broker.handlers.connect import ConnectHost, handle_connect
from broker.handlers.disconnect import DisconnectHost, handle_disconnect
from broker.handlers.ping import handle_pingreq
from broker.handlers.publish import PublishHost, handle_publish, handle_pubrel
from broker.handlers.subscribe import SubscribeHost, handle_subscribe, handle_unsubscribe
from broker.packets import PacketType, ReasonCode

if TYPE_CHECKING:
    from broker.connection import MQTTConnection


class HandlerHost(ConnectHost, PublishHost, SubscribeHost, AcksHost, DisconnectHost, Protocol):
    """What the handlers use of the broker, each module's view (``ConnectHost`` ...)
    together: the connection holds the broker as one (broker/connection.py)."""


def reject_server_packet(conn: MQTTConnection, packet: Any) -> None:
    """CONNACK, SUBACK, UNSUBACK and PINGRESP only travel server to client; AUTH
    needs an authentication method, and devicemq offers none."""
    raise MQTTError(ReasonCode.PROTOCOL_ERROR, f"a client may not send {packet.type.name}")


HANDLERS: dict[PacketType, Callable[[MQTTConnection, Any], None]] = {
    PacketType.CONNECT: handle_connect,
    PacketType.PUBLISH: handle_publish,
    PacketType.PUBACK: handle_puback,
    PacketType.PUBREC: handle_pubrec,
    PacketType.PUBREL: handle_pubrel,
    PacketType.PUBCOMP: handle_pubcomp,
    PacketType.SUBSCRIBE: handle_subscribe,
    PacketType.UNSUBSCRIBE: handle_unsubscribe,
    PacketType.PINGREQ: handle_pingreq,
    PacketType.DISCONNECT: handle_disconnect,
    PacketType.CONNACK: reject_server_packet,
    PacketType.SUBACK: reject_server_packet,
    PacketType.UNSUBACK: reject_server_packet,
    PacketType.PINGRESP: reject_server_packet,
    PacketType.AUTH: reject_server_packet,
}
