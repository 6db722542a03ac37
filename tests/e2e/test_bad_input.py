"""Malformed and forbidden input over a raw socket.

Each bad packet must end THAT connection with the reason the spec gives (a v5
DISCONNECT reason code, a CONNACK code, or a plain close for 3.1.1, which has
no server DISCONNECT), while a well-behaved paho client connected alongside
keeps publishing and receiving as if nothing happened.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import pytest

from broker.codec import encode, encode_remaining_length
from broker.packets import (
    ConnAck,
    Connect,
    Disconnect,
    PingReq,
    Properties,
    Publish,
    PubRel,
    Subscribe,
    Subscription,
    Will,
)
from tests.e2e.clients import Paho
from tests.e2e.conftest import devicemq_only, is_mosquitto

pytestmark = pytest.mark.e2e

MALFORMED = 0x81
PROTOCOL_ERROR = 0x82


class Bystander:
    """A paho client that must not notice anything: it echoes messages to itself."""

    def __init__(self, client: Paho, topic: str) -> None:
        self.client = client
        self.topic = topic
        self.n = 0
        client.connect()
        client.subscribe(topic, 1)

    def check(self) -> None:
        for qos in (0, 1, 2):
            self.n += 1
            payload = f"still fine {self.n}".encode()
            self.client.publish(self.topic, payload, qos)
            m = self.client.get()
            assert m.payload == payload, "the bystander lost a message"
        assert self.client.connected


@pytest.fixture
def bystander(broker, clients, names) -> Bystander:
    b = Bystander(clients.paho(broker, names.client("bystander")), names.topic("bystander"))
    b.check()
    return b


def frame(first_byte: int, body: bytes) -> bytes:
    return bytes((first_byte,)) + encode_remaining_length(len(body)) + body


def with_first_byte(data: bytes, first_byte: int) -> bytes:
    return bytes((first_byte,)) + data[1:]


def publish_bytes(level: int, topic: str = "t/x", qos: int = 1, packet_id: int | None = 1) -> bytes:
    return encode(Publish(topic, b"payload", qos, packet_id=packet_id if qos else None), level)


# name -> (bytes to send after a successful CONNECT at a level, v5 reason code)
BAD_PACKETS: dict[str, tuple[Callable[[int], bytes], int]] = {
    # a Variable Byte Integer of five bytes (1.5.5)
    "remaining-length-5-bytes": (lambda lv: b"\x30\xff\xff\xff\xff\x01", MALFORMED),
    # SUBSCRIBE must have flags 0b0010 (MQTT-3.8.1-1)
    "subscribe-reserved-flags": (
        lambda lv: with_first_byte(encode(Subscribe(1, [Subscription("t/x", 1)]), lv), 0x80),
        MALFORMED,
    ),
    # PUBREL must have flags 0b0010 (MQTT-3.6.1-1)
    "pubrel-reserved-flags": (lambda lv: with_first_byte(encode(PubRel(1), lv), 0x60), MALFORMED),
    # PINGREQ flags must be 0
    "pingreq-reserved-flags": (lambda lv: with_first_byte(encode(PingReq(), lv), 0xC1), MALFORMED),
    # QoS bits 11 (MQTT-3.3.1-4)
    "publish-qos-3": (lambda lv: with_first_byte(publish_bytes(lv), 0x36), MALFORMED),
    # DUP on QoS 0 (MQTT-3.3.1-2)
    "publish-qos0-dup": (lambda lv: with_first_byte(publish_bytes(lv, qos=0), 0x38), MALFORMED),
    # packet identifier 0 (MQTT-2.2.1-3)
    "publish-packet-id-0": (lambda lv: publish_bytes(lv, packet_id=0), MALFORMED),
    "subscribe-packet-id-0": (
        lambda lv: encode(Subscribe(0, [Subscription("t/x", 1)]), lv),
        MALFORMED,
    ),
    # wildcards in a topic name (MQTT-3.3.2-2)
    "publish-wildcard-plus": (lambda lv: publish_bytes(lv, topic="t/+/x"), 0x90),
    "publish-wildcard-hash": (lambda lv: publish_bytes(lv, topic="t/#"), 0x90),
    # a topic name that is not UTF-8 (MQTT-1.5.4-1)
    "publish-topic-not-utf8": (
        lambda lv: frame(0x30, b"\x00\x03t/\xff" + (b"\x00" if lv == 5 else b"") + b"x"),
        MALFORMED,
    ),
    # U+0000 in a topic (MQTT-1.5.4-2)
    "publish-topic-nul": (lambda lv: publish_bytes(lv, topic="t/\x00"), MALFORMED),
    # a SUBSCRIBE without any topic filter (MQTT-3.8.3-2)
    "subscribe-no-filters": (lambda lv: encode(Subscribe(5, []), lv), PROTOCOL_ERROR),
    # a second CONNECT (MQTT-3.1.0-2)
    "second-connect": (lambda lv: encode(Connect("again", protocol_level=lv), lv), PROTOCOL_ERROR),
    # packets only a server sends
    "client-sends-connack": (lambda lv: encode(ConnAck(False, 0), lv), PROTOCOL_ERROR),
    # packet type 0 is reserved (2.1.2)
    "packet-type-0": (lambda lv: b"\x00\x00", MALFORMED),
}


# reference-broker leniency, so the mosquitto run checks the rest
MOSQUITTO_ACCEPTS = {"pingreq-reserved-flags", "publish-qos0-dup"}


@pytest.mark.parametrize("level", [5, 4], ids=["v5", "v311"])
@pytest.mark.parametrize("case", list(BAD_PACKETS))
def test_bad_packet_closes_only_that_connection(broker, clients, names, bystander, case, level):
    """A malformed or forbidden packet after CONNECT: v5 gets DISCONNECT with the
    spec's reason code, 3.1.1 a closed socket; the bystander sees nothing."""
    build, reason = BAD_PACKETS[case]
    if is_mosquitto() and case in MOSQUITTO_ACCEPTS:
        pytest.skip(f"mosquitto 2.0.11 accepts {case}")
    raw = clients.raw(broker, level)
    assert raw.connect(names.client("bad")).reason_code == 0
    raw.send_bytes(build(level))
    after = raw.expect_close()
    if is_mosquitto():  # closes, with or without saying why
        assert all(isinstance(p, Disconnect) and p.reason_code >= 0x80 for p in after), after
    elif level == 5:
        assert after == [Disconnect(reason)], (after, hex(reason))
    else:
        assert after == []
    bystander.check()


