"""The admin API (app/admin.py) and its CLI (app/admin_cli.py) against a real broker
with its embedded Redis and Tansu, driven by real MQTT clients (paho).

One persistent broker with a token serves the module (tests keep apart by
client IDs); the read-only rule and flapping get brokers of their own.
"""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from paho.mqtt.packettypes import PacketTypes

from app import cli
from app.admin_cli import AdminClient
from app.embedded_services import EmbeddedServices
from persistence.format import decode_event_record
from tests.conftest import free_port
from tests.e2e.admin import (
    ADMINISTRATIVE_ACTION,
    BANNED,
    TOKEN,
    admin_broker,
    persistent_subscriber,
    publish,
    status,
    wait_for,
)
from tests.e2e.clients import V5, V311, Paho, props
from tests.e2e.conftest import REPO, BrokerProcess, is_mosquitto

pytestmark = pytest.mark.skipif(is_mosquitto(), reason="devicemq's admin API")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BrokerProcess, AdminClient]]:
    with admin_broker(tmp_path_factory.mktemp("admin")) as running:
        yield running


def test_a_request_without_the_token_is_refused(server: tuple[BrokerProcess, AdminClient]) -> None:
    _, api = server
    assert status(AdminClient(api.url), "GET", "sessions")[0] == 401
    assert status(AdminClient(api.url, "wrong"), "GET", "sessions")[0] == 401
    assert status(api, "GET", "sessions")[0] == 200
    stats = api.call("GET", "stats")
    assert stats["version"] and stats["uptime"] > 0 and stats["connections"] >= 0
    doc = api.call("GET", "openapi.json")
    assert doc["openapi"].startswith("3.")
    assert "/api/v1/sessions/{client_id}/messages" in doc["paths"]
    assert set(doc["paths"]["/api/v1/blocked"]) == {"get", "post", "delete"}


def test_a_persistent_session_its_backlog_peeked_then_purged(
    server: tuple[BrokerProcess, AdminClient],
) -> None:
    broker, api = server
    cid, topic = "adm-backlog", "adm/backlog"
    sub = persistent_subscriber(broker, cid, topic)
    publish(broker, topic, 5, "adm-backlog-pub")

    def listed() -> dict[str, Any] | None:
        items = api.call("GET", "sessions", {"client_id": "adm-backlog", "persistent": True})
        found = [s for s in items["items"] if s["client_id"] == cid]
        return found[0] if found and found[0]["backlog"] == 5 else None

    view = wait_for(listed, "the five messages stored")
    assert (view["connected"], view["persistent"], view["protocol"]) == (False, True, "3.1.1")
    assert view["subscriptions"] == 1 and view["peer"] == "127.0.0.1"
    assert view["last_seen"] >= view["connected_at"] > 0

    detail = api.call("GET", api.session_path(cid))
    assert detail["subscription_list"][0]["filter"] == topic
    assert detail["backlog_detail"]["packet_ids"] == [1, 5]
    low, high = detail["backlog_detail"]["scores"]
    assert high - low == 4
    assert 0 <= detail["backlog_detail"]["oldest_age"] < 60

    peek = api.call("GET", api.session_path(cid, "messages"), {"limit": 2, "payload": True})
    assert [m["packet_id"] for m in peek["items"]] == [1, 2]
    assert base64.b64decode(peek["items"][0]["payload"]) == b"m0"
    assert peek["items"][0]["topic"] == topic and peek["items"][0]["size"] == 2
    # the time kept with a stored message is its publish time (the store's is not kept)
    assert 0 <= time.time() - peek["items"][0]["published_at"] < 60
    no_payload = api.call("GET", api.session_path(cid, "messages"), {"limit": 1})
    assert "payload" not in no_payload["items"][0]
    cut = api.call("GET", api.session_path(cid, "messages"), {"payload": True, "payload_max": 1})
    assert base64.b64decode(cut["items"][0]["payload"]) == b"m"
    assert cut["items"][0]["payload_truncated"] and not peek["items"][0]["payload_truncated"]

    assert api.call("DELETE", api.session_path(cid, "messages"))["purged"] == 5
    assert api.call("GET", api.session_path(cid))["backlog"] == 0
    # The session is kept: a message published now is the only one delivered.
    publish(broker, topic, 1, "adm-backlog-pub")
    wait_for(lambda: api.call("GET", api.session_path(cid))["backlog"] == 1, "the new one stored")
    assert sub.connect(clean_start=False).session_present
    (got,) = sub.get_n(1)
    assert got.payload == b"m0"  # the new one (the publisher counts from m0 again)
    sub.assert_no_message()
    sub.close()
    # every purged message and the write itself are in the events topic
    events = _events(broker, cid)
    assert sum(1 for e in events if e["ev"] == "purged") == 5
    assert any(e["ev"] == "admin" and e["action"] == "purge" for e in events)


