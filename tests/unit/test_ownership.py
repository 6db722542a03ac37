"""Client IDs and $ECQ queues bound to their owner, and flapping counted only for a
client that may use its ID (issue 45, findings 1-3): the pure rules of
broker/ownership.py, and the sans-IO core's CONNECT and SUBSCRIBE answers."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import orjson
import pytest

from app.authentication import open_authentication
from broker.auth import hash_password, write_password_file
from broker.config import AuthSettings, ConfigError, FlappingSettings, Settings, TlsSettings
from broker.core import Broker, client_id_policy
from broker.ownership import CLIENT_ID, QUEUE, Claim, MemoryOwners, client_id_allowed
from broker.packets import (
    ConnAck,
    Connect,
    ConnectReturnCode,
    Properties,
    ReasonCode,
    SubAck,
    Subscribe,
    Subscription,
)
from broker.persistent_path import InMemoryPersistentPath
from tests.unit.core_harness import V5, V311, Client, FakeClock, Harness

PASSWORD = b"pw"
HASH = hash_password(PASSWORD)

# -- the pure rules ---------------------------------------------------------------------


def test_a_client_id_is_its_users_name_or_matches_a_pattern_naming_the_user() -> None:
    assert client_id_allowed("alice", "alice", ())
    assert not client_id_allowed("alice-1", "alice", ())
    assert client_id_allowed("alice-1", "alice", ("%u-*",))
    assert client_id_allowed("alice-", "alice", ("%u-*",))
    assert client_id_allowed("site/alice", "alice", ("%u-*", "site/%u"))
    assert not client_id_allowed("bob-1", "alice", ("%u-*",))
    assert not client_id_allowed("xalice-1", "alice", ("%u-*",))  # the whole ID
    assert client_id_allowed("a.ice-1", "a.ice", ("%u-*",))
    assert not client_id_allowed("abice-1", "a.ice", ("%u-*",))  # the dot is no wildcard
    assert not client_id_allowed("alice", None, ("%u-*", "*"))  # anonymous: no name
    # a user named "*" does not become a wildcard
    assert not client_id_allowed("anything-1", "*", ("%u-*",))


def _settings(tmp_path: Path | None = None, **auth: Any) -> Settings:
    return dataclasses.replace(Settings(), auth=AuthSettings(**auth))


def test_without_authentication_no_client_id_is_bound() -> None:
    assert client_id_policy(_settings()) == "off"  # the default, first, binds nothing
    assert client_id_policy(_settings(password_file="p")) == "first"
    assert client_id_policy(_settings(password_file="p", client_id_owner="off")) == "off"
    tls = dataclasses.replace(_settings(), tls=TlsSettings(cafile="ca.pem"))
    assert client_id_policy(tls) == "first"  # certificate identities


def test_username_binding_needs_user_names_and_patterns_naming_the_user() -> None:
    with pytest.raises(ConfigError, match=r"auth\.client_id_owner"):
        client_id_policy(_settings(client_id_owner="username"))
    with pytest.raises(ConfigError, match=r"auth\.client_id_pattern"):
        client_id_policy(_settings(password_file="p", client_id_pattern="%u-*, dev-*"))
    assert (
        client_id_policy(
            _settings(password_file="p", client_id_owner="username", client_id_pattern="%u-*")
        )
        == "username"
    )


def test_memory_claims_hold_until_released_or_run_out() -> None:
    clock = FakeClock()
    owners = MemoryOwners(clock)
    answers: list[Claim | None] = []
    owners.claim(CLIENT_ID, "dev", "alice", 10, answers.append)
    owners.claim(CLIENT_ID, "dev", "bob", 10, answers.append)
    owners.claim(CLIENT_ID, "dev", None, 10, answers.append)  # anonymous asks only
    owners.claim(QUEUE, "dev", "bob", 0, answers.append)  # another kind, another claim
    refused = Claim(False, "alice")
    assert answers == [Claim(True), refused, refused, Claim(True)]
    assert asyncio.run(owners.holder(CLIENT_ID, "dev")) == ("alice", 10)
    clock.now += 10
    assert asyncio.run(owners.holder(CLIENT_ID, "dev")) is None  # unused that long: free
    assert asyncio.run(owners.holder(QUEUE, "dev")) == ("bob", None)  # no deadline
    assert asyncio.run(owners.assign(QUEUE, "dev", "carol", 0)) == "bob"
    assert asyncio.run(owners.assign(QUEUE, "dev", None, 0)) == "carol"
    answers.clear()
    owners.claim(QUEUE, "dev", None, 0, answers.append)
    assert answers == [Claim(True)]  # nobody's: granted, nothing kept
    assert asyncio.run(owners.holder(QUEUE, "dev")) is None


# -- through the core ---------------------------------------------------------------------


class QueuePath(InMemoryPersistentPath):
    """A path that says it keeps queues (delivering none): SUBSCRIBE's rules only."""

    keeps_queues = True  # type: ignore[assignment]


