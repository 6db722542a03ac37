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
from broker.packets import (
    Auth,
    ConnAck,
    Connect,
    Disconnect,
    PingReq,
    PingResp,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    ReasonCode,
    SubAck,
    Subscribe,
    UnsubAck,
    Unsubscribe,
)

if TYPE_CHECKING:
    from broker.connection import MQTTConnection


class HandlerHost(ConnectHost, PublishHost, SubscribeHost, AcksHost, DisconnectHost, Protocol):
    """What the handlers use of the broker, each module's view (``ConnectHost`` ...)
    together: the connection holds the broker as one (broker/connection.py)."""


def reject_server_packet(conn: MQTTConnection, packet: Any) -> None:
    """CONNACK, SUBACK, UNSUBACK and PINGRESP only travel server to client; AUTH
    needs an authentication method, and devicemq offers none."""
    raise MQTTError(ReasonCode.PROTOCOL_ERROR, f"a client may not send {packet.type.name}")


# By packet class, not by ``packet.type``: ``type(packet)`` costs what a class
# attribute did, while ``type``, now a property (broker/packets.py), costs a call.
HANDLERS: dict[type[Any], Callable[[MQTTConnection, Any], None]] = {
    Connect: handle_connect,
    Publish: handle_publish,
    PubAck: handle_puback,
    PubRec: handle_pubrec,
    PubRel: handle_pubrel,
    PubComp: handle_pubcomp,
    Subscribe: handle_subscribe,
    Unsubscribe: handle_unsubscribe,
    PingReq: handle_pingreq,
    Disconnect: handle_disconnect,
    ConnAck: reject_server_packet,
    SubAck: reject_server_packet,
    UnsubAck: reject_server_packet,
    PingResp: reject_server_packet,
    Auth: reject_server_packet,
}