def test_kick_and_delete_a_connected_client(server: tuple[BrokerProcess, AdminClient]) -> None:
    broker, api = server
    v5 = Paho(broker, "adm-kick", V5)
    expiry = props(PacketTypes.CONNECT, SessionExpiryInterval=300)
    assert v5.connect(clean_start=False, properties=expiry).reason_code == 0
    v5.subscribe("adm/kick", 1)
    api.call("POST", api.session_path("adm-kick", "disconnect"))
    gone = v5.wait_disconnected()
    assert gone.from_server and gone.reason_code == ADMINISTRATIVE_ACTION
    # not connected any more: a second kick is a conflict
    wait_for(lambda: not api.call("GET", api.session_path("adm-kick"))["connected"], "offline")
    assert status(api, "POST", api.session_path("adm-kick", "disconnect"))[0] == 409

    v3 = Paho(broker, "adm-delete", V311)
    assert v3.connect(clean_start=False).reason_code == 0
    v3.subscribe("adm/delete", 1)
    api.call("DELETE", api.session_path("adm-delete"))
    v3.wait_disconnected()
    assert status(api, "GET", api.session_path("adm-delete"))[0] == 404
    # ended for good: the next connect finds no session
    assert not v3.connect(clean_start=False).session_present
    v3.close()


def test_a_blocked_client_is_refused_and_disconnected(
    server: tuple[BrokerProcess, AdminClient],
) -> None:
    broker, api = server
    victim = Paho(broker, "adm-blocked", V5)
    assert victim.connect().reason_code == 0
    entry = api.call(
        "POST", "blocked", body={"kind": "client_id_regex", "value": "adm-bl.*", "reason": "t"}
    )
    assert entry["closed_here"] == 1
    assert victim.wait_disconnected().reason_code == ADMINISTRATIVE_ACTION
    assert victim.connect().reason_code == BANNED
    other = Paho(broker, "adm-fine", V5)
    assert other.connect().reason_code == 0
    other.close()
    listed = api.call("GET", "blocked")["items"]
    assert {"kind": "client_id_regex", "value": "adm-bl.*"}.items() <= listed[0].items()
    api.call("DELETE", "blocked", {"kind": "client_id_regex", "value": "adm-bl.*"})
    assert victim.connect().reason_code == 0
    victim.close()
    nobody = {"kind": "client_id", "value": "nobody"}
    assert status(api, "DELETE", "blocked", query=nobody)[0] == 404


def test_a_block_with_a_ttl_ends_by_itself(server: tuple[BrokerProcess, AdminClient]) -> None:
    broker, api = server
    api.call("POST", "blocked", body={"kind": "client_id", "value": "adm-ttl", "ttl": 1})
    client = Paho(broker, "adm-ttl", V5)
    assert client.connect().reason_code == BANNED
    wait_for(lambda: client.connect().reason_code == 0, "the entry ended", timeout=10)
    client.close()
    assert all(e["value"] != "adm-ttl" for e in api.call("GET", "blocked")["items"])


