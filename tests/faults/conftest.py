"""Real processes for the fault tests: redis-server, Tansu, devicemq.

Each test gets its own redis-server (AOF on, ``appendfsync always``, in a tmp
dir, so a restart on the same port and dir keeps every write) and its own
devicemq process on a fixed port (so a restart lands where the clients
reconnect). Tansu is the session-wide one of :mod:`tests.kafka_fixtures`;
each test uses its own Kafka topic and consumer group, so a broker killed in
one test leaves nothing for the next. Every process is started and stopped by
its PID, in ``finally`` blocks.

Tansu keeps its data in memory only: it can be paused (SIGSTOP) but not
restarted without losing what it held, so Kafka outages are simulated by
pausing it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from app.embedded_services import find_redis_server, find_tansu, free_port
from tests.conftest import admin_env
from tests.kafka_fixtures import bootstrap_of, start_tansu, stop_tansu

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
START_TIMEOUT = 20.0
STOP_TIMEOUT = 10.0


def _wait_tcp(port: int, alive: callable, timeout: float, what: str) -> None:  # type: ignore[valid-type]
    deadline = time.monotonic() + timeout
    while True:
        if not alive():
            raise RuntimeError(f"{what} exited before listening on {port}")
        with socket.socket() as s:
            s.settimeout(0.5)
            try:
                s.connect((HOST, port))
            except OSError:
                pass
            else:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not listening on {port} after {timeout} s")
        time.sleep(0.05)


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    """Signal by PID, SIGKILL if it will not go, reap. Safe to call twice."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)  # a paused process cannot act on SIGTERM
            os.kill(proc.pid, sig)
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(STOP_TIMEOUT)


