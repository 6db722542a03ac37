"""app/http.py and app/admin.py's rules without a broker process: the HTTP edge on a
real socket, the token and loopback rules, routing and the OpenAPI document."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import orjson
import pytest

from app.admin import ROUTES, AdminApi, AdminServer, admin_token, openapi_document
from app.http import MAX_BODY, Request
from broker.config import AdminSettings, ConfigError, Settings
from broker.core import Broker
from tests.conftest import free_port


def _settings(**admin: object) -> Settings:
    defaults: dict[str, object] = {"port": free_port("127.0.0.1")}
    return dataclasses.replace(Settings(), admin=AdminSettings(**{**defaults, **admin}))  # type: ignore[arg-type]


def _api(token: str | None = None) -> AdminApi:
    settings = _settings()
    return AdminApi(settings, Broker(settings), "node-1", token=token)


def _request(method: str, path: str, peer: str = "127.0.0.1", **headers: str) -> Request:
    return Request(method, path, {}, {k.lower(): v for k, v in headers.items()}, b"", peer)


async def _status(api: AdminApi, request: Request) -> int:
    from app.http import HttpError

    try:
        return (await api.handle(request)).status
    except HttpError as e:
        return e.status


async def test_without_a_token_reads_answer_loopback_only_and_writes_are_refused() -> None:
    api = _api()
    assert await _status(api, _request("GET", "/api/v1/sessions")) == 200
    assert await _status(api, _request("GET", "/api/v1/sessions", peer="::1")) == 200
    assert await _status(api, _request("GET", "/api/v1/sessions", peer="::ffff:127.0.0.1")) == 200
    assert await _status(api, _request("GET", "/api/v1/sessions", peer="10.1.2.3")) == 403
    assert await _status(api, _request("POST", "/api/v1/blocked")) == 403
    assert await _status(api, _request("DELETE", "/api/v1/sessions/x")) == 403


async def test_with_a_token_every_api_request_needs_it_from_anywhere() -> None:
    api = _api("s3cret")
    assert await _status(api, _request("GET", "/api/v1/sessions")) == 401
    wrong = _request("GET", "/api/v1/sessions", Authorization="Bearer nope")
    assert await _status(api, wrong) == 401
    basic = _request("GET", "/api/v1/sessions", Authorization="Basic s3cret")
    assert await _status(api, basic) == 401
    right = _request("GET", "/api/v1/sessions", peer="10.1.2.3", Authorization="Bearer s3cret")
    assert await _status(api, right) == 200
    # the console's files hold no data: no token needed
    assert await _status(api, _request("GET", "/does-not-exist.js")) == 404


async def test_routing_answers_404_405_and_decodes_client_ids() -> None:
    api = _api()
    assert await _status(api, _request("GET", "/api/v1/nope")) == 404
    assert await _status(api, _request("PATCH", "/api/v1/sessions")) == 405
    assert await _status(api, _request("GET", "/api/v1/sessions/a%2Fb")) == 404  # no such session
    assert await _status(api, _request("GET", "/api/v1/sessions/a/b/c/d")) == 404
    for name in ("../pyproject.toml", "%2e%2e/x.html", ".hidden.js", "x.py"):
        assert await _status(api, _request("GET", f"/{name}")) == 404, name


def test_the_openapi_document_lists_every_route() -> None:
    doc = openapi_document()
    listed = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert listed == {(r.method, "/api/v1/" + "/".join(r.pattern)) for r in ROUTES}
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


def test_the_token_file_is_read_and_its_problems_named(tmp_path: Path) -> None:
    good = tmp_path / "token"
    good.write_text("abc\n")
    assert admin_token(_settings(token_file=str(good))) == "abc"
    assert admin_token(_settings(token="from-env")) == "from-env"
    assert admin_token(_settings()) is None
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for path in (empty, tmp_path / "missing"):
        with pytest.raises(ConfigError) as caught:
            admin_token(_settings(token_file=str(path)))
        assert "admin.token_file" in str(caught.value)


def test_generate_token_creates_the_file_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """admin.generate_token (issue 40, docker-compose.yml): the file and its directory
    made at the first start, 0600; a random token logged once; kept afterwards."""
    path = tmp_path / "admin" / "token"
    settings = _settings(token_file=str(path), generate_token=True)
    with caplog.at_level("WARNING", logger="devicemq.admin"):
        token = admin_token(settings)
    assert token is not None and len(token) >= 32
    assert path.read_text() == token + "\n"
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert [r.getMessage().count(token) for r in caplog.records] == [1]
    caplog.clear()
    with caplog.at_level("WARNING", logger="devicemq.admin"):
        assert admin_token(settings) == token  # the next start reads it
    assert not caplog.records


def test_generate_token_writes_the_operators_token_unlogged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "token"
    settings = _settings(token_file=str(path), token="chosen-token", generate_token=True)
    with caplog.at_level("WARNING", logger="devicemq.admin"):
        assert admin_token(settings) == "chosen-token"
    assert path.read_text() == "chosen-token\n"
    assert "chosen-token" not in caplog.text and str(path) in caplog.text


def test_generate_token_problems_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"admin\.generate_token needs admin\.token_file"):
        admin_token(_settings(generate_token=True))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="cannot create the token file") as caught:
        admin_token(_settings(token_file=str(blocker / "token"), generate_token=True))
    assert caught.value.name == "admin.token_file"


async def test_a_changed_token_file_is_read_again(tmp_path: Path) -> None:
    """As the password file: no restart for a new token; an unreadable or empty
    file keeps the one in force."""
    path = tmp_path / "token"
    path.write_text("first\n")
    settings = _settings(token_file=str(path))
    now = [1000.0]
    broker = Broker(settings, clock=lambda: now[0])
    api = AdminApi(settings, broker, "node-1", token=admin_token(settings))

    def get(token: str) -> Request:
        return _request("GET", "/api/v1/sessions", Authorization=f"Bearer {token}")

    assert await _status(api, get("first")) == 200
    path.write_text("second\n")
    os.utime(path, ns=(1, 1))  # a different mtime, whatever the file system's resolution
    assert await _status(api, get("second")) == 401  # checked at most once a second
    now[0] += 1.5
    assert await _status(api, get("second")) == 200
    assert await _status(api, get("first")) == 401
    path.write_text("  \n")
    os.utime(path, ns=(2, 2))
    now[0] += 1.5
    assert await _status(api, get("second")) == 200  # empty: the token in force stays
    path.unlink()
    now[0] += 1.5
    assert await _status(api, get("second")) == 200  # gone: likewise


# -- the HTTP edge on a socket ------------------------------------------------------------


@pytest.fixture
async def server() -> AsyncIterator[AdminServer]:
    settings = _settings()
    admin = AdminServer(settings, AdminApi(settings, Broker(settings), "n", token=None))
    await admin.start()
    try:
        yield admin
    finally:
        await admin.stop()


async def _exchange(port: int, data: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    status = int(answer.split(b" ", 2)[1])
    return status, answer.split(b"\r\n\r\n", 1)[1]


async def test_the_edge_answers_malformed_requests_with_4xx(server: AdminServer) -> None:
    port = server.port
    assert (await _exchange(port, b"GET /api/v1/stats HTTP/1.1\r\n\r\n"))[0] == 200
    assert (await _exchange(port, b"NONSENSE\r\n\r\n"))[0] == 400
    assert (await _exchange(port, b"GET / HTTP/1.1\r\nno colon\r\n\r\n"))[0] == 400
    chunked = b"POST /api/v1/blocked HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    assert (await _exchange(port, chunked))[0] == 411
    big = f"POST /api/v1/blocked HTTP/1.1\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n".encode()
    assert (await _exchange(port, big))[0] == 413
    status, body = await _exchange(port, b"GET /api/v1/sessions?limit=x HTTP/1.1\r\n\r\n")
    assert status == 400
    assert orjson.loads(body) == {
        "error": "limit: an integer is needed",
        "detail": {"field": "limit"},
    }
    status, body = await _exchange(port, b"HEAD /api/v1/stats HTTP/1.1\r\n\r\n")
    assert status == 200 and body == b""
    # the listener keeps serving after all that
    assert (await _exchange(port, b"GET /api/v1/stats HTTP/1.1\r\n\r\n"))[0] == 200


async def test_a_taken_port_is_a_start_error_naming_the_setting(server: AdminServer) -> None:
    from app.admin import AdminUnavailable

    settings = _settings(port=server.port)
    second = AdminServer(settings, AdminApi(settings, Broker(settings), "n", token=None))
    with pytest.raises(AdminUnavailable) as caught:
        await second.start()
    assert str(caught.value).startswith("admin.port: cannot serve the admin API on 127.0.0.1:")


async def test_without_a_token_the_host_must_name_this_machine() -> None:
    """A page whose name was rebound to 127.0.0.1 sends its own name (DNS rebinding)."""
    api = _api()
    for host in ("localhost", "localhost:18083", "127.0.0.1:18083", "[::1]:18083", "[::1]"):
        assert await _status(api, _request("GET", "/api/v1/stats", Host=host)) == 200, host
    for host in ("evil.example", "evil.example:18083", "10.0.0.1", "[2001:db8::1]:80"):
        assert await _status(api, _request("GET", "/api/v1/stats", Host=host)) == 403, host
    with_token = _api("t")
    rebound = _request("GET", "/api/v1/stats", Host="evil.example", Authorization="Bearer t")
    assert await _status(with_token, rebound) == 200  # the token is what counts then


async def test_idle_connections_are_capped(server: AdminServer) -> None:
    """Sockets opened by anyone, before any token is read: at most MAX_CONNECTIONS
    are held, the next is closed at once, and the listener serves again after."""
    from app.http import MAX_CONNECTIONS

    idle = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(MAX_CONNECTIONS)]
    await _until(lambda: server.http._open == MAX_CONNECTIONS)  # all taken
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, unanswered
    writer.close()
    for _, w in idle:
        w.close()
    await _until(lambda: server.http._open == 0)
    assert (await _exchange(server.port, b"GET /api/v1/stats HTTP/1.1\r\n\r\n"))[0] == 200


async def _until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(5):
        while not condition():
            await asyncio.sleep(0.01)


def test_every_route_has_its_handler() -> None:
    api = _api()
    for route in ROUTES:
        assert callable(getattr(api, route.handler)), route
