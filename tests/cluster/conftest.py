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
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from persistence.services import find_tansu
from tests.faults.conftest import DeviceMQ, RedisProcess
from tests.kafka_fixtures import bootstrap_of, start_tansu, stop_tansu


@dataclass
class Cluster:
    a: DeviceMQ
    b: DeviceMQ
    tag: str

    def name(self, suffix: str) -> str:
        return f"cluster-{self.tag}-{suffix}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    find_tansu()
    root = tmp_path_factory.mktemp("cluster")
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
    }
    a = DeviceMQ(root / "a", redis, bootstrap_of(tansu), {**common, "cluster.node_id": "a"})
    b = DeviceMQ(root / "b", redis, bootstrap_of(tansu), {**common, "cluster.node_id": "b"})
    try:
        redis.start()
        a.start()
        b.start()
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
