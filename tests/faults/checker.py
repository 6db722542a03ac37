"""Clients that record everything, and the check that nothing acknowledged was lost.

- :class:`Publisher`: a paho-mqtt 2.x client (MQTT 5.0 or 3.1.1, clean
  session) publishing ``b"<name>:<seq>"`` at QoS 1 or 2, recording the reason
  code of every PUBACK / PUBCOMP. paho reconnects by itself and re-sends what
  was in flight; those seqs are *ambiguous* (the broker may have stored them
  already, and then forwards the re-send as a new message).
- :class:`PahoSubscriber`: a persistent paho subscriber (3.1.1 clean session 0,
  5.0 clean start 0 + Session Expiry), reconnecting by itself, recording every
  PUBLISH with its DUP flag.
- :class:`RawSubscriber`: the same over a plain socket with
  :mod:`broker.codec`, for exact control: packet ids, held-back acks, an
  abrupt close, and QoS 2 receiver state kept across connections.
- :func:`check`: every acknowledged message arrived; per publisher the first
  receipts of acknowledged messages come in sequence order; a repeat of a message arrives with DUP=1
  (unless the publisher itself re-sent it); QoS 2: exactly once.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties as PahoProperties

from broker.codec import PacketDecoder, encode
from broker.packets import (
    ConnAck,
    Connect,
    Disconnect,
    Packet,
    PingReq,
    Properties,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    Subscription,
)

if TYPE_CHECKING:
    from tests.faults.conftest import Stack

V5 = mqtt.MQTTv5
V311 = mqtt.MQTTv311
SESSION_EXPIRY = 600


def wait_until(condition: Callable[[], bool], timeout: float, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def parse(payload: bytes) -> tuple[str, int]:
    name, _, seq = payload.decode().rpartition(":")
    return name, int(seq)


def _reason(rc: Any) -> int:
    return int(rc.value) if hasattr(rc, "value") else int(rc)


# ---------------------------------------------------------------------------
# Publisher
# ---------------------------------------------------------------------------


class Publisher:
    """Publishes ``b"<name>:<seq>"``, seq 1, 2, ...; records the outcome of each."""

    def __init__(
        self,
        address: tuple[str, int],
        name: str,
        topic: str,
        *,
        version: int = V5,
        qos: int = 1,
        window: int = 100,
        properties: PahoProperties | None = None,
    ) -> None:
        self.name = name
        self.topic = topic
        self.qos = qos
        self.window = window
        self.properties = properties
        self._lock = threading.Lock()
        self.last_seq = 0
        self._mids: dict[int, int] = {}  # mid -> seq
        self._done: dict[int, int] = {}  # mid -> reason code of PUBACK / PUBCOMP
        self.ambiguous: set[int] = set()  # possibly re-sent by paho after a reconnect
        self.disconnects = 0
        self.connects = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        v5 = version == V5
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=name,
            protocol=version,
            clean_session=None if v5 else True,
            reconnect_on_failure=True,
        )
        self.client.reconnect_delay_set(0.1, 0.5)
        self.client.max_queued_messages_set(0)
        self.client.on_publish = self._on_publish
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self._connected = threading.Event()
        self._resync = threading.Event()  # after a reconnect: re-sends first, then new
        self.client.connect_async(address[0], address[1], keepalive=30)
        self.client.loop_start()
        if not self._connected.wait(10):
            raise AssertionError(f"publisher {name} did not connect")

    # -- paho callbacks (network thread) ------------------------------------------

    def _on_connect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any) -> None:
        if _reason(rc) == 0:
            self.connects += 1
            self._connected.set()

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any) -> None:
        self._connected.clear()
        self._resync.set()
        with self._lock:
            self.disconnects += 1
            self.ambiguous.update(s for m, s in self._mids.items() if m not in self._done)
            self.ambiguous.add(self.last_seq)  # may be on its way, mid not yet known

    def _on_publish(self, client: Any, userdata: Any, mid: int, rc: Any, props: Any) -> None:
        with self._lock:
            self._done[mid] = _reason(rc)

    # -- publishing ---------------------------------------------------------------

    def _pending(self) -> int:
        with self._lock:
            return len(self._mids) - len(self._done)

    def publish(self, count: int, interval: float = 0.0) -> None:
        """Publish ``count`` more messages from this thread (window-limited)."""
        for _ in range(count):
            if self._stop.is_set():
                return
            self._wait_turn()
            if self._stop.is_set():
                return
            with self._lock:
                self.last_seq += 1
                seq = self.last_seq
            info = self.client.publish(
                self.topic, f"{self.name}:{seq}".encode(), self.qos, properties=self.properties
            )
            with self._lock:
                assert info.mid not in self._mids, "paho reused a message id"
                self._mids[info.mid] = seq
            if interval:
                time.sleep(interval)

    def _wait_turn(self) -> None:
        """Room in the window, connected, and nothing from before a reconnect pending.

        paho sends a new PUBLISH as soon as the socket is back, possibly before
        it re-sends the older in-flight ones after CONNACK: the broker would
        then receive them out of order, through no fault of its own.
        """
        while not self._stop.is_set():
            if self._connected.is_set():
                pending = self._pending()
                if self._resync.is_set() and pending == 0:
                    self._resync.clear()
                if not self._resync.is_set() and pending < self.window:
                    return
            time.sleep(0.002)

    def start(self, interval: float = 0.002, limit: int = 1_000_000) -> None:
        """Publish continuously from a thread until :meth:`stop`."""
        self._thread = threading.Thread(
            target=self.publish, args=(limit, interval), name=f"pub-{self.name}", daemon=True
        )
        self._thread.start()

    def stop(self, settle: float = 15.0) -> None:
        """Stop publishing; wait (up to ``settle`` s) for outstanding acks."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        with contextlib.suppress(AssertionError):
            wait_until(lambda: self._pending() == 0, settle, "publisher acks")

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):
            self.client.disconnect()
        self.client.loop_stop()

    # -- results -------------------------------------------------------------------

    @property
    def outcomes(self) -> dict[int, int | None]:
        """seq -> reason code (None: no ack)."""
        with self._lock:
            out: dict[int, int | None] = {s: None for s in self._mids.values()}
            for mid, rc in self._done.items():
                seq = self._mids.get(mid)
                if seq is not None:
                    out[seq] = rc
            return out

    @property
    def acked(self) -> set[int]:
        return {s for s, rc in self.outcomes.items() if rc is not None and rc < 0x80}

    @property
    def failed(self) -> set[int]:
        return {s for s, rc in self.outcomes.items() if rc is not None and rc >= 0x80}

    @property
    def unanswered(self) -> set[int]:
        return {s for s, rc in self.outcomes.items() if rc is None}


