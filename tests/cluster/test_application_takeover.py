"""An APPLICATION session taken over by another broker mid-backlog: the one that lost
it writes no progress any more (docs/application-sessions.md, "Replicas").

Two ``devicemq run`` processes on one redis-server and one Tansu, both with
``application.client_ids``. They are not replicas of each other (no
``cluster.enabled``): neither tells the other that the client moved, so the
owner fence in Redis (``{cid}_app_owner``, persistence/application_feed.py) is
all that stops the broker that lost the session. The late write is driven on
purpose: the client acknowledges, on its old connection, messages the new
broker has just sent again; the old broker's commit of them must not land.

On the code before the fence the commit lands (the committed offset jumps to 10
while the new connection holds those messages unacknowledged) and the old
connection stays open: the test fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis

from app.embedded_services import find_tansu
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
from tests.e2e.clients import Raw
from tests.faults.conftest import DeviceMQ, RedisProcess
from tests.kafka_fixtures import bootstrap_of, start_tansu, stop_tansu

BACKLOG = 50
WINDOW = 10  # the subscriber's Receive Maximum


@dataclass
class Pair:
    a: DeviceMQ
    b: DeviceMQ
    redis: RedisProcess
    tag: str


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    root = tmp_path_factory.mktemp("app-takeover")
    find_tansu()
    tansu = start_tansu(log=root / "tansu.log")
    store = RedisProcess(root / "redis")
    tag = uuid.uuid4().hex[:8]
    common: dict[str, object] = {
        "persistence.enabled": True,
        "persistence.topic": f"takeover.{tag}",
        "persistence.consumer_group": f"takeover-{tag}",
        "application.client_ids": '["^app-"]',
        "events.enabled": False,
        "log.level": "INFO",
    }
    a = DeviceMQ(root / "a", store, bootstrap_of(tansu), common)
    b = DeviceMQ(root / "b", store, bootstrap_of(tansu), common)
    try:
        store.start()
        a.start()
        b.start()
        yield Pair(a, b, store, tag)
    finally:
        for broker in (b, a):
            broker.stop()
        store.stop()
        with contextlib.suppress(ProcessLookupError):
            os.kill(tansu.pid, signal.SIGCONT)
        stop_tansu(tansu)
        for broker in (a, b):  # shown by pytest when a test failed
            print(f"--- {broker.data_dir} ---\n{broker.log()[-8000:]}")


def _connect(broker: DeviceMQ, client_id: str, clean: bool) -> tuple[Raw, ConnAck]:
    raw = Raw(broker)
    connack = raw.connect(
        client_id,
        clean_start=clean,
        properties=Properties(session_expiry_interval=3600, receive_maximum=WINDOW),
    )
    assert isinstance(connack, ConnAck) and connack.reason_code == 0, connack
    return raw, connack


def _publish(broker: DeviceMQ, topic: str, count: int) -> None:
    """``count`` QoS 1 messages, payload = their number, each acknowledged 0x00."""
    pub = Raw(broker)
    try:
        assert pub.connect(f"pub-{uuid.uuid4().hex[:8]}").reason_code == 0  # type: ignore[attr-defined]
        for i in range(count):
            pub.send(Publish(topic, str(i).encode(), 1, packet_id=i + 1))
        for _ in range(count):
            ack = pub.recv(timeout=30)
            assert isinstance(ack, PubAck) and ack.reason_code == 0, ack
        pub.disconnect()
    finally:
        pub.close()


def _committed(client: redis.Redis, client_id: str) -> int:
    return int(client.hget(app_keys(client_id).offsets, "0") or 0)


def _wait_committed(client: redis.Redis, client_id: str, offset: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while _committed(client, client_id) != offset:
        assert time.monotonic() < deadline, (
            f"committed {_committed(client, client_id)}, expected {offset}"
        )
        time.sleep(0.05)


def test_the_broker_that_lost_the_session_cannot_write_its_late_progress(pair: Pair) -> None:
    app = f"app-{pair.tag}"
    topic = f"takeover/{pair.tag}"
    store = redis.Redis.from_url(pair.redis.url)

    old, _ = _connect(pair.a, app, clean=True)
    old.send(Subscribe(1, [Subscription(topic, 1)]))
    suback = old.recv()
    assert isinstance(suback, SubAck) and list(suback.reason_codes) == [1], suback
    _publish(pair.a, topic, BACKLOG)
    first = [old.recv() for _ in range(WINDOW)]  # sent: their marks are in Redis
    assert [int(p.payload) for p in first] == list(range(WINDOW))  # type: ignore[union-attr]
    assert _committed(store, app) == 0

    # The client comes back through b (a does not know: no cluster between them).
    new, connack = _connect(pair.b, app, clean=False)
    assert connack.session_present
    again = [new.recv() for _ in range(WINDOW)]  # b read the progress: it owns the session
    ids = {int(p.payload): p.packet_id for p in first}  # type: ignore[union-attr]
    for p in again:  # may have been seen: DUP, under the id a gave it (MQTT-4.4.0-1)
        assert isinstance(p, Publish) and p.dup and p.packet_id == ids[int(p.payload)], p

    # The late write: the client acknowledges on its old connection. a's commit of
    # offsets 0-9 is refused (b holds them in flight), and a lets the connection go.
    for p in first:
        old.send(PubAck(p.packet_id))  # type: ignore[union-attr, arg-type]
    closing = old.expect_close(timeout=30)
    assert any(
        isinstance(p, Disconnect) and p.reason_code == ReasonCode.SESSION_TAKEN_OVER
        for p in closing
    ), closing
    assert _committed(store, app) == 0  # nothing of a's landed

    # b serves the whole backlog, in order, and commits it.
    for p in again:
        new.send(PubAck(p.packet_id))  # type: ignore[union-attr, arg-type]
    rest = []
    while len(rest) < BACKLOG - WINDOW:
        p = new.recv(timeout=30)
        assert isinstance(p, Publish), p
        assert p.packet_id is not None
        new.send(PubAck(p.packet_id))
        rest.append(int(p.payload))
    assert rest == list(range(WINDOW, BACKLOG))
    _wait_committed(store, app, BACKLOG)
    new.disconnect()
    store.close()
