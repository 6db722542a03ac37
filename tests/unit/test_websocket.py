"""edge.websocket: the sans-IO WebSocket server, and edge.listeners' TLS context."""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.config import ConfigError, ListenerSettings, Settings, TlsSettings, WebsocketSettings
from edge.listeners import Framing, build_ssl_context, listener_specs
from edge.websocket import (
    MAX_HANDSHAKE_SIZE,
    OP_BINARY,
    OP_CLOSE,
    OP_CONTINUATION,
    OP_PING,
    OP_PONG,
    OP_TEXT,
    Accepted,
    Closed,
    Data,
    Event,
    OriginPolicy,
    WebSocketServer,
    WsState,
    accept_key,
    encode_frame,
)

KEY = "dGhlIHNhbXBsZSBub25jZQ=="
MASK = b"\x37\xfa\x21\x3d"


def request(**change: str | None) -> bytes:
    headers = {
        "Host": "broker.example",
        "Upgrade": "websocket",
        "Connection": "keep-alive, Upgrade",
        "Sec-WebSocket-Key": KEY,
        "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Protocol": "mqttv3.1, mqtt",
    }
    for name, value in change.items():
        name = name.replace("_", "-")
        if value is None:
            headers.pop(name, None)
        else:
            headers[name] = value
    lines = ["GET /mqtt HTTP/1.1", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def opened() -> WebSocketServer:
    ws = WebSocketServer()
    assert ws.receive_data(request()) == [Accepted("/mqtt")]
    ws.data_to_send()
    return ws


def masked(opcode: int, payload: bytes, fin: bool = True) -> bytes:
    return encode_frame(opcode, payload, fin=fin, mask=MASK)


def data_of(events: Sequence[object]) -> bytes:
    return b"".join(e.data for e in events if isinstance(e, Data))


def closed_with(ws: WebSocketServer, events: Sequence[object], code: int) -> None:
    assert events[-1] == Closed(code, events[-1].reason)  # type: ignore[attr-defined]
    out = ws.data_to_send()
    assert out[0] == 0x88 and struct.unpack_from("!H", out, 2)[0] == code
    assert ws.state is WsState.CLOSED
    assert ws.receive_data(masked(OP_BINARY, b"late")) == []


# ------------------------------------------------------------------ handshake


def test_rfc_example_accept_key() -> None:
    assert accept_key(KEY) == "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="


def test_handshake_answer_echoes_mqtt() -> None:
    ws = WebSocketServer()
    assert ws.receive_data(request()) == [Accepted("/mqtt")]
    answer = ws.data_to_send().decode()
    assert answer.startswith("HTTP/1.1 101 Switching Protocols\r\n")
    assert "Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n" in answer
    assert "Sec-WebSocket-Protocol: mqtt\r\n" in answer
    assert answer.endswith("\r\n\r\n")
    assert "Sec-WebSocket-Extensions" not in answer  # permessage-deflate is never accepted
    assert ws.state is WsState.OPEN


def test_handshake_byte_by_byte_and_frames_in_the_same_segment() -> None:
    ws = WebSocketServer()
    wire = request() + masked(OP_BINARY, b"\x10\x00")
    events: list[Event] = []
    for i in range(len(wire)):
        events += ws.receive_data(wire[i : i + 1])
    assert events[0] == Accepted("/mqtt")
    assert data_of(events) == b"\x10\x00"
    ws2 = WebSocketServer()
    assert ws2.receive_data(wire) == [Accepted("/mqtt"), Data(b"\x10\x00")]


@pytest.mark.parametrize(
    ("wire", "status"),
    [
        (request(Sec_WebSocket_Protocol=None), 400),
        (request(Sec_WebSocket_Protocol="mqttv3.1"), 400),
        (request(Sec_WebSocket_Protocol="MQTT"), 400),  # subprotocol names are case-sensitive
        (request(Sec_WebSocket_Version="8"), 426),
        (request(Sec_WebSocket_Key=None), 400),
        (request(Sec_WebSocket_Key="c2hvcnQ="), 400),  # 5 bytes, not 16
        (request(Sec_WebSocket_Key="not base64!"), 400),
        (request(Upgrade=None), 400),
        (request(Upgrade="h2c"), 400),
        (request(Connection="keep-alive"), 400),
        (request(Host=None), 400),
        (request().replace(b"GET ", b"POST ", 1), 405),
        (request().replace(b"HTTP/1.1", b"HTTP/1.0", 1), 400),
        (request().replace(b"GET /mqtt HTTP/1.1", b"GET", 1), 400),
        (request().replace(b"/mqtt", b"mqtt", 1), 400),
        (request().replace(b"Host:", b"Host :", 1), 400),
        (b"\x10\x0c\x00\x04MQTT\x04\x02\x00\x3c\x00\x00\r\n\r\n", 400),  # MQTT on the WS port
        (b"GET / HTTP/1.1\r\nX: " + b"a" * MAX_HANDSHAKE_SIZE + b"\r\n\r\n", 431),
    ],
)
def test_bad_handshakes_get_an_http_error_and_close(wire: bytes, status: int) -> None:
    ws = WebSocketServer()
    events = ws.receive_data(wire)
    assert len(events) == 1 and isinstance(events[0], Closed) and events[0].code == status
    answer = ws.data_to_send()
    assert answer.startswith(f"HTTP/1.1 {status} ".encode())
    assert b"Connection: close\r\n" in answer
    if status == 426:
        assert b"Sec-WebSocket-Version: 13\r\n" in answer
    assert ws.state is WsState.CLOSED
    assert ws.receive_data(b"more") == []


def test_endless_handshake_is_cut_at_the_limit() -> None:
    ws = WebSocketServer()
    events: list[Event] = []
    sent = 0
    while not events:
        events = ws.receive_data(b"x" * 1000)
        sent += 1000
        assert sent <= MAX_HANDSHAKE_SIZE + 1000
    assert events == [Closed(431, "handshake too large")]


# ------------------------------------------------------------------ frames


def test_binary_frames_all_length_encodings() -> None:
    ws = opened()
    for size in (0, 1, 125, 126, 65535, 65536, 300_000):
        payload = os.urandom(size)
        assert data_of(ws.receive_data(masked(OP_BINARY, payload))) == payload


def test_payload_streams_byte_by_byte_with_the_mask_phase_kept() -> None:
    ws = opened()
    payload = bytes(range(200))
    wire = masked(OP_BINARY, payload) + masked(OP_BINARY, b"next")
    events: list[Event] = []
    for i in range(len(wire)):
        events += ws.receive_data(wire[i : i + 1])
    assert data_of(events) == payload + b"next"


def test_fragmented_message_with_a_ping_in_between() -> None:
    ws = opened()
    wire = (
        masked(OP_BINARY, b"ab", fin=False)
        + masked(OP_PING, b"p")
        + masked(OP_CONTINUATION, b"cd", fin=False)
        + masked(OP_CONTINUATION, b"ef", fin=True)
    )
    assert data_of(ws.receive_data(wire)) == b"abcdef"
    assert ws.data_to_send() == encode_frame(OP_PONG, b"p")


def test_tiny_frames_are_coalesced_into_one_data_event() -> None:
    """Issue 19: 1-byte continuation frames each became an MQTT feed of their own."""
    ws = opened()
    wire = masked(OP_BINARY, b"a", fin=False) + b"".join(
        masked(OP_CONTINUATION, bytes([ch]), fin=False) for ch in b"bcdefgh"
    )
    events = ws.receive_data(wire)
    assert events == [Data(b"abcdefgh")]
    assert ws.frames == 8
    # Data before a close frame still comes before the Closed event.
    events = ws.receive_data(masked(OP_CONTINUATION, b"i") + masked(OP_CLOSE, b""))
    assert events[0] == Data(b"i") and isinstance(events[1], Closed)


def test_frame_budget_fails_the_connection_with_1008() -> None:
    ws = opened()
    frame = masked(OP_CONTINUATION, b"x", fin=False)
    events = ws.receive_data(masked(OP_BINARY, b"s", fin=False) + frame * 2, max_frames=3)
    assert events == [Data(b"sxx")] and ws.state is WsState.OPEN
    events = ws.receive_data(frame * 5, max_frames=2)
    assert events[0] == Data(b"xx")  # what came within the budget is delivered first
    closed_with(ws, events, 1008)
    assert ws.frames == 5


def test_ping_pong_and_unsolicited_pong() -> None:
    ws = opened()
    assert ws.receive_data(masked(OP_PING, b"")) == []
    assert ws.data_to_send() == b"\x8a\x00"
    assert ws.receive_data(masked(OP_PONG, b"whatever")) == []
    assert ws.data_to_send() == b""


def test_send_data_is_one_unmasked_binary_frame() -> None:
    ws = opened()
    ws.send_data(b"\x20\x02\x00\x00")
    assert ws.data_to_send() == b"\x82\x04\x20\x02\x00\x00"
    big = b"x" * 70000
    ws.send_data(big)
    out = ws.data_to_send()
    assert out[:2] == b"\x82\x7f" and struct.unpack_from("!Q", out, 2)[0] == 70000
    assert out[10:] == big
    ws.send_data(b"")
    assert ws.data_to_send() == b""


def test_peer_close_is_echoed() -> None:
    ws = opened()
    events = ws.receive_data(masked(OP_CLOSE, struct.pack("!H", 1001) + b"bye"))
    assert events == [Closed(1001, "bye", by_peer=True)]
    assert ws.data_to_send() == encode_frame(OP_CLOSE, struct.pack("!H", 1001))
    assert ws.state is WsState.CLOSED


def test_empty_close_is_answered_with_1000() -> None:
    ws = opened()
    assert ws.receive_data(masked(OP_CLOSE, b"")) == [Closed(1000, "", by_peer=True)]
    assert ws.data_to_send() == encode_frame(OP_CLOSE, struct.pack("!H", 1000))


def test_server_close() -> None:
    ws = opened()
    ws.close(1001, "shutting down")
    assert ws.data_to_send() == encode_frame(OP_CLOSE, struct.pack("!H", 1001) + b"shutting down")
    ws.send_data(b"ignored")
    assert ws.data_to_send() == b""


@pytest.mark.parametrize(
    ("wire", "code"),
    [
        (encode_frame(OP_BINARY, b"unmasked"), 1002),
        (masked(OP_TEXT, b"text"), 1003),
        (bytes([0x80 | 0x40 | OP_BINARY]) + masked(OP_BINARY, b"x")[1:], 1002),  # RSV1
        (bytes([0x80 | 0x3]) + masked(OP_BINARY, b"x")[1:], 1002),  # reserved opcode
        (bytes([0x80 | 0xB]) + masked(OP_BINARY, b"x")[1:], 1002),  # reserved control opcode
        (masked(OP_CONTINUATION, b"x"), 1002),  # nothing to continue
        (masked(OP_BINARY, b"a", fin=False) + masked(OP_BINARY, b"b"), 1002),
        (masked(OP_PING, b"x", fin=False), 1002),
        (masked(OP_PING, b"x" * 126), 1002),
        (masked(OP_CLOSE, b"\x03"), 1002),  # one-byte close payload
        (masked(OP_CLOSE, struct.pack("!H", 1005)), 1002),  # reserved code
        (masked(OP_CLOSE, struct.pack("!H", 999)), 1002),
        (masked(OP_CLOSE, struct.pack("!H", 1000) + b"\xff"), 1007),  # reason not UTF-8
        (b"\x82\xff" + b"\x80" + b"\x00" * 7 + MASK, 1002),  # 64-bit length, top bit set
    ],
)
def test_broken_frames_fail_the_connection(wire: bytes, code: int) -> None:
    ws = opened()
    events = ws.receive_data(wire)
    closed_with(ws, events, code)


def test_data_before_a_bad_frame_is_delivered() -> None:
    ws = opened()
    events = ws.receive_data(masked(OP_BINARY, b"ok") + encode_frame(OP_BINARY, b"bad"))
    assert events[0] == Data(b"ok")
    closed_with(ws, events, 1002)


def test_custom_close_codes_are_accepted() -> None:
    ws = opened()
    assert ws.receive_data(masked(OP_CLOSE, struct.pack("!H", 4000))) == [
        Closed(4000, "", by_peer=True)
    ]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=30))