def start_publishers(
    pubs: list[Publisher],
    stack: Stack,
    topic: str,
    *,
    qos: int = 1,
    interval: float = 0.003,
) -> None:
    """One publisher per protocol version (5.0, 3.1.1), each on ``topic/<i>``.

    Appended to ``pubs`` as each starts, so the caller's cleanup stops every
    publisher that did start even if a later one fails.
    """
    for i, version in enumerate((V5, V311)):
        pub = Publisher(
            stack.broker.address, stack.client(f"pub{i}"), f"{topic}/{i}", version=version, qos=qos
        )
        pubs.append(pub)
        pub.start(interval=interval)


# ---------------------------------------------------------------------------
# Subscribers
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Received:
    payload: bytes
    dup: bool
    qos: int
    packet_id: int
    connection: int  # which connection of the subscriber it came on (1, 2, ...)
    expiry: int | None = None  # MQTT 5 Message Expiry Interval as received


class _Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.received: list[Received] = []
        # QoS 2 delivered to the application (first PUBLISH of a packet id not in flight)
        self.delivered_qos2: list[bytes] = []

    def snapshot(self) -> list[Received]:
        with self.lock:
            return list(self.received)

    def seqs(self, publisher: str) -> set[int]:
        with self.lock:
            return {s for n, s in (parse(r.payload) for r in self.received) if n == publisher}

    def has_all(self, publishers: Iterable[Publisher]) -> bool:
        return all(p.acked <= self.seqs(p.name) for p in publishers)

    def wait_all(self, publishers: Iterable[Publisher], timeout: float = 30.0) -> None:
        pubs = list(publishers)

        def missing() -> str:
            return ", ".join(
                f"{p.name}: {len(p.acked - self.seqs(p.name))} missing e.g. "
                f"{sorted(p.acked - self.seqs(p.name))[:10]}"
                for p in pubs
            )

        try:
            wait_until(lambda: self.has_all(pubs), timeout, "every acknowledged message")
        except AssertionError as e:
            raise AssertionError(f"{e}: {missing()}") from None


