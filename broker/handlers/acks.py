"""PUBACK, PUBREC and PUBCOMP from the client: the outgoing QoS 1 and 2 flows (spec 4.3)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from broker.packets import PubAck, PubComp, PubRec, PubRel, ReasonCode

if TYPE_CHECKING:
    from broker.connection import MQTTConnection
    from broker.session import Session

log = logging.getLogger("devicemq.acks")


class AcksHost(Protocol):
    """What the acknowledgement handlers use of the broker."""

    def resume_retained(self, session: Session) -> None: ...


def handle_puback(conn: MQTTConnection, packet: PubAck) -> None:
    assert conn.session is not None
    if not conn.session.outflow.acknowledge(packet.packet_id):
        log.debug("client %s: PUBACK for unknown id %d", conn.client_id, packet.packet_id)
    elif conn.session.retained_sender:
        conn.broker.resume_retained(conn.session)  # its queue shrank


def handle_pubrec(conn: MQTTConnection, packet: PubRec) -> None:
    """Answer with PUBREL (MQTT-4.3.3-4); a failure reason ends the flow instead.

    The session's outflow sends the PUBREL of a message it holds: a persistent one only
    after the PUBREL stage is stored, so a crash cannot replay the PUBLISH.
    """
    assert conn.session is not None
    failed = packet.reason_code >= 0x80
    if conn.session.outflow.received(packet.packet_id, failed):
        return
    if not failed:
        conn.send(PubRel(packet.packet_id, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND))


def handle_pubcomp(conn: MQTTConnection, packet: PubComp) -> None:
    assert conn.session is not None
    if not conn.session.outflow.completed(packet.packet_id):
        log.debug("client %s: PUBCOMP for unknown id %d", conn.client_id, packet.packet_id)
    elif conn.session.retained_sender:
        conn.broker.resume_retained(conn.session)  # its queue shrank