def harness(
    tmp_path: Path, acl: str = "", path: Any = None, flaps: int = 20, **auth: Any
) -> Harness:
    passwd = tmp_path / "passwd"
    write_password_file(passwd, dict.fromkeys(("alice", "bob"), HASH))
    if acl:
        (tmp_path / "acl").write_text(acl)
        auth["acl_file"] = str(tmp_path / "acl")
    settings = dataclasses.replace(
        Settings(),
        auth=AuthSettings(password_file=str(passwd), allow_anonymous=True, **auth),
        flapping=FlappingSettings(enabled=True, max_connects=flaps, window=60.0, ban_time=30.0),
    )
    return Harness(settings, persistent_path=path)


def connect(h: Harness, cid: str, user: str | None, level: int = V5) -> tuple[Client, int]:
    client = h.client(level, peer=cid)
    password = PASSWORD if user is not None else None
    client.send(Connect(cid, protocol_level=level, username=user, password=password, keep_alive=0))
    connack = client.read()[0]
    assert isinstance(connack, ConnAck)
    return client, connack.reason_code


def test_a_stranger_connecting_as_a_device_gets_nobody_banned(tmp_path: Path) -> None:
    """Counted before the ownership check, a stranger's CONNECTs with the device's ID
    (and his own password) got the device disconnected 0x98 and banned."""
    for policy in ("first", "off"):  # refused by the ID's claim, or by the session's owner
        h = harness(tmp_path, flaps=2, client_id_owner=policy)
        device, code = connect(h, "dev-9", "alice")
        assert code == 0
        for _ in range(10):
            _, code = connect(h, "dev-9", "bob")
            assert code == ReasonCode.NOT_AUTHORIZED
        assert len(h.broker.blocklist) == 0
        assert h.broker.stats.flapping_blocks == 0
        assert not device.closed
        device.expect_nothing()


def test_the_owner_reconnecting_too_often_is_still_banned(tmp_path: Path) -> None:
    h = harness(tmp_path, flaps=2)
    for _ in range(2):
        client, code = connect(h, "flap", "alice")
        assert code == 0
        client.conn.connection_lost()
    third, code = connect(h, "flap", "alice")
    assert code == ReasonCode.BANNED and third.closed
    (entry,) = h.broker.blocklist.entries()
    assert entry.by == "flapping"
    assert "flap" not in h.broker.sessions  # the session opened for it ended with it


