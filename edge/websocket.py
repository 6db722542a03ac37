"""The server side of WebSocket (RFC 6455) for MQTT over WebSockets, sans-IO.

MQTT over WebSockets (MQTT 5 section 6, 3.1.1 section 6) carries the MQTT
byte stream in *binary* frames of a WebSocket whose subprotocol is ``mqtt``.
Frame boundaries mean nothing to MQTT: a packet may span frames and a frame
may hold several packets. So :class:`WebSocketServer` does not reassemble
messages; it hands the MQTT layer the payload bytes as they arrive, which
keeps memory per connection bounded (a partial frame header, at most one
control frame of 125 bytes, and the handshake, capped at
:data:`MAX_HANDSHAKE_SIZE`) whatever the frame sizes.

In the style of h11: bytes go in through :meth:`WebSocketServer.receive_data`,
which returns events (:class:`Accepted`, :class:`Data`, :class:`Closed`);
bytes to put on the wire come out of :meth:`WebSocketServer.data_to_send`.
No sockets, no clock.

Rules enforced (the close code sent when broken):

- handshake: ``GET`` (405), HTTP/1.1 or later, ``Host``, ``Upgrade: websocket``,
  ``Connection: upgrade``, a ``Sec-WebSocket-Key`` of 16 base64 bytes (400),
  ``Sec-WebSocket-Version: 13`` (426), ``mqtt`` among the offered
  subprotocols (400; MQTT-6.0.0-3), an ``Origin`` the :class:`OriginPolicy`
  allows (403; ``websocket.allowed_origins``), and the whole request within
  :data:`MAX_HANDSHAKE_SIZE` bytes (431). The answer is ``101`` with
  ``Sec-WebSocket-Accept`` and ``Sec-WebSocket-Protocol: mqtt`` (MQTT-6.0.0-4).
  Extensions (permessage-deflate) are never accepted.
- frames: masked by the client (1002), no RSV bits (1002), known opcodes
  (1002), binary data only (a text frame: 1003, MQTT-6.0.0-1), continuation
  only inside a fragmented message and no new message inside one (1002),
  control frames unfragmented and at most 125 bytes (1002), 64-bit lengths
  with the top bit clear (1002), a close payload of 0 or 2+ bytes with a
  valid code (1002) and UTF-8 reason (1007).
- ping is answered with pong (same payload); pong is ignored; close is
  answered with close (the peer's code) and ends the connection.
- frames per call: at most the caller's budget (1008), see
  :meth:`WebSocketServer.receive_data`. The data of all frames one call
  completes is handed over as one :class:`Data` event.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ipaddress
import struct
from dataclasses import dataclass
from enum import Enum
from urllib.parse import urlsplit

__all__ = [
    "MAX_HANDSHAKE_SIZE",
    "Accepted",
    "Closed",
    "Data",
    "Event",
    "OriginPolicy",
    "WebSocketServer",
    "WsState",
    "accept_key",
    "encode_frame",
]

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
SUBPROTOCOL = "mqtt"
MAX_HANDSHAKE_SIZE = 8192  # request line and headers, bytes

OP_CONTINUATION = 0x0
OP_TEXT = 0x1
OP_BINARY = 0x2
OP_CLOSE = 0x8
OP_PING = 0x9
OP_PONG = 0xA

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_PROTOCOL_ERROR = 1002
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_INVALID_PAYLOAD = 1007
CLOSE_POLICY_VIOLATION = 1008

# Codes a peer may put in a close frame (RFC 6455 7.4; 1004-1006 and 1015 never travel).
_VALID_CLOSE_CODES = frozenset({1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011})


class WsState(Enum):
    HANDSHAKE = 1
    OPEN = 2
    CLOSED = 3


@dataclass(frozen=True)
class Accepted:
    """The handshake succeeded; the 101 response is queued."""

    path: str


@dataclass(frozen=True)
class Data:
    """Payload bytes of binary (or continuation) frames: part of the MQTT stream."""

    data: bytes


@dataclass(frozen=True)
class Closed:
    """The WebSocket is over: close the transport once :meth:`data_to_send` is written.

    ``by_peer`` is True for a close frame from the client; otherwise the
    server refused the handshake (``code`` is then the HTTP status) or
    failed the connection (``code`` is the close code it sent).
    """

    code: int
    reason: str
    by_peer: bool = False


Event = Accepted | Data | Closed


def accept_key(key: str) -> str:
    """``Sec-WebSocket-Accept`` for a ``Sec-WebSocket-Key`` (RFC 6455 4.2.2)."""
    digest = hashlib.sha1(key.encode("ascii") + GUID, usedforsecurity=False).digest()
    return base64.b64encode(digest).decode("ascii")


def encode_frame(opcode: int, payload: bytes, fin: bool = True, mask: bytes | None = None) -> bytes:
    """One frame; servers send unmasked (``mask=None``), clients (tests) masked."""
    first = (0x80 if fin else 0) | opcode
    n = len(payload)
    mask_bit = 0x80 if mask is not None else 0
    if n < 126:
        header = struct.pack("!BB", first, mask_bit | n)
    elif n < 65536:
        header = struct.pack("!BBH", first, mask_bit | 126, n)
    else:
        header = struct.pack("!BBQ", first, mask_bit | 127, n)
    if mask is None:
        return header + payload
    return header + mask + _xor(payload, mask)


def _xor(data: bytes, key: bytes) -> bytes:
    """XOR ``data`` with the 4-byte ``key`` repeated (fast: one big-int operation)."""
    n = len(data)
    if not n:
        return b""
    stream = (key * (n // 4 + 1))[:n]
    return (int.from_bytes(data, "little") ^ int.from_bytes(stream, "little")).to_bytes(n, "little")


class _Failure(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class _Refusal(Exception):
    def __init__(self, status: int, reason: str, headers: tuple[str, ...] = ()) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.headers = headers


_STATUS_TEXT = {
    400: "Bad Request",
    403: "Forbidden",
    405: "Method Not Allowed",
    426: "Upgrade Required",
    431: "Request Header Fields Too Large",
}


def _netloc(value: str, scheme: str = "") -> str:
    """``host[:port]`` in lower case, without the scheme's default port."""
    netloc = value.strip().lower()
    for default in {"http": (":80",), "https": (":443",)}.get(scheme) or (":80", ":443"):
        if netloc.endswith(default) and not netloc.endswith("]"):
            netloc = netloc[: -len(default)]
    return netloc


