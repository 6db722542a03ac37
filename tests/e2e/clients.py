"""Test-side MQTT clients: paho-mqtt wrapped for blocking tests, and a raw socket.

``Paho`` runs one real paho-mqtt 2.x client per network connection (a fresh
``paho.mqtt.client.Client`` on every ``connect``, its own network thread, no
automatic reconnect) and turns its callbacks into queues a test can wait on.

``Raw`` speaks MQTT through ``broker.codec`` over a plain socket, for what
paho will not do: stay silent past the keep-alive, leave messages
unacknowledged, send malformed or forbidden packets, announce a tiny Receive
Maximum and then hold back the PUBACKs.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties as PahoProperties
from paho.mqtt.subscribeoptions import SubscribeOptions

from broker.codec import PacketDecoder, encode
from broker.packets import Connect, Disconnect, Packet, PingReq

TIMEOUT = 10.0  # longest wait for something that should happen (5 s was met late under CI load)
QUIET = 0.5  # how long "nothing arrives" is watched, where no barrier can be used

V5 = mqtt.MQTTv5
V311 = mqtt.MQTTv311

__all__ = [
    "QUIET",
    "TIMEOUT",
    "V5",
    "V311",
    "Connack",
    "Paho",
    "Raw",
    "SubscribeOptions",
    "props",
]


def props(packet_type: int, **values: Any) -> PahoProperties:
    """paho Properties for ``packet_type`` (PacketTypes.PUBLISH, ...), e.g.
    ``props(PacketTypes.PUBLISH, UserProperty=[("a", "1")], MessageExpiryInterval=2)``."""
    p = PahoProperties(packet_type)
    for name, value in values.items():
        setattr(p, name, value)
    return p


@dataclass
class Connack:
    reason_code: int
    session_present: bool
    properties: PahoProperties | None

    def prop(self, name: str, default: Any = None) -> Any:
        return getattr(self.properties, name, default) if self.properties else default


@dataclass
class Disconnected:
    reason_code: int
    from_server: bool  # the server sent a DISCONNECT packet (v5)
    properties: PahoProperties | None


@dataclass
class _Waiter:
    event: threading.Event = field(default_factory=threading.Event)
    result: Any = None


class Paho:
    """One paho-mqtt client identity; each ``connect`` is a new network connection."""

    def __init__(
        self,
        broker: Any,
        client_id: str = "",
        version: int = V5,
        name: str = "",
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        self.host, self.port = broker.address
        self.client_id = client_id
        self.username = username
        self.password = password
        self.version = version
        self.name = name or client_id or "paho"
        self.messages: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self.disconnects: queue.Queue[Disconnected] = queue.Queue()
        self.client: mqtt.Client | None = None
        self._connack: _Waiter | None = None
        self._acks: dict[int, _Waiter] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()

    # -- connection ---------------------------------------------------------------------

    def connect(
        self,
        clean_start: bool = True,
        keepalive: int = 30,
        properties: PahoProperties | None = None,
        will: tuple[str, bytes, int, bool] | None = None,
        will_properties: PahoProperties | None = None,
        timeout: float = TIMEOUT,
        bind_address: str = "",
    ) -> Connack:
        """Open a connection and wait for CONNACK (whatever its reason code).

        ``bind_address`` is the local address to connect from, e.g. ``127.0.0.2``:
        any 127.x.y.z is loopback on Linux, so tests can play several sources.
        """
        self.close()
        v5 = self.version == V5
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            protocol=self.version,
            clean_session=None if v5 else clean_start,
            reconnect_on_failure=False,
        )
        client.on_connect = self._on_connect
        client.on_message = self._on_message
        client.on_subscribe = self._on_subscribe
        client.on_unsubscribe = self._on_unsubscribe
        client.on_disconnect = self._on_disconnect
        client.on_publish = self._on_publish
        if self.username is not None:
            client.username_pw_set(self.username, self.password)
        if will is not None:
            topic, payload, qos, retain = will
            client.will_set(topic, payload, qos, retain, properties=will_properties)
        self.client = client
        self._connack = waiter = _Waiter()
        self._closed = threading.Event()
        self.disconnects = queue.Queue()  # only this connection's ending counts
        if v5:
            client.connect(
                self.host,
                self.port,
                keepalive,
                bind_address=bind_address,
                clean_start=clean_start,
                properties=properties,
            )
        else:
            client.connect(self.host, self.port, keepalive, bind_address=bind_address)
        client.loop_start()
        if not waiter.event.wait(timeout):
            self.close()
            raise AssertionError(f"{self.name}: no CONNACK within {timeout} s")
        connack: Connack = waiter.result
        return connack

    def disconnect(
        self, reason_code: int | None = None, properties: PahoProperties | None = None
    ) -> None:
        """A normal DISCONNECT, then wait for the network thread to finish."""
        client = self.client
        if client is None:
            return
        rc = None
        if reason_code is not None:
            rc = mqtt.ReasonCode(PacketTypes.DISCONNECT, identifier=reason_code)
        client.disconnect(rc, properties)
        self._finish(client)

    def terminate(self) -> None:
        """Drop the TCP connection without DISCONNECT (an abnormal end: the will is due)."""
        client = self.client
        if client is None:
            return
        sock = client.socket()
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._finish(client)

    def close(self) -> None:
        """Whatever state it is in, leave nothing running (used by cleanup)."""
        client = self.client
        if client is None:
            return
        if client.is_connected():
            client.disconnect()
        self._finish(client)

    def _finish(self, client: mqtt.Client) -> None:
        client.loop_stop()
        with contextlib.suppress(Exception):
            sock = client.socket()
            if sock is not None:
                sock.close()
        self.client = None

    def wait_disconnected(self, timeout: float = TIMEOUT) -> Disconnected:
        """The connection ended from the server side (DISCONNECT packet or closed socket)."""
        try:
            return self.disconnects.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.name}: still connected after {timeout} s") from None

    @property
    def connected(self) -> bool:
        return self.client is not None and self.client.is_connected()

    # -- operations ---------------------------------------------------------------------

    def subscribe(
        self,
        topic: str | list[tuple[str, Any]],
        qos: int | SubscribeOptions = 2,
        properties: PahoProperties | None = None,
    ) -> list[int]:
        """SUBSCRIBE and wait for the SUBACK; returns its reason codes (granted QoS / 0x80+)."""
        client = self._client()
        subscriptions: Any = topic if isinstance(topic, list) else [(topic, qos)]
        waiter = _Waiter()
        with self._lock:
            if self.version == V5:
                rc, mid = client.subscribe(subscriptions, properties=properties)
            else:
                rc, mid = client.subscribe(subscriptions)
            assert rc == mqtt.MQTT_ERR_SUCCESS, f"subscribe failed locally: {rc}"
            self._acks[mid] = waiter
        return self._wait(waiter, "SUBACK")  # type: ignore[no-any-return]

    def unsubscribe(self, topics: str | list[str]) -> list[int]:
        """UNSUBSCRIBE and wait for UNSUBACK; returns its v5 reason codes ([] for 3.1.1)."""
        client = self._client()
        waiter = _Waiter()
        with self._lock:
            rc, mid = client.unsubscribe(topics)
            assert rc == mqtt.MQTT_ERR_SUCCESS, f"unsubscribe failed locally: {rc}"
            self._acks[mid] = waiter
        return self._wait(waiter, "UNSUBACK")  # type: ignore[no-any-return]

    def publish(
        self,
        topic: str,
        payload: bytes | str = b"",
        qos: int = 0,
        retain: bool = False,
        properties: PahoProperties | None = None,
        wait: bool = True,
    ) -> int | None:
        """PUBLISH; with ``wait`` block until the QoS flow completes.

        Returns the v5 reason code of the PUBACK/PUBREC (None for QoS 0 or 3.1.1).
        """
        client = self._client()
        waiter = _Waiter()
        with self._lock:
            info = client.publish(topic, payload, qos, retain, properties)
            if not wait and info.rc == mqtt.MQTT_ERR_NO_CONN:
                return None  # the server closed the connection first (see wait_disconnected)
            assert info.rc == mqtt.MQTT_ERR_SUCCESS, f"publish failed locally: {info.rc}"
            if qos:
                self._acks[info.mid] = waiter
        if not wait:
            return None
        if qos == 0:
            info.wait_for_publish(TIMEOUT)
            assert info.is_published(), f"{self.name}: QoS 0 PUBLISH not written"
            return None
        return self._wait(waiter, f"acknowledgement of QoS {qos} PUBLISH")  # type: ignore[no-any-return]

    def get(self, timeout: float = TIMEOUT) -> mqtt.MQTTMessage:
        try:
            return self.messages.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.name}: no message within {timeout} s") from None

    def get_n(self, n: int, timeout: float = TIMEOUT) -> list[mqtt.MQTTMessage]:
        deadline = time.monotonic() + timeout
        got = []
        for _ in range(n):
            left = deadline - time.monotonic()
            try:
                got.append(self.messages.get(timeout=max(left, 0.001)))
            except queue.Empty:
                raise AssertionError(
                    f"{self.name}: {len(got)} of {n} messages within {timeout} s: "
                    f"{[(m.topic, m.payload) for m in got]}"
                ) from None
        return got

    def get_optional(self, timeout: float = QUIET) -> list[mqtt.MQTTMessage]:
        """The next message if one arrives within ``timeout``, as a list of 0 or 1."""
        try:
            return [self.messages.get(timeout=timeout)]
        except queue.Empty:
            return []

    def assert_no_message(self, timeout: float = QUIET) -> None:
        try:
            m = self.messages.get(timeout=timeout)
        except queue.Empty:
            return
        raise AssertionError(f"{self.name}: unexpected message {m.topic!r} {m.payload!r}")

    def drain(self) -> list[mqtt.MQTTMessage]:
        got = []
        while True:
            try:
                got.append(self.messages.get_nowait())
            except queue.Empty:
                return got

    def until(self, marker_topic: str, timeout: float = TIMEOUT) -> list[mqtt.MQTTMessage]:
        """Every message before the first one on ``marker_topic`` (a barrier).

        The broker keeps one publisher's messages in order for a subscriber, so
        once the marker arrives anything published before it has arrived too.
        Publish the marker at QoS 2: paho hands a QoS 2 message over only when
        PUBREL arrives, so a QoS 1 marker could overtake an earlier QoS 2 message.
        """
        got = []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                m = self.messages.get(timeout=max(left, 0.001))
            except queue.Empty:
                raise AssertionError(
                    f"{self.name}: marker {marker_topic!r} not received; got "
                    f"{[(m.topic, m.payload) for m in got]}"
                ) from None
            if m.topic == marker_topic:
                return got
            got.append(m)

    # -- internals ------------------------------------------------------------------------

    def _client(self) -> mqtt.Client:
        assert self.client is not None, f"{self.name} is not connected"
        return self.client

    def _wait(self, waiter: _Waiter, what: str) -> Any:
        if not waiter.event.wait(TIMEOUT):
            raise AssertionError(f"{self.name}: no {what} within {TIMEOUT} s")
        return waiter.result

    def _complete(self, mid: int, result: Any) -> None:
        with self._lock:
            waiter = self._acks.pop(mid, None)
        if waiter is not None:
            waiter.result = result
            waiter.event.set()

    def _on_connect(self, client: Any, userdata: Any, flags: Any, rc: Any, properties: Any) -> None:
        waiter = self._connack
        if waiter is not None:
            waiter.result = Connack(rc.value, bool(flags.session_present), properties)
            waiter.event.set()

    def _on_message(self, client: Any, userdata: Any, message: mqtt.MQTTMessage) -> None:
        self.messages.put(message)

    def _on_subscribe(
        self, client: Any, userdata: Any, mid: int, reason_codes: Any, properties: Any
    ) -> None:
        self._complete(mid, [rc.value for rc in reason_codes])

    def _on_unsubscribe(
        self, client: Any, userdata: Any, mid: int, reason_codes: Any, properties: Any
    ) -> None:
        self._complete(mid, [rc.value for rc in reason_codes] if self.version == V5 else [])

    def _on_publish(
        self, client: Any, userdata: Any, mid: int, reason_code: Any, properties: Any
    ) -> None:
        self._complete(mid, reason_code.value if self.version == V5 else None)

    def _on_disconnect(
        self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any
    ) -> None:
        self.disconnects.put(
            Disconnected(reason_code.value, flags.is_disconnect_packet_from_server, properties)
        )
        self._closed.set()


class Raw:
    """A hand-driven MQTT client over a plain socket, using devicemq's codec."""

    def __init__(self, broker: Any, level: int = 5, source: str | None = None) -> None:
        """``source``: the local address to connect from (any 127.x.y.z on Linux)."""
        self.level = level
        self.sock = socket.create_connection(
            broker.address, timeout=TIMEOUT, source_address=(source, 0) if source else None
        )
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.decoder = PacketDecoder(protocol_level=level)
        self._pending: list[Packet] = []
        self.eof = False

    def __enter__(self) -> Raw:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def send(self, packet: Packet) -> None:
        self.sock.sendall(encode(packet, self.level))

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(data)

    def connect(self, client_id: str = "", timeout: float = TIMEOUT, **kwargs: Any) -> Packet:
        """Send CONNECT and return the broker's CONNACK (within ``timeout``)."""
        self.send(Connect(client_id, protocol_level=self.level, **kwargs))
        return self.recv(timeout)

    def recv(self, timeout: float = TIMEOUT) -> Packet:
        """The next packet; AssertionError if none within ``timeout`` or the socket closed."""
        packet = self.recv_or_none(timeout)
        if packet is None:
            raise AssertionError(
                "connection closed by the broker" if self.eof else f"no packet within {timeout} s"
            )
        return packet

    def recv_or_none(self, timeout: float = TIMEOUT) -> Packet | None:
        deadline = time.monotonic() + timeout
        while not self._pending:
            if self.eof:
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return None
            except ConnectionResetError:
                data = b""
            if not data:
                self.eof = True
                continue
            self._pending.extend(self.decoder.feed(data))
        return self._pending.pop(0)

    def expect_close(self, timeout: float = TIMEOUT) -> list[Packet]:
        """Read until the broker closes the connection; return what came before."""
        got = []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            packet = self.recv_or_none(max(left, 0.0))
            if packet is None:
                if self.eof:
                    return got
                raise AssertionError(
                    f"broker did not close the connection within {timeout} s; got {got}"
                )
            got.append(packet)

    def read_until_close(self, timeout: float = TIMEOUT) -> bytes:
        """Raw bytes until the broker closes (for answers this decoder cannot parse)."""
        data = bytearray()
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"broker did not close within {timeout} s; got {data!r}")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                self.eof = True
                return bytes(data)
            data += chunk

    def ping(self) -> None:
        self.send(PingReq())

    def disconnect(self, reason_code: int = 0) -> None:
        with contextlib.suppress(OSError):
            self.send(Disconnect(reason_code))
        self.close()
