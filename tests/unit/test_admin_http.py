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
    good.write_text("abcdefghijklmnop\n")
    assert admin_token(_settings(token_file=str(good))) == "abcdefghijklmnop"
    assert admin_token(_settings(token="from-env-16-chars")) == "from-env-16-chars"
    assert admin_token(_settings()) is None
    empty = tmp_path / "empty"
    empty.write_text("\n")
    short = tmp_path / "short"
    short.write_text("abc\n")
    for path in (empty, tmp_path / "missing", short):
        with pytest.raises(ConfigError) as caught:
            admin_token(_settings(token_file=str(path)))
        assert "admin.token_file" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        admin_token(_settings(token="s3cret"))
    assert str(caught.value) == (
        "admin.token: the token has 6 characters, at least 16 are needed "
        "(e.g. head -c 32 /dev/urandom | base64)"
    )


async def test_wrong_tokens_from_one_address_are_slowed_to_a_trickle() -> None:
    """Issue 45 #9: past a burst of 10 wrong tokens an address gets 429 for every /api
    request, the right token too (so a guess then tells nothing), until it slows to
    admin.max_auth_failures_per_source; other addresses are not touched."""
    settings = _settings()
    broker = Broker(settings)
    now = [100.0]
    broker.clock = lambda: now[0]  # type: ignore[method-assign]
    api = AdminApi(settings, broker, "n", token="the-right-token-0123")

    def call(token: str | None, peer: str = "10.0.0.9") -> Request:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        return _request("GET", "/api/v1/stats", peer=peer, **headers)

    for _ in range(5):
        assert await _status(api, call(None)) == 401  # no token: no guess, not counted
    for _ in range(10):
        assert await _status(api, call("guess")) == 401
    assert await _status(api, call("guess")) == 429
    assert await _status(api, call("the-right-token-0123")) == 429
    assert await _status(api, call("the-right-token-0123", peer="10.0.0.10")) == 200
    now[0] += 1.0  # one more try a second
    assert await _status(api, call("guess")) == 401
    assert await _status(api, call("guess")) == 429
    now[0] += 1.0
    assert await _status(api, call("the-right-token-0123")) == 200


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


async def _idle(port: int, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def test_idle_connections_cannot_lock_the_listener(server: AdminServer) -> None:
    """Issue 45 #8: sockets opened by anyone, before any request is read: one address
    holds at most admin.max_connections_per_source, and a newcomer pushes out the
    oldest idle one, so a request sent at once is answered, from that address too."""
    from app.http import MAX_CONNECTIONS

    per_source = 8
    idle = [await _idle(server.port, "127.0.0.7") for _ in range(MAX_CONNECTIONS)]
    await _until(lambda: server.http.gate.by_source.get("127.0.0.7") == per_source)
    assert server.http.gate.open == per_source
    assert (await _exchange(server.port, b"GET /api/v1/stats HTTP/1.1\r\n\r\n"))[0] == 200
    request = b"GET /api/v1/stats HTTP/1.1\r\n\r\n"
    reader, writer = await _idle(server.port, "127.0.0.7")
    writer.write(request)
    assert (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/1.1 200 ")
    writer.close()
    pushed_out = [await asyncio.wait_for(r.read(), 5) for r, _ in idle[: MAX_CONNECTIONS - 8]]
    assert pushed_out == [b""] * (MAX_CONNECTIONS - 8)  # closed, unanswered
    for _, w in idle:
        w.close()
    await _until(lambda: server.http.gate.open == 0)


async def test_a_silent_socket_is_dropped_after_the_head_timeout(
    server: AdminServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request head must come within HEAD_TIMEOUT (3 s; shortened here), or
    the socket is closed unanswered; one that sent it is served."""
    import app.http

    monkeypatch.setattr(app.http, "HEAD_TIMEOUT", 0.3)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /api/v1/stats HTTP/1.1\r\n")  # the head, never finished
    started = asyncio.get_running_loop().time()
    assert await asyncio.wait_for(reader.read(), 5) == b""
    assert asyncio.get_running_loop().time() - started < 3  # not REQUEST_TIMEOUT's 5 s
    writer.close()
    assert (await _exchange(server.port, b"GET /api/v1/stats HTTP/1.1\r\n\r\n"))[0] == 200


async def test_connections_mid_request_are_not_pushed_out_429_then() -> None:
    """Connections that sent their head and wait for their body are not idle: a
    newcomer over the address's limit gets 429; over the global cap (from many
    addresses), with nobody idle to push out, it is closed unanswered."""
    from app.http import MAX_CONNECTIONS

    settings = _settings(max_connections_per_source=2)
    admin = AdminServer(settings, AdminApi(settings, Broker(settings), "n", token=None))
    await admin.start()
    try:
        head = b"POST /api/v1/blocked HTTP/1.1\r\nContent-Length: 10\r\n\r\n"
        busy = []
        for _ in range(2):
            busy.append(await _idle(admin.port, "127.0.0.8"))
            busy[-1][1].write(head)
        await _until(lambda: not admin.http.gate.waiting and admin.http.gate.open == 2)
        reader, writer = await _idle(admin.port, "127.0.0.8")
        answer = await asyncio.wait_for(reader.read(), 5)
        assert answer.startswith(b"HTTP/1.1 429 Too Many Requests"), answer
        writer.close()
        for i in range(MAX_CONNECTIONS - 2):
            busy.append(await _idle(admin.port, f"127.0.1.{i + 1}"))
            busy[-1][1].write(head)
        gate = admin.http.gate
        await _until(lambda: not gate.waiting and gate.open == MAX_CONNECTIONS)
        reader, writer = await _idle(admin.port, "127.0.2.1")
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        for _, w in busy:
            w.close()
    finally:
        await admin.stop()


async def _until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(5):
        while not condition():
            await asyncio.sleep(0.01)


async def test_listing_retained_messages_is_paged_and_yields_to_the_loop() -> None:
    """Issue 45 #13: GET /api/v1/retained?topic=# walked and sorted every retained
    message in one step of the event loop. It is paged now (limit, cursor) and
    walks a slice per loop turn: other work runs while it does."""
    from broker.message import Message

    api = _api()
    for i in range(20_000):
        api.broker.retained.store(Message(f"r/{i % 7}/t{i:05d}", b"x", 0, True))
    turns = 0
    done = False

    async def other_work() -> None:
        nonlocal turns
        while not done:
            await asyncio.sleep(0)
            turns += 1

    other = asyncio.create_task(other_work())
    await asyncio.sleep(0)
    query = {"topic": "r/#", "limit": "1000"}
    first = orjson.loads((await api.handle(_listing(query))).body)
    done = True
    await other
    assert turns > 100, turns  # the walk let the loop turn (0 before)
    everything = sorted(f"r/{i % 7}/t{i:05d}" for i in range(20_000))
    assert [m["topic"] for m in first["items"]] == everything[:1000]
    assert first["truncated"] and first["next_cursor"] == everything[999]
    seen = [m["topic"] for m in first["items"]]
    cursor = first["next_cursor"]
    while cursor is not None:
        page = orjson.loads((await api.handle(_listing({**query, "cursor": cursor}))).body)
        seen += [m["topic"] for m in page["items"]]
        cursor = page["next_cursor"]
    assert seen == everything


def _listing(query: dict[str, str]) -> Request:
    return Request("GET", "/api/v1/retained", query, {}, b"", "127.0.0.1")


def test_every_route_has_its_handler() -> None:
    api = _api()
    for route in ROUTES:
        assert callable(getattr(api, route.handler)), route
