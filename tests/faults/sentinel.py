"""A Redis that Sentinel keeps available, for tests: a replica, one Sentinel, and the
``redis_url`` a broker is given then (persistence.redis_sentinels, issue 18).
Used by tests/faults/test_redis_sentinel.py and the model checker's failover
scenario (tests/model/system.py)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import redis

from app.embedded_services import find_redis_server, free_port
from tests.faults.conftest import HOST, RedisProcess, _stop

MASTER_NAME = "devicemq-test"


class ReplicaRedis(RedisProcess):
    """A redis-server replicating ``master``'s port."""

    def __init__(self, directory: Path, master: RedisProcess) -> None:
        super().__init__(directory)
        self.master = master

    def start(self) -> None:
        argv = [
            find_redis_server(),
            "--port", str(self.port), "--bind", HOST, "--dir", str(self.dir),
            "--appendonly", "yes", "--appendfsync", "always", "--save", "",
            "--replicaof", HOST, str(self.master.port),
            "--daemonize", "no", "--loglevel", "warning",
            "--logfile", str(self.dir / f"redis-{self.starts}.log"),
        ]  # fmt: skip
        self.starts += 1
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        client = redis.Redis(host=HOST, port=self.port, socket_timeout=1)
        deadline = time.monotonic() + 20
        try:
            while True:  # up and in sync with its master
                try:
                    if client.info("replication").get("master_link_status") == "up":
                        return
                except (redis.RedisError, OSError):
                    pass
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"replica did not sync on {self.port}")
                time.sleep(0.05)
        finally:
            client.close()


class SentinelProcess:
    """One redis-server in Sentinel mode watching ``master`` (quorum 1)."""

    def __init__(self, directory: Path, master: RedisProcess) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port(HOST)
        self.master = master
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        conf = self.dir / "sentinel.conf"
        conf.write_text(
            f"port {self.port}\nbind {HOST}\ndir {self.dir}\n"
            f"logfile {self.dir / 'sentinel.log'}\n"
            f"sentinel monitor {MASTER_NAME} {HOST} {self.master.port} 1\n"
            f"sentinel down-after-milliseconds {MASTER_NAME} 1000\n"
            f"sentinel failover-timeout {MASTER_NAME} 5000\n"
        )
        self.proc = subprocess.Popen(
            [find_redis_server(), str(conf), "--sentinel"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while self.master_port() != self.master.port:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"sentinel did not start on {self.port}")
            time.sleep(0.05)

    def master_port(self) -> int | None:
        client = redis.Redis(host=HOST, port=self.port, socket_timeout=1)
        try:
            answer = client.execute_command("SENTINEL", "get-master-addr-by-name", MASTER_NAME)
            return int(answer[1]) if answer else None
        except (redis.RedisError, OSError):
            return None
        finally:
            client.close()

    def ready_replicas(self) -> set[int]:
        """Ports of the replicas this Sentinel knows and would promote."""
        client = redis.Redis(host=HOST, port=self.port, socket_timeout=1, decode_responses=True)
        try:
            answer = client.execute_command("SENTINEL", "replicas", MASTER_NAME)
        except (redis.RedisError, OSError):
            return set()
        finally:
            client.close()
        ready = set()
        for entry in answer:
            if not isinstance(entry, dict):  # RESP2: a flat name, value list
                entry = dict(zip(entry[::2], entry[1::2], strict=True))
            fields = entry
            if fields.get("flags") == "slave" and fields.get("master-link-status") == "ok":
                ready.add(int(fields["port"]))
        return ready

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)


class Found(RedisProcess):
    """What the broker is told: no host, the Sentinels name the master."""

    @property
    def url(self) -> str:
        return "redis:///0"


def cut_off(replica: ReplicaRedis) -> None:
    """Freeze the replica and cut its link: what the master writes from now on is sent
    nowhere (bytes already sent wait in the frozen replica's socket and still reach
    it). The replica then lags until it is thawed: a failover meanwhile loses what
    the master alone had."""
    from tests.kafka_fixtures import freeze

    assert replica.proc is not None
    freeze(replica.proc)  # type: ignore[arg-type]
    with redis.Redis(host=HOST, port=replica.master.port) as direct:
        direct.execute_command("CLIENT", "KILL", "TYPE", "replica")