class PahoSubscriber(_Recorder):
    """A persistent paho subscriber that reconnects by itself (clean start 0)."""

    def __init__(self, address: tuple[str, int], client_id: str, *, version: int = V5) -> None:
        super().__init__()
        self.address = address
        self.version = version
        self.client_id = client_id
        self.connections = 0
        self.session_present: list[bool] = []
        self._connected = threading.Event()
        self._subscribed = threading.Event()
        self.client: mqtt.Client | None = None

    def connect(self, clean_start: bool = False) -> bool:
        """Open (with paho's automatic reconnect) and wait for CONNACK; session present?"""
        self.close()
        v5 = self.version == V5
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            protocol=self.version,
            clean_session=None if v5 else clean_start,
            reconnect_on_failure=True,
        )
        client.reconnect_delay_set(0.1, 0.5)
        client.on_connect = self._on_connect
        client.on_message = self._on_message
        client.on_subscribe = lambda *a: self._subscribed.set()
        client.on_disconnect = lambda *a: self._connected.clear()
        properties = None
        if v5:
            properties = PahoProperties(PacketTypes.CONNECT)
            properties.SessionExpiryInterval = SESSION_EXPIRY
        self._connected.clear()
        self.client = client
        if v5:
            client.connect_async(
                *self.address, keepalive=30, clean_start=clean_start, properties=properties
            )
        else:
            client.connect_async(*self.address, keepalive=30)
        client.loop_start()
        if not self._connected.wait(10):
            raise AssertionError(f"subscriber {self.client_id} did not connect")
        return self.session_present[-1]

    def subscribe(self, topic_filter: str, qos: int = 1) -> None:
        assert self.client is not None
        self._subscribed.clear()
        self.client.subscribe(topic_filter, qos)
        if not self._subscribed.wait(10):
            raise AssertionError("no SUBACK")

    def wait_connected(self, timeout: float = 30.0) -> None:
        if not self._connected.wait(timeout):
            raise AssertionError(f"subscriber {self.client_id} did not reconnect")

    def close(self) -> None:
        """A clean DISCONNECT (the session stays, it is persistent)."""
        client, self.client = self.client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.disconnect()
            client.loop_stop()

    def _on_connect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any) -> None:
        if _reason(rc) == 0:
            with self.lock:
                self.connections += 1
                self.session_present.append(bool(flags.session_present))
            self._connected.set()

    def _on_message(self, client: Any, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        expiry = getattr(msg.properties, "MessageExpiryInterval", None) if msg.properties else None
        with self.lock:
            self.received.append(
                Received(msg.payload, bool(msg.dup), msg.qos, msg.mid, self.connections, expiry)
            )


AckPolicy = Callable[[Publish], bool]


def _always(packet: Publish) -> bool:
    return True


class RawSubscriber(_Recorder):
    """A persistent subscriber over a plain socket, its own reader thread.

    ``ack`` decides per PUBLISH whether to acknowledge it (PUBACK, or PUBREC
    for QoS 2; PUBREL is always completed). With ``reconnect``, a lost
    connection is re-opened (clean start 0) until :meth:`close`. QoS 2
    receiver state (ids PUBREC'd and not yet released) survives reconnects,
    as the spec requires of a session: a PUBLISH with such an id is a
    duplicate, not a new delivery (MQTT-4.3.3-10's receiver side).
    """

    def __init__(
        self,
        address: tuple[str, int],
        client_id: str,
        *,
        level: int = 5,
        session_expiry: int = SESSION_EXPIRY,
        receive_maximum: int | None = None,
    ) -> None:
        super().__init__()
        self.address = address
        self.client_id = client_id
        self.level = level
        self.session_expiry = session_expiry
        self.receive_maximum = receive_maximum
        self.ack: AckPolicy = _always
        self.complete = True  # answer PUBREL with PUBCOMP
        self.pubrels: list[tuple[int, int]] = []  # (packet id, connection) of each PUBREL
        self.connections = 0
        self.connacks: list[ConnAck] = []
        self.qos2_in_flight: dict[int, bytes] = {}
        self.protocol_errors: list[str] = []
        self.sock: socket.socket | None = None
        self._decoder = PacketDecoder(protocol_level=level)
        self._pending: list[Packet] = []
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._reconnect = False
        self._wlock = threading.Lock()

    # -- connection ---------------------------------------------------------------

    def connect(
        self,
        clean_start: bool = False,
        subscribe: list[tuple[str, int]] | None = None,
        *,
        reconnect: bool = False,
        timeout: float = 10.0,
    ) -> ConnAck:
        """Connect (retrying until ``timeout`` while refused), subscribe, start reading."""
        self.close()
        self._closing.clear()
        self._reconnect = reconnect
        deadline = time.monotonic() + timeout
        while True:
            try:
                connack = self._open(clean_start)
                break
            except (OSError, AssertionError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        if subscribe:
            self._send(Subscribe(1, [Subscription(f, qos=q) for f, q in subscribe]))
            suback = self._recv_sync(timeout)
            assert isinstance(suback, SubAck), suback
            assert all(rc < 0x80 for rc in suback.reason_codes), suback
        self._thread = threading.Thread(target=self._run, name=f"sub-{self.client_id}", daemon=True)
        self._thread.start()
        return connack

    def _open(self, clean_start: bool) -> ConnAck:
        sock = socket.create_connection(self.address, timeout=5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._decoder = PacketDecoder(protocol_level=self.level)
        self._pending = []
        props = None
        if self.level == 5:
            props = Properties(
                session_expiry_interval=self.session_expiry,
                receive_maximum=self.receive_maximum,
            )
        self._send(
            Connect(
                self.client_id,
                protocol_level=self.level,
                clean_start=clean_start,
                keep_alive=60,
                properties=props,
            )
        )
        connack = self._recv_sync(5)
        if not isinstance(connack, ConnAck) or connack.reason_code != 0:
            sock.close()
            raise AssertionError(f"refused: {connack}")
        with self.lock:
            self.connections += 1
            self.connacks.append(connack)
        return connack

    def _send(self, packet: Packet) -> None:
        sock = self.sock
        if sock is None:
            return
        with self._wlock, contextlib.suppress(OSError):
            sock.sendall(encode(packet, self.level))

    def _recv_sync(self, timeout: float) -> Packet:
        deadline = time.monotonic() + timeout
        assert self.sock is not None
        while not self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("no packet in time")
            self.sock.settimeout(left)
            data = self.sock.recv(65536)
            if not data:
                raise AssertionError("connection closed")
            self._pending.extend(self._decoder.feed(data))
        return self._pending.pop(0)

    def abort(self) -> None:
        """Drop the connection abruptly (RST, no DISCONNECT); no reconnect."""
        self._reconnect = False
        self._closing.set()
        sock, self.sock = self.sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                )
                sock.close()
        self._join()

    def close(self, disconnect: bool = True) -> None:
        """Clean DISCONNECT (normal, session kept)."""
        self._closing.set()
        self._reconnect = False
        if disconnect and self.sock is not None:
            self._send(Disconnect(0))
        sock, self.sock = self.sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        self._join()

    def _join(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(10)

    def ping(self) -> None:
        self._send(PingReq())

    # -- reader thread -----------------------------------------------------------

    def _run(self) -> None:
        while not self._closing.is_set():
            sock = self.sock
            if sock is None:
                return
            try:
                for packet in self._pending:
                    self._handle(packet)
                self._pending = []
                sock.settimeout(0.2)
                data = sock.recv(65536)
                if not data:
                    raise ConnectionResetError
            except TimeoutError:
                continue
            except OSError:
                if self._closing.is_set() or not self._reconnect:
                    return
                self._reopen()
                continue
            for packet in self._decoder.feed(data):
                self._handle(packet)

    def _reopen(self) -> None:
        with contextlib.suppress(OSError):
            if self.sock is not None:
                self.sock.close()
        while not self._closing.is_set():
            time.sleep(0.2)
            try:
                self._open(False)
                return
            except (OSError, AssertionError):
                continue

    def _handle(self, packet: Packet) -> None:
        if isinstance(packet, Publish):
            expiry = packet.properties.message_expiry_interval if packet.properties else None
            record = Received(
                packet.payload,
                packet.dup,
                packet.qos,
                packet.packet_id or 0,
                self.connections,
                expiry,
            )
            with self.lock:
                self.received.append(record)
                if packet.qos == 2:
                    assert packet.packet_id is not None
                    held = self.qos2_in_flight.get(packet.packet_id)
                    if held is None:
                        self.qos2_in_flight[packet.packet_id] = packet.payload
                        self.delivered_qos2.append(packet.payload)
                    elif held != packet.payload:
                        self.protocol_errors.append(
                            f"id {packet.packet_id} reused for {packet.payload!r} while "
                            f"{held!r} awaits PUBREL"
                        )
            if packet.qos and self.ack(packet):
                assert packet.packet_id is not None
                self._send(
                    PubAck(packet.packet_id) if packet.qos == 1 else PubRec(packet.packet_id)
                )
        elif isinstance(packet, PubRel):
            with self.lock:
                self.pubrels.append((packet.packet_id, self.connections))
                if not self.complete:
                    return
                # Unknown ids are fine: a PUBREL re-sent after our PUBCOMP got lost.
                self.qos2_in_flight.pop(packet.packet_id, None)
            self._send(PubComp(packet.packet_id))
        elif isinstance(packet, Disconnect):
            pass  # the broker closes right after; the reader sees EOF

    def send_ack(self, packet_id: int, qos: int = 1) -> None:
        self._send(PubAck(packet_id) if qos == 1 else PubRec(packet_id))


# ---------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    received: int = 0
    repeats: int = 0

    def add(self, text: str) -> None:
        if len(self.problems) < 40:
            self.problems.append(text)


def check(
    publishers: Iterable[Publisher], subscriber: _Recorder, *, exactly_once: bool = False
) -> Report:
    """Nothing acknowledged lost, order per publisher, DUP on every repeat (see module doc)."""
    pubs = {p.name: p for p in publishers}
    report = Report()
    seen: dict[str, set[int]] = {n: set() for n in pubs}
    last_first: dict[str, int] = dict.fromkeys(pubs, 0)
    # Order is owed for what the broker accepted: a message it refused (Kafka
    # timed out) may still surface later, Kafka having taken it after all.
    acked = {n: p.acked for n, p in pubs.items()}
    received = subscriber.snapshot()
    report.received = len(received)
    for r in received:
        name, seq = parse(r.payload)
        pub = pubs.get(name)
        if pub is None:
            report.add(f"message from nobody: {r.payload!r}")
            continue
        if seq in seen[name]:
            report.repeats += 1
            if not r.dup and seq not in pub.ambiguous:
                report.add(f"{name}:{seq} repeated with DUP=0 (connection {r.connection})")
            continue
        seen[name].add(seq)
        if seq not in acked[name]:
            continue
        if seq < last_first[name]:
            report.add(f"{name}:{seq} first received after {name}:{last_first[name]}")
        last_first[name] = max(last_first[name], seq)
    for name in pubs:
        lost = sorted(acked[name] - seen[name])
        if lost:
            report.add(f"{name}: {len(lost)} acknowledged messages never arrived: {lost[:20]}")
    if exactly_once:
        counts: dict[bytes, int] = {}
        for payload in subscriber.delivered_qos2:
            counts[payload] = counts.get(payload, 0) + 1
        for payload, n in counts.items():
            name, seq = parse(payload)
            if n > 1 and seq not in pubs[name].ambiguous:
                report.add(f"QoS 2 {payload!r} delivered {n} times")
    if isinstance(subscriber, RawSubscriber) and subscriber.protocol_errors:
        report.add(f"protocol errors: {subscriber.protocol_errors[:5]}")
    return report


def assert_ok(report: Report) -> None:
    assert not report.problems, "\n".join(report.problems)
