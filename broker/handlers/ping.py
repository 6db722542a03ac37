"""PINGREQ (spec 3.12): answered at once; receiving it already reset the keep-alive."""

from __future__ import annotations

from typing import TYPE_CHECKING

from broker.packets import PingReq, PingResp

if TYPE_CHECKING:
    from broker.connection import MQTTConnection


def handle_pingreq(conn: MQTTConnection, packet: PingReq) -> None:
    conn.send(PingResp())
