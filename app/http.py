"""A small HTTP/1.1 server on ``asyncio.start_server`` for the admin API.

Enough HTTP for JSON requests from curl, the CLI and a browser: one request
per connection (``Connection: close``), a body only with ``Content-Length``
(at most ``MAX_BODY``), the head within ``MAX_HEAD`` bytes and ``HEAD_TIMEOUT``,
head and body within ``REQUEST_TIMEOUT``; at most ``MAX_CONNECTIONS`` at once
(the listener shares the broker's file descriptors: idle sockets opened by
anyone must not starve MQTT), and at most ``max_per_source`` from one address
(IPv6: one /64). A connection over either limit pushes out the oldest one that
has not sent its request head yet (of its address, for the per-address limit),
so idle sockets cannot lock the listener: a client that sends its request at
once is served. With none to push out, it is refused (429 over the per-address
limit, closed unanswered over the global one). Anything else gets a 4xx or the
connection closed; a handler's bug is a 500 and one log line, never a dead
listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlsplit

import orjson

from broker.limits import LogLimiter, source_key

log = logging.getLogger("devicemq.admin")

MAX_HEAD = 16 * 1024
MAX_BODY = 64 * 1024
HEAD_TIMEOUT = 3.0  # the request head: a socket silent that long is dropped
REQUEST_TIMEOUT = 5.0  # the whole request, head and body
WRITE_TIMEOUT = 10.0  # the answer, to a reader that does not read
MAX_CONNECTIONS = 64  # at once; more are closed unanswered (descriptors are the broker's)

JSON = "application/json"
REASONS = {
    200: "OK",
    201: "Created",
    204: "No Content",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    411: "Length Required",
    413: "Content Too Large",
    429: "Too Many Requests",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


@dataclass(slots=True)
class Request:
    method: str
    path: str  # as sent (percent-encoded): split it with ``segments``
    query: dict[str, str]
    headers: dict[str, str]  # names in lower case
    body: bytes
    peer: str  # the client's IP address


def segments(path: str) -> list[str]:
    """The path's segments, each percent-decoded: a client ID may hold a ``/``."""
    return [unquote(part) for part in path.strip("/").split("/")]


