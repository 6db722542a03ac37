"""PINGREQ (spec 3.12): answered at once; receiving it already reset the keep-alive."""

from __future__ import annotations

from broker.connection import MQTTConnection
from broker.packets import PingReq, PingResp


def handle_pingreq(conn: MQTTConnection, packet: PingReq) -> None:
    conn.send(PingResp())