@pytest.mark.parametrize(
    ("method", "path", "kw", "expected", "text"),
    [
        ("GET", "sessions", {"query": {"limit": 5000}}, 400, "limit"),
        ("GET", "sessions", {"query": {"connected": "maybe"}}, 400, "connected"),
        ("GET", "sessions/nobody-at-all", {}, 404, "no session"),
        ("POST", "blocked", {"body": {"kind": "ip", "value": "1.2.3.4"}}, 400, "kind"),
        ("POST", "blocked", {"body": {"kind": "address", "value": "1.2.3.999"}}, 400, "value"),
        ("POST", "blocked", {"body": {"kind": "client_id", "value": "x", "ttl": -1}}, 400, "ttl"),
        ("POST", "blocked", {"body": {"kind": "client_id", "value": "x", "tll": 1}}, 400, "tll"),
        ("POST", "blocked", {"body": [1]}, 400, "object"),
        ("DELETE", "retained", {"query": {"topic": "a/#"}}, 400, "topic"),
        ("DELETE", "retained", {"query": {"topic": "adm/none"}}, 404, "no retained"),
        ("PUT", "sessions", {}, 405, "PUT"),
        ("GET", "nothing", {}, 404, "openapi"),
    ],
)
def test_bad_input_gets_the_documented_error(
    server: tuple[BrokerProcess, AdminClient],
    method: str,
    path: str,
    kw: dict[str, Any],
    expected: int,
    text: str,
) -> None:
    _, api = server
    got, message = status(api, method, path, **kw)
    assert got == expected and text in message, message


def test_a_clean_session_has_no_stored_messages_to_purge(
    server: tuple[BrokerProcess, AdminClient],
) -> None:
    broker, api = server
    client = Paho(broker, "adm-clean", V5)
    client.connect()
    assert status(api, "DELETE", api.session_path("adm-clean", "messages"))[0] == 409
    view = api.call("GET", api.session_path("adm-clean"))
    assert (view["connected"], view["persistent"], view["protocol"]) == (True, False, "5.0")
    client.close()


def test_retained_messages_listed_and_deleted(server: tuple[BrokerProcess, AdminClient]) -> None:
    broker, api = server
    pub = Paho(broker, "adm-retain", V5)
    pub.connect()
    pub.publish("adm/retained/a", b"hello", qos=1, retain=True)
    pub.close()
    items = api.call("GET", "retained", {"topic": "adm/retained/#"})["items"]
    assert [(r["topic"], r["size"]) for r in items] == [("adm/retained/a", 5)]
    api.call("DELETE", "retained", {"topic": "adm/retained/a"})
    assert api.call("GET", "retained", {"topic": "adm/retained/#"})["items"] == []
    late = Paho(broker, "adm-retain-sub", V5)
    late.connect()
    late.subscribe("adm/retained/#", 1)
    late.assert_no_message()
    late.close()


def test_retained_messages_are_paged_by_cursor(server: tuple[BrokerProcess, AdminClient]) -> None:
    """Issue 45 #13: one request lists one page (limit), the next starts after its
    next_cursor; before, every match was walked and sorted at once and the cursor
    did not exist."""
    broker, api = server
    pub = Paho(broker, "adm-retained-pager", V5)
    pub.connect()
    topics = [f"adm/pages/{name}" for name in ("e", "a", "d", "b", "c")]
    for topic in topics:
        pub.publish(topic, b"r", qos=1, retain=True)
    pub.disconnect()
    seen: list[str] = []
    cursor = None
    for _ in range(3):
        page = api.call("GET", "retained", {"topic": "adm/pages/#", "limit": 2, "cursor": cursor})
        seen += [r["topic"] for r in page["items"]]
        cursor = page["next_cursor"]
        assert page["truncated"] == (cursor is not None)
    assert seen == sorted(topics) and cursor is None


