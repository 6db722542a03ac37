"""APPLICATION sessions on two replicas (cluster.enabled) sharing one redis-server and
one Tansu (docs/application-sessions.md, "Replicas").

- A message routed by the replica that does not hold the session goes to the
  session's topic (the ``conn`` notice says the session is an APPLICATION one),
  not to the Redis store of a DEVICE session, which its feed never reads.
- A rewind asked of the replica that does not hold the session: the one that
  holds it lets the client go at once, and the client, connecting again, gets
  the rewound messages with DUP.
- The client moves to the other replica mid-backlog: the first one lets it go
  (0x8E), the second goes on from the committed offset, what was in flight again
  with DUP under its ids, then the rest, in order, nothing lost; messages routed
  by the replica it left reach it there.

On the code before, a replica with ``application.client_ids`` refused to start
with ``cluster.enabled``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from app.admin_cli import AdminClient
from broker.packets import (
    ConnAck,
    Disconnect,
    Properties,
    PubAck,
    Publish,
    ReasonCode,
    SubAck,
    Subscribe,
    Subscription,
)
from persistence.application_feed import app_keys
from persistence.format import client_keys
from tests.cluster.conftest import Cluster, running_cluster
from tests.e2e.admin import TOKEN, answering
from tests.e2e.clients import Raw
from tests.faults.conftest import DeviceMQ

WINDOW = 10  # the subscriber's Receive Maximum


@pytest.fixture(scope="module")
def app_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    settings = {"persistence.enabled": True, "application.client_ids": '["^app-"]'}
    root = tmp_path_factory.mktemp("app-cluster")
    with running_cluster(root, settings, admin_token=TOKEN) as replicas:
        yield replicas


def _connect(broker: DeviceMQ, client_id: str, clean: bool) -> tuple[Raw, ConnAck]:
    raw = Raw(broker)
    connack = raw.connect(
        client_id,
        clean_start=clean,
        properties=Properties(session_expiry_interval=3600, receive_maximum=WINDOW),
    )
    assert isinstance(connack, ConnAck) and connack.reason_code == 0, connack
    return raw, connack


def _subscribe(raw: Raw, topic_filter: str) -> None:
    raw.send(Subscribe(1, [Subscription(topic_filter, 1)]))
    suback = raw.recv()
    assert isinstance(suback, SubAck) and list(suback.reason_codes) == [1], suback


def _publish(broker: DeviceMQ, topic: str, first: int, count: int) -> None:
    """Messages ``first`` .. ``first + count - 1`` (payload = the number), QoS 1, each
    acknowledged 0x00."""
    pub = Raw(broker)
    try:
        assert pub.connect(f"pub-{uuid.uuid4().hex[:8]}").reason_code == 0  # type: ignore[attr-defined]
        for i in range(count):
            pub.send(Publish(topic, str(first + i).encode(), 1, packet_id=i + 1))
        for _ in range(count):
            ack = pub.recv(timeout=30)
            assert isinstance(ack, PubAck) and ack.reason_code == 0, ack
        pub.disconnect()
    finally:
        pub.close()


def _read(raw: Raw, count: int) -> list[int]:
    """``count`` PUBLISHes, each acknowledged as it comes; their numbers."""
    got = []
    while len(got) < count:
        p = raw.recv(timeout=30)
        assert isinstance(p, Publish), p
        assert p.packet_id is not None
        raw.send(PubAck(p.packet_id))
        got.append(int(p.payload))
    return got


def _wait_committed(store: redis.Redis, client_id: str, offset: int) -> None:
    deadline = time.monotonic() + 30
    while int(store.hget(app_keys(client_id).offsets, "0") or 0) != offset:
        assert time.monotonic() < deadline, store.hgetall(app_keys(client_id).offsets)
        time.sleep(0.05)


def test_a_message_routed_by_the_other_replica_goes_to_the_sessions_topic(
    app_cluster: Cluster,
) -> None:
    app, topic = f"app-{app_cluster.tag}-routed", f"r/{uuid.uuid4().hex}"
    raw, _ = _connect(app_cluster.a, app, clean=True)
    _subscribe(raw, topic)
    _publish(app_cluster.b, topic, 0, 100)  # b routes: a holds the session
    assert _read(raw, 100) == list(range(100))
    store = redis.Redis.from_url(app_cluster.a.redis.url)
    _wait_committed(store, app, 100)
    assert store.zcard(client_keys(app).messages) == 0  # nothing in a DEVICE store
    assert raw.recv_or_none(timeout=0.5) is None
    raw.disconnect()
    store.close()


def test_a_client_moving_to_the_other_replica_mid_backlog_gets_it_all_in_order(
    app_cluster: Cluster,
) -> None:
    app, topic = f"app-{app_cluster.tag}-moved", f"m/{uuid.uuid4().hex}"
    a, b = app_cluster.a, app_cluster.b
    old, _ = _connect(a, app, clean=True)
    _subscribe(old, topic)
    _publish(b, topic, 0, 50)
    first = [old.recv() for _ in range(WINDOW)]  # in flight on a, not acknowledged
    assert [int(p.payload) for p in first] == list(range(WINDOW))  # type: ignore[union-attr]
    ids = {int(p.payload): p.packet_id for p in first}  # type: ignore[union-attr]

    new, connack = _connect(b, app, clean=False)  # the takeover: a lets the old one go
    assert connack.session_present
    closing = old.expect_close(timeout=30)
    assert any(
        isinstance(p, Disconnect) and p.reason_code == ReasonCode.SESSION_TAKEN_OVER
        for p in closing
    ), closing

    again = [new.recv(timeout=30) for _ in range(WINDOW)]
    for p in again:  # may have been seen: DUP, under the id a gave it (MQTT-4.4.0-1)
        assert isinstance(p, Publish) and p.dup and p.packet_id == ids[int(p.payload)], p
        new.send(PubAck(p.packet_id))
    assert _read(new, 40) == list(range(WINDOW, 50))
    _publish(a, topic, 50, 30)  # a routes now: b holds the session
    assert _read(new, 30) == list(range(50, 80))
    store = redis.Redis.from_url(a.redis.url)
    _wait_committed(store, app, 80)
    assert store.zcard(client_keys(app).messages) == 0
    new.disconnect()
    store.close()


def test_a_rewind_asked_of_the_other_replica_reaches_the_connected_client(
    app_cluster: Cluster,
) -> None:
    app, topic = f"app-{app_cluster.tag}-rewound", f"w/{uuid.uuid4().hex}"
    a, b = app_cluster.a, app_cluster.b
    raw, _ = _connect(a, app, clean=True)
    _subscribe(raw, topic)
    _publish(a, topic, 0, 20)
    assert _read(raw, 20) == list(range(20))
    store = redis.Redis.from_url(a.redis.url)
    _wait_committed(store, app, 20)

    api = answering(AdminClient(f"http://127.0.0.1:{b.settings['admin.port']}", TOKEN))
    answer = api.call("POST", api.session_path(app, "rewind"), body={"offset": 5})
    assert answer["offsets"] == {"0": 5}
    closing = raw.expect_close(timeout=30)  # a lets it go: its progress is stale now
    assert any(isinstance(p, Disconnect) for p in closing), closing
    assert int(store.hget(app_keys(app).offsets, "0") or 0) == 5  # nothing of a's over it

    raw, connack = _connect(a, app, clean=False)
    assert connack.session_present
    again = []
    for _ in range(15):
        p = raw.recv(timeout=30)
        assert isinstance(p, Publish) and p.dup, p  # seen before the rewind
        assert p.packet_id is not None
        raw.send(PubAck(p.packet_id))
        again.append(int(p.payload))
    assert again == list(range(5, 20))
    _wait_committed(store, app, 20)
    raw.disconnect()
    store.close()
