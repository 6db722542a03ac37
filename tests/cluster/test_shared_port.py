"""Replicas on one host share their MQTT port (``cluster.share_ports``).

The kernel spreads new connections over both listening processes
(SO_REUSEPORT); clients cannot tell which replica they reached, and the two
still act as one broker: persistent subscribers get everything, in order,
wherever their publisher landed.
"""

from __future__ import annotations

from pathlib import Path

from tests.cluster.conftest import running_cluster
from tests.cluster.test_replicas import Client, in_order_without_loss, probe, publish, wait_until

SUBSCRIBERS = 16


def test_replicas_sharing_a_port_split_the_clients_and_act_as_one_broker(tmp_path: Path) -> None:
    with running_cluster(tmp_path, {"cluster.share_ports": True}, shared_port=True) as cluster:
        assert cluster.a.port == cluster.b.port
        topic = cluster.name("shared/t")
        subs = [Client(cluster.a, cluster.name(f"sub-{i}"), expiry=600) for i in range(SUBSCRIBERS)]
        pub = Client(cluster.a, cluster.name("pub"))
        try:
            for sub in subs:
                sub.subscribe(topic, 1)
            for sub in subs:
                probe(pub, sub, topic, 1, 30)  # the first one also waits for the consumer group
            sent = [b"m-%d" % i for i in range(100)]
            publish(pub, topic, sent, 1)
            for sub in subs:
                wait_until(lambda s=sub: len(set(s.received(b"m-"))) == len(sent), 30, "100 each")
                in_order_without_loss(sub.received(b"m-"), sent)
        finally:
            pub.close()
            for sub in subs:
                sub.close()
        # 17 connections, each replica took some (all on one: a chance of 2**-16).
        for replica in (cluster.a, cluster.b):
            assert f"client {cluster.name('sub-')}" in replica.log(), f"{replica.data_dir} got none"
