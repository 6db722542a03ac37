"""Rewinding a persistent session to a time (``POST /api/v1/sessions/{id}/rewind``,
``devicemq sessions rewind``): its messages read back from the persisted Kafka
topic and delivered again with DUP, against a real broker, embedded Redis and
Tansu, with paho-mqtt clients."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from paho.mqtt.packettypes import PacketTypes

from app import cli
from app.admin_cli import AdminClient, ApiError
from tests.e2e.admin import TOKEN, admin_broker, wait_for
from tests.e2e.clients import Paho, props
from tests.e2e.conftest import BrokerProcess, Clients, Names, devicemq_only

pytestmark = devicemq_only("the admin API and Kafka are devicemq's")


@pytest.fixture(scope="module")
def _rewind_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, AdminClient]]:
    with admin_broker(tmp_path_factory.mktemp("rewind")) as started:
        yield started


@pytest.fixture
def broker(_rewind_broker: tuple[BrokerProcess, AdminClient]) -> BrokerProcess:
    return _rewind_broker[0]


@pytest.fixture
def api(_rewind_broker: tuple[BrokerProcess, AdminClient]) -> AdminClient:
    return _rewind_broker[1]


def _persistent(
    clients: Clients, broker: BrokerProcess, client_id: str, clean: bool = True
) -> Paho:
    sub = clients.paho(broker, client_id)
    expiry = props(PacketTypes.CONNECT, SessionExpiryInterval=600)
    sub.connect(clean_start=clean, properties=expiry)
    return sub


def test_a_rewind_delivers_again_with_dup_what_was_published_since_a_time(
    broker: BrokerProcess, api: AdminClient, clients: Clients, names: Names, tmp_path: Path
) -> None:
    topic = names.topic("t")
    cid = names.client("device")
    sub = _persistent(clients, broker, cid)
    assert sub.subscribe(topic, qos=1) == [1]
    pub = clients.paho(broker, names.client("pub"))
    pub.connect()
    pub.publish(topic, "m1", qos=1)
    assert sub.get().payload == b"m1"
    between = time.time()  # after m1 was published (it was received), before m2
    pub.publish(topic, "m2", qos=1)
    pub.publish(topic, "m3", qos=1)
    assert [m.payload for m in sub.get_n(2)] == [b"m2", b"m3"]
    # The queue this client consumes shares its Kafka key: a rewind leaves it alone.
    pub.publish(f"$ECQ/w/{cid}/k", "queued", qos=1)
    wait_for(lambda: api.call("GET", f"queues/{cid}")["last_seq"] == 1, "the queue write stored")

    answer = api.call("POST", f"sessions/{cid}/rewind", body={"since": between})
    assert (answer["matched"], answer["rewound"]) == (2, 2)
    assert answer["records_read"] >= 4 and answer["oldest_in_kafka"] <= between
    again = sub.get_n(2)
    assert [(m.topic, m.payload, m.dup) for m in again] == [(topic, b"m2", 1), (topic, b"m3", 1)]
    sub.assert_no_message()

    # The command line, with an ISO 8601 time: everything since before m1.
    iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(between - 60))
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    common = ["--url", api.url, "--token-file", str(token_file)]
    assert cli.main(["sessions", "rewind", cid, "--since", iso, *common]) == 0
    assert [m.payload for m in sub.get_n(3)] == [b"m1", b"m2", b"m3"]


def test_a_rewind_answers_bad_input_with_the_field_and_a_clean_session_with_409(
    broker: BrokerProcess, api: AdminClient, clients: Clients, names: Names
) -> None:
    cid = names.client("device")
    _persistent(clients, broker, cid)
    for since in ("yesterday", "2026-11-26T06:00:00", True, None):  # no zone: ambiguous
        with pytest.raises(ApiError) as bad:
            api.call("POST", f"sessions/{cid}/rewind", body={"since": since})
        assert bad.value.status == 400 and "since" in str(bad.value)
    with pytest.raises(ApiError) as unknown:
        api.call("POST", f"sessions/{cid}/rewind", body={"since": 0, "until": 1})
    assert unknown.value.status == 400
    clean = clients.paho(broker, names.client("clean"))
    clean.connect()
    with pytest.raises(ApiError) as conflict:
        api.call("POST", f"sessions/{names.client('clean')}/rewind", body={"since": 0})
    assert conflict.value.status == 409
    with pytest.raises(ApiError) as missing:
        api.call("POST", f"sessions/{names.client('nobody')}/rewind", body={"since": 0})
    assert missing.value.status == 404


def test_a_rewind_never_makes_room_by_dropping_the_backlog(
    tmp_path: Path, clients: Clients, names: Names
) -> None:
    """Found by review: copies marked sent made the store trim what the client had not
    received yet, then refuse new messages. Now a rewind takes only the room left."""
    limit = {"persistence.max_messages_per_client": 5}
    with admin_broker(tmp_path / "b", **limit) as (broker, api):
        topic, cid = names.topic("t"), names.client("device")
        sub = _persistent(clients, broker, cid)
        assert sub.subscribe(topic, qos=1) == [1]
        pub = clients.paho(broker, names.client("pub"))
        pub.connect()
        for i in range(5):
            pub.publish(topic, f"m{i}", qos=1)
        assert [m.payload for m in sub.get_n(5)] == [b"m0", b"m1", b"m2", b"m3", b"m4"]
        wait_for(lambda: api.call("GET", f"sessions/{cid}")["backlog"] == 0, "acks stored")
        sub.disconnect()
        for i in range(3):
            pub.publish(topic, f"u{i}", qos=1)  # the backlog, never delivered yet
        wait_for(lambda: api.call("GET", f"sessions/{cid}")["backlog"] == 3, "backlog stored")

        answer = api.call("POST", f"sessions/{cid}/rewind", body={"since": 0})
        assert (answer["matched"], answer["rewound"], answer["over_limit"]) == (8, 2, 6)
        again = _persistent(clients, broker, cid, clean=False)
        got = [(m.payload, bool(m.dup)) for m in again.get_n(5)]
        # The backlog first, untouched; then the newest copies that fit, with DUP.
        assert got == [(b"u0", False), (b"u1", False), (b"u2", False), (b"u1", True), (b"u2", True)]
        again.assert_no_message()


def test_a_rewind_gives_nothing_of_an_ended_session(
    broker: BrokerProcess, api: AdminClient, clients: Clients, names: Names
) -> None:
    """Found by review: records routed to an earlier session of the client ID (before
    a clean start) came back into the new one, topics it never subscribed to."""
    secret, cid = names.topic("old"), names.client("device")
    sub = _persistent(clients, broker, cid)
    assert sub.subscribe(secret, qos=1) == [1]
    pub = clients.paho(broker, names.client("pub"))
    pub.connect()
    pub.publish(secret, "from-the-old-session", qos=1)
    assert sub.get().payload == b"from-the-old-session"
    sub.disconnect()
    fresh = _persistent(clients, broker, cid)  # a clean start: a new session
    answer = api.call("POST", f"sessions/{cid}/rewind", body={"since": 0})
    assert (answer["matched"], answer["rewound"]) == (0, 0)
    fresh.assert_no_message()