def test_any_bytes_after_the_handshake_are_handled(chunks: list[bytes]) -> None:
    """Random input never raises, never keeps more than a frame header buffered."""
    ws = opened()
    for chunk in chunks:
        for event in ws.receive_data(chunk):
            assert isinstance(event, Data | Closed)
        assert len(ws._buf) < 14 + 125
        ws.data_to_send()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_any_bytes_as_a_handshake_are_handled(wire: bytes) -> None:
    ws = WebSocketServer()
    for event in ws.receive_data(wire):
        assert isinstance(event, Accepted | Data | Closed)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.binary(max_size=300), min_size=1, max_size=8),
    st.binary(min_size=4, max_size=4),
    st.integers(1, 50),
)
def test_fragmented_random_payloads_roundtrip(parts: list[bytes], mask: bytes, step: int) -> None:
    ws = opened()
    wire = b""
    for i, part in enumerate(parts):
        opcode = OP_BINARY if i == 0 else OP_CONTINUATION
        wire += encode_frame(opcode, part, fin=i == len(parts) - 1, mask=mask)
    events: list[Event] = []
    for i in range(0, len(wire), step):
        events += ws.receive_data(wire[i : i + step])
    assert data_of(events) == b"".join(parts)
    assert ws.state is WsState.OPEN


