"""Replicas on a Redis Cluster keep the promises of one broker.

Three replicas on a Redis Cluster (:func:`tests.cluster.conftest.running_replicas`)
and the embedded Kafka-protocol broker. Liveness keys live in one hash slot and
go through the cluster client (issue 16, 2): a replica starts whatever its node
id hashes to, and one killed without a goodbye is noticed by the others.
"""

from __future__ import annotations

import threading
import time

from tests.cluster.conftest import Replicas
from tests.cluster.test_replicas import Client, in_order_without_loss, probe, wait_until


def test_a_replica_killed_under_load_is_forgotten_and_comes_back(replicas: Replicas) -> None:
    """kill -9 r2 while r0 publishes: r0 notices by r2's expired liveness key, and
    r2's persistent subscriber, back on a restarted r2, gets every message."""
    topic = replicas.name("kill/t")
    r0, r2 = replicas.nodes[0], replicas.nodes[2]
    device = replicas.name("kill-sub")
    sub = Client(r2, device, expiry=600)
    sub.subscribe(topic, 1)
    pub = Client(r0, replicas.name("kill-pub"))
    probe(pub, sub, topic, 1, 30)
    sent: list[bytes] = []
    stop = threading.Event()

    def load() -> None:
        i = 0
        while not stop.is_set():
            payload = b"m-%d" % i
            pub.client.publish(topic, payload, 1).wait_for_publish(30)
            sent.append(payload)
            i += 1
            time.sleep(0.005)

    loader = threading.Thread(target=load)
    loader.start()
    again = None
    try:
        time.sleep(0.5)
        r2.kill()
        sub.client.loop_stop()
        # HEARTBEAT_TTL (5 s) after the last refresh, read by one MGET on the cluster.
        wait_until(lambda: "replica r2 missed its heartbeat" in r0.log(), 20, "r0 noticing")
        r2.start()
        again = Client(r2, device, expiry=600)
        time.sleep(1.0)
    finally:
        stop.set()
        loader.join(60)
    assert again is not None
    try:
        assert sent, "nothing published"

        def got() -> set[bytes]:
            return set(sub.received(b"m-")) | set(again.received(b"m-"))

        wait_until(lambda: len(got()) == len(sent), 30, f"{len(sent)} messages")
        in_order_without_loss(sub.received(b"m-") + again.received(b"m-"), sent)
    finally:
        pub.close()
        again.close()