@pytest.mark.parametrize("level", [5, 4], ids=["v5", "v311"])
def test_packet_above_maximum_size(broker_factory, clients, names, level):
    """A packet larger than the Maximum Packet Size the server announced ends the
    connection with 0x95 Packet too large (MQTT-3.2.2-15 / 4.13); the check is on
    the fixed header, so the body is never buffered."""
    server = broker_factory({"mqtt.max_packet_size": 1024})
    b = Bystander(clients.paho(server, names.client("bystander")), names.topic("bystander"))
    raw = clients.raw(server, level)
    ack = raw.connect(names.client("big"))
    if level == 5:
        assert ack.properties.maximum_packet_size == 1024
    raw.send_bytes(encode(Publish("t/big", b"x" * 2000, 1, packet_id=1), level))
    after = raw.expect_close()
    assert after == ([Disconnect(0x95)] if level == 5 else [])

    # only the header of a huge packet: refused at once, without waiting for the body
    raw = clients.raw(server, level)
    raw.connect(names.client("huge"))
    raw.send_bytes(b"\x32" + encode_remaining_length(100_000_000))
    after = raw.expect_close(timeout=3)
    assert after == ([Disconnect(0x95)] if level == 5 else [])
    b.check()


def test_garbage_before_connect(broker, clients, bystander):
    """Bytes that are not a CONNECT as the first packet close the connection without
    any answer (MQTT-3.1.0-1)."""
    for garbage in (
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"\x00\x00\x00\x00",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS ClientHello start
    ):
        raw = clients.raw(broker)
        raw.send_bytes(garbage)
        assert raw.expect_close() == [], garbage
    bystander.check()