@dataclass(slots=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str = JSON
    headers: dict[str, str] = field(default_factory=dict)


class HttpError(Exception):
    """Answer ``status`` with ``{"error": message, "detail": detail}``."""

    def __init__(
        self,
        status: int,
        message: str,
        detail: object = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail
        self.headers = headers or {}


def json_response(status: int, data: object, headers: dict[str, str] | None = None) -> Response:
    return Response(status, orjson.dumps(data) + b"\n", JSON, headers or {})


def error_response(error: HttpError) -> Response:
    body = {"error": str(error), "detail": error.detail}
    return json_response(error.status, body, error.headers)


Handler = Callable[[Request], Awaitable[Response]]


class ConnectionGate:
    """At most ``max_total`` connections, ``max_per_source`` (0: no limit) from one
    address (``source_key``: IPv6 by its /64). A newcomer over a limit pushes out
    the oldest connection still waiting for its request head (of its address, for
    the per-address limit); with none to push out it is refused. Used by the
    admin listener and the metrics server (app/metrics.py)."""

    def __init__(self, max_total: int, max_per_source: int = 0) -> None:
        self.max_total = max_total
        self.max_per_source = max_per_source
        self.open = 0
        self.by_source: dict[str, int] = {}
        # Connections still reading their request head, oldest first: (source, transport).
        self.waiting: OrderedDict[object, tuple[str, asyncio.WriteTransport]] = OrderedDict()

    def enter(self, writer: asyncio.StreamWriter) -> tuple[object | None, str]:
        """(key, source) of an admitted connection; (None, source) when the address
        is over its limit (answer it), (None, "") when the total is (close it)."""
        peer = writer.get_extra_info("peername")
        source = source_key(str(peer[0])) if isinstance(peer, tuple) else ""
        limit = self.max_per_source
        if limit and self.by_source.get(source, 0) >= limit and not self._push_out(source):
            return None, source
        if self.open >= self.max_total and not self._push_out(None):
            return None, ""
        self.open += 1
        self.by_source[source] = self.by_source.get(source, 0) + 1
        key = object()
        self.waiting[key] = (source, writer.transport)
        return key, source

    def head_read(self, key: object) -> None:
        """No longer an idle socket: not pushed out by a newcomer."""
        self.waiting.pop(key, None)

    def leave(self, key: object, source: str) -> None:
        self.waiting.pop(key, None)
        self.open -= 1
        left = self.by_source[source] - 1
        if left:
            self.by_source[source] = left
        else:
            del self.by_source[source]

    def _push_out(self, source: str | None) -> bool:
        """Abort the oldest connection still waiting for its request head (of
        ``source``, if given); False if there is none."""
        for key, (waiting_source, transport) in self.waiting.items():
            if source is None or waiting_source == source:
                del self.waiting[key]
                transport.abort()
                return True
        return False


class HttpServer:
    """Serves ``handler`` on ``host:port``; ``reuse_port`` for workers sharing it;
    ``max_per_source``: connections one address may hold (0: no limit)."""

    def __init__(
        self,
        handler: Handler,
        host: str,
        port: int,
        *,
        reuse_port: bool = False,
        max_per_source: int = 0,
    ):
        self.handler = handler
        self.host = host
        self.requested_port = port
        self.reuse_port = reuse_port
        self._server: asyncio.Server | None = None
        self.gate = ConnectionGate(MAX_CONNECTIONS, max_per_source)
        self._refusals = LogLimiter(log, "admin connection refusals")

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve,
            self.host,
            self.requested_port,
            reuse_address=True,
            reuse_port=self.reuse_port or None,
            limit=MAX_HEAD,
        )

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        gate = self.gate
        key, source = gate.enter(writer)
        if key is None:
            if not source:  # over the total: closed unanswered
                writer.transport.abort()
                return
            self._refusals.log(
                time.monotonic(),
                logging.WARNING,
                "admin listener: %s holds %d connections (admin.max_connections_per_source): "
                "refused 429",
                source,
                gate.max_per_source,
            )
            writer.write(
                _encode(error_response(HttpError(429, "too many connections from your address")))
            )
            writer.close()
            return
        try:
            await self._exchange(reader, writer, lambda: gate.head_read(key))
        finally:
            gate.leave(key, source)

    async def _exchange(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        head_read: Callable[[], None],
    ) -> None:
        head_only = False
        try:
            try:
                request = await asyncio.wait_for(_read(reader, writer, head_read), REQUEST_TIMEOUT)
            except HttpError as e:
                response = error_response(e)
            except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
                return
            else:
                head_only = request.method == "HEAD"
                try:
                    response = await self.handler(request)
                except HttpError as e:
                    response = error_response(e)
                except Exception:  # a bug answers 500 and leaves the listener serving
                    log.exception("admin request %s %s failed", request.method, request.path)
                    response = error_response(HttpError(500, "internal error"))
            writer.write(_encode(response, head_only))
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT)
        except (ConnectionError, OSError, TimeoutError):
            writer.transport.abort()
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()


async def _read(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    head_read: Callable[[], None] = lambda: None,
) -> Request:
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT)
    except asyncio.LimitOverrunError:
        raise HttpError(400, "request head too large") from None
    head_read()  # no longer an idle socket: not pushed out by a newcomer
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HttpError(400, "bad request line")
    method, target = parts[0], parts[1]
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise HttpError(400, "bad header line")
        headers[name.strip().lower()] = value.strip()
    body = b""
    if "transfer-encoding" in headers:
        raise HttpError(411, "send a Content-Length, not chunks")
    length_text = headers.get("content-length")
    if length_text is not None:
        if not (length_text.isascii() and length_text.isdigit()):
            raise HttpError(400, "bad Content-Length")
        length = int(length_text)
        if length > MAX_BODY:
            raise HttpError(413, f"body over {MAX_BODY} bytes")
        body = await reader.readexactly(length)
    url = urlsplit(target)
    try:
        query = dict(parse_qsl(url.query, keep_blank_values=True, strict_parsing=False))
    except ValueError:
        raise HttpError(400, "bad query string") from None
    peer = writer.get_extra_info("peername")
    address = str(peer[0]) if isinstance(peer, tuple) else ""
    return Request(method, url.path, query, headers, body, address)


def _encode(response: Response, head_only: bool = False) -> bytes:
    lines = [
        f"HTTP/1.1 {response.status} {REASONS.get(response.status, '')}",
        f"Content-Type: {response.content_type}",
        f"Content-Length: {len(response.body)}",
        "Cache-Control: no-store",
        "Connection: close",
        *(f"{k}: {v}" for k, v in response.headers.items()),
    ]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only else head + response.body