class RedisProcess:
    """A redis-server that keeps its data across restarts (AOF, fsync always)."""

    def __init__(self, directory: Path, appendfsync: str = "always") -> None:
        self.dir = directory
        self.appendfsync = appendfsync
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port(HOST)
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def start(self) -> None:
        argv = [
            find_redis_server(),
            "--port", str(self.port),
            "--bind", HOST,
            "--dir", str(self.dir),
            "--appendonly", "yes",
            "--appendfsync", self.appendfsync,
            "--save", "",
            "--daemonize", "no",
            "--loglevel", "warning",
            "--logfile", str(self.dir / f"redis-{self.starts}.log"),
        ]  # fmt: skip
        self.starts += 1
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT
        while not self.ping():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start on {self.port}")
            time.sleep(0.02)

    def ping(self) -> bool:
        try:
            with socket.create_connection((HOST, self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """SIGTERM makes redis-server fsync and exit, like ``redis-cli shutdown``."""
        if self.proc is not None:
            _stop(self.proc, sig)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class DeviceMQ:
    """A ``devicemq run`` process on a fixed port and data dir, restartable."""

    def __init__(
        self, data_dir: Path, redis: RedisProcess, bootstrap: str, settings: Mapping[str, object]
    ) -> None:
        self.data_dir = data_dir
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port(HOST)
        self.redis = redis
        self.bootstrap = bootstrap
        self.settings = dict(settings)
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.exit_codes: list[int] = []

    @property
    def address(self) -> tuple[str, int]:
        return HOST, self.port

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DEVICEMQ_")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env["DEVICEMQ_PERSISTENCE_REDIS_URL"] = self.redis.url
        env["DEVICEMQ_PERSISTENCE_KAFKA_BOOTSTRAP"] = self.bootstrap
        env.update(admin_env())
        for name, value in self.settings.items():
            var = "DEVICEMQ_" + name.replace(".", "_").upper()
            env[var] = str(value).lower() if isinstance(value, bool) else str(value)
        return env

    def start(self) -> None:
        argv = [
            sys.executable, "-m", "app.cli", "run",
            "--host", HOST, "--port", str(self.port), "--data-dir", str(self.data_dir),
        ]  # fmt: skip
        log = (self.data_dir / "broker.log").open("ab")
        log.write(f"\n===== start {self.starts} =====\n".encode())
        log.flush()
        self.starts += 1
        try:
            self.proc = subprocess.Popen(
                argv, cwd=REPO, env=self.env(), stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        finally:
            log.close()
        try:
            _wait_tcp(self.port, self.alive, START_TIMEOUT, "devicemq")
        except BaseException as error:
            self.stop()
            if not isinstance(error, Exception):
                raise  # a SystemExit (the model checker killed) or Ctrl-C stays itself
            raise RuntimeError(f"devicemq did not start:\n{self.log()[-4000:]}") from None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.exit_codes.append(self.proc.wait(STOP_TIMEOUT))

    def terminate(self, timeout: float = 40.0) -> int:
        """SIGTERM and wait for the graceful drain to finish."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGTERM)
        code = self.proc.wait(timeout)
        self.exit_codes.append(code)
        return code

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            _stop(self.proc)
            self.exit_codes.append(self.proc.returncode)

    def log(self) -> str:
        try:
            return (self.data_dir / "broker.log").read_text(errors="replace")
        except OSError:
            return ""


@dataclass
class Stack:
    redis: RedisProcess
    broker: DeviceMQ
    tansu_pid: int | None
    prefix: str

    def topic(self, suffix: str = "") -> str:
        return f"{self.prefix}/{suffix}" if suffix else self.prefix

    def client(self, suffix: str) -> str:
        return f"{self.prefix.replace('/', '-')}-{suffix}"


# FAULTS_TANSU_STORAGE=s3: the fault tests on the Tansu of an embedded data dir on
# s3 storage (docs/embedded-kafka.md), with its S3 store, instead of one in memory.
ENV_STORAGE = "FAULTS_TANSU_STORAGE"


@pytest.fixture(scope="session")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int | None]]:
    """Tansu for the fault tests: (bootstrap, pid). The pid lets a test pause it."""
    find_tansu()
    if os.environ.get(ENV_STORAGE, "memory") == "s3":
        from app.embedded_services import EmbeddedServices

        services = EmbeddedServices(tmp_path_factory.mktemp("kafka-s3"), kafka_storage="s3")
        pid: int | None = None
        try:
            bootstrap = services.ensure_running().kafka_bootstrap
            pid = next(s.pid for s in services.status() if s.name == "kafka")
            yield bootstrap, pid
        finally:
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            services.stop()
        return
    proc = start_tansu(log=Path(os.environ.get("TMPDIR", "/tmp")) / "devicemq-faults-tansu.log")
    try:
        yield bootstrap_of(proc), proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        stop_tansu(proc)


@pytest.fixture
def stack_factory(
    tmp_path: Path, kafka: tuple[str, int | None], request: pytest.FixtureRequest
) -> Iterator[callable]:  # type: ignore[valid-type]
    """``make(settings)``: a fresh Redis and a devicemq on them and the shared Tansu."""
    made: list[Stack] = []

    def make(
        settings: Mapping[str, object] | None = None,
        *,
        redis_dir: Path | None = None,
        appendfsync: str = "always",
    ) -> Stack:
        tag = uuid.uuid4().hex[:8]
        merged: dict[str, object] = {
            "persistence.topic": f"faults.{tag}",
            "persistence.consumer_group": f"faults-{tag}",
            "persistence.partitions": 4,
            "log.level": "INFO",
        }
        merged.update(settings or {})
        redis = RedisProcess(redis_dir or tmp_path / f"redis-{len(made)}", appendfsync)
        broker = DeviceMQ(tmp_path / f"broker-{len(made)}", redis, kafka[0], merged)
        name = request.node.name.replace("[", "-").replace("]", "")[:30]
        stack = Stack(redis, broker, kafka[1], f"faults/{name}-{tag}")
        made.append(stack)
        redis.start()
        broker.start()
        return stack

    try:
        yield make
    finally:
        for stack in made:
            stack.broker.stop()
            stack.redis.stop()
    failed = request.node.rep_call.failed if hasattr(request.node, "rep_call") else False
    if failed:
        for stack in made:
            print(f"--- devicemq log ({stack.broker.data_dir}) ---")
            print(stack.broker.log()[-6000:])


@pytest.fixture
def stack(stack_factory: callable) -> Stack:  # type: ignore[valid-type]
    return stack_factory()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    report = yield
    if report.when == "call":
        item.rep_call = report  # type: ignore[attr-defined]
    return report