# ------------------------------------------------------------------ listeners and TLS


def test_default_listeners_are_plain_tcp_only() -> None:
    specs = listener_specs(Settings())
    assert [(s.name, s.port, s.framing, s.ssl) for s in specs] == [
        ("listener", 1883, Framing.MQTT, None)
    ]


def test_listeners_without_a_host_are_loopback_only_without_authentication() -> None:
    """Issue 19 (secure by default), as Mosquitto 2: nobody configured logins, so the
    broker is not put on the network unless a host is asked for explicitly."""
    from broker.config import AuthSettings
    from edge.listeners import effective_host

    ws = WebsocketSettings(enabled=True)
    open_broker = Settings(websocket=ws)
    assert [s.host for s in listener_specs(open_broker)] == ["127.0.0.1", "127.0.0.1"]
    secured = Settings(websocket=ws, auth=AuthSettings(password_file="/etc/devicemq/passwd"))
    assert [s.host for s in listener_specs(secured)] == ["0.0.0.0", "0.0.0.0"]
    certs = Settings(auth=AuthSettings(use_identity_as_username=True))
    assert effective_host(certs, "") == "0.0.0.0"
    explicit = Settings(listener=ListenerSettings(host="0.0.0.0"))
    assert [s.host for s in listener_specs(explicit)] == ["0.0.0.0"]
    assert effective_host(secured, "10.1.2.3") == "10.1.2.3"