def test_client_id_owner_username_refuses_another_users_id(tmp_path: Path) -> None:
    h = harness(tmp_path, client_id_owner="username", client_id_pattern="%u-*")
    assert connect(h, "alice", "alice")[1] == 0
    assert connect(h, "alice-kitchen", "alice")[1] == 0
    assert connect(h, "alice", "bob")[1] == ReasonCode.CLIENT_IDENTIFIER_NOT_VALID
    assert connect(h, "dev-7", "bob")[1] == ReasonCode.CLIENT_IDENTIFIER_NOT_VALID
    assert connect(h, "bob-1", None)[1] == ReasonCode.CLIENT_IDENTIFIER_NOT_VALID  # anonymous
    # 3.1.1: return code 2, identifier rejected
    assert connect(h, "alice-2", "bob", V311)[1] == ConnectReturnCode.IDENTIFIER_REJECTED
    assert h.broker.stats.connections_rejected == {"client_id_not_the_users": 4}
    assert connect(h, "", "bob")[1] == 0  # an ID the broker assigns is nobody else's


def test_client_id_owner_first_holds_an_id_after_its_session_is_gone(tmp_path: Path) -> None:
    """Session ownership protected only a session that existed: once the device's clean
    session ended, anyone could connect with its ID (its %c rules, its queue)."""
    h = harness(tmp_path, client_id_release_after=3600.0)
    device, code = connect(h, "dev-7", "alice")
    assert code == 0
    device.conn.connection_lost()
    assert "dev-7" not in h.broker.sessions
    assert connect(h, "dev-7", "bob")[1] == ReasonCode.NOT_AUTHORIZED
    assert connect(h, "dev-7", None)[1] == ReasonCode.NOT_AUTHORIZED  # anonymous too
    assert h.broker.stats.connections_rejected == {"client_id_owned_by_another": 2}
    assert connect(h, "dev-7", "alice")[1] == 0
    h.advance(3601)  # alice is still connected: the claim ran out, the ID is hers
    assert connect(h, "dev-7", "bob")[1] == ReasonCode.NOT_AUTHORIZED
    asyncio.run(h.broker.owners.assign(CLIENT_ID, "dev-7", None, 0))  # an admin's release
    assert connect(h, "dev-7", "bob")[1] == ReasonCode.NOT_AUTHORIZED  # alice connected
    h.broker.sessions["dev-7"].connection.connection_lost()  # type: ignore[union-attr]
    h.advance(3601)  # unused that long: free
    assert connect(h, "dev-7", "bob")[1] == 0


def _queue_suback(client: Client, topic_filter: str) -> int:
    client.send(Subscribe(client.next_id(), [Subscription(topic_filter, 1)]))
    (suback,) = client.read()
    assert isinstance(suback, SubAck)
    return suback.reason_codes[0]


def test_a_queue_belongs_to_the_owner_of_its_first_consumer(tmp_path: Path) -> None:
    """With no session left, another user connecting with the device's ID read its
    queue, acknowledged entries too (rewind): a queue belonged to a client ID only."""
    h = harness(tmp_path, path=QueuePath(), client_id_owner="off")
    device, _ = connect(h, "dev-7", "alice")
    assert _queue_suback(device, "$ECQ/dev-7/#") == 1
    device.conn.connection_lost()
    thief, code = connect(h, "dev-7", "bob")
    assert code == 0  # client_id_owner off: the ID is anyone's
    assert _queue_suback(thief, "$ECQ/dev-7/#") == ReasonCode.NOT_AUTHORIZED
    assert "$ECQ/dev-7/#" not in h.broker.sessions["dev-7"].subscriptions
    thief.conn.connection_lost()
    v3, _ = connect(h, "dev-7", "bob", V311)
    assert _queue_suback(v3, "$ECQ/dev-7/#") == 0x80
    v3.conn.connection_lost()
    anonymous, _ = connect(h, "dev-7", None)
    assert _queue_suback(anonymous, "$ECQ/dev-7/#") == ReasonCode.NOT_AUTHORIZED
    anonymous.conn.connection_lost()
    again, _ = connect(h, "dev-7", "alice")
    assert _queue_suback(again, "$ECQ/dev-7/#") == 1
    assert h.broker.stats.dropped["ecq_subscribe_refused"] == 3


