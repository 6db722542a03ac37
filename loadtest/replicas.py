"""Latency by replica: is a subscriber on the replica that consumes its partition?

With several devicemq replicas (``cluster.enabled``), a persistent subscriber's
messages are stored by the replica whose Kafka consumer holds the partition of
its client ID. When the subscriber is connected to that replica, the stored
message is handed to its connection in memory; when it is connected to another,
that replica is told over Redis pub/sub and reads the message back from Redis.
``--replicas`` connects the clients to each replica's own port and reads which
partitions each one holds from its ``/metrics``
(``devicemq_kafka_consumer_lag_records{partition=...}``, one series per
assigned partition), so that the report gives the latency of each group:
measured, not inferred.
"""

from __future__ import annotations

import re
import urllib.request
from array import array
from collections.abc import Iterable
from dataclasses import dataclass

from aiokafka.partitioner import DefaultPartitioner

__all__ = ["Grouping", "by_consuming_replica", "partition_of", "partition_owners"]

_ASSIGNED = re.compile(rb'^devicemq_kafka_consumer_lag_records\{partition="(\d+)"\}', re.M)
_COUNT = re.compile(rb"^devicemq_kafka_consumer_assigned_partitions (\d+)", re.M)


def partition_owners(
    host: str, metrics_ports: Iterable[int], timeout: float = 3.0
) -> tuple[dict[int, int], int]:
    """Partition -> index of the replica whose consumer holds it, read from each
    replica's ``/metrics``, and how many partitions the replicas say they hold in
    all (a partition's lag series is only there once its offsets are known, so
    the two can differ). A replica that does not answer holds nothing here."""
    owners: dict[int, int] = {}
    held = 0
    for index, port in enumerate(metrics_ports):
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as r:
                text = r.read()
        except OSError:
            continue
        for match in _ASSIGNED.finditer(text):
            owners[int(match.group(1))] = index
        count = _COUNT.search(text)
        held += int(count.group(1)) if count else 0
    return owners, held


def partition_of(client_id: str, count: int) -> int:
    """The partition devicemq's producer gives records for ``client_id`` (its key),
    with the Kafka client's default partitioner (persistence/kafka_path.py)."""
    every = list(range(count))
    return int(DefaultPartitioner()(client_id.encode(), every, every))


@dataclass
class Grouping:
    """Subscribers split by whether their replica consumes their partition."""

    partitions: dict[int, list[int]]  # replica index -> partitions its consumer holds
    subscribers: dict[str, int]  # "consuming" / "other" -> how many
    latencies: dict[str, array[int]]  # "consuming" / "other" -> e2e us of their deliveries
    error: str | None = None  # set when the owners do not cover every partition


def by_consuming_replica(
    owners: dict[int, int], held: int, subscribers: Iterable[tuple[str, int, bytes]]
) -> Grouping:
    """Split ``subscribers`` (client ID, index of the replica it is connected to,
    its latencies as array "I" bytes) into those on the replica that consumes
    their partition and the others. ``owners`` and ``held`` as
    :func:`partition_owners`; when the owners are not every partition from 0 to
    ``held``, the split cannot be trusted and ``error`` says so."""
    count = held
    by_replica: dict[int, list[int]] = {}
    for partition, replica in sorted(owners.items()):
        by_replica.setdefault(replica, []).append(partition)
    grouping = Grouping(
        by_replica, {"consuming": 0, "other": 0}, {"consuming": array("I"), "other": array("I")}
    )
    if count == 0 or set(owners) != set(range(count)):
        grouping.error = f"partition owners incomplete: {sorted(owners)}"
        return grouping
    for client_id, replica, latencies in subscribers:
        group = "consuming" if owners[partition_of(client_id, count)] == replica else "other"
        grouping.subscribers[group] += 1
        samples = array("I")
        samples.frombytes(latencies)
        grouping.latencies[group].extend(samples)
    return grouping
