"""The system under test: real redis-server, Tansu and one or two ``devicemq run``.

Every process runs on a free 127.0.0.1 port and is started and stopped by
its PID (the classes of ``tests/faults/conftest.py`` for Redis and devicemq):

- Redis keeps an append-only file with ``appendfsync always``, so a restart
  (SIGTERM or SIGKILL) on the same port and dir loses nothing it answered;
- Tansu keeps its records in memory only: it is restarted on the same port
  (empty) only after every broker stored everything Kafka acknowledged (the
  caller waits for :meth:`System.quiesced`);
- each broker serves metrics on its own port (its assigned partitions), and
  Kafka itself tells when it holds nothing the brokers have not stored: the
  group's committed offsets against the log ends.

Nothing here knows the broker's insides: processes, signals, ports, the
``/metrics`` text and Kafka's offsets.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from app.embedded_services import find_tansu, free_port, kafka_ready
from tests.faults.conftest import HOST, DeviceMQ, RedisProcess
from tests.faults.sentinel import MASTER_NAME, Found, ReplicaRedis, SentinelProcess, cut_off
from tests.kafka_fixtures import listed_partitions, name_topic, start_tansu, stop_tansu

PARTITIONS = 4  # the default; a plan or test may set persistence.partitions


class Tansu:
    """A Kafka-protocol broker (memory storage) that can be killed and started again."""

    def __init__(self, log: Path) -> None:
        find_tansu()
        self.log = log
        self.port = free_port(HOST)
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.paused = False

    @property
    def bootstrap(self) -> str:
        return f"{HOST}:{self.port}"

    def start(self) -> None:
        """Start on :attr:`port` (again: the port may linger a moment after a kill)."""
        deadline = time.monotonic() + 20
        while True:
            try:
                self.proc = start_tansu(self.port, log=self.log)
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.starts += 1
        self.paused = False

    def reused_offsets(self) -> bool:
        """Did Tansu write over offsets it had acknowledged? After a restart it takes
        produces for the topic before the topic exists again, then counts that
        partition's offsets from 0 once more (its log: AlreadyExists)."""
        try:
            return "AlreadyExists" in self.log.read_text(errors="replace")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: everything it held is gone."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.paused = False

    def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            stop_tansu(self.proc)
        self.paused = False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready(self) -> bool:
        return kafka_ready(self.port)


def _signal(proc: subprocess.Popen[bytes] | None, sig: int) -> bool:
    if proc is None or proc.poll() is not None:
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, sig)
        return True
    return False


