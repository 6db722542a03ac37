"""The TLS, WebSocket and secure WebSocket listeners, with real clients.

One broker for the module serves all four listeners (TCP, TLS with client
certificates optional, WS, WSS); a second one requires client certificates.
The certificates are made here with ``cryptography``: a CA, a server
certificate for 127.0.0.1/localhost, and client certificates from that CA and
from a stranger CA. Clients: paho-mqtt (TCP, TLS, ``transport="websockets"``
over ws and wss), mosquitto_pub/mosquitto_sub with ``--cafile``, the
``websockets`` package for raw WebSocket checks, and ssl sockets.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import ssl
import subprocess
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

from broker.codec import PacketDecoder, encode
from broker.packets import ConnAck, Connect
from edge.websocket import OP_BINARY, OP_PING, OP_PONG, OP_TEXT, encode_frame
from tests.conftest import free_port
from tests.e2e.conftest import HOST, BrokerProcess, devicemq_only, start_broker
from tests.pki import Pki, make_pki

pytestmark = [pytest.mark.e2e, devicemq_only("TLS/WebSocket listeners configured by devicemq")]

TIMEOUT = 5.0


# ------------------------------------------------------------------ brokers


@dataclass
class Listeners:
    broker: BrokerProcess
    tcp: int
    tls: int
    ws: int
    wss: int


def _start(directory: Path, pki: Pki, **extra: object) -> Listeners:
    tls, ws, wss = free_port(HOST), free_port(HOST), free_port(HOST)
    settings: dict[str, object] = {
        "persistence.enabled": False,
        "tls.enabled": True,
        "tls.host": HOST,
        "tls.port": tls,
        "tls.certfile": pki.server_cert,
        "tls.keyfile": pki.server_key,
        "tls.cafile": pki.ca,
        "websocket.enabled": True,
        "websocket.host": HOST,
        "websocket.port": ws,
        "websocket_tls.enabled": True,
        "websocket_tls.host": HOST,
        "websocket_tls.port": wss,
    }
    settings.update(extra)
    broker = start_broker(directory, settings)
    for port in (tls, ws, wss):
        _wait_port(port)
    return Listeners(broker, broker.port, tls, ws, wss)


def _wait_port(port: int) -> None:
    deadline = time.monotonic() + TIMEOUT
    while True:
        with socket.socket() as s:
            if s.connect_ex((HOST, port)) == 0:
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing listens on {port}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def listeners(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[Listeners]:
    started = _start(tmp_path_factory.mktemp("listeners"), pki)
    try:
        yield started
    finally:
        started.broker.stop()
    assert "Traceback" not in started.broker.log(), started.broker.log()[-4000:]


@pytest.fixture(scope="module")
def mutual(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[Listeners]:
    started = _start(tmp_path_factory.mktemp("mutual"), pki, **{"tls.require_certificate": True})
    try:
        yield started
    finally:
        started.broker.stop()


# ------------------------------------------------------------------ a small paho wrapper


class Client:
    def __init__(
        self,
        port: int,
        *,
        transport: str = "tcp",
        tls: ssl.SSLContext | None = None,
        version: int = mqtt.MQTTv5,
        client_id: str | None = None,
    ) -> None:
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id or f"t-{uuid.uuid4().hex[:10]}",
            protocol=MQTTProtocolVersion(version),
            transport=transport,  # type: ignore[arg-type]
            reconnect_on_failure=False,
        )
        if tls is not None:
            self.client.tls_set_context(tls)
        self.messages: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self.connacks: queue.Queue[Any] = queue.Queue()
        self.subacks: queue.Queue[Any] = queue.Queue()
        self.client.on_connect = lambda c, u, f, rc, p=None: self.connacks.put(rc)
        self.client.on_message = lambda c, u, m: self.messages.put(m)
        self.client.on_subscribe = lambda c, u, mid, rcs, p=None: self.subacks.put(rcs)
        self.client.connect(HOST, port, keepalive=30)
        self.client.loop_start()
        rc = self.connacks.get(timeout=TIMEOUT)
        assert not rc.is_failure, rc

    def subscribe(self, topic: str, qos: int = 1) -> None:
        self.client.subscribe(topic, qos)
        codes = self.subacks.get(timeout=TIMEOUT)
        assert all(not c.is_failure for c in codes), codes

    def publish(self, topic: str, payload: bytes, qos: int = 1) -> None:
        info = self.client.publish(topic, payload, qos)
        info.wait_for_publish(TIMEOUT)
        assert info.is_published()

    def get(self) -> mqtt.MQTTMessage:
        return self.messages.get(timeout=TIMEOUT)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.disconnect()
        self.client.loop_stop()


@contextlib.contextmanager
def client(port: int, **kw: Any) -> Iterator[Client]:
    c = Client(port, **kw)
    try:
        yield c
    finally:
        c.close()


def client_context(pki: Pki, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca))
    if cert is not None:
        context.load_cert_chain(str(cert), str(key))
    return context


def _topic(suffix: str) -> str:
    return f"listeners/{uuid.uuid4().hex[:8]}/{suffix}"


# ------------------------------------------------------------------ the tests


@pytest.mark.parametrize("version", [mqtt.MQTTv311, mqtt.MQTTv5], ids=["v311", "v5"])
def test_every_listener_feeds_the_same_sessions(
    listeners: Listeners, pki: Pki, version: int
) -> None:
    """A message published on each listener reaches subscribers on every listener."""
    tls = client_context(pki)
    kinds: dict[str, tuple[int, dict[str, Any]]] = {
        "tcp": (listeners.tcp, {}),
        "tls": (listeners.tls, {"tls": tls}),
        "ws": (listeners.ws, {"transport": "websockets"}),
        "wss": (listeners.wss, {"transport": "websockets", "tls": tls}),
    }
    topic = _topic("all")
    with contextlib.ExitStack() as stack:
        made = {
            name: stack.enter_context(client(port, version=version, **kw))
            for name, (port, kw) in kinds.items()
        }
        for c in made.values():
            c.subscribe(topic + "/#")
        for name, c in made.items():
            c.publish(f"{topic}/{name}", f"from {name}".encode() * 100)
        for receiver in made.values():
            got = sorted(receiver.get().payload for _ in made)
            assert got == sorted(f"from {name}".encode() * 100 for name in made)


def test_large_messages_over_websockets(listeners: Listeners, pki: Pki) -> None:
    """Packets bigger than one 64 KiB frame length field, both directions, ws and wss."""
    topic = _topic("big")
    payload = bytes(range(256)) * 2000  # 512000 bytes
    with (
        client(listeners.ws, transport="websockets") as ws,
        client(listeners.wss, transport="websockets", tls=client_context(pki)) as wss,
    ):
        ws.subscribe(topic)
        wss.publish(topic, payload)
        assert ws.get().payload == payload


def test_tls_client_certificate_optional_but_verified(listeners: Listeners, pki: Pki) -> None:
    """With cafile set, a certificate from the CA is accepted, a stranger's refused."""
    with client(listeners.tls, tls=client_context(pki, pki.client_cert, pki.client_key)) as c:
        c.subscribe(_topic("cert"))
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        bad = client_context(pki, pki.stranger_cert, pki.stranger_key)
        _tls_handshake(listeners.tls, bad)


