"""What the replicas share beyond routing: retained messages (in Redis), a re-sync
after a lost pub/sub connection, and the heartbeat that forgets a dead replica.

The tests of this module run in order on their own pair of replicas (the
module-scoped fixture of :mod:`tests.cluster.conftest`): the last one kills
replica ``b``.
"""

from __future__ import annotations

import re
import time

import paho.mqtt.client as mqtt
import redis

from tests.cluster.conftest import Cluster
from tests.cluster.test_replicas import Client, probe, publish, wait_until
from tests.faults.conftest import HOST, DeviceMQ

HEARTBEAT_TTL = 5  # persistence/cluster_link.py


class RetainClient(Client):
    """Also records the RETAIN flag of what arrives."""

    def __init__(self, broker: DeviceMQ, client_id: str, *, expiry: int = 0) -> None:
        self.flags: list[tuple[bytes, bool]] = []
        super().__init__(broker, client_id, expiry=expiry)

    def _on_message(self, client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        with self.lock:
            self.payloads.append(bytes(msg.payload))
            self.flags.append((bytes(msg.payload), bool(msg.retain)))


def retained_seen(cluster: Cluster, broker: DeviceMQ, topic: str) -> list[tuple[bytes, bool]]:
    """What a brand-new subscriber of ``topic`` on ``broker`` receives at once."""
    sub = RetainClient(broker, cluster.name(f"ret-probe-{time.monotonic_ns()}"))
    try:
        sub.subscribe(topic, 1)
        time.sleep(0.3)
        with sub.lock:
            return list(sub.flags)
    finally:
        sub.close()


def publish_retained(client: Client, topic: str, payload: bytes) -> None:
    client.client.publish(topic, payload, 1, retain=True).wait_for_publish(10)


def eventually_retained(
    cluster: Cluster, broker: DeviceMQ, topic: str, expected: list[tuple[bytes, bool]]
) -> None:
    deadline = time.monotonic() + 10
    seen = retained_seen(cluster, broker, topic)
    while seen != expected:
        assert time.monotonic() < deadline, f"retained on {topic}: {seen}, not {expected}"
        time.sleep(0.2)
        seen = retained_seen(cluster, broker, topic)


def test_retained_published_on_a_reaches_a_new_subscriber_on_b(cluster: Cluster) -> None:
    topic = cluster.name("ret/one")
    pub = Client(cluster.a, cluster.name("ret-pub"))
    try:
        publish_retained(pub, topic, b"kept-1")
        eventually_retained(cluster, cluster.b, topic, [(b"kept-1", True)])
        assert retained_seen(cluster, cluster.a, topic) == [(b"kept-1", True)]
    finally:
        pub.close()


def test_retained_deleted_on_b_is_gone_on_a(cluster: Cluster) -> None:
    topic = cluster.name("ret/two")
    on_a = Client(cluster.a, cluster.name("ret-pub-a"))
    on_b = Client(cluster.b, cluster.name("ret-pub-b"))
    try:
        publish_retained(on_a, topic, b"doomed")
        eventually_retained(cluster, cluster.b, topic, [(b"doomed", True)])
        publish_retained(on_b, topic, b"")
        eventually_retained(cluster, cluster.a, topic, [])
        assert retained_seen(cluster, cluster.b, topic) == []
    finally:
        on_a.close()
        on_b.close()


def test_retained_survives_a_restart_of_each_replica(cluster: Cluster) -> None:
    kept, deleted = cluster.name("ret/restart"), cluster.name("ret/restart-deleted")
    pub = Client(cluster.b, cluster.name("ret-pub-restart"))
    try:
        publish_retained(pub, kept, b"after-restart")
        publish_retained(pub, deleted, b"x")
        publish_retained(pub, deleted, b"")
    finally:
        pub.close()
    # One after the other: each comes back with nothing in memory and loads the hash.
    # (Both down at once, Tansu 0.6 left the emptied consumer group stuck: the
    # restarted replicas re-joined it every 3 s and never got partitions.)
    for broker in (cluster.b, cluster.a):
        assert broker.terminate() == 0
        broker.start()
        loaded = re.search(r"(\d+) retained messages loaded", broker.log().rsplit("=====", 1)[1])
        assert loaded is not None and int(loaded.group(1)) >= 2  # ret/one and ret/restart
    for broker in (cluster.a, cluster.b):
        assert retained_seen(cluster, broker, kept) == [(b"after-restart", True)]
        assert retained_seen(cluster, broker, deleted) == []
    # Set before the restart, still there after it (the first test's message).
    assert retained_seen(cluster, cluster.b, cluster.name("ret/one")) == [(b"kept-1", True)]


def test_a_replica_resyncs_after_its_pubsub_connection_is_killed(cluster: Cluster) -> None:
    admin = redis.Redis(host=HOST, port=cluster.a.redis.port)  # redis-cli CLIENT KILL TYPE pubsub
    try:
        killed = admin.client_kill_filter(_type="pubsub")
    finally:
        admin.close()
    assert killed >= 2  # one per replica
    for broker in (cluster.a, cluster.b):

        def resynced(broker: DeviceMQ = broker) -> bool:
            return "re-syncing" in broker.log()

        wait_until(resynced, 15, f"a re-sync on {broker.data_dir}")
    topic = cluster.name("resync/t")
    sub = Client(cluster.b, cluster.name("resync-sub"))
    pub = Client(cluster.a, cluster.name("resync-pub"))
    try:
        sub.subscribe(topic, 1)
        probe(pub, sub, topic, 0, 10)
        publish(pub, topic, [b"after-resync"], 1)
        wait_until(lambda: bool(sub.received(b"after-resync")), 10, "a message routed a -> b")
    finally:
        pub.close()
        sub.close()


def test_a_killed_replica_is_forgotten_after_its_heartbeat_ttl(cluster: Cluster) -> None:
    group_topic = cluster.name("hb/shared")
    durable_topic = cluster.name("hb/durable")
    durable_id = cluster.name("hb-durable")
    member_a = Client(cluster.a, cluster.name("hb-member-a"))
    member_b = Client(cluster.b, cluster.name("hb-member-b"))
    durable = Client(cluster.b, durable_id, expiry=600)
    pub = Client(cluster.a, cluster.name("hb-pub"))
    try:
        durable.subscribe(durable_topic, 1)
        probe(pub, durable, durable_topic, 1, 30)  # a routes to b's durable session
        member_b.subscribe(f"$share/g/{group_topic}", 0)
        member_a.subscribe(f"$share/g/{group_topic}", 0)
        # a knows b's member once b's member has received something published on a.
        probe(pub, member_b, group_topic, 0, 10)
        for client in (member_b, durable):
            client.client.loop_stop()  # b dies under them: no reconnect attempts
        cluster.b.kill()
        killed_at = time.monotonic()
        wait_until(
            lambda: "replica b missed its heartbeat" in cluster.a.log(),
            HEARTBEAT_TTL + 5,
            "a forgetting b",
        )
        assert time.monotonic() - killed_at < HEARTBEAT_TTL + 3
        # b's clean member is gone from a's group: every message goes to a's member
        # (a message routed to b's stale record would be lost).
        sent = [b"g-%d" % i for i in range(20)]
        publish(pub, group_topic, sent, 0)
        wait_until(lambda: len(member_a.received(b"g-")) == len(sent), 10, "20 to a's member")
        # b's durable session is still routed (through Kafka): its backlog waits on a.
        backlog = [b"d-%d" % i for i in range(20)]
        publish(pub, durable_topic, backlog, 1)
        time.sleep(0.5)
        resumed = Client(cluster.a, durable_id, expiry=600)
        try:
            wait_until(lambda: set(resumed.received(b"d-")) == set(backlog), 45, "the backlog on a")
        finally:
            resumed.close()
    finally:
        pub.close()
        member_a.close()
        cluster.b.start()  # the fixture stops what it started