def test_the_cli_pages_retained_messages(
    server: tuple[BrokerProcess, AdminClient],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    broker, api = server
    pub = Paho(broker, "adm-retained-cli", V5)
    pub.connect()
    for name in ("c", "a", "b"):
        pub.publish(f"adm/cli-pages/{name}", b"r", qos=1, retain=True)
    pub.disconnect()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    common = ["--url", api.url, "--token-file", str(token_file), "--topic", "adm/cli-pages/#"]
    assert cli.main(["retained", "list", *common, "--limit", "2"]) == 0
    out = capsys.readouterr().out
    assert "adm/cli-pages/a" in out and "adm/cli-pages/c" not in out
    assert "(more: --all, or the API with cursor=adm/cli-pages/b)" in out
    assert cli.main(["retained", "list", *common, "--limit", "2", "--all"]) == 0
    out = capsys.readouterr().out
    assert all(f"adm/cli-pages/{name}" in out for name in "abc") and "(more" not in out


def test_sessions_are_paged_by_cursor(server: tuple[BrokerProcess, AdminClient]) -> None:
    broker, api = server
    clients = [Paho(broker, f"adm-page-{i}", V5) for i in range(5)]
    for c in clients:
        c.connect()
    seen: list[str] = []
    cursor = None
    while True:
        page = api.call("GET", "sessions", {"client_id": "adm-page-", "limit": 2, "cursor": cursor})
        assert len(page["items"]) <= 2
        seen += [s["client_id"] for s in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [f"adm-page-{i}" for i in range(5)]
    connected = api.call("GET", "sessions", {"client_id": "adm-page-", "connected": False})
    assert connected["items"] == []
    for c in clients:
        c.close()


def test_the_cli_lists_kicks_and_blocks(
    server: tuple[BrokerProcess, AdminClient],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    broker, api = server
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    common = ["--url", api.url, "--token-file", str(token_file)]
    client = Paho(broker, "adm-cli", V5)
    client.connect()
    assert cli.main(["sessions", "list", *common, "--prefix", "adm-cli"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["CLIENT_ID", "CONNECTED", "PERSISTENT"]
    assert table[1].split()[:2] == ["adm-cli", "yes"]
    assert cli.main(["sessions", "show", *common, "--json", "adm-cli"]) == 0
    assert orjson.loads(capsys.readouterr().out)["client_id"] == "adm-cli"
    assert cli.main(["sessions", "kick", *common, "adm-cli"]) == 0
    assert client.wait_disconnected().reason_code == ADMINISTRATIVE_ACTION
    capsys.readouterr()
    assert cli.main(["blocked", "add", *common, "username", "mallory", "--ttl", "60"]) == 0
    assert cli.main(["blocked", "list", *common, "--json"]) == 0
    out = capsys.readouterr().out
    assert '"mallory"' in out
    assert cli.main(["blocked", "remove", *common, "username", "mallory"]) == 0
    # errors: one line, exit status 1
    assert cli.main(["sessions", "show", *common, "nobody-here"]) == 1
    assert capsys.readouterr().err.strip() == "devicemq: error: 404: no session nobody-here"
    assert cli.main(["sessions", "list", "--url", api.url]) == 1  # no token
    assert "401" in capsys.readouterr().err
    client.close()


def test_the_cli_reads_the_brokers_token_file_from_its_environment(
    server: tuple[BrokerProcess, AdminClient],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`docker compose exec devicemq devicemq sessions list` (issue 40): the CLI in
    the broker's container finds the token through DEVICEMQ_ADMIN_TOKEN_FILE."""
    _broker, api = server
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    monkeypatch.delenv("DEVICEMQ_ADMIN_TOKEN", raising=False)
    monkeypatch.setenv("DEVICEMQ_ADMIN_TOKEN_FILE", str(token_file))
    assert cli.main(["sessions", "list", "--url", api.url]) == 0
    assert capsys.readouterr().out.startswith("CLIENT_ID")
    monkeypatch.setenv("DEVICEMQ_ADMIN_TOKEN", "wrong")  # the token itself comes first
    assert cli.main(["sessions", "list", "--url", api.url]) == 1
    assert "401" in capsys.readouterr().err
    monkeypatch.delenv("DEVICEMQ_ADMIN_TOKEN")
    monkeypatch.setenv("DEVICEMQ_ADMIN_TOKEN_FILE", str(tmp_path / "missing"))
    assert cli.main(["sessions", "list", "--url", api.url]) == 1
    assert "cannot read the token file" in capsys.readouterr().err


def _raw_http(port: int, source: str, request: bytes) -> bytes:
    """What the admin listener answers ``request`` sent from ``source`` (127.0.0.x)."""
    with socket.create_connection(("127.0.0.1", port), 5, source_address=(source, 0)) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


def _get_stats(token: str) -> bytes:
    return f"GET /api/v1/stats HTTP/1.1\r\nAuthorization: Bearer {token}\r\n\r\n".encode()


def test_idle_sockets_from_one_address_cannot_lock_the_admin_listener(
    server: tuple[BrokerProcess, AdminClient],
) -> None:
    """Issue 45 #8: 64 idle sockets (the listener's cap) from one address used to take
    every place, and every request was closed unanswered until they timed out."""
    _, api = server
    port = int(api.url.rsplit(":", 1)[1])
    idle = [
        socket.create_connection(("127.0.0.1", port), 5, source_address=("127.0.0.7", 0))
        for _ in range(64)
    ]
    try:
        assert status(api, "GET", "stats")[0] == 200  # from 127.0.0.1
        answer = _raw_http(port, "127.0.0.7", _get_stats(TOKEN))  # the same address
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
        # All but admin.max_connections_per_source (8) of them were pushed out.
        for sock in idle[:56]:
            sock.settimeout(5)
            assert sock.recv(1) == b""
    finally:
        for sock in idle:
            sock.close()


def test_guessing_the_admin_token_is_slowed_and_logged(
    server: tuple[BrokerProcess, AdminClient],
) -> None:
    """Issue 45 #9: wrong tokens were answered 401 as fast as they came (~1,650/s),
    with no log line. Past a burst of 10 an address gets 429, the right token too
    (a guess then tells nothing), and the log names the address."""
    broker, api = server
    port = int(api.url.rsplit(":", 1)[1])
    codes = [_raw_http(port, "127.0.0.9", _get_stats(f"guess-{i}"))[9:12] for i in range(15)]
    assert codes[:10] == [b"401"] * 10 and codes[-3:] == [b"429"] * 3, codes
    assert _raw_http(port, "127.0.0.9", _get_stats(TOKEN))[9:12] == b"429"
    assert b"Retry-After: 1" in _raw_http(port, "127.0.0.9", _get_stats(TOKEN))
    assert _raw_http(port, "127.0.0.10", _get_stats(TOKEN))[9:12] == b"200"
    assert status(api, "GET", "stats")[0] == 200
    log = broker.log()
    assert "admin: a wrong token from 127.0.0.9 (GET /api/v1/stats)" in log
    assert "too many wrong tokens from 127.0.0.9" in log
    assert "guess-" not in log  # the guesses themselves are not logged


def test_a_client_id_segment_of_dot_is_marked_not_resolved(
    server: tuple[BrokerProcess, AdminClient],
) -> None:
    """Issue 45 #10 at the HTTP level: a client like a browser or a proxy resolves
    /sessions/./messages to /sessions/messages; "%00." is the client ID "." and
    reaches that session, "." and ".." alone name no session."""
    broker, api = server
    persistent_subscriber(broker, "..", "adm/dotdot")
    publish(broker, "adm/dotdot", 1, "adm-dotdot-pub")
    wait_for(lambda: api.call("GET", "sessions/%00..")["backlog"] == 1, "the message stored")
    assert api.session_path("..", "messages") == "sessions/%00../messages"
    assert api.call("DELETE", "sessions/%00../messages")["purged"] == 1
    assert api.call("GET", "sessions/%00..")["client_id"] == ".."
    assert status(api, "GET", "sessions/%00")[0] == 404  # a NUL alone: no such session


def test_a_short_admin_token_stops_the_start(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVICEMQ_")}
    env.update(
        PYTHONPATH=str(REPO),
        DEVICEMQ_PERSISTENCE_ENABLED="false",
        DEVICEMQ_DATA_DIR=str(tmp_path),
        DEVICEMQ_ADMIN_PORT=str(free_port("127.0.0.1")),
        DEVICEMQ_ADMIN_TOKEN="hunter2",
    )
    argv = [sys.executable, "-m", "app.cli", "run", "--host", "127.0.0.1", "--port"]
    done = subprocess.run(
        [*argv, str(free_port("127.0.0.1"))],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=60,
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("devicemq: error: admin.token: the token has 7 characters"), last


# -- brokers of their own --------------------------------------------------------------------


def test_without_a_token_the_api_is_read_only(tmp_path: Path) -> None:
    with admin_broker(tmp_path / "b", token=None, **{"persistence.enabled": False}) as (
        broker,
        api,
    ):
        client = Paho(broker, "ro-client", V5)
        client.connect()
        assert [s["client_id"] for s in api.call("GET", "sessions")["items"]] == ["ro-client"]
        code, message = status(api, "POST", api.session_path("ro-client", "disconnect"))
        assert code == 403 and "token" in message
        assert client.connected
        client.close()


def test_a_flapping_client_is_blocked(tmp_path: Path) -> None:
    flapping = {
        "persistence.enabled": False,
        "flapping.enabled": True,
        "flapping.max_connects": 3,
        "flapping.ban_time": 600,
    }
    with admin_broker(tmp_path / "b", **flapping) as (broker, api):
        client = Paho(broker, "flapper", V5)
        codes = []
        for _ in range(4):
            codes.append(client.connect().reason_code)
            client.close()
        assert codes == [0, 0, 0, BANNED]
        (entry,) = api.call("GET", "blocked")["items"]
        assert (entry["value"], entry["by"]) == ("flapper", "flapping")
        assert 590 < entry["until"] - entry["created"] <= 600
        assert "flapping" in broker.log()


def _events(broker: BrokerProcess, client_id: str) -> list[dict[str, Any]]:
    """Every event of ``client_id`` in the embedded Kafka's events topic, in order."""
    kafka = next(s for s in EmbeddedServices(broker.data_dir).status() if s.name == "kafka")

    async def read() -> list[dict[str, Any]]:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=f"127.0.0.1:{kafka.port}", auto_offset_reset="earliest"
        )
        await consumer.start()
        try:
            partitions = consumer.partitions_for_topic("devicemq.events") or set()
            tps = [TopicPartition("devicemq.events", p) for p in partitions]
            consumer.assign(tps)
            ends = await consumer.end_offsets(tps)
            found: list[dict[str, Any]] = []
            while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
                for records in (await consumer.getmany(timeout_ms=2000)).values():
                    for record in records:
                        events = decode_event_record(record.value)
                        found += [e for e in events if e["cid"] == client_id]
            return found
        finally:
            await consumer.stop()

    def enough() -> list[dict[str, Any]] | None:
        events = asyncio.run(read())
        return events if any(e["ev"] == "admin" for e in events) else None

    return wait_for(enough, "the admin event written (the event log flushes every second)")  # type: ignore[no-any-return]


def test_who_subscribes_to_a_topic_plain_shared_and_group_queue_members(
    server: tuple[BrokerProcess, AdminClient],
) -> None:
    broker, api = server
    clients = []
    for cid, topic_filter, qos in (
        ("who-a", "who/+/temp", 1),
        ("who-b", "who/#", 0),
        ("who-c", "$share/g/who/+/temp", 1),
        ("who-e", "who/other", 1),
    ):
        client = Paho(broker, cid, V5)
        assert client.connect().reason_code == 0
        assert client.subscribe(topic_filter, qos) == [qos]
        clients.append(client)
    persistent_subscriber(broker, "who-d", "$queue/gq/who/#")
    try:
        answer = api.call("GET", "subscribers", {"topic": "who/x/temp"})
        got = [
            (i["client_id"], i["filter"], i["qos"], i["share_group"], i["group_queue"])
            for i in answer["items"]
        ]
        assert got == [
            ("who-a", "who/+/temp", 1, None, False),
            ("who-b", "who/#", 0, None, False),
            ("who-c", "$share/g/who/+/temp", 1, "g", False),
            ("who-d", "$queue/gq/who/#", 1, "$queue/gq", True),
        ], got
        assert (answer["count"], answer["truncated"]) == (4, False)
        assert {i["replica"] for i in answer["items"]} == {api.call("GET", "stats")["node"]}

        page = api.call("GET", "subscribers", {"topic": "who/x/temp", "limit": 2})
        assert [i["client_id"] for i in page["items"]] == ["who-a", "who-b"]
        assert (page["count"], page["truncated"]) == (4, True)
        assert api.call("GET", "subscribers", {"topic": "who/none"})["items"][0]["client_id"] == (
            "who-b"
        )
        for bad in ("who/+/temp", "who/#", ""):
            code, error = status(api, "GET", "subscribers", query={"topic": bad})
            assert code == 400 and "topic" in error and "\n" not in error, (bad, error)
    finally:
        for client in clients:
            client.close()


def test_the_replicas_of_a_broker_without_a_cluster_are_itself(
    server: tuple[BrokerProcess, AdminClient],
) -> None:
    broker, api = server
    client = Paho(broker, "replicas-one", V5)
    assert client.connect().reason_code == 0
    try:
        answer = api.call("GET", "replicas")
        stats = api.call("GET", "stats")
        assert answer["cluster"] is False
        [me] = answer["items"]
        assert (me["node"], me["here"]) == (stats["node"], True)
        assert me["connected"] >= 1 and abs(me["last_seen"] - time.time()) < 60
    finally:
        client.close()