def test_the_acl_governs_reading_a_queue(tmp_path: Path) -> None:
    acl = "user alice\ntopic read $ECQ/dev-7/#\nuser bob\ntopic read $ECQ/other/#\n"
    h = harness(tmp_path, acl=acl, path=QueuePath())
    alice, _ = connect(h, "dev-7", "alice")
    assert _queue_suback(alice, "$ECQ/dev-7/#") == 1
    bob, _ = connect(h, "dev-8", "bob")
    assert _queue_suback(bob, "$ECQ/dev-8/#") == ReasonCode.NOT_AUTHORIZED
    # nothing was claimed for bob: the queue is still nobody's
    assert asyncio.run(h.broker.owners.holder(QUEUE, "dev-8")) is None
    assert asyncio.run(h.broker.owners.holder(QUEUE, "dev-7")) == ("alice", None)


# -- the admin API (app/admin.py), in process ---------------------------------------------


async def test_an_operator_shows_and_releases_a_client_id_and_a_queue_needs_queues(
    tmp_path: Path,
) -> None:
    from app.admin import AdminApi
    from app.http import HttpError, Request

    settings = harness(tmp_path).broker.settings
    clock = FakeClock()
    authenticator, authorizer = open_authentication(settings, clock)
    broker = Broker(
        settings,
        clock=clock,
        wall_clock=FakeClock(),
        authenticator=authenticator,
        authorizer=authorizer,
    )
    api = AdminApi(settings, broker, "node-1", token="t")

    async def call(method: str, path: str, body: bytes = b"") -> tuple[int, Any]:
        request = Request(method, "/api/v1/" + path, {}, {"authorization": "Bearer t"}, body, "")
        try:
            response = await api.handle(request)
        except HttpError as e:
            return e.status, str(e)
        return response.status, orjson.loads(response.body)

    assert await call("GET", "client-ids/dev-7/owner") == (
        200,
        {"client_id": "dev-7", "owner": None, "released_in": None, "client_id_owner": "first"},
    )
    broker.owners.claim(CLIENT_ID, "dev-7", "alice", 60, lambda claim: None)
    status, answer = await call("GET", "client-ids/dev-7/owner")
    assert (status, answer["owner"], answer["released_in"]) == (200, "alice", 60)
    status, answer = await call("DELETE", "client-ids/dev-7/owner")
    assert (status, answer["before"]) == (200, "alice")
    assert (await call("DELETE", "client-ids/dev-7/owner"))[0] == 404
    # no persistence, no queues: their owners are not there to change either
    assert (await call("GET", "queues/dev-7/owner"))[0] == 409
    assert (await call("PUT", "queues/dev-7/owner", b'{"owner": "bob"}'))[0] == 409


def test_a_resumed_consumer_of_a_queue_given_to_another_loses_its_subscription(
    tmp_path: Path,
) -> None:
    h = harness(tmp_path, path=QueuePath())

    def resume() -> Client:
        client = h.client(V5, peer="dev-7")
        client.send(
            Connect(
                "dev-7",
                protocol_level=V5,
                username="alice",
                password=PASSWORD,
                keep_alive=0,
                clean_start=False,
                properties=Properties(session_expiry_interval=600),
            )
        )
        connack = client.read()[0]
        assert isinstance(connack, ConnAck) and connack.reason_code == 0
        return client

    device = resume()
    assert _queue_suback(device, "$ECQ/dev-7/#") == 1
    device.conn.connection_lost()
    resume().conn.connection_lost()  # still hers: the subscription stays
    assert "$ECQ/dev-7/#" in h.broker.sessions["dev-7"].subscriptions
    asyncio.run(h.broker.owners.assign(QUEUE, "dev-7", "bob", 0))  # an operator's
    resume()
    assert "$ECQ/dev-7/#" not in h.broker.sessions["dev-7"].subscriptions
    assert h.broker.subscriptions.match("$ECQ/dev-7/k").entries == []
    assert h.broker.stats.dropped["ecq_subscribe_refused"] == 1
