"""A small HTTP/1.1 server on ``asyncio.start_server`` for the admin API.

Enough HTTP for JSON requests from curl, the CLI and a browser: one request
per connection (``Connection: close``), a body only with ``Content-Length``
(at most ``MAX_BODY``), the head within ``MAX_HEAD`` bytes and both within
``REQUEST_TIMEOUT``; at most ``MAX_CONNECTIONS`` at once (the listener shares
the broker's file descriptors: idle sockets opened by anyone must not starve
MQTT). Anything else gets a 4xx or the connection closed; a handler's bug is
a 500 and one log line, never a dead listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlsplit

import orjson

log = logging.getLogger("devicemq.admin")

MAX_HEAD = 16 * 1024
MAX_BODY = 64 * 1024
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

    def __init__(self, status: int, message: str, detail: object = None) -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail


def json_response(status: int, data: object, headers: dict[str, str] | None = None) -> Response:
    return Response(status, orjson.dumps(data) + b"\n", JSON, headers or {})


def error_response(error: HttpError) -> Response:
    return json_response(error.status, {"error": str(error), "detail": error.detail})


Handler = Callable[[Request], Awaitable[Response]]


class HttpServer:
    """Serves ``handler`` on ``host:port``; ``reuse_port`` for workers sharing it."""

    def __init__(self, handler: Handler, host: str, port: int, *, reuse_port: bool = False):
        self.handler = handler
        self.host = host
        self.requested_port = port
        self.reuse_port = reuse_port
        self._server: asyncio.Server | None = None
        self._open = 0

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
        if self._open >= MAX_CONNECTIONS:
            writer.transport.abort()
            return
        self._open += 1
        try:
            await self._exchange(reader, writer)
        finally:
            self._open -= 1

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head_only = False
        try:
            try:
                request = await asyncio.wait_for(_read(reader, writer), REQUEST_TIMEOUT)
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


async def _read(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Request:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise HttpError(400, "request head too large") from None
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


def _encode(response: Response, head_only: bool) -> bytes:
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
