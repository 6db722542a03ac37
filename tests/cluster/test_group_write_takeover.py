"""A member holding a group write in flight on replica ``a`` is taken over by a
connection to replica ``b`` while ``a`` still holds its connection (the client's
network broke and it came back through the load balancer before ``a`` noticed).
tests/model/FINDINGS.md, finding 35; docs/queues.md says the session's first
connection to "another replica" gets the write again under its packet id.

``a`` keeps the write with the session only as its connection closes
(``Outflow.left``), that is once it hears of the takeover over pub/sub, while
``b`` reads the kept writes back right after its CONNACK. Read first, ``b``
knew nothing of the write and gave its packet id to another message while
the client may hold it (MQTT-2.2.1-3), and ``a``'s record landed later,
stale (finding 37). Now ``b`` waits for ``a`` to say its keep landed
(``ClusterState.await_kept``). Here ``a`` is frozen (SIGSTOP) across the
takeover, so without that wait ``b`` reads first, deterministically; ``a``
is let go once ``b`` has shown it waits (nothing comes for a second).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from broker.packets import ConnAck, Properties, PubAck, Publish, SubAck, Subscribe, Subscription
from loadtest.replicas import partition_of
from tests.cluster.conftest import probe_until_routed, publish_acked, running_cluster
from tests.e2e.clients import Raw
from tests.kafka_fixtures import freeze

pytestmark = pytest.mark.timeout(180)

EXPIRY = Properties(session_expiry_interval=600)
BEFORE = 2  # group writes taken and acknowledged first: the held one's id is not 1


def test_a_group_writes_id_is_not_reused_after_a_takeover_by_another_replica(
    tmp_path: Path,
) -> None:
    with running_cluster(tmp_path, {"group_queues.lease": 30.0}, metrics=True) as cluster:
        owners = cluster.balanced_owners()
        # Everything stored by b, which is never frozen: the group's entries and the
        # member's own messages (keyed by its client id).
        topic = cluster.name("t")
        group = next(
            f
            for f in (f"$queue/g{i}/{topic}" for i in range(100))
            if owners[partition_of(f, 4)] == 1
        )
        member_id = next(
            c
            for c in (cluster.name(f"m{i}") for i in range(100))
            if owners[partition_of(c, 4)] == 1
        )
        direct_topic = cluster.name("d")

        member = Raw(cluster.a)
        connack = member.connect(member_id, clean_start=False, properties=EXPIRY)
        assert isinstance(connack, ConnAck) and connack.reason_code == 0, connack
        member.send(Subscribe(1, [Subscription(group, 1), Subscription(direct_topic, 1)]))
        assert isinstance(member.recv(), SubAck)

        producer = Raw(cluster.b)
        producer.connect(cluster.name("producer"))
        n = probe_until_routed(producer, member, topic)  # a's subscription reached b
        while (packet := member.recv_or_none(0.5)) is not None:  # probes still coming
            assert isinstance(packet, Publish) and packet.packet_id is not None
            member.send(PubAck(packet.packet_id))
        for i in range(BEFORE):
            n += 1
            publish_acked(producer, topic, b"before:%d" % i, n)
            taken = member.recv(timeout=10)
            assert isinstance(taken, Publish) and taken.packet_id is not None, taken
            member.send(PubAck(taken.packet_id))
        n += 1
        publish_acked(producer, topic, b"write", n)
        write = member.recv(timeout=10)
        assert isinstance(write, Publish) and write.payload == b"write", write
        held = write.packet_id
        assert held is not None and held > 1  # held: never acknowledged

        assert cluster.a.proc is not None
        freeze(cluster.a.proc)  # a hears of the takeover only after b answered
        try:
            # Enough of the member's own messages to take every id up to the held one's
            # (b's first identifiers are the lowest; the probes made it vary), stored
            # before the takeover: they are there to go at once.
            count = held + 1
            for i in range(count):
                n += 1
                publish_acked(producer, direct_topic, b"direct:%d" % i, n)
            again = Raw(cluster.b)
            connack = again.connect(member_id, clean_start=False, properties=EXPIRY)
            assert isinstance(connack, ConnAck) and connack.reason_code == 0, connack
            assert connack.session_present
            # b waits for a to say it kept the write (finding 37): nothing comes yet
            # (for KEPT_WAIT, 5 s, at most; a's heartbeat, frozen, lasts 5 s too).
            assert again.recv_or_none(1.0) is None
        finally:
            os.kill(cluster.a.proc.pid, signal.SIGCONT)
        direct: list[bytes] = []
        resent = False
        while len(direct) < count:
            packet = again.recv(timeout=15)
            assert isinstance(packet, Publish) and packet.packet_id is not None, packet
            if not resent:
                # The client holds `held` unacknowledged: nothing else may come
                # under it (MQTT-2.2.1-3); the write itself comes again under it.
                assert packet.packet_id != held or packet.payload == b"write", (
                    f"packet id {held}, held unacknowledged for the group write, was "
                    f"given to {packet.payload!r} by the replica that took over"
                )
            if packet.payload == b"write":
                assert packet.packet_id == held and packet.dup, packet
                resent = True
            else:
                direct.append(packet.payload)
            again.send(PubAck(packet.packet_id))
        assert resent, "the group write held under its packet id never came again"
