"""One client network connection, as a sans-IO state machine.

Bytes go in through :meth:`MQTTConnection.receive_data`; packets are decoded,
dispatched to the handler of their type (``broker/handlers``), and whatever
the broker sends back is encoded into an output buffer that the I/O edge drains with
:meth:`MQTTConnection.data_to_send`. The edge is told there is something to
send through the ``on_output`` callback, once per batch, so one socket write
carries many packets.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from broker.codec import (
    MAX_REMAINING_LENGTH,
    PUBACK_BYTE,
    PUBREC_BYTE,
    DecodeLimits,
    PacketDecoder,
    encode,
    encode_ack,
    encode_publish,
)
from broker.connection_state import ConnectionState, PendingAck, WillMessage
from broker.errors import MQTTError
from broker.handlers import HANDLERS, HandlerHost
from broker.limits import bucket_or_none
from broker.message import Delivery
from broker.packets import (
    ConnAck,
    Disconnect,
    Packet,
    Properties,
    ProtocolLevel,
    ReasonCode,
)

if TYPE_CHECKING:
    from broker.acl import Grant
    from broker.cluster import ClusterState
    from broker.config import Settings
    from broker.session import Session
    from broker.stats import BrokerStats

# Seconds before a connection with no deadline of its own (no keep-alive, no
# in-flight timeout) is looked at again.
IDLE_RECHECK = 30.0
RECHECK = 1.0  # seconds between looks at a deadline that may come any moment

log = logging.getLogger("devicemq.connection")

MAX_PACKET_SIZE = MAX_REMAINING_LENGTH + 5
_NO_PROPERTIES = Properties()
# Enum members as module constants, for the per-message path: on Python 3.11 the
# metaclass's __getattr__ makes each look-up of a member on an Enum class cost
# about 120 ns, against 11 for a global (BENCHMARKS.md, "Enum members").
_AWAITING_CONNECT, _CONNECTED, _CLOSED = (
    ConnectionState.AWAITING_CONNECT,
    ConnectionState.CONNECTED,
    ConnectionState.CLOSED,
)
_MQTT_5 = ProtocolLevel.MQTT_5


class ConnectionHost(HandlerHost, Protocol):
    """What a connection and its handlers use of the broker (``Broker`` is one)."""

    @property
    def settings(self) -> Settings: ...
    @property
    def clock(self) -> Callable[[], float]: ...
    @property
    def stats(self) -> BrokerStats: ...
    @property
    def call_soon(self) -> Callable[[Callable[[], None]], object] | None: ...
    @property
    def connections(self) -> set[MQTTConnection]: ...
    def detach(self, conn: MQTTConnection, publish_will: bool) -> None: ...
    def watch_connection(self, conn: MQTTConnection, when: float) -> None: ...


class MQTTConnection:
    """``on_output``: the connection has bytes to send (or closes). ``on_input_flow``:
    stop (False) or go on (True) reading from this client: a 3.1.1 publisher with as
    many acknowledgements owed as the broker's Receive Maximum waits for them to be
    sent (3.1.1 has no Receive Maximum: without this, a slow Kafka would queue its
    publishes without bound; an MQTT 5 client over it is disconnected, 0x93)."""

    def __init__(
        self,
        broker: ConnectionHost,
        peer: str,
        on_output: Callable[[MQTTConnection], None],
        on_input_flow: Callable[[bool], None] | None = None,
        source: str | None = None,
        address: str | None = None,
    ) -> None:
        self.broker = broker
        self.peer = peer
        # The peer's IP address (the block list's "address" entries); the label without one.
        self.address = address if address is not None else peer
        # Who the connection comes from, for per-source limits: the peer's address
        # (IPv6: its /64, broker/limits.py source_key); the peer label without one.
        self.source = source if source is not None else peer
        self._on_output = on_output
        self._on_input_flow = on_input_flow
        self.input_paused = False  # too many acknowledgements owed: not reading
        self._stashed: deque[Packet] = deque()  # decoded while paused, to handle on resume
        self._cluster_held = False  # a PUBLISH waits for the cluster (wait_for_cluster)
        mqtt = broker.settings.mqtt
        # Until its CONNECT is accepted a client is nobody: its packets may be
        # only mqtt.max_connect_packet_size long, and nothing after the CONNECT
        # is decoded before CONNACK (release_input).
        self.decoder = PacketDecoder(
            max_packet_size=min(mqtt.max_packet_size, mqtt.max_connect_packet_size),
            limits=DecodeLimits(mqtt.max_user_properties, mqtt.max_topic_filters_per_packet),
            pause_after_connect=True,
        )
        # Both through their setters, which keep ``accepts_publish`` and ``is_v5`` plain
        # attributes: the per-message path reads them, a property would cost a call.
        self._state = _AWAITING_CONNECT
        self.accepts_publish = False
        self.state = _AWAITING_CONNECT
        self._protocol_level: int = ProtocolLevel.MQTT_3_1_1
        self.is_v5 = False
        self.protocol_level = ProtocolLevel.MQTT_3_1_1
        self.client_id: str | None = None
        # Who the client is once authenticated (None: anonymous); see broker/auth.py.
        self.username: str | None = None
        # Its own ACL rules from auth.chain (broker/acl.py Grant), if any.
        self.grant: Grant | None = None
        # ssl getpeercert() of a TLS client certificate, set by the listener.
        self.peer_certificate: dict[str, Any] | None = None
        # While CONNECT waits for authentication what follows is kept undecoded
        # in the decoder; _held_bytes counts it.
        self._holding = False
        self._held_bytes = 0
        self.session: Session | None = None
        self.will: WillMessage | None = None
        self.keep_alive = 0
        now = broker.clock()
        self.opened_at = now
        self.last_received = now
        # What the client told us it can take (CONNECT properties).
        self.client_receive_maximum = 65535
        self.client_max_packet_size = MAX_PACKET_SIZE
        self.client_topic_alias_maximum = 0
        self.request_problem_information = True
        self.incoming_aliases: dict[int, str] = {}
        self.outgoing_aliases: dict[str, int] = {}
        self.pending_acks: deque[PendingAck] = deque()
        self.congested = False
        self.close_requested = False
        # Why it ended, for the $SYS presence event (broker/sys_topics.py): the first says.
        self.close_reason = ""
        self.publish_bucket = bucket_or_none(broker.settings.mqtt.max_publish_rate, now)
        self._stats = broker.stats
        self._out: list[bytes] = []
        # Tracked from the start so Broker.tick() can enforce the connect timeout.
        broker.connections.add(self)
        self.watched_at: float | None = None  # when Broker.tick looks at its deadlines
        self.due_entry: list[Any] | None = None  # its entry in the tick's heap
        broker.watch_connection(self, now + broker.settings.mqtt.connect_timeout)

    @property
    def protocol_level(self) -> int:
        return self._protocol_level

    @protocol_level.setter
    def protocol_level(self, level: int) -> None:
        self._protocol_level = level
        self.is_v5 = level == _MQTT_5

    @property
    def state(self) -> ConnectionState:
        return self._state

    @state.setter
    def state(self, state: ConnectionState) -> None:
        self._state = state
        # ``accepts_publish``: CONNACK went out and the connection is open. The first
        # packet the server sends is CONNACK (MQTT-3.2.0-1), so nothing is delivered
        # before it, even to a session attached while its CONNACK waits for the store.
        self.accepts_publish = state is _CONNECTED

    # -- input ------------------------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        if self._state is _CLOSED:
            return
        self.last_received = self.broker.clock()
        self._stats.bytes_received += len(data)
        if self.input_paused or self._stashed:
            self.decoder.buffer(data)  # read before the edge stopped reading: kept
            return
        if self._holding:
            self._held_bytes += len(data)
            if self._held_bytes > 2 * self.broker.settings.mqtt.max_packet_size:
                log.info("%s sent too much while its CONNECT was being checked", self.peer)
                self.broker.stats.reject("flood_before_connack")
                self.close(publish_will=False)
                return
            self.decoder.buffer(data)  # decoded once CONNACK is sent, if it is
            return
        try:
            self._process(self.decoder.feed(data))
        except MQTTError as error:
            self.protocol_violation(error)

    def _process(self, packets: list[Packet]) -> None:
        handlers = HANDLERS
        for i, packet in enumerate(packets):
            handlers[type(packet)](self, packet)  # as _dispatch, one call less per packet
            if self.close_requested or self._holding:
                return  # the decoder returns nothing after a CONNECT: nothing is lost
            if self.input_paused:
                # Owed too many acknowledgements: what one read brought waits too.
                self._stashed.extend(packets[i + 1 :])
                return

    def _input_resumed(self) -> None:
        """The acknowledgements went out: handle what waited, in order, then read on."""
        if self.state is _CLOSED:
            return
        try:
            stashed = self._stashed
            while stashed and not self.input_paused and not self.close_requested:
                self._dispatch(stashed.popleft())
            if not self.input_paused and not self.close_requested:
                self._process(self.decoder.feed(b""))
        except MQTTError as error:
            self.protocol_violation(error)
        if not self.input_paused and self._on_input_flow is not None:
            self._on_input_flow(True)

    def wait_for_cluster(self, packet: Packet, cluster: ClusterState) -> None:
        """``packet``, a QoS 1/2 PUBLISH, waits with everything after it until this
        replica knows every subscription again (``ClusterState.current``,
        tests/model/FINDINGS.md, finding 39): routed now, it could miss one another
        replica acknowledged meanwhile, and its PUBACK would promise what is lost."""
        self._stashed.appendleft(packet)
        if not self.input_paused:
            self.input_paused = True
            if self._on_input_flow is not None:
                self._on_input_flow(False)
        if not self._cluster_held:
            self._cluster_held = True
            cluster.hold(self._cluster_current)

    def _cluster_current(self) -> None:
        self._cluster_held = False
        # What waited was heard: the keep-alive counts from now (it was not read).
        self.last_received = self.broker.clock()
        if self.is_v5 or len(self.pending_acks) <= self.broker.settings.mqtt.receive_maximum // 2:
            self._resume_input()  # else ack_ready resumes, once enough acks went out

    def _resume_input(self) -> None:
        """Read on: what waited is handled next, not from inside the callback that
        decided it (a storage answer, the cluster being current)."""
        self.input_paused = False
        call_soon = self.broker.call_soon
        if call_soon is None:
            self._input_resumed()
        else:
            call_soon(self._input_resumed)

    def hold_input(self) -> None:
        """CONNECT is being authenticated: keep what follows until :meth:`release_input`."""
        self._holding = True
        self._held_bytes = 0

    def release_input(self) -> None:
        """CONNACK was sent: the client may now send packets up to mqtt.max_packet_size;
        decode and handle what arrived meanwhile, in order."""
        self._holding = False
        if self.state is _CLOSED:
            return
        self.decoder.max_packet_size = self.broker.settings.mqtt.max_packet_size
        try:
            self._process(self.decoder.feed(b""))
        except MQTTError as error:
            self.protocol_violation(error)

    def _dispatch(self, packet: Packet) -> None:
        HANDLERS[type(packet)](self, packet)

    # -- output -----------------------------------------------------------------------

    def send(self, packet: Packet) -> None:
        self._write(encode(packet, self._protocol_level))

    def _write(self, data: bytes) -> None:
        out = self._out
        out.append(data)
        self._stats.bytes_sent += len(data)
        if len(out) == 1:
            self._on_output(self)

    def data_to_send(self) -> bytes:
        out = self._out
        if not out:
            return b""
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        return data

    def send_delivery(
        self, delivery: Delivery, packet_id: int | None, dup: bool, resend: bool = False
    ) -> bool:
        """Encode one PUBLISH for this client; False if it must be discarded instead.

        Discarded are messages whose expiry passed before their onward delivery
        started (MQTT-3.3.2-5) and messages larger than the client's Maximum
        Packet Size (MQTT-3.1.2-24). A ``resend`` of a message already sent is
        not discarded for its age: its flow must complete (MQTT-4.4.0-1), so it
        goes out with whatever expiry is left, down to 0.
        """
        message = delivery.message
        stats = self._stats
        properties = None
        topic = message.topic
        new_alias = None
        if self.is_v5:
            expiry = None
            if message.expires_at is not None:
                now = self.broker.clock()
                if not resend and message.expired(now):
                    stats.drop("expired")
                    return False
                expiry = message.remaining_expiry(now)
            alias = None
            if self.client_topic_alias_maximum:
                alias = self.outgoing_aliases.get(topic)
                if alias is not None:
                    topic = ""
                elif len(self.outgoing_aliases) < self.client_topic_alias_maximum:
                    alias = new_alias = len(self.outgoing_aliases) + 1
            properties = message.properties
            if expiry is not None or alias is not None or delivery.subscription_ids:
                properties = replace(
                    properties or _NO_PROPERTIES,
                    message_expiry_interval=expiry,
                    topic_alias=alias,
                    subscription_identifiers=delivery.subscription_ids,
                )
        elif message.expires_at is not None and not resend and message.expired(self.broker.clock()):
            stats.drop("expired")
            return False
        qos = delivery.qos
        data = encode_publish(
            topic,
            message.payload,
            qos,
            delivery.retain,
            dup,
            packet_id,
            properties,
            self._protocol_level,
        )
        if len(data) > self.client_max_packet_size:
            stats.drop("too_large_for_client")
            return False
        if new_alias is not None:
            self.outgoing_aliases[topic] = new_alias
        stats.messages_sent[qos] += 1
        stats.payload_bytes_sent[qos] += len(message.payload)
        self._write(data)
        return True

    # -- acknowledgements owed to the client --------------------------------------------

    def expect_ack(self, packet_id: int, qos: int, reason: int) -> PendingAck:
        ack = PendingAck(packet_id, qos, reason)
        pending = self.pending_acks
        pending.append(ack)
        if (
            not self.input_paused
            and not self.is_v5  # MQTT 5 clients keep to our Receive Maximum (or go: 0x93)
            and len(pending) >= self.broker.settings.mqtt.receive_maximum
            and self._on_input_flow is not None
        ):
            self.input_paused = True
            self.broker.stats.input_pauses += 1
            self._on_input_flow(False)
        return ack

    def ack_ready(self, ack: PendingAck, ok: bool) -> None:
        """Storage finished for ``ack``: send every acknowledgement now due, in order."""
        ack.done = True
        ack.ok = ok
        pending = self.pending_acks
        while pending and pending[0].done:
            head = pending.popleft()
            if self._state is not _CONNECTED:
                continue
            if not head.ok:
                if not self.is_v5:
                    # 3.1.1 has no failure code: close so the client re-sends on reconnect.
                    self.disconnect(ReasonCode.UNSPECIFIED_ERROR)
                    return
                if head.reason < 0x80:  # else the failure's own code (0x97 Quota exceeded)
                    head.reason = ReasonCode.UNSPECIFIED_ERROR
            first = PUBACK_BYTE if head.qos == 1 else PUBREC_BYTE
            self._write(encode_ack(first, head.packet_id, head.reason, self._protocol_level))
        if (
            self.input_paused
            and not self._cluster_held
            and len(pending) <= self.broker.settings.mqtt.receive_maximum // 2
        ):
            self._resume_input()

    def incoming_in_flight(self) -> int:
        """QoS > 0 publishes from this client not yet fully acknowledged (Receive Maximum)."""
        session = self.session
        qos2 = len(session.incoming_qos2) if session is not None else 0
        return len(self.pending_acks) + qos2

    # -- ending -----------------------------------------------------------------------

    def protocol_violation(self, error: MQTTError) -> None:
        log.info("client %s (%s) protocol error: %s", self.client_id or "-", self.peer, error)
        self.broker.stats.reject(error.reason_code.name.lower())  # before or after CONNECT
        if self.state is _AWAITING_CONNECT:
            if error.reason_code is ReasonCode.UNSUPPORTED_PROTOCOL_VERSION:
                # Answered in the 3.1.1 form, which every client version can read.
                self._write(encode(ConnAck(False, 1), ProtocolLevel.MQTT_3_1_1))
            self.close(publish_will=False)
        else:
            self.disconnect(error.reason_code)

    def disconnect(self, reason: ReasonCode) -> None:
        """Server-initiated end: DISCONNECT with a reason (5.0 only), then close."""
        self.close_reason = self.close_reason or reason.name.lower()
        if self.state is _CONNECTED and self.is_v5:
            self.send(Disconnect(reason))
        self.close(publish_will=True)

    def close(self, publish_will: bool) -> None:
        if self.state is _CLOSED:
            return
        self.state = _CLOSED
        self.close_requested = True
        self._on_output(self)
        self.broker.detach(self, publish_will)

    def connection_lost(self) -> None:
        """The socket closed under us: an abnormal disconnect, so the will is due."""
        self.close_reason = self.close_reason or "connection_lost"
        self.close(publish_will=True)

    def check_timeouts(self, now: float) -> float | None:
        """Enforce the deadlines that passed (connect timeout, keep-alive, in-flight
        timeout); when to look again, None if the connection ended."""
        if self.state is _AWAITING_CONNECT:
            deadline = self.opened_at + self.broker.settings.mqtt.connect_timeout
            if now > deadline:
                self.broker.stats.reject("connect_timeout")
                self.close(publish_will=False)
                return None
            return deadline
        when = now + IDLE_RECHECK
        if self.keep_alive and not self._cluster_held:  # held: not read, not silent
            deadline = self.last_received + 1.5 * self.keep_alive
            if now > deadline:
                log.info("client %s keep-alive timeout", self.client_id)
                self.disconnect(ReasonCode.KEEP_ALIVE_TIMEOUT)
                return None
            when = deadline
        timeout = self.broker.settings.mqtt.inflight_timeout
        session = self.session
        if timeout and session is not None:
            outflow = session.outflow
            if outflow.stalled(now, timeout):
                # It reads but never acknowledges: what it holds waits for a client
                # that does (a persistent session keeps it), not for this one.
                log.info("client %s left its whole window unacknowledged", self.client_id)
                self.broker.stats.reject("inflight_timeout")
                self.disconnect(ReasonCode.QUOTA_EXCEEDED)
                return None
            if not outflow.inflight:
                when = min(when, now + timeout)  # a stall's clock starts with a message
            else:
                # The window may fill any moment: due when the last progress is
                # ``timeout`` old, looked at every RECHECK seconds after that.
                stall = outflow.last_progress + timeout
                when = min(when, stall if stall > now else now + RECHECK)
        return when


__all__ = ["ConnectionState", "MQTTConnection", "PendingAck", "WillMessage"]
