"""Two devicemq replicas (cluster.enabled) on one redis-server and one Tansu.

Real processes, started and stopped by PID (the classes of
``tests/faults/conftest.py``): replica ``a`` starts first, then ``b`` (one
after the other, so only one of them creates the Kafka topic); both share the
topic and the consumer group, so each stores the partitions it was given and
tells the other about clients connected there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from app.embedded_services import find_tansu
from broker.packets import PubAck, Publish
from tests.conftest import free_port
from tests.e2e.clients import Raw
from tests.faults.conftest import HOST, START_TIMEOUT, DeviceMQ, RedisProcess
from tests.integration.redis_servers import RedisCluster3
from tests.kafka_fixtures import bootstrap_of, start_tansu, stop_tansu


@dataclass
class Cluster:
    a: DeviceMQ
    b: DeviceMQ
    tag: str

    def name(self, suffix: str) -> str:
        return f"cluster-{self.tag}-{suffix}"

    def balanced_owners(self, timeout: float = 60) -> dict[int, int]:
        """Kafka partition -> the replica consuming it (0: a, 1: b), once both consume
        some (the cluster started with ``metrics=True``)."""
        from loadtest.replicas import partition_owners

        ports = [int(str(broker.settings["metrics.port"])) for broker in (self.a, self.b)]
        owners: dict[int, int] = {}
        deadline = time.monotonic() + timeout
        while True:
            owners.update(partition_owners(HOST, ports)[0])
            if set(owners) == {0, 1, 2, 3} and set(owners.values()) == {0, 1}:
                return owners
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s: partitions {owners}")
            time.sleep(0.02)


def publish_acked(producer: Raw, topic: str, payload: bytes, packet_id: int) -> None:
    """One QoS 1 PUBLISH, its PUBACK taken and checked."""
    producer.send(Publish(topic, payload, 1, packet_id=packet_id))
    ack = producer.recv()
    assert isinstance(ack, PubAck) and ack.reason_code == 0, ack


def probe_until_routed(producer: Raw, member: Raw, topic: str, timeout: float = 30) -> int:
    """Publish probes to ``topic`` on the producer's replica until ``member`` (on the
    other replica) gets one, which it acknowledges: that replica routes to the group
    now (the member's subscription reached it). Answers the last packet id used."""
    n = 0
    deadline = time.monotonic() + timeout
    while True:
        n += 1
        publish_acked(producer, topic, b"probe", n)
        packet = member.recv_or_none(0.5)
        if isinstance(packet, Publish):
            assert packet.packet_id is not None
            member.send(PubAck(packet.packet_id))
            return n
        assert time.monotonic() < deadline, "b never routed to the group"


@contextlib.contextmanager
def running_cluster(
    root: Path,
    settings: Mapping[str, object] = {},
    shared_port: bool = False,
    metrics: bool = False,
    admin_token: str | None = None,
) -> Iterator[Cluster]:
    """Tansu, redis-server and replicas ``a`` then ``b``; ``shared_port``: both on a's
    port; ``metrics``: each serves /metrics on a port of its own (``metrics.port``);
    ``admin_token``: each serves the admin API with that token on a port of its own
    (``admin.port``)."""
    find_tansu()
    tansu = start_tansu(log=root / "tansu.log")
    redis = RedisProcess(root / "redis")
    tag = uuid.uuid4().hex[:8]
    common: dict[str, object] = {
        "persistence.topic": f"cluster.{tag}",
        "persistence.consumer_group": f"cluster-{tag}",
        "persistence.partitions": 4,
        "cluster.enabled": True,
        "events.enabled": False,
        "log.level": "INFO",
        **settings,
    }
    a = DeviceMQ(root / "a", redis, bootstrap_of(tansu), {**common, "cluster.node_id": "a"})
    b = DeviceMQ(root / "b", redis, bootstrap_of(tansu), {**common, "cluster.node_id": "b"})
    if shared_port:
        b.port = a.port
    if metrics:
        for broker in (a, b):
            broker.settings.update({"metrics.enabled": True, "metrics.port": free_port(HOST)})
    if admin_token is not None:
        for broker in (a, b):
            broker.settings.update({"admin.port": free_port(HOST), "admin.token": admin_token})
    try:
        redis.start()
        a.start()
        b.start()
        if shared_port:  # a answers on the port already: wait for b's own listener
            _wait_for_log(b, "devicemq listening on", START_TIMEOUT)
        yield Cluster(a, b, tag)
    finally:
        for broker in (b, a):
            broker.stop()
        redis.stop()
        with contextlib.suppress(ProcessLookupError):
            os.kill(tansu.pid, signal.SIGCONT)
        stop_tansu(tansu)
        for broker in (a, b):  # shown by pytest when a test of the module failed
            print(f"--- {broker.data_dir} ---\n{broker.log()[-8000:]}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tmp_path_factory.mktemp("cluster")) as replicas:
        yield replicas


def _wait_for_log(broker: DeviceMQ, line: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while line not in broker.log():
        if not broker.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{broker.data_dir}: no {line!r}:\n{broker.log()[-4000:]}")
        time.sleep(0.05)


@dataclass
class Replicas:
    """Replicas ``r0``, ``r1``, ... on a Redis Cluster (``persistence.redis_cluster``)."""

    nodes: list[DeviceMQ]
    redis: RedisCluster3
    tag: str

    def name(self, suffix: str) -> str:
        return f"rc-{self.tag}-{suffix}"

    def redis_cli(self, *args: str) -> str:
        """Run a command on every master; their answers, joined."""
        return "\n".join(
            subprocess.run(
                ["redis-cli", "-p", str(port), *args], capture_output=True, text=True, check=True
            ).stdout
            for port in self.redis.ports
        )

    def kill_pubsub(self, node: str) -> None:
        """Close the cluster link's pub/sub connection of replica ``node`` (it is
        named devicemq-cluster-<node>), as a Redis restart or a network cut would."""
        for port in self.redis.ports:
            listing = subprocess.run(
                ["redis-cli", "-p", str(port), "CLIENT", "LIST", "TYPE", "pubsub"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            for line in listing.splitlines():
                fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
                if fields.get("name") == f"devicemq-cluster-{node}":
                    subprocess.run(
                        ["redis-cli", "-p", str(port), "CLIENT", "KILL", "ID", fields["id"]],
                        capture_output=True,
                        check=True,
                    )


@contextlib.contextmanager
def running_replicas(
    root: Path, count: int, settings: Mapping[str, object] = {}
) -> Iterator[Replicas]:
    """Tansu, a 3-master Redis Cluster, then ``count`` replicas started one by one."""
    find_tansu()
    tansu = start_tansu(log=root / "tansu.log")
    redis = RedisCluster3()
    tag = uuid.uuid4().hex[:8]
    common: dict[str, object] = {
        "persistence.topic": f"rc.{tag}",
        "persistence.consumer_group": f"rc-{tag}",
        "persistence.partitions": 4,
        "persistence.redis_cluster": True,
        "cluster.enabled": True,
        "events.enabled": False,
        "log.level": "INFO",
        **settings,
    }
    nodes = [
        DeviceMQ(root / f"r{i}", redis, bootstrap_of(tansu), {**common, "cluster.node_id": f"r{i}"})  # type: ignore[arg-type]
        for i in range(count)
    ]
    try:
        for node in nodes:
            node.start()
        yield Replicas(nodes, redis, tag)
    finally:
        for node in reversed(nodes):
            node.stop()
        redis.stop()
        stop_tansu(tansu)
        for node in nodes:  # shown by pytest when a test of the module failed
            print(f"--- {node.data_dir} ---\n{node.log()[-8000:]}")


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    with running_replicas(tmp_path_factory.mktemp("replicas"), 3) as running:
        yield running