def _names_this_machine(host: str) -> bool:
    """A Host (``name[:port]``) that is localhost or a loopback address."""
    name = host.strip().lower()
    if name.startswith("["):
        name = name[1 : name.find("]")] if "]" in name else name[1:]
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class OriginPolicy:
    """Which browser pages may open the WebSocket (``websocket.allowed_origins``).

    Browsers send ``Origin`` with every WebSocket handshake, and let any page open
    one to any address (no CORS): without a check, a page the user visits reaches
    a broker on their machine. A handshake without ``Origin`` is not a browser's
    and passes. One with it passes when it is ``allowed`` (exact ``scheme://host
    [:port]``, case-insensitive; ``*`` in it: every origin), or when it is the
    same host as the request's ``Host`` (a page served from the broker's own
    address, and clients such as paho that send one) -- then, while
    ``local_only`` (no authentication configured), that ``Host`` must also name
    this machine: a page whose name was rebound to 127.0.0.1 (DNS rebinding)
    sends its own name as both."""

    allowed: frozenset[str] = frozenset()
    local_only: bool = False

    @classmethod
    def from_setting(cls, text: str, local_only: bool) -> OriginPolicy:
        origins = {o.strip().lower().rstrip("/") for o in text.split(",") if o.strip()}
        return cls(frozenset(origins), local_only)

    def allows(self, origin: str | None, host: str) -> bool:
        if origin is None:
            return True
        origin = origin.strip().lower()
        if "*" in self.allowed or origin.rstrip("/") in self.allowed:
            return True
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return False  # "null" (a sandboxed page, a file), or not an origin at all
        if _netloc(parts.netloc, parts.scheme) != _netloc(host):
            return False
        return not self.local_only or _names_this_machine(host)


