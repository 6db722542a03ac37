"""Issue 45, findings 4 and 5, replayed against a real ``devicemq run`` with its
embedded Redis and Kafka: group queue amplification ($queue) and an $ECQ queue
without a byte limit. Each test failed on 282301f.

- Finding 4: one session subscribed ``$queue/g0..g999/mallory/amp``; two 64 KiB
  publishes then grew Redis by 163.5 MB, outside every per-client limit, kept
  for 7 days after the session; the admin API could neither list nor show nor
  purge a group store. Now memberships are capped per session and per owner
  (SUBACK 0x97; 3.1.1 0x80), a group store has a byte limit, a store whose
  group has no members expires, and the admin API lists, shows and purges them.
- Finding 5: 320 x 256 KiB to ``$ECQ/w/nobody-ever/k{i}`` all succeeded, +105 MB
  in one queue. Now a queue has a byte limit (``ecq.max_bytes``): writes over
  it are refused (PUBACK 0x97; 3.1.1: the connection is closed).

The limits are set small here (1 MiB, not the 64 MiB defaults) to keep the
tests short; the mechanism is the same.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from app.admin_cli import AdminClient
from broker.auth import hash_password, write_password_file
from broker.packets import ConnAck, Properties, Publish, SubAck, Subscribe, Subscription
from tests.conftest import free_port
from tests.e2e.admin import admin_broker, status, wait_for
from tests.e2e.clients import V5, Paho, Raw
from tests.e2e.conftest import BrokerProcess, Clients, Names, devicemq_only

pytestmark = [pytest.mark.e2e, devicemq_only("issue 45: devicemq's queue limits")]

KIB = 1024
MIB = 1024 * KIB
QUOTA_EXCEEDED = 0x97
PER_CLIENT, PER_OWNER = 8, 12  # group_queues.max_groups_per_client / _per_owner
EXPIRY = Properties(session_expiry_interval=600)
PASSWORDS = {u: f"{u}-pw" for u in ("mallory", "alice", "eve", "bob", "dave")}


@pytest.fixture(scope="module")
def _limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BrokerProcess, Any]]:
    data_dir = tmp_path_factory.mktemp("queue-limits")
    passwd = data_dir / "passwd"
    write_password_file(passwd, {u: hash_password(p) for u, p in PASSWORDS.items()})
    settings: dict[str, object] = {
        "auth.password_file": passwd,
        "ecq.max_bytes": MIB,
        "group_queues.max_bytes": MIB,
        "group_queues.max_groups_per_client": PER_CLIENT,
        "group_queues.max_groups_per_owner": PER_OWNER,
        "group_queues.unused_expiry": 2.0,
        "metrics.enabled": True,
        "metrics.host": "127.0.0.1",
        "metrics.port": free_port(),
    }
    with admin_broker(data_dir, **settings) as started:
        yield started


@pytest.fixture
def broker(_limited: tuple[BrokerProcess, AdminClient]) -> BrokerProcess:
    return _limited[0]


@pytest.fixture
def api(_limited: tuple[BrokerProcess, AdminClient]) -> AdminClient:
    return _limited[1]


def _metric(broker: BrokerProcess, name: str, label: str = "") -> float:
    """A counter of /metrics (0 if it is not there)."""
    url = f"http://127.0.0.1:{broker.settings['metrics.port']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as answer:
        text = answer.read().decode()
    for line in text.splitlines():
        if line.startswith(f"devicemq_{name}_total") and label in line and not line.startswith("#"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _paho(clients: Clients, broker: BrokerProcess, cid: str, user: str) -> Paho:
    """A connected MQTT 5 paho client logged in as ``user``."""
    client = clients.paho(broker, cid, V5)
    client.username, client.password = user, PASSWORDS[user]
    assert client.connect().reason_code == 0
    return client


def _raw(clients: Clients, broker: BrokerProcess, cid: str, user: str, level: int = 5) -> Raw:
    """A raw client with a persistent session (MQTT 5: 600 s), logged in as ``user``."""
    raw = clients.raw(broker, level)
    properties = EXPIRY if level == 5 else None
    connack = raw.connect(
        cid,
        clean_start=False,
        username=user,
        password=PASSWORDS[user].encode(),
        properties=properties,
    )
    assert isinstance(connack, ConnAck) and connack.reason_code == 0
    return raw


def _subscribe(raw: Raw, filters: list[str], packet_id: int = 1) -> list[int]:
    raw.send(Subscribe(packet_id, [Subscription(f, 1) for f in filters]))
    suback = raw.recv()
    assert isinstance(suback, SubAck)
    return suback.reason_codes


def _path(store_id: str) -> str:
    return "queues/" + quote(store_id, safe="")


# ---------------------------------------------------------------- finding 4: $queue


def test_one_session_cannot_join_a_thousand_group_queues(
    broker: BrokerProcess, clients: Clients, names: Names
) -> None:
    """Each membership stores every matching message once more: 1,000 of them made two
    64 KiB publishes 163.5 MB. Over the per-session cap SUBACK says 0x97 (3.1.1: 0x80);
    a subscription held already may be sent again."""
    raw = _raw(clients, broker, names.client("amp"), "mallory")
    filters = [f"$queue/g{i}/mallory/{names.prefix}/amp" for i in range(1000)]
    codes: list[int] = []
    for n, start in enumerate(range(0, 1000, 100)):  # filters per packet are capped too
        codes += _subscribe(raw, filters[start : start + 100], n + 1)
    assert codes == [1] * PER_CLIENT + [QUOTA_EXCEEDED] * (1000 - PER_CLIENT)
    assert _subscribe(raw, filters[:1], 11) == [1]  # held already: no new membership
    assert _metric(broker, "publish_dropped", '"group_membership_quota"') >= 992
    old = _raw(clients, broker, names.client("amp311"), "alice", level=4)
    codes = _subscribe(old, [f"$queue/o{i}/{names.prefix}/x" for i in range(PER_CLIENT + 1)])
    assert codes == [1] * PER_CLIENT + [0x80]


def test_one_owner_cannot_spread_memberships_over_sessions(
    broker: BrokerProcess, clients: Clients, names: Names
) -> None:
    """The per-owner cap counts the distinct group queues of all sessions of one user;
    more workers of a group she holds already add no store and are let in."""
    first = _raw(clients, broker, names.client("s1"), "eve")
    second = _raw(clients, broker, names.client("s2"), "eve")
    before = [f"$queue/a{i}/{names.prefix}/x" for i in range(PER_CLIENT)]
    after = [f"$queue/b{i}/{names.prefix}/x" for i in range(PER_CLIENT)]
    assert _subscribe(first, before) == [1] * PER_CLIENT
    left = PER_OWNER - PER_CLIENT
    assert _subscribe(second, after) == [1] * left + [QUOTA_EXCEEDED] * (PER_CLIENT - left)
    worker = _raw(clients, broker, names.client("s3"), "eve")  # one more worker of each
    assert _subscribe(worker, before) == [1] * PER_CLIENT
    bob = _raw(clients, broker, names.client("bob"), "bob")  # another owner: not affected
    assert _subscribe(bob, [f"$queue/c{i}/{names.prefix}/x" for i in range(2)]) == [1, 1]


def test_a_group_store_is_bounded_listed_shown_purged_and_expires_without_members(
    broker: BrokerProcess, api: AdminClient, clients: Clients, names: Names
) -> None:
    """Two 64 KiB publishes per store are kept, up to group_queues.max_bytes (the oldest
    leave); the admin API lists the store with its backlog and bytes, shows it by its
    URL-encoded id (a 400 on 282301f) and purges it; once the group has no members its
    store is deleted after group_queues.unused_expiry."""
    store_id = f"$queue/g1/dave/{names.prefix}/amp"
    member_id = names.client("member")
    member = _raw(clients, broker, member_id, "dave")
    assert _subscribe(member, [store_id]) == [1]
    producer = _paho(clients, broker, names.client("producer"), "dave")
    topic = f"dave/{names.prefix}/amp"
    for _ in range(24):  # 24 x 64 KiB = 1.5 MiB into a 1 MiB store
        assert producer.publish(topic, b"x" * 64 * KIB, qos=1) == 0

    def shown_when(ready: Any) -> Any:
        def look() -> Any:
            code, view = status(api, "GET", _path(store_id))  # a 400 on 282301f
            assert code == 200, view
            return view if ready(view) else None

        return look

    shown = wait_for(shown_when(lambda v: v["last_seq"] == 24), "all 24 saved")
    assert shown["kind"] == "group" and shown["members"] is True
    assert 0 < shown["bytes"] <= MIB and 14 <= shown["pending"] < 24  # the oldest left
    listed = api.call("GET", "queues", {"kind": "group", "limit": 10_000})["queues"]
    assert [q["bytes"] for q in listed if q["client_id"] == store_id] == [shown["bytes"]]
    assert _metric(broker, "queue_entries_trimmed") >= 24 - shown["pending"]
    purged = api.call("DELETE", _path(store_id))
    assert purged["pending"] == shown["pending"] and purged["bytes"] == shown["bytes"]
    assert api.call("GET", _path(store_id))["pending"] == 0
    assert producer.publish(topic, b"y", qos=1) == 0
    wait_for(shown_when(lambda v: v["pending"] == 1), "one stored again")
    # The member's session ends: no member is left, and the store goes after 2 s.
    member.close()
    _end_session(broker, member_id)

    def gone() -> bool:
        listed = api.call("GET", "queues", {"kind": "group", "limit": 10_000})["queues"]
        return store_id not in {q["client_id"] for q in listed}

    wait_for(gone, "the store of a group without members expires", timeout=30)
    assert api.call("GET", _path(store_id))["last_seq"] == 0  # nothing of it is left
    assert _metric(broker, "group_queues_expired") >= 1


def _end_session(broker: BrokerProcess, cid: str) -> None:
    """Connect with clean start and no expiry: the stored session and its
    subscriptions end when this connection closes."""
    raw = Raw(broker)
    connack = raw.connect(
        cid, clean_start=True, username="dave", password=PASSWORDS["dave"].encode()
    )
    assert isinstance(connack, ConnAck) and connack.reason_code == 0
    raw.disconnect()
    raw.close()


# ---------------------------------------------------------------- finding 5: $ECQ


def test_an_ecq_queue_of_a_client_that_never_connected_has_a_byte_limit(
    broker: BrokerProcess, api: AdminClient, clients: Clients, names: Names
) -> None:
    """320 x 256 KiB all succeeded, +105 MB in one queue. Now what does not fit is not
    stored (counted), and once the queue is seen full its producer hears 0x97 before
    anything goes to Kafka; the admin API shows and lists the queue's bytes and purges
    it, after which writes are taken again."""
    queue = names.client("nobody-ever")
    producer = _paho(clients, broker, names.client("writer"), "alice")
    refused_before = _metric(broker, "queue_writes_refused")
    codes = [producer.publish(f"$ECQ/w/{queue}/k{i}", b"v" * 256 * KIB, qos=1) for i in range(8)]
    assert set(codes) <= {0, QUOTA_EXCEEDED}

    def settled() -> dict[str, Any] | None:
        code, info = status(api, "GET", _path(queue))
        assert code == 200, info
        refused = _metric(broker, "queue_writes_refused") - refused_before
        done = info["last_seq"] + refused + codes.count(QUOTA_EXCEEDED) == 8
        return info if done else None

    info = wait_for(settled, "every write stored or refused")
    assert info["keys"] == 3 and info["pending"] == 3  # 4 x 256 KiB > 1 MiB
    assert 3 * 256 * KIB < info["bytes"] <= MIB
    # The queue is full: the next write is refused before Kafka, and counted.
    assert producer.publish(f"$ECQ/w/{queue}/k9", b"v" * 256 * KIB, qos=1) == QUOTA_EXCEEDED
    assert _metric(broker, "publish_dropped", '"ecq_full"') >= 1
    # A 3.1.1 producer has no failure code: its connection is closed (it re-sends later).
    old = clients.raw(broker, 4)
    connack = old.connect(names.client("old"), username="alice", password=b"alice-pw")
    assert isinstance(connack, ConnAck) and connack.reason_code == 0
    old.send(Publish(f"$ECQ/w/{queue}/k10", b"v" * 256 * KIB, 1, packet_id=1))
    assert old.expect_close() == []
    listed = api.call("GET", "queues", {"kind": "ecq", "limit": 10_000})["queues"]
    assert [q["bytes"] for q in listed if q["client_id"] == queue] == [info["bytes"]]
    purged = api.call("DELETE", _path(queue))
    assert (purged["entries"], purged["bytes"]) == (3, info["bytes"])
    # The view of a full queue is looked at again within a second: writes are taken.
    wait_for(
        lambda: producer.publish(f"$ECQ/w/{queue}/k11", b"small", qos=1) == 0,
        "a write to the purged queue is taken",
    )


def test_the_cli_lists_and_purges_queues(
    broker: BrokerProcess, api: AdminClient, clients: Clients, names: Names, tmp_path: Path
) -> None:
    from app import cli

    queue = names.client("cli-queue")
    producer = _paho(clients, broker, names.client("cli-writer"), "alice")
    assert producer.publish(f"$ECQ/w/{queue}/k", b"v" * 100, qos=1) == 0
    wait_for(lambda: api.call("GET", _path(queue))["pending"] == 1, "the write is stored")
    token = tmp_path / "token"
    token.write_text(api.token or "")
    common = ["--url", api.url, "--token-file", str(token)]
    assert cli.main(["queues", "list", "--kind", "ecq", "--limit", "10000", *common]) == 0
    assert cli.main(["queues", "purge", queue, *common]) == 0
    assert api.call("GET", _path(queue))["pending"] == 0


def test_a_producer_cannot_start_queues_without_bound(
    tmp_path: Path, clients: Clients, names: Names
) -> None:
    """Finding 5 too: nothing capped the number of queues. Over ecq.max_queues a write
    that would start a queue is not stored (counted), and that queue's next write is
    refused 0x97 before Kafka; the queues held go on taking writes."""
    settings = {"ecq.max_queues": 2, "metrics.enabled": True, "metrics.host": "127.0.0.1"}
    with admin_broker(tmp_path, **settings, **{"metrics.port": free_port()}) as (broker, api):
        producer = clients.paho(broker, names.client("writer"), V5)
        assert producer.connect().reason_code == 0
        queues = [names.client(f"q{i}") for i in range(5)]
        for queue in queues:
            assert producer.publish(f"$ECQ/w/{queue}/k", b"v", qos=1) == 0
        wait_for(lambda: _metric(broker, "queue_writes_refused") == 3, "3 writes refused")
        # Which two: the consumer saves queues side by side, any two may come first.
        held = {q["client_id"] for q in api.call("GET", "queues", {"kind": "ecq"})["queues"]}
        assert len(held) == 2 and held < set(queues)
        refused = sorted(set(queues) - held)
        assert producer.publish(f"$ECQ/w/{refused[0]}/k", b"v", qos=1) == QUOTA_EXCEEDED
        assert producer.publish(f"$ECQ/w/{sorted(held)[0]}/k2", b"v", qos=1) == 0