def test_tls_require_certificate(mutual: Listeners, pki: Pki) -> None:
    with client(mutual.tls, tls=client_context(pki, pki.client_cert, pki.client_key)) as c:
        c.subscribe(_topic("mutual"))
    for context in (client_context(pki), client_context(pki, pki.stranger_cert, pki.stranger_key)):
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            _tls_handshake(mutual.tls, context)
    # the same rule on the secure WebSocket listener
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        _tls_handshake(mutual.wss, client_context(pki))
    assert mutual.broker.alive()


def _tls_handshake(port: int, context: ssl.SSLContext) -> None:
    """Handshake, then one CONNECT/CONNACK (TLS 1.3 reports a refused client
    certificate only on the first read)."""
    with (
        socket.create_connection((HOST, port), timeout=TIMEOUT) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        tls.sendall(encode(Connect("hs", protocol_level=4), 4))
        data = tls.recv(64)
        if not data:
            raise ConnectionError("closed by the server")
        assert isinstance(PacketDecoder(protocol_level=4).feed(data)[0], ConnAck)


def test_tls_refuses_old_protocol_versions(listeners: Listeners, pki: Pki) -> None:
    context = client_context(pki)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        context.minimum_version = ssl.TLSVersion.MINIMUM_SUPPORTED
        context.maximum_version = ssl.TLSVersion.TLSv1_1
    with contextlib.suppress(ssl.SSLError, ValueError):
        context.set_ciphers("ALL:@SECLEVEL=0")
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        _tls_handshake(listeners.tls, context)
    # ...while TLS 1.2 and 1.3 both work
    for version in (ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3):
        context = client_context(pki)
        context.minimum_version = context.maximum_version = version
        _tls_handshake(listeners.tls, context)


def test_plain_mqtt_on_the_tls_port_is_closed(listeners: Listeners) -> None:
    with socket.create_connection((HOST, listeners.tls), timeout=TIMEOUT) as s:
        s.sendall(encode(Connect("plain", protocol_level=4), 4))
        got = _read_until_closed(s)  # a TLS alert perhaps, then EOF; never a CONNACK
        assert not got.startswith(b"\x20")
    assert listeners.broker.alive()


def _read_until_closed(s: socket.socket) -> bytes:
    got = b""
    with contextlib.suppress(OSError):
        while chunk := s.recv(4096):
            got += chunk
    return got


@pytest.mark.parametrize("version", ["mqttv311", "mqttv5"])
def test_mosquitto_clients_over_tls(listeners: Listeners, pki: Pki, version: str) -> None:
    topic = _topic("mosq")
    common = ["-h", "localhost", "-p", str(listeners.tls), "--cafile", str(pki.ca), "-V", version]
    sub = subprocess.Popen(
        ["mosquitto_sub", *common, "-t", topic, "-C", "1", "-q", "1", "-W", "10"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:  # publish until the subscriber, once subscribed, gets one
            subprocess.run(
                ["mosquitto_pub", *common, "-t", topic, "-m", "over tls", "-q", "1"],
                check=True,
                timeout=TIMEOUT,
            )
            try:
                out, err = sub.communicate(timeout=0.3)
                break
            except subprocess.TimeoutExpired:
                assert time.monotonic() < deadline, "mosquitto_sub got nothing"
        assert out.decode().strip() == "over tls", err
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.wait()
    # with a client certificate too (mosquitto_pub --cert/--key)
    subprocess.run(
        [
            "mosquitto_pub",
            *common,
            "--cert",
            str(pki.client_cert),
            "--key",
            str(pki.client_key),
            "-t",
            topic,
            "-m",
            "x",
        ],
        check=True,
        timeout=TIMEOUT,
    )


# ------------------------------------------------------------------ raw WebSockets


def _ws_upgrade(port: int, headers: dict[str, str]) -> tuple[bytes, socket.socket]:
    s = socket.create_connection((HOST, port), timeout=TIMEOUT)
    lines = ["GET /mqtt HTTP/1.1"] + [f"{k}: {v}" for k, v in headers.items()]
    s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = s.recv(4096)
        if not chunk:
            break
        got += chunk
    return got, s


GOOD_HEADERS = {
    "Host": "localhost",
    "Upgrade": "websocket",
    "Connection": "Upgrade",
    "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
    "Sec-WebSocket-Version": "13",
    "Sec-WebSocket-Protocol": "mqtt",
}


def test_websocket_handshake_answer(listeners: Listeners) -> None:
    response, s = _ws_upgrade(listeners.ws, GOOD_HEADERS)
    with s:
        assert response.startswith(b"HTTP/1.1 101 ")
        assert b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=" in response
        assert b"Sec-WebSocket-Protocol: mqtt" in response
        mask = b"\x01\x02\x03\x04"
        # a ping is answered with a pong carrying the same payload
        s.sendall(encode_frame(OP_PING, b"hello", mask=mask))
        assert _recv_exact(s, 7) == encode_frame(OP_PONG, b"hello")
        # CONNECT split over two binary frames (fragmented message) -> CONNACK in a binary frame
        connect = encode(Connect("ws-raw", protocol_level=4), 4)
        s.sendall(encode_frame(OP_BINARY, connect[:5], fin=False, mask=mask))
        s.sendall(encode_frame(0, connect[5:], fin=True, mask=mask))
        frame = _recv_exact(s, 6)
        assert frame[0] == 0x82 and frame[1] == 4
        assert isinstance(PacketDecoder(protocol_level=4).feed(frame[2:])[0], ConnAck)
        # a text frame is not MQTT: close 1003 and the socket ends
        s.sendall(encode_frame(OP_TEXT, b"hi", mask=mask))
        closing = _read_until_closed(s)
        assert closing[0] == 0x88 and closing[2:4] == b"\x03\xeb"  # close, code 1003


@pytest.mark.parametrize(
    ("change", "status"),
    [
        ({"Sec-WebSocket-Protocol": None}, b"400"),
        ({"Sec-WebSocket-Protocol": "mqttv3.1"}, b"400"),
        ({"Sec-WebSocket-Version": "8"}, b"426"),
        ({"Sec-WebSocket-Key": "short"}, b"400"),
        ({"Upgrade": None}, b"400"),
    ],
)
def test_websocket_bad_handshakes(
    listeners: Listeners, change: dict[str, str | None], status: bytes
) -> None:
    headers = {**GOOD_HEADERS, **change}
    response, s = _ws_upgrade(listeners.ws, {k: v for k, v in headers.items() if v is not None})
    with s:
        assert response.split(b" ")[1] == status, response
        _read_until_closed(s)


def test_websockets_library_client(listeners: Listeners) -> None:
    """An independent WebSocket implementation (the websockets package) interoperates."""
    from websockets.sync import client as sync_client

    with sync_client.connect(
        f"ws://{HOST}:{listeners.ws}/mqtt", subprotocols=["mqtt"], open_timeout=TIMEOUT
    ) as ws:
        assert ws.subprotocol == "mqtt"
        ws.send(encode(Connect("ws-lib", protocol_level=5), 5))
        reply = ws.recv(timeout=TIMEOUT)
        assert isinstance(reply, bytes)
        connack = PacketDecoder(protocol_level=5).feed(reply)[0]
        assert isinstance(connack, ConnAck) and connack.reason_code == 0


def _recv_exact(s: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        chunk = s.recv(n - len(got))
        if not chunk:
            raise AssertionError(f"closed after {got!r}")
        got += chunk
    return got