class WebSocketServer:
    """One server-side WebSocket connection, from the HTTP upgrade to the close;
    ``origins``: whose pages may open it (None: anyone's)."""

    def __init__(self, origins: OriginPolicy | None = None) -> None:
        self.origins = origins
        self.state = WsState.HANDSHAKE
        self.path: str | None = None
        self._buf = bytearray()
        self._out: list[bytes] = []
        # The frame whose payload is being read (streamed for data frames).
        self._opcode = 0
        self._fin = True
        self._mask = b""
        self._left = 0  # payload bytes of the current frame still to come
        self._offset = 0  # payload bytes of the current frame already read (mask phase)
        self._in_frame = False
        self._control = bytearray()  # payload of a control frame being read
        self._fragmented = False  # inside a message whose last frame has not come
        self._pieces: list[bytes] = []  # data payloads of this receive_data call
        self.frames = 0  # frame headers read so far, for the caller's frame budget
        self._frame_budget: int | None = None

    # -- output -----------------------------------------------------------------------

    def data_to_send(self) -> bytes:
        out = self._out
        if not out:
            return b""
        data = b"".join(out)
        out.clear()
        return data

    def send_data(self, payload: bytes) -> None:
        """Frame MQTT bytes for the client: one unmasked binary frame."""
        if self.state is WsState.OPEN and payload:
            self._out.append(encode_frame(OP_BINARY, payload))

    def close(self, code: int = CLOSE_NORMAL, reason: str = "") -> None:
        """End from the server side: a close frame if open, then the transport closes."""
        if self.state is WsState.OPEN:
            self._out.append(encode_frame(OP_CLOSE, struct.pack("!H", code) + reason.encode()))
        self.state = WsState.CLOSED

    # -- input ------------------------------------------------------------------------

    def receive_data(self, data: bytes, max_frames: int | None = None) -> list[Event]:
        """Events for ``data``. The data payloads of all the frames it completes come
        as one :class:`Data` event (joined once: many small frames cost one MQTT
        feed, not one each). ``max_frames`` is how many frame headers this call
        may read: beyond it the connection fails with 1008 Policy Violation, so
        a peer that sends tiny frames is stopped by its frame rate
        (``websocket.max_frame_rate``), not by the time it costs."""
        self._frame_budget = max_frames
        events: list[Event] = []
        if self.state is WsState.CLOSED:
            return events
        if self.state is WsState.HANDSHAKE:
            self._buf += data
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > MAX_HANDSHAKE_SIZE:
                    events.append(self._refuse(_Refusal(431, "handshake too large")))
                return events
            if end > MAX_HANDSHAKE_SIZE:
                events.append(self._refuse(_Refusal(431, "handshake too large")))
                return events
            request = bytes(self._buf[:end])
            rest = bytes(self._buf[end + 4 :])
            self._buf.clear()
            try:
                self._handshake(request)
            except _Refusal as refusal:
                events.append(self._refuse(refusal))
                return events
            events.append(Accepted(self.path or "/"))
            data = rest
            if not data:
                return events
        try:
            self._frames(data, events)
        except _Failure as failure:
            self._flush_data(events)
            self.close(failure.code, failure.reason)
            events.append(Closed(failure.code, failure.reason))
        self._flush_data(events)
        return events

    def _flush_data(self, events: list[Event]) -> None:
        pieces = self._pieces
        if pieces:
            events.append(Data(pieces[0] if len(pieces) == 1 else b"".join(pieces)))
            pieces.clear()

    # -- the handshake ----------------------------------------------------------------

    def _handshake(self, request: bytes) -> None:
        try:
            text = request.decode("latin-1")
        except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
            raise _Refusal(400, "undecodable request") from None
        lines = text.split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            raise _Refusal(400, "malformed request line")
        method, target, version = parts
        if not version.startswith("HTTP/1.") or version == "HTTP/1.0":
            raise _Refusal(400, "HTTP/1.1 or later required")
        if method != "GET":
            raise _Refusal(405, "only GET upgrades", ("Allow: GET",))
        if not target.startswith("/"):
            raise _Refusal(400, "malformed request target")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip() or not name.isascii():
                raise _Refusal(400, "malformed header line")
            key = name.lower()
            value = value.strip()
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        if "host" not in headers:
            raise _Refusal(400, "Host header missing")
        if self.origins is not None and not self.origins.allows(
            headers.get("origin"), headers["host"]
        ):
            raise _Refusal(403, "Origin not allowed (websocket.allowed_origins)")
        if "websocket" not in _tokens(headers.get("upgrade", "")):
            raise _Refusal(400, "not a WebSocket upgrade")
        if "upgrade" not in _tokens(headers.get("connection", "")):
            raise _Refusal(400, "Connection: upgrade missing")
        if headers.get("sec-websocket-version", "").strip() != "13":
            raise _Refusal(426, "WebSocket version 13 required", ("Sec-WebSocket-Version: 13",))
        key = headers.get("sec-websocket-key", "")
        try:
            raw_key = base64.b64decode(key.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError):
            raw_key = b""
        if len(raw_key) != 16:
            raise _Refusal(400, "invalid Sec-WebSocket-Key")
        offered = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",")]
        if SUBPROTOCOL not in offered:
            raise _Refusal(400, "subprotocol mqtt required")
        self.path = target
        self._out.append(
            (
                "HTTP/1.1 101 Switching Protocols\r\n"
                "Upgrade: websocket\r\n"
                "Connection: Upgrade\r\n"
                f"Sec-WebSocket-Accept: {accept_key(key)}\r\n"
                f"Sec-WebSocket-Protocol: {SUBPROTOCOL}\r\n"
                "\r\n"
            ).encode("ascii")
        )
        self.state = WsState.OPEN

    def _refuse(self, refusal: _Refusal) -> Closed:
        body = (refusal.reason + "\n").encode()
        head = [
            f"HTTP/1.1 {refusal.status} {_STATUS_TEXT[refusal.status]}",
            "Connection: close",
            "Content-Type: text/plain; charset=utf-8",
            f"Content-Length: {len(body)}",
            *refusal.headers,
        ]
        self._out.append(("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body)
        self._buf.clear()
        self.state = WsState.CLOSED
        return Closed(refusal.status, refusal.reason)

    # -- frames -----------------------------------------------------------------------

    def _frames(self, data: bytes, events: list[Event]) -> None:
        buf = self._buf
        if buf:
            buf += data
            view = bytes(buf)
            buf.clear()
        else:
            view = data
        pos = 0
        end = len(view)
        while pos < end and self.state is WsState.OPEN:
            if not self._in_frame:
                header = self._header(view, pos)
                if header is None:
                    break
                pos = header
                if self._left == 0:
                    self._frame_done(events)
                continue
            take = min(self._left, end - pos)
            chunk = view[pos : pos + take]
            pos += take
            phase = self._offset % 4
            key = self._mask[phase:] + self._mask[:phase]
            payload = _xor(chunk, key)
            self._offset += take
            self._left -= take
            if self._opcode >= OP_CLOSE:
                self._control += payload
            elif payload:
                self._pieces.append(payload)
            if self._left == 0:
                self._frame_done(events)
        if pos < end and self.state is WsState.OPEN:
            buf += view[pos:]

    def _header(self, view: bytes, pos: int) -> int | None:
        """Parse a frame header at ``pos``; the position after it, or None if incomplete."""
        end = len(view)
        if end - pos < 2:
            return None
        budget = self._frame_budget
        if budget is not None and budget <= 0:
            raise _Failure(CLOSE_POLICY_VIOLATION, "too many frames")
        b0, b1 = view[pos], view[pos + 1]
        n = b1 & 0x7F
        need = 2 + (2 if n == 126 else 8 if n == 127 else 0) + 4
        if b1 & 0x80 == 0:
            raise _Failure(CLOSE_PROTOCOL_ERROR, "client frames must be masked")
        if b0 & 0x70:
            raise _Failure(CLOSE_PROTOCOL_ERROR, "reserved bits set")
        fin = bool(b0 & 0x80)
        opcode = b0 & 0x0F
        if opcode == OP_TEXT:
            raise _Failure(CLOSE_UNSUPPORTED_DATA, "MQTT travels in binary frames only")
        if opcode in (OP_CLOSE, OP_PING, OP_PONG):
            if not fin:
                raise _Failure(CLOSE_PROTOCOL_ERROR, "fragmented control frame")
            if n > 125:
                raise _Failure(CLOSE_PROTOCOL_ERROR, "control frame longer than 125 bytes")
        elif opcode == OP_BINARY:
            if self._fragmented:
                raise _Failure(CLOSE_PROTOCOL_ERROR, "new message inside a fragmented one")
        elif opcode == OP_CONTINUATION:
            if not self._fragmented:
                raise _Failure(CLOSE_PROTOCOL_ERROR, "continuation outside a message")
        else:
            raise _Failure(CLOSE_PROTOCOL_ERROR, f"unknown opcode {opcode:#x}")
        if end - pos < need:
            return None
        if n == 126:
            (n,) = struct.unpack_from("!H", view, pos + 2)
        elif n == 127:
            (n,) = struct.unpack_from("!Q", view, pos + 2)
            if n >> 63:
                raise _Failure(CLOSE_PROTOCOL_ERROR, "frame length has the top bit set")
        self.frames += 1
        if budget is not None:
            self._frame_budget = budget - 1
        self._mask = bytes(view[pos + need - 4 : pos + need])
        self._opcode = opcode
        self._fin = fin
        self._left = n
        self._offset = 0
        self._in_frame = True
        self._control.clear()
        if opcode in (OP_BINARY, OP_CONTINUATION):
            self._fragmented = not fin
        return pos + need

    def _frame_done(self, events: list[Event]) -> None:
        self._in_frame = False
        opcode = self._opcode
        if opcode == OP_PING:
            self._out.append(encode_frame(OP_PONG, bytes(self._control)))
        elif opcode == OP_CLOSE:
            self._flush_data(events)  # what came before the close comes first
            payload = bytes(self._control)
            code, reason = CLOSE_NORMAL, ""
            if len(payload) == 1:
                raise _Failure(CLOSE_PROTOCOL_ERROR, "close payload of one byte")
            if payload:
                (code,) = struct.unpack_from("!H", payload)
                if code not in _VALID_CLOSE_CODES and not 3000 <= code <= 4999:
                    raise _Failure(CLOSE_PROTOCOL_ERROR, f"invalid close code {code}")
                try:
                    reason = payload[2:].decode("utf-8")
                except UnicodeDecodeError:
                    raise _Failure(CLOSE_INVALID_PAYLOAD, "close reason is not UTF-8") from None
            self._out.append(encode_frame(OP_CLOSE, struct.pack("!H", code)))
            self.state = WsState.CLOSED
            events.append(Closed(code, reason, by_peer=True))


def _tokens(value: str) -> set[str]:
    return {t.strip().lower() for t in value.split(",")}