def parse_metrics(text: str) -> dict[str, float]:
    """``name{labels}`` -> value, for every sample line of the Prometheus text."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


class System:
    """Redis, Tansu and ``replicas`` brokers (``cluster.enabled`` when 2)."""

    def __init__(self, root: Path, replicas: int, settings: Mapping[str, object]) -> None:
        self.root = root
        shutil.rmtree(root, ignore_errors=True)  # a fresh Redis: no AOF of an earlier run
        root.mkdir(parents=True)
        tag = uuid.uuid4().hex[:8]
        self.tag = tag
        self.topic, self.group = f"model.{tag}", f"model-{tag}"
        self.redis = RedisProcess(root / "redis")
        self.tansu = Tansu(root / "tansu.log")
        # redis_wait: replicas (the failover scenario): a replica and a Sentinel, and
        # the brokers find the master through it (persistence.redis_sentinels).
        self.replica: ReplicaRedis | None = None
        self.sentinel: SentinelProcess | None = None
        self.replica_lagging = False
        self.failovers = 0
        given: RedisProcess = self.redis
        if settings.get("persistence.redis_wait") == "replicas":
            self.replica = ReplicaRedis(root / "redis-r0", self.redis)
            self.sentinel = SentinelProcess(root / "sentinel", self.redis)
            given = Found(root / "found")
            settings = {
                **settings,
                "persistence.redis_sentinels": f"{HOST}:{self.sentinel.port}",
                "persistence.redis_sentinel_master": MASTER_NAME,
            }
        self.partitions = int(str(settings.get("persistence.partitions", PARTITIONS)))
        common: dict[str, object] = {
            "persistence.topic": self.topic,
            "persistence.consumer_group": self.group,
            "persistence.partitions": PARTITIONS,
            "events.enabled": False,
            "log.level": "INFO",
            "metrics.enabled": True,
            "metrics.host": HOST,
            **settings,
        }
        if replicas > 1:
            common["cluster.enabled"] = True
        self.brokers: list[DeviceMQ] = []
        self.metrics_ports: list[int] = []
        for i in range(replicas):
            port = free_port(HOST)
            own = {**common, "metrics.port": port}
            if replicas > 1:
                own["cluster.node_id"] = "ab"[i] if i < 2 else f"n{i}"
            self.brokers.append(DeviceMQ(root / f"broker-{i}", given, self.tansu.bootstrap, own))
            self.metrics_ports.append(port)
        self.redis_paused = False
        self.kills: list[tuple[float, int]] = []  # (time, broker) of every kill -9
        self.unexpected_exits: list[str] = []

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        self.tansu.start()
        self.redis.start()
        if self.replica is not None and self.sentinel is not None:
            self.replica.start()
            self.sentinel.start()
            self._until_promotable(self.replica)
        for broker in self.brokers:  # one after the other: one of them creates the topic
            broker.start()
        for i in range(len(self.brokers)):
            self.wait_serving(i)

    def stop(self) -> None:
        """Everything down, by PID; safe after a partial start."""
        self.resume_all()
        for broker in reversed(self.brokers):
            with contextlib.suppress(Exception):
                broker.stop()
        for other in (self.sentinel, self.replica):
            if other is not None:
                with contextlib.suppress(Exception):
                    other.stop()
        with contextlib.suppress(Exception):
            self.redis.stop()
        with contextlib.suppress(Exception):
            self.tansu.stop()

    def address(self, i: int) -> tuple[str, int]:
        return self.brokers[i % len(self.brokers)].address

    def logs(self) -> list[Path]:
        return [b.data_dir / "broker.log" for b in self.brokers]

    # -- faults ------------------------------------------------------------------------

    def kill_broker(self, i: int) -> None:
        broker = self.brokers[i]
        if broker.alive():
            broker.kill()
            self.kills.append((time.monotonic(), i))

    def start_broker(self, i: int) -> None:
        broker = self.brokers[i]
        if not broker.alive():
            broker.start()
            self.wait_serving(i)

    def restart_redis(self, sig: int) -> None:
        """Stop Redis with ``sig`` (SIGTERM: fsync and exit; SIGKILL) and start it again."""
        self.resume_redis()
        self.redis.stop(sig)
        self.redis.start()

    def pause_redis(self) -> None:
        if not self.redis_paused and _signal(self.redis.proc, signal.SIGSTOP):
            self.redis_paused = True

    def resume_redis(self) -> None:
        if self.redis_paused:
            _signal(self.redis.proc, signal.SIGCONT)
            self.redis_paused = False

    def pause_kafka(self) -> None:
        if not self.tansu.paused and _signal(self.tansu.proc, signal.SIGSTOP):
            self.tansu.paused = True

    def resume_kafka(self) -> None:
        if self.tansu.paused:
            _signal(self.tansu.proc, signal.SIGCONT)
            self.tansu.paused = False

    def resume_all(self) -> None:
        self.resume_redis()
        self.resume_kafka()
        self.thaw_replica()

    def lag_replica(self) -> bool:
        """Cut the replica off (frozen, its link killed): it lags from now on."""
        if self.replica is None or self.replica_lagging or not self.replica.alive():
            return False
        self._until_promotable(self.replica)  # else the Sentinel could not fail over
        cut_off(self.replica)
        self.replica_lagging = True
        return True

    def thaw_replica(self) -> None:
        """The cut-off replica runs again and catches up with the master."""
        if self.replica is not None and self.replica_lagging:
            _signal(self.replica.proc, signal.SIGCONT)
            self.replica_lagging = False

    def kill_master(self) -> bool:
        """Kill the master (-9): the Sentinel will promote the replica. True when the
        replica lagged: the new master lacks what the old one alone had (with
        redis_wait: replicas, nothing acknowledged may be lost for that)."""
        assert self.replica is not None and self.sentinel is not None
        lagged = self.replica_lagging
        if not lagged:  # (a cut-off one was promotable when it was cut: lag_replica)
            self._until_promotable(self.replica)  # the one started by the last failover
        self.redis.stop(signal.SIGKILL)
        self.thaw_replica()
        return lagged

    def promote(self) -> None:
        """Wait for the Sentinel to promote the replica; a fresh replica follows it."""
        assert self.replica is not None and self.sentinel is not None
        promoted = self.replica
        deadline = time.monotonic() + 30
        while self.sentinel.master_port() != promoted.port:
            if time.monotonic() > deadline:
                raise RuntimeError("the sentinel did not promote the replica within 30 s")
            time.sleep(0.05)
        self.failovers += 1
        self.redis = promoted
        self.replica = ReplicaRedis(self.root / f"redis-r{self.failovers}", promoted)
        self.replica.start()  # in sync; the Sentinel learns of it later (see above)

    def _until_promotable(self, replica: ReplicaRedis) -> None:
        """The Sentinel learns of a new replica from the master's INFO (every 10 s):
        a failover before that would find none to promote."""
        assert self.sentinel is not None
        deadline = time.monotonic() + 30
        while replica.port not in self.sentinel.ready_replicas():
            if time.monotonic() > deadline:
                raise RuntimeError("the sentinel did not see the new replica within 30 s")
            time.sleep(0.1)

    def restart_kafka(self) -> None:
        """Kill Tansu and start an empty one on the same port."""
        self.tansu.kill()
        self.tansu.start()

    @contextlib.contextmanager
    def frozen_broker(self, i: int) -> Iterator[None]:
        """Broker ``i`` stopped (SIGSTOP) for the block, let go after it."""
        proc = self.brokers[i].proc
        frozen = _signal(proc, signal.SIGSTOP)
        try:
            yield
        finally:
            if frozen:
                _signal(proc, signal.SIGCONT)

    def restart_kafka_frozen(self) -> None:
        """Restart Kafka and name the topic while every broker is stopped (SIGSTOP):
        the brokers find Tansu's own topic, at its size, whatever their timing."""
        frozen = [b.proc for b in self.brokers if _signal(b.proc, signal.SIGSTOP)]
        try:
            self.restart_kafka()
            self.name_topic()
        finally:
            for proc in frozen:
                _signal(proc, signal.SIGCONT)

    def name_topic(self) -> None:
        """Ask Tansu for the topic by name, as any Kafka client may (a reader such as
        the stream audit, a producer refreshing its metadata): Tansu creates a topic a
        metadata request names, at its default size (4 partitions), if it has none."""
        asyncio.run(asyncio.wait_for(name_topic(self.tansu.bootstrap, self.topic), 10.0))

    def listed_partitions(self) -> int | None:
        """Partitions Tansu lists for the topic now (asked without naming it)."""
        return asyncio.run(
            asyncio.wait_for(listed_partitions(self.tansu.bootstrap, self.topic), 10.0)
        )

    # -- observation ---------------------------------------------------------------------

    def check_alive(self) -> list[str]:
        """Brokers that exited without being killed (each reported once)."""
        found = []
        for i, broker in enumerate(self.brokers):
            proc = broker.proc
            if proc is not None and proc.poll() is not None and proc.returncode != -9:
                text = f"broker {i} exited unexpectedly with code {proc.returncode}"
                if text not in self.unexpected_exits:
                    self.unexpected_exits.append(text)
                    found.append(text)
        return found

    def metrics(self, i: int, timeout: float = 3.0) -> dict[str, float] | None:
        conn = http.client.HTTPConnection(HOST, self.metrics_ports[i], timeout=timeout)
        try:
            conn.request("GET", "/metrics")
            response = conn.getresponse()
            body = response.read()
            if response.status != 200:
                return None
            return parse_metrics(body.decode())
        except OSError:
            return None
        finally:
            conn.close()

    def ready(self, i: int) -> bool:
        conn = http.client.HTTPConnection(HOST, self.metrics_ports[i], timeout=3.0)
        try:
            conn.request("GET", "/ready")
            response = conn.getresponse()
            response.read()
            return response.status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def wait_serving(self, i: int, timeout: float = 30.0) -> bool:
        """Until the broker's /ready is 200 (partitions assigned, backends up)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.brokers[i].alive():
                return False
            if self.ready(i):
                return True
            time.sleep(0.1)
        return False

    def kafka_settled(self) -> bool:
        """Kafka's own answer: the group's committed offset has reached the log end of
        every partition (the consumer commits only what Redis stored).

        Asked of Tansu itself, not of the brokers' metrics: a broker's cached
        highwater lags behind what its producer just had acknowledged, and after a
        Kafka restart both its highwater and committed offsets may describe the
        log that is gone.
        """
        if self.tansu.paused or self.tansu.proc is None:
            return False
        try:
            return asyncio.run(asyncio.wait_for(self._kafka_settled(), 10.0))
        except (KafkaError, OSError, TimeoutError):
            return False

    async def _kafka_settled(self) -> bool:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.tansu.bootstrap,
            group_id=self.group,
            enable_auto_commit=False,
        )
        await consumer.start()
        try:
            partitions = [TopicPartition(self.topic, p) for p in range(self.partitions)]
            ends = await consumer.end_offsets(partitions)
            for tp in partitions:
                if ends.get(tp, 0) > 0 and (await consumer.committed(tp) or 0) < ends[tp]:
                    return False
            return True
        finally:
            await consumer.stop()

    def quiesced(self) -> bool:
        """Every partition assigned to a live broker, none with consumer lag, and
        Kafka itself holding nothing the brokers have not stored."""
        assigned = 0
        for i, broker in enumerate(self.brokers):
            if not broker.alive():
                continue
            sample = self.metrics(i)
            if sample is None:
                return False
            assigned += int(sample.get("devicemq_kafka_consumer_assigned_partitions", 0))
            lags = [v for k, v in sample.items() if k.startswith("devicemq_kafka_consumer_lag")]
            if len(lags) != int(sample.get("devicemq_kafka_consumer_assigned_partitions", 0)):
                return False  # a partition without a known highwater or commit yet
            if any(v > 0 for v in lags):
                return False
        return assigned == self.partitions and self.kafka_settled()

    def counter(self, name: str) -> float:
        """Sum of a metric over the live brokers."""
        total = 0.0
        for i, broker in enumerate(self.brokers):
            if broker.alive():
                sample = self.metrics(i) or {}
                total += sum(v for k, v in sample.items() if k.split("{")[0] == name)
        return total