@pytest.mark.parametrize("level", [5, 4], ids=["v5", "v311"])
def test_publish_before_connect(broker, clients, bystander, level):
    """A PUBLISH before CONNECT: closed, no CONNACK, nothing routed (MQTT-3.1.0-1)."""
    raw = clients.raw(broker, level)
    raw.send_bytes(encode(Publish(bystander.topic, b"sneaky", 0), level))
    assert raw.expect_close() == []
    bystander.client.assert_no_message(0.3)
    bystander.check()


@pytest.mark.parametrize("level", [6, 2, 0], ids=["level6", "level2", "level0"])
def test_unsupported_protocol_level(broker, clients, bystander, level):
    """An unknown protocol level is refused: CONNACK 0x01 (3.1.1) / 0x84 (5.0),
    then close (MQTT-3.1.2-2)."""
    data = bytearray(encode(Connect("unsupported", protocol_level=4), 4))
    assert data[2:8] == b"\x00\x04MQTT"
    data[8] = level
    raw = clients.raw(broker)
    raw.send_bytes(bytes(data))
    answer = raw.read_until_close()
    assert answer in (b"", b"\x20\x02\x00\x01", b"\x20\x03\x00\x84\x00"), answer
    if not is_mosquitto():
        assert answer == b"\x20\x02\x00\x01"  # the form every client version can read
    bystander.check()


@pytest.mark.parametrize("level", [5, 4], ids=["v5", "v311"])
def test_malformed_connect(broker, clients, bystander, level):
    """A CONNECT with the reserved flag set (MQTT-3.1.2-3) or a truncated payload
    is not accepted."""
    good = encode(Connect("reserved", protocol_level=level), level)
    flags_at = 9  # 0x10, length, 00 04 MQTT, level, flags
    reserved = bytearray(good)
    reserved[flags_at] |= 0x01
    truncated = frame(0x10, good[2:-3])
    for data in (bytes(reserved), truncated):
        raw = clients.raw(broker, level)
        raw.send_bytes(data)
        after = raw.read_until_close()
        assert not after.startswith(b"\x20\x02\x00\x00"), after  # not a success CONNACK
        if level == 4:
            assert after == b""
    bystander.check()


@devicemq_only("mqtt.connect_timeout is a devicemq setting")
def test_silent_socket_closed_after_connect_timeout(broker_factory, clients, names):
    """A socket that never sends CONNECT, or stops in the middle of one, is closed
    after mqtt.connect_timeout (spec 4.2: the server should close it)."""
    server = broker_factory({"mqtt.connect_timeout": 1})
    b = Bystander(clients.paho(server, names.client("bystander")), names.topic("bystander"))
    silent = clients.raw(server)
    partial = clients.raw(server)
    partial.send_bytes(encode(Connect("partial"), 5)[:7])
    start = time.monotonic()
    assert silent.expect_close(timeout=4) == []
    assert partial.expect_close(timeout=4) == []
    elapsed = time.monotonic() - start
    assert 0.8 <= elapsed <= 3.0, elapsed
    b.check()  # a connected client is not subject to the connect timeout


@pytest.mark.parametrize("level", [5, 4], ids=["v5", "v311"])
def test_keep_alive_violation(broker, clients, names, bystander, level):
    """Silent for 1.5 x keep-alive: v5 gets DISCONNECT 0x8D Keep Alive timeout, then
    the socket closes (MQTT-3.1.2-22), and the will is published."""
    will_topic = names.topic("will")
    watcher = clients.paho(broker, names.client("watcher"))
    watcher.connect()
    watcher.subscribe(will_topic, 1)
    raw = clients.raw(broker, level)
    will = Will(will_topic, b"gone quiet", 1)
    assert raw.connect(names.client("quiet"), keep_alive=1, will=will).reason_code == 0
    limit = 7.0 if is_mosquitto() else 3.5  # mosquitto checks keep-alive coarsely
    start = time.monotonic()
    after = raw.expect_close(timeout=limit + 1)
    assert 1.4 <= time.monotonic() - start <= limit
    if level == 5 and not is_mosquitto():
        assert after == [Disconnect(0x8D)]
    else:
        assert after in ([], [Disconnect(0x8D)])
    assert watcher.get().payload == b"gone quiet"
    bystander.check()


