"""Replicas on one host share their MQTT port (``cluster.share_ports``).

The kernel spreads new connections over both listening processes
(SO_REUSEPORT); clients cannot tell which replica they reached, and the two
still act as one broker: persistent subscribers get everything, in order,
wherever their publisher landed.
"""

from __future__ import annotations

from pathlib import Path

from tests.cluster.conftest import running_cluster
from tests.cluster.test_replicas import Client, every_persistent_subscriber_gets_all

SUBSCRIBERS = 16


def test_replicas_sharing_a_port_split_the_clients_and_act_as_one_broker(tmp_path: Path) -> None:
    with running_cluster(tmp_path, {"cluster.share_ports": True}, shared_port=True) as cluster:
        assert cluster.a.port == cluster.b.port
        topic = cluster.name("shared/t")
        subs = [Client(cluster.a, cluster.name(f"sub-{i}"), expiry=600) for i in range(SUBSCRIBERS)]
        pub = Client(cluster.a, cluster.name("pub"))
        every_persistent_subscriber_gets_all(pub, subs, topic, 100)
        # 17 connections, each replica took some (all on one: a chance of 2**-16).
        for replica in (cluster.a, cluster.b):
            assert f"client {cluster.name('sub-')}" in replica.log(), f"{replica.data_dir} got none"
