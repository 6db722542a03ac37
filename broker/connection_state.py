"""What a connection holds between packets: its state, the acknowledgements it
owes, its will.

Apart from broker/connection.py so that the packet handlers, which create
these, and the connection, which dispatches to the handlers, import each
other in one direction only (connection -> handlers -> these).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from broker.message import Message

if TYPE_CHECKING:
    from broker.acl import Grant


class ConnectionState(Enum):
    AWAITING_CONNECT = 1
    CONNECTED = 2
    CLOSED = 3


@dataclass(slots=True)
class PendingAck:
    """A PUBACK/PUBREC owed to the client once the message is stored.

    Acknowledgements leave in the order the PUBLISH packets arrived
    (MQTT-4.6.0-2), even when storage completes out of order.
    """

    packet_id: int
    qos: int
    reason: int
    done: bool = False
    ok: bool = True


@dataclass(slots=True)
class WillMessage:
    """The will of the current connection, resolved into a message.

    ``expiry_interval`` is the will's Message Expiry Interval: it starts when
    the will is published, not at CONNECT (spec 3.1.3.2.4), so
    ``message.expires_at`` is only set by :meth:`Broker.publish_will`.
    ``client_id``, ``username`` and ``grant`` (its rules from auth.chain) say
    who published it, for the ACL check at publish time (the ACL may have
    changed since CONNECT; the grant is gone from the ACL once the session ends).
    """

    message: Message
    delay: int
    expiry_interval: int | None = None
    client_id: str = ""
    username: str | None = None
    grant: Grant | None = None