@pytest.mark.parametrize("version", [5, 4], ids=["v5", "v311"])
def test_session_takeover(broker, clients, names, bystander, version):
    """A second connection with the same client id takes over: the old one gets
    DISCONNECT 0x8E Session taken over (v5) and is closed (MQTT-3.1.4-3); the
    new one works."""
    cid = names.client("twin")
    topic = names.topic("twin")
    old = clients.paho(broker, cid, version=version)
    old.connect()
    new = clients.paho(broker, cid, version=version)
    assert new.connect().reason_code == 0
    gone = old.wait_disconnected()
    if version == 5 and not is_mosquitto():  # mosquitto 2.0.11 just closes
        assert gone.from_server and gone.reason_code == 0x8E, gone
    new.subscribe(topic, 1)
    new.publish(topic, b"mine now", 1)
    assert new.get().payload == b"mine now"
    assert new.connected
    bystander.check()


@devicemq_only("mosquitto 2.0.11 closes without DISCONNECT 0x8E")
def test_takeover_raw_sees_disconnect_then_close(broker, clients, names):
    """The same takeover seen on the wire: exactly one DISCONNECT 0x8E, then EOF."""
    cid = names.client("twin")
    old = clients.raw(broker)
    assert old.connect(cid).reason_code == 0
    new = clients.raw(broker)
    assert new.connect(cid).reason_code == 0
    assert old.expect_close() == [Disconnect(0x8E)]
    new.ping()
    assert new.recv().type.name == "PINGRESP"
    new.disconnect()


def test_abrupt_close_mid_packet(broker, clients, names, bystander):
    """A client that vanishes in the middle of a packet leaves the broker healthy
    and its will is published (the connection ended without DISCONNECT)."""
    will_topic = names.topic("will")
    watcher = clients.paho(broker, names.client("watcher"))
    watcher.connect()
    watcher.subscribe(will_topic, 1)
    raw = clients.raw(broker)
    raw.connect(names.client("vanish"), will=Will(will_topic, b"vanished", 1))
    raw.send_bytes(publish_bytes(5)[:5])
    raw.sock.shutdown(socket.SHUT_RDWR)
    raw.close()
    assert watcher.get().payload == b"vanished"
    bystander.check()


def test_will_with_invalid_topic_refused(broker, clients, names, bystander):
    """A will topic with a wildcard is refused at CONNECT (v5 CONNACK 0x90 or
    close; MQTT-3.1.3-11 requires a valid topic name)."""
    raw = clients.raw(broker)
    raw.send(Connect(names.client("w"), will=Will("t/+", b"x")))
    after = raw.expect_close()
    assert all(isinstance(p, ConnAck) and p.reason_code >= 0x80 for p in after), after
    bystander.check()


def test_disconnect_expiry_from_zero_is_protocol_error(broker, clients, names, bystander):
    """DISCONNECT may not set a Session Expiry when CONNECT had 0 (MQTT-3.14.2-2):
    the server answers DISCONNECT 0x82, and no session is kept."""
    cid = names.client("a")
    raw = clients.raw(broker)
    assert raw.connect(cid).reason_code == 0
    raw.send(Disconnect(0, Properties(session_expiry_interval=30)))
    assert raw.expect_close() == [Disconnect(PROTOCOL_ERROR)]
    raw = clients.raw(broker)
    assert raw.connect(cid, clean_start=False).session_present is False
    raw.disconnect()
    bystander.check()
