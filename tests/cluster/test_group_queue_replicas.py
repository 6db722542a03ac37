"""Durable group queues ($queue, broker/group_queue.py) across two replicas.

A group queue's entries are stored by the replica whose Kafka consumer holds
the partition of the group's store (keyed by its filter); its members may be
connected to either replica. The storing replica tells the others over
Redis pub/sub, and their members claim. A replica that is killed gives back
nothing: its members' claims lapse with their lease, and a member on the
other replica gets what was in flight, with DUP.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.packets import ConnAck, Properties, PubAck, Publish, SubAck, Subscribe, Subscription
from loadtest.replicas import partition_of
from tests.cluster.conftest import probe_until_routed, publish_acked, running_cluster
from tests.e2e.clients import Raw

pytestmark = pytest.mark.timeout(180)

LEASE = 2.0
EXPIRY = Properties(session_expiry_interval=600)


def _member(broker: object, client_id: str, topic_filter: str) -> Raw:
    raw = Raw(broker)
    connack = raw.connect(client_id, clean_start=False, properties=EXPIRY)
    assert isinstance(connack, ConnAck) and connack.reason_code == 0
    raw.send(Subscribe(1, [Subscription(topic_filter, 1)]))
    assert isinstance(raw.recv(), SubAck)
    return raw


def test_members_on_both_replicas_share_the_group_and_a_killed_ones_entries_move(
    tmp_path: Path,
) -> None:
    with running_cluster(tmp_path, {"group_queues.lease": LEASE}, metrics=True) as cluster:
        owners = cluster.balanced_owners()
        topic = cluster.name("t")
        # A group whose store b keeps; its first member is on a: a hears of every
        # entry only through b's notice.
        group = next(
            f
            for f in (f"$queue/g{i}/{topic}" for i in range(100))
            if owners[partition_of(f, 4)] == 1
        )
        x = _member(cluster.a, cluster.name("x"), group)
        producer = Raw(cluster.b)
        producer.connect(cluster.name("producer"))
        probe_until_routed(producer, x, topic)  # a's subscription reached b
        while (packet := x.recv_or_none(0.5)) is not None:  # probes still coming
            if isinstance(packet, Publish) and packet.packet_id is not None:
                x.send(PubAck(packet.packet_id))

        for i in range(3):
            publish_acked(producer, topic, b"m%d" % i, 100 + i)
        held = [x.recv() for _ in range(3)]  # in flight to x, on a, not acknowledged
        assert sorted(p.payload for p in held if isinstance(p, Publish)) == [b"m0", b"m1", b"m2"]

        y = _member(cluster.b, cluster.name("y"), group)
        assert y.recv_or_none(0.5) is None  # x's claims hold while a renews them
        cluster.a.kill()
        got: list[Publish] = []
        while len(got) < 3:
            packet = y.recv(timeout=LEASE * 5)
            assert isinstance(packet, Publish) and packet.packet_id is not None
            got.append(packet)
            y.send(PubAck(packet.packet_id))
        assert sorted(p.payload for p in got) == [b"m0", b"m1", b"m2"]
        assert all(p.dup for p in got)
        publish_acked(producer, topic, b"after", 200)
        after = y.recv()
        assert isinstance(after, Publish) and after.payload == b"after" and not after.dup
        for raw in (x, y, producer):
            raw.close()