def test_no_listener_at_all_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="every listener is disabled"):
        listener_specs(Settings(listener=ListenerSettings(enabled=False)))


def test_websocket_listener() -> None:
    settings = Settings(websocket=WebsocketSettings(enabled=True, port=9001))
    specs = listener_specs(settings)
    assert [(s.name, s.port, s.scheme) for s in specs] == [
        ("listener", 1883, "mqtt"),
        ("websocket", 9001, "ws"),
    ]


def test_tls_without_certificate_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"tls\.certfile"):
        listener_specs(Settings(tls=TlsSettings(enabled=True)))


def test_tls_unreadable_files_are_config_errors(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(ConfigError, match=r"tls\.certfile: cannot read .*nope\.pem"):
        build_ssl_context(TlsSettings(enabled=True, certfile=missing))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(ConfigError, match=r"tls\.certfile: cannot load"):
        build_ssl_context(TlsSettings(enabled=True, certfile=str(garbage)))


def test_require_certificate_needs_a_ca() -> None:
    with pytest.raises(ConfigError, match="require_certificate needs cafile"):
        build_ssl_context(TlsSettings(certfile="x", require_certificate=True))


def test_tls_context_defaults(tmp_path: Path) -> None:
    import ssl

    from tests.pki import make_pki

    pki = make_pki(tmp_path)
    tls = TlsSettings(certfile=str(pki.server_cert), keyfile=str(pki.server_key))
    context = build_ssl_context(tls)
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert context.verify_mode == ssl.CERT_NONE
    assert context.options & ssl.OP_NO_COMPRESSION
    with_ca = build_ssl_context(
        TlsSettings(certfile=str(pki.server_cert), keyfile=str(pki.server_key), cafile=str(pki.ca))
    )
    assert with_ca.verify_mode == ssl.CERT_OPTIONAL
    required = build_ssl_context(
        TlsSettings(
            certfile=str(pki.server_cert),
            keyfile=str(pki.server_key),
            cafile=str(pki.ca),
            require_certificate=True,
            min_version="TLSv1.3",
        )
    )
    assert required.verify_mode == ssl.CERT_REQUIRED
    assert required.minimum_version == ssl.TLSVersion.TLSv1_3
    with pytest.raises(ConfigError, match=r"tls\.ciphers"):
        build_ssl_context(
            TlsSettings(
                certfile=str(pki.server_cert), keyfile=str(pki.server_key), ciphers="NOPE-NOTHING"
            )
        )


def test_the_origin_policy() -> None:
    """websocket.allowed_origins: who may open the listener from a browser page."""
    local = OriginPolicy.from_setting("", local_only=True)
    assert local.allows(None, "anything")  # no Origin: not a browser
    assert local.allows("http://127.0.0.1:8083", "127.0.0.1:8083")
    assert local.allows("http://[::1]:8083", "[::1]:8083")
    assert local.allows("HTTP://LocalHost", "localhost:80")  # default port, any case
    assert not local.allows("http://evil.example:8083", "evil.example:8083")  # rebinding
    assert not local.allows("http://127.0.0.1:9000", "127.0.0.1:8083")
    assert not local.allows("null", "127.0.0.1:8083")
    assert not local.allows("", "127.0.0.1:8083")
    public = OriginPolicy.from_setting(" https://dash.example.com/ ,http://x:3000", False)
    assert public.allows("https://mqtt.example.com", "mqtt.example.com:443")
    assert public.allows("https://dash.example.com", "mqtt.example.com")
    assert public.allows("http://X:3000", "mqtt.example.com")
    assert not public.allows("https://dash.example.com.evil", "mqtt.example.com")
    assert not public.allows("https://evil.example", "mqtt.example.com")
    assert OriginPolicy.from_setting("*", True).allows("https://evil.example", "127.0.0.1")


def test_a_refused_origin_is_a_403_before_the_upgrade() -> None:
    ws = WebSocketServer(OriginPolicy.from_setting("", local_only=True))
    request = (
        b"GET /mqtt HTTP/1.1\r\nHost: 127.0.0.1:8083\r\nOrigin: https://evil.example\r\n"
        b"Upgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Protocol: mqtt\r\n\r\n"
    )
    (event,) = ws.receive_data(request)
    assert isinstance(event, Closed) and event.code == 403
    assert ws.data_to_send().startswith(b"HTTP/1.1 403 Forbidden\r\n")
    assert ws.state is WsState.CLOSED
