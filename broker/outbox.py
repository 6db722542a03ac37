"""A session's outgoing QoS 1 and 2 flows (spec 4.3, 4.4, 4.9).

:class:`Outbox` is the interface the handlers and the session use;
:class:`MemoryOutbox` keeps the flow in process memory. The persistent path
supplies a Redis-backed outbox for persistent sessions.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from broker.message import Delivery
from broker.packets import PubRel

if TYPE_CHECKING:
    from broker.session import Session
    from broker.stats import BrokerStats


class Outbox(Protocol):
    def deliver(self, delivery: Delivery) -> None:
        """Send a QoS 1/2 delivery now if the window allows, else keep it for later."""

    def resume(self) -> None:
        """A connection was attached: re-send what is unacknowledged (MQTT-4.4.0-1)."""

    def pump(self) -> None:
        """The window may have opened (an ack, or the socket drained): send more."""

    def acknowledge(self, packet_id: int) -> bool:
        """PUBACK: the QoS 1 flow ends. False if no such message is in flight."""

    def received(self, packet_id: int, failed: bool) -> bool:
        """PUBREC: the QoS 2 flow moves to PUBREL (the outbox sends it, once it may:
        a stored outbox first stores the PUBREL stage), or ends if the client refused it."""

    def completed(self, packet_id: int) -> bool:
        """PUBCOMP: the QoS 2 flow ends."""

    def pending(self) -> int:
        """Messages not yet acknowledged, in flight or waiting."""

    def discard(self) -> None:
        """The session ended: drop everything it held."""


class OutgoingState(Enum):
    AWAIT_PUBACK = 1  # QoS 1 sent
    AWAIT_PUBREC = 2  # QoS 2 sent
    AWAIT_PUBCOMP = 3  # QoS 2, PUBREL sent


@dataclass(slots=True)
class OutgoingMessage:
    packet_id: int
    delivery: Delivery
    state: OutgoingState
    sent: bool = False  # a re-send carries DUP (MQTT-3.3.1-1)


class MemoryOutbox:
    """In-flight window, queue and packet identifiers in process memory.

    The window is the smaller of the configured in-flight cap and the
    client's Receive Maximum (MQTT-3.3.4-9). Identifiers wrap 65535 -> 1 and
    skip any still in flight. While the queue is full, new messages are
    dropped and counted, or with ``drop_oldest`` the head of the queue is.
    """

    def __init__(
        self, session: Session, max_inflight: int, max_queued: int, stats: BrokerStats
    ) -> None:
        self._session = session
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.stats = stats
        self.inflight: dict[int, OutgoingMessage] = {}
        self.queue: deque[Delivery] = deque()
        self._resend: deque[int] = deque()  # in flight, not yet re-sent on this connection
        self._last_packet_id = 0
        self.drop_oldest = False  # mqtt.queue_drop_policy: oldest

    def deliver(self, delivery: Delivery) -> None:
        if self.queue or not self._window_open():
            if len(self.queue) >= self.max_queued:
                self.stats.drop("queue_full")
                if not self.drop_oldest or not self.queue:
                    return
                self.queue.popleft()  # make room: the newest is worth more
            self.queue.append(delivery)
            return
        self._send_new(delivery)

    def resume(self) -> None:
        self._resend = deque(self.inflight)
        self.pump()

    def pump(self) -> None:
        resend, queue = self._resend, self.queue
        while (resend or queue) and self._window_open():
            if resend:
                self._send_again(resend.popleft())
            else:
                self._send_new(queue.popleft())

    def acknowledge(self, packet_id: int) -> bool:
        return self._finish(packet_id, OutgoingState.AWAIT_PUBACK)

    def received(self, packet_id: int, failed: bool) -> bool:
        out = self.inflight.get(packet_id)
        if out is None or out.state is not OutgoingState.AWAIT_PUBREC:
            return False
        if failed:
            return self._finish(packet_id, OutgoingState.AWAIT_PUBREC)
        out.state = OutgoingState.AWAIT_PUBCOMP
        conn = self._session.connection
        if conn is not None:
            conn.send(PubRel(packet_id))
        return True

    def completed(self, packet_id: int) -> bool:
        return self._finish(packet_id, OutgoingState.AWAIT_PUBCOMP)

    def pending(self) -> int:
        return len(self.inflight) + len(self.queue)

    def discard(self) -> None:
        self.inflight.clear()
        self.queue.clear()
        self._resend.clear()

    def _finish(self, packet_id: int, expected: OutgoingState) -> bool:
        out = self.inflight.get(packet_id)
        if out is None or out.state is not expected or packet_id in self._resend:
            return False
        del self.inflight[packet_id]
        self.pump()
        return True

    def _window_open(self) -> bool:
        conn = self._session.connection
        if conn is None or conn.congested:
            return False
        on_the_wire = len(self.inflight) - len(self._resend)
        return on_the_wire < min(self.max_inflight, conn.client_receive_maximum)

    def _send_again(self, packet_id: int) -> None:
        conn = self._session.connection
        assert conn is not None
        out = self.inflight[packet_id]
        if out.state is OutgoingState.AWAIT_PUBCOMP:
            conn.send(PubRel(packet_id))
        elif conn.send_delivery(out.delivery, packet_id, dup=out.sent):
            out.sent = True
        else:
            del self.inflight[packet_id]  # expired or too large for this client

    def _send_new(self, delivery: Delivery) -> None:
        conn = self._session.connection
        assert conn is not None
        packet_id = self._next_packet_id()
        state = OutgoingState.AWAIT_PUBACK if delivery.qos == 1 else OutgoingState.AWAIT_PUBREC
        if conn.send_delivery(delivery, packet_id, dup=False):
            self.inflight[packet_id] = OutgoingMessage(packet_id, delivery, state, sent=True)

    def _next_packet_id(self) -> int:
        """Next free identifier, wrapping 65535 -> 1 and skipping ids still in flight."""
        packet_id = self._last_packet_id
        inflight = self.inflight
        while True:
            packet_id = packet_id + 1 if packet_id < 65535 else 1
            if packet_id not in inflight:
                self._last_packet_id = packet_id
                return packet_id
