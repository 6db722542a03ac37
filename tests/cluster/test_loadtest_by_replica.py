"""``devicemq loadtest --replicas``: latency by whether a subscriber is on the
replica that consumes its Kafka partition (issue 16), against two real replicas.

What must hold whatever the group's assignment: the tool read every partition's
owner from the replicas' /metrics, every subscriber is in one of the two groups,
and the groups' deliveries are all the run's deliveries.
"""

from __future__ import annotations

from array import array
from pathlib import Path

import pytest

from loadtest.replicas import by_consuming_replica, partition_of
from loadtest.report import format_report
from loadtest.runner import run_load
from loadtest.scenarios import LoadConfig
from tests.cluster.conftest import running_cluster

pytestmark = pytest.mark.timeout(180)


def test_latency_is_reported_by_consuming_replica(tmp_path: Path) -> None:
    with running_cluster(tmp_path, metrics=True) as cluster:
        replicas = [
            (broker.port, int(str(broker.settings["metrics.port"])))
            for broker in (cluster.a, cluster.b)
        ]
        config = LoadConfig(
            scenario="p2p",
            pairs=8,
            qos=1,
            rate=50,
            duration=2,
            warmup=2,
            drain=20,
            seed=11,
            port=cluster.a.port,
            replicas=replicas,
        )
        result = run_load(config, progress=False)
    check = result["check"]
    assert check["ok"], check
    assert check["lost"] == 0
    grouped = result["by_replica"]
    assert grouped["error"] is None
    held = [p for parts in grouped["partitions"].values() for p in parts]
    assert sorted(held) == [0, 1, 2, 3]  # persistence.partitions of running_cluster
    assert grouped["consuming"]["subscribers"] + grouped["other"]["subscribers"] == 8
    # the measured window's deliveries, as the run's own percentiles
    in_window = result["latency_ms"]["e2e"]["count"]
    assert grouped["consuming"]["count"] + grouped["other"]["count"] == in_window
    text = format_report([result])
    assert "on the replica consuming their partition" in text
    assert "on another replica" in text


def test_grouping_puts_each_subscriber_by_its_partition_owner() -> None:
    owners = {0: 0, 1: 1, 2: 0, 3: 1}
    ids = [f"lt-x-s{j}" for j in range(16)]
    one = array("I", [5000]).tobytes()
    grouping = by_consuming_replica(owners, 4, ((cid, j % 2, one) for j, cid in enumerate(ids)))
    expected = sum(owners[partition_of(cid, 4)] == j % 2 for j, cid in enumerate(ids))
    assert grouping.subscribers == {"consuming": expected, "other": 16 - expected}
    assert len(grouping.latencies["consuming"]) == expected
    assert grouping.partitions == {0: [0, 2], 1: [1, 3]}
    assert grouping.error is None


def test_grouping_refuses_owners_that_miss_a_partition() -> None:
    """A replica whose /metrics did not answer, or a partition whose lag series is
    not there yet: the split cannot be trusted."""
    grouping = by_consuming_replica({0: 0, 2: 0}, 2, [("c", 0, b"")])
    assert grouping.error == "partition owners incomplete: [0, 2]"
    grouping = by_consuming_replica({0: 0, 1: 1, 2: 0}, 4, [("c", 0, b"")])
    assert grouping.error == "partition owners incomplete: [0, 1, 2]"
    assert grouping.subscribers == {"consuming": 0, "other": 0}


def test_partition_of_is_pinned() -> None:
    """murmur2 of the key, as aiokafka's default partitioner (the one devicemq's
    producer uses) computes it; pinned, so that a change on either side shows."""
    assert [partition_of(f"client-{i}", 4) for i in range(8)] == [2, 2, 3, 3, 3, 2, 2, 1]
    assert [partition_of(f"client-{i}", 12) for i in range(8)] == [2, 6, 7, 11, 3, 10, 6, 1]
