"""MQTT session state: what outlives a network connection (spec 4.1).

The session owns the outgoing QoS 1/2 flows (in-flight window, queue, packet
identifiers) and the receiver side of incoming QoS 2. The connection that is
currently attached, if any, is only a way to send bytes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from broker.message import Delivery
from broker.packets import PubRel
from broker.stats import BrokerStats
from broker.topics import SubscriptionEntry

if TYPE_CHECKING:
    from broker.connection import MQTTConnection, WillMessage

NEVER_EXPIRES = 0xFFFFFFFF


class OutgoingState(Enum):
    AWAIT_PUBACK = 1  # QoS 1 sent
    AWAIT_PUBREC = 2  # QoS 2 sent
    AWAIT_PUBCOMP = 3  # QoS 2, PUBREL sent


@dataclass(slots=True)
class OutgoingMessage:
    packet_id: int
    delivery: Delivery
    state: OutgoingState
    sent: bool = False  # a resend after reconnect carries DUP (MQTT-3.3.1-1)


class Session:
    def __init__(
        self,
        client_id: str,
        expiry_interval: int,
        max_inflight: int,
        max_queued: int,
        stats: BrokerStats,
    ) -> None:
        self.client_id = client_id
        self.expiry_interval = expiry_interval
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.subscriptions: dict[str, SubscriptionEntry] = {}
        self.connection: MQTTConnection | None = None
        self.inflight: dict[int, OutgoingMessage] = {}
        self.queue: deque[Delivery] = deque()
        # QoS 2 ids received and not yet released: id -> stored by the persistent path
        self.incoming_qos2: dict[int, bool] = {}
        self.qos2_awaiting_pubrec: set[int] = set()  # re-sent while storage was under way
        self.expires_at: float | None = None  # set while no connection is attached
        self.pending_will: WillMessage | None = None  # a will waiting out its delay
        self.will_at: float | None = None
        self.stats = stats
        self._last_packet_id = 0

    @property
    def persistent(self) -> bool:
        return self.expiry_interval > 0

    # -- delivery towards the client -------------------------------------------------

    def deliver(self, delivery: Delivery) -> None:
        """Send now if the window allows, else queue (QoS 0 is never queued offline)."""
        conn = self.connection
        if delivery.qos == 0:
            if conn is None:
                return
            if conn.congested:
                self.stats.drop("qos0_congested")
                return
            conn.send_delivery(delivery, None, dup=False)
            return
        if self.queue or not self._window_open():
            self._enqueue(delivery)
            return
        self._send_new(delivery)

    def pump(self) -> None:
        """Move queued messages into the in-flight window as far as it is open."""
        queue = self.queue
        while queue and self._window_open():
            self._send_new(queue.popleft())

    def resume(self) -> None:
        """Re-send everything unacknowledged on a new connection (MQTT-4.4.0-1), then pump."""
        conn = self.connection
        assert conn is not None
        for out in list(self.inflight.values()):
            if out.state is OutgoingState.AWAIT_PUBCOMP:
                conn.send(PubRel(out.packet_id))
            elif not conn.send_delivery(out.delivery, out.packet_id, dup=out.sent):
                self._drop_inflight(out.packet_id)
            else:
                out.sent = True
        self.pump()

    def acknowledge(self, packet_id: int) -> bool:
        """PUBACK for QoS 1: the flow ends. False if no such QoS 1 message is in flight."""
        out = self.inflight.get(packet_id)
        if out is None or out.state is not OutgoingState.AWAIT_PUBACK:
            return False
        del self.inflight[packet_id]
        self.pump()
        return True

    def received(self, packet_id: int, failed: bool) -> bool:
        """PUBREC for QoS 2: answer PUBREL, or end the flow if the client refused it."""
        out = self.inflight.get(packet_id)
        if out is None or out.state is not OutgoingState.AWAIT_PUBREC:
            return False
        if failed:
            del self.inflight[packet_id]
            self.pump()
            return True
        out.state = OutgoingState.AWAIT_PUBCOMP
        return True

    def completed(self, packet_id: int) -> bool:
        """PUBCOMP for QoS 2: the flow ends."""
        out = self.inflight.get(packet_id)
        if out is None or out.state is not OutgoingState.AWAIT_PUBCOMP:
            return False
        del self.inflight[packet_id]
        self.pump()
        return True

    # -- internals ----------------------------------------------------------------------

    def _window_open(self) -> bool:
        conn = self.connection
        if conn is None or conn.congested:
            return False
        return len(self.inflight) < min(self.max_inflight, conn.client_receive_maximum)

    def _enqueue(self, delivery: Delivery) -> None:
        if len(self.queue) >= self.max_queued:
            self.stats.drop("queue_full")
            return
        self.queue.append(delivery)

    def _send_new(self, delivery: Delivery) -> None:
        conn = self.connection
        assert conn is not None
        packet_id = self._next_packet_id()
        state = OutgoingState.AWAIT_PUBACK if delivery.qos == 1 else OutgoingState.AWAIT_PUBREC
        out = OutgoingMessage(packet_id, delivery, state)
        self.inflight[packet_id] = out
        if conn.send_delivery(delivery, packet_id, dup=False):
            out.sent = True
        else:
            self._drop_inflight(packet_id)

    def _drop_inflight(self, packet_id: int) -> None:
        """The connection refused the message (expired or too large): end its flow."""
        del self.inflight[packet_id]

    def _next_packet_id(self) -> int:
        """Next free identifier, wrapping 65535 -> 1 and skipping ids still in flight."""
        packet_id = self._last_packet_id
        inflight = self.inflight
        while True:
            packet_id = packet_id + 1 if packet_id < 65535 else 1
            if packet_id not in inflight:
                self._last_packet_id = packet_id
                return packet_id
