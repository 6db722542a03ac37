"""Exclusive compacted queues ($ECQ) across two replicas.

A queue's entries are stored by the replica whose Kafka consumer holds the
partition of the queue's client ID; its consumer may be connected to the
other replica, with a clean session. The storing replica tells that replica
over Redis pub/sub, for any session (not only durable ones), and its queue
feed re-reads: the consumer gets every write while it stays connected.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.replicas import partition_of
from tests.cluster.conftest import running_cluster
from tests.cluster.test_replicas import Client, publish, wait_until

pytestmark = pytest.mark.timeout(180)


def test_a_clean_consumer_on_the_replica_not_storing_its_queue_gets_every_write(
    tmp_path: Path,
) -> None:
    with running_cluster(tmp_path, metrics=True) as cluster:
        owners = cluster.balanced_owners()
        # A queue whose partition b stores, consumed on a with a clean session.
        queue = next(
            cid
            for cid in (cluster.name(f"q{i}") for i in range(100))
            if owners[partition_of(cid, 4)] == 1
        )
        consumer = Client(cluster.a, queue)
        producer = Client(cluster.b, cluster.name("producer"))
        try:
            consumer.subscribe(f"$ECQ/{queue}/#", 1)
            publish(producer, f"$ECQ/w/{queue}/k0", [b"v0"], 1)
            wait_until(lambda: consumer.received(b"v") == [b"v0"], 20, "the first write")
            # Caught up now: later writes reach it only through b's notice.
            for i in range(1, 4):
                publish(producer, f"$ECQ/w/{queue}/k{i}", [b"v%d" % i], 1)
            wait_until(lambda: len(consumer.received(b"v")) == 4, 20, "every write on a")
            assert consumer.received(b"v") == [b"v0", b"v1", b"v2", b"v3"]
        finally:
            producer.close()
            consumer.close()
