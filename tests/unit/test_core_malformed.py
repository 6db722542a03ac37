"""Malformed and forbidden input, and byte-stream framing (MQTT 5.0 spec 4.13, 1.5)."""

from __future__ import annotations

import pytest

from broker.codec import encode
from broker.packets import (
    Auth,
    ConnAck,
    Connect,
    Disconnect,
    PingReq,
    PingResp,
    Publish,
    ReasonCode,
    SubAck,
    Subscribe,
    Subscription,
    Will,
)
from tests.unit.core_harness import V5, V311, Harness, payloads

# Raw bytes sent after a valid CONNECT: 0x00 is a reserved packet type, 0x36 a
# PUBLISH with QoS 3, 0x60 a PUBREL without its required 0b0010 flags.
MALFORMED = {
    "reserved type": b"\x00\x00",
    "publish qos 3": b"\x36\x05\x00\x01t\x00\x01",
    "pubrel bad flags": b"\x60\x02\x00\x01",
    "bad utf-8 topic": b"\x30\x03\x00\x01\xff",
    "bad remaining length": b"\x30\xff\xff\xff\xff\x7f",
}


@pytest.mark.parametrize("raw", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_packet_v5_disconnect_0x81_others_unaffected(raw: bytes) -> None:
    """MQTT-4.13.1-1: on a Malformed Packet the server sends DISCONNECT 0x81 and closes;
    the will is published; other connections go on."""
    h = Harness()
    watcher = h.connected("watcher")
    watcher.subscribe("#")
    bad = h.connected("bad", will=Will("wills/bad", b"gone"))
    bad.send_raw(raw)
    assert bad.read() == [Disconnect(ReasonCode.MALFORMED_PACKET)]
    assert bad.closed
    assert payloads(watcher.read()) == [b"gone"]
    good = h.connected("good")
    good.publish("still/works", b"yes")
    assert payloads(watcher.read()) == [b"yes"]
    good.send(PingReq())
    assert good.read() == [PingResp()]


@pytest.mark.parametrize("raw", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_packet_v311_plain_close(raw: bytes) -> None:
    """3.1.1 MQTT-4.8.0-1: close the network connection, nothing sent."""
    h = Harness()
    bad = h.connected("bad", V311)
    bad.send_raw(raw)
    assert bad.read() == []
    assert bad.closed


def test_codec_protocol_error_gets_0x82() -> None:
    """A property repeated where it may appear once is a Protocol Error (2.2.2.2)."""
    c = Harness().connected("c")
    # PUBLISH "t" with Message Expiry Interval twice.
    props = b"\x02\x00\x00\x00\x01" * 2
    body = b"\x00\x01t" + bytes([len(props)]) + props
    c.send_raw(bytes([0x30, len(body)]) + body)
    assert c.read() == [Disconnect(ReasonCode.PROTOCOL_ERROR)]


def test_topic_alias_0_gets_0x94() -> None:
    c = Harness().connected("c")
    body = b"\x00\x01t" + b"\x03\x23\x00\x00"
    c.send_raw(bytes([0x30, len(body)]) + body)
    assert c.read() == [Disconnect(ReasonCode.TOPIC_ALIAS_INVALID)]


@pytest.mark.parametrize(
    "packet",
    [ConnAck(), SubAck(1, [0]), PingResp(), Auth()],
    ids=["CONNACK", "SUBACK", "PINGRESP", "AUTH"],
)
def test_server_only_packets_from_client_are_protocol_errors(packet: object) -> None:
    c = Harness().connected("c")
    c.send(packet)  # type: ignore[arg-type]
    assert c.read() == [Disconnect(ReasonCode.PROTOCOL_ERROR)]
    assert c.closed


def test_malformed_connect_closes_without_connack() -> None:
    h = Harness()
    c = h.client()
    raw = bytearray(encode(Connect("c"), V5))
    raw[raw.index(b"MQTT") + 5] |= 0x01  # reserved connect flag [MQTT-3.1.2-3]
    c.send_raw(bytes(raw))
    assert c.read() == []
    assert c.closed
    assert h.broker.sessions == {}


def test_unknown_protocol_name_closes() -> None:
    h = Harness()
    c = h.client()
    raw = encode(Connect("c", protocol_level=4), V311).replace(b"MQTT", b"MQTX")
    c.send_raw(raw)
    assert c.read() == []
    assert c.closed


def test_bytes_one_at_a_time_are_reassembled() -> None:
    """Packets may arrive split anywhere: the state machine buffers."""
    h = Harness()
    sub = h.connected("sub")
    sub.subscribe("t", qos=1)
    c = h.client()
    stream = (
        encode(Connect("pub"), V5)
        + encode(Publish("t", b"a" * 300, 1, False, False, 1), V5)
        + encode(PingReq(), V5)
    )
    for i in range(len(stream)):
        c.send_raw(stream[i : i + 1])
    kinds = [type(p).__name__ for p in c.read()]
    assert kinds == ["ConnAck", "PubAck", "PingResp"]
    assert payloads(sub.read()) == [b"a" * 300]


def test_many_packets_in_one_chunk() -> None:
    h = Harness()
    c = h.client()
    c.send_raw(
        encode(Connect("c"), V5)
        + encode(Subscribe(1, [Subscription("t", 1)]), V5)
        + encode(Publish("t", b"self", 1, False, False, 2), V5)
    )
    kinds = [type(p).__name__ for p in c.read()]
    assert kinds == ["ConnAck", "SubAck", "Publish", "PubAck"]


def test_nothing_processed_after_disconnect_in_the_same_chunk() -> None:
    h = Harness()
    sub = h.connected("sub")
    sub.subscribe("t")
    c = h.connected("c")
    c.send_raw(encode(Disconnect(), V5) + encode(Publish("t", b"late"), V5))
    assert c.closed
    assert sub.read() == []


def test_input_after_close_is_ignored() -> None:
    h = Harness()
    c = h.connected("c")
    c.conn.connection_lost()
    c.send(PingReq())
    assert c.read() == []


def test_on_output_called_once_per_batch() -> None:
    """The edge is told once that there is data, however many packets follow."""
    h = Harness()
    c = h.client()
    c.send(Connect("c"))
    before = c.outputs
    c.send_raw(encode(PingReq(), V5) * 5)
    assert c.outputs == before  # the output buffer still holds the CONNACK: no new notification
    c.read()
    c.send_raw(encode(PingReq(), V5) * 5)
    assert c.outputs == before + 1
    assert c.read() == [PingResp()] * 5
