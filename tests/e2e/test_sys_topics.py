"""$SYS topics against a real broker process (broker/sys_topics.py, docs/metrics.md "$SYS topics"):
read with the real ``mosquitto_sub`` and with paho-mqtt.

Nothing here sleeps and hopes: every check waits for the value it expects,
up to a deadline well past ``sys_interval``.
"""

from __future__ import annotations

import queue
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import orjson
import pytest

from broker.auth import hash_password, write_password_file
from tests.conftest import free_port
from tests.e2e.clients import V311, Paho
from tests.e2e.conftest import BrokerProcess, Clients, Names, devicemq_only

pytestmark = pytest.mark.e2e

Factory = Callable[[Mapping[str, object] | None], BrokerProcess]
DEADLINE = 15.0  # seconds to wait for a value that comes every sys_interval (1 s here)
LINE_BUFFERED = ["stdbuf", "-oL"] if shutil.which("stdbuf") else []
BROKER_TOPICS = {
    f"$SYS/broker/{name}"
    for name in (
        "version",
        "uptime",
        "clients/connected",
        "clients/disconnected",
        "clients/total",
        "messages/received",
        "messages/sent",
        "publish/messages/received",
        "publish/messages/sent",
        "bytes/received",
        "bytes/sent",
        "subscriptions/count",
        "retained messages/count",
    )
}


class MosquittoSub:
    """``mosquitto_sub -v`` running in the background; ``values`` is the last payload
    seen per topic, updated as lines are read."""

    def __init__(self, broker: BrokerProcess, *args: str) -> None:
        argv = [*LINE_BUFFERED, "mosquitto_sub", "-h", broker.host, "-p", str(broker.port)]
        self.proc = subprocess.Popen(
            [*argv, "-v", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.values: dict[str, str] = {}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put(raw.decode(errors="replace").rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, condition: Callable[[dict[str, str]], bool], what: str) -> None:
        """Read lines until ``condition(values)`` holds; fail after DEADLINE."""
        deadline = time.monotonic() + DEADLINE
        while not condition(self.values):
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                raise AssertionError(f"mosquitto_sub: not {what}: {self.values}") from None
            if line is None:
                raise AssertionError(f"mosquitto_sub exited: {self.values}")
            topic, _, payload = line.partition(" ")  # -v: "topic payload"; no space in ours
            if topic == "$SYS/broker/retained":  # "retained messages/count" has a space
                rest, _, payload = payload.partition(" ")
                topic = f"{topic} {rest}"
            self.values[topic] = payload

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture
def mosquitto_subs() -> Iterator[list[MosquittoSub]]:
    running: list[MosquittoSub] = []
    yield running
    for sub in running:
        sub.stop()


def test_sys_broker_topics_with_mosquitto_sub(
    broker_factory: Factory, mosquitto_subs: list[MosquittoSub], clients: Clients, names: Names
) -> None:
    """``mosquitto_sub -t '$SYS/broker/#' -v``: Mosquitto's names and formats; the
    connected count includes the subscriber itself and follows clients coming and
    going. Runs against Mosquitto too (DEVICEMQ_TEST_BROKER=mosquitto)."""
    broker = broker_factory({"sys_interval": 1})
    sub = MosquittoSub(broker, "-t", "$SYS/broker/#")
    mosquitto_subs.append(sub)
    sub.wait_for(lambda v: v.keys() >= BROKER_TOPICS, "every topic")
    values = sub.values
    assert re.fullmatch(r"(devicemq|mosquitto) version \S+", values["$SYS/broker/version"])
    assert re.fullmatch(r"\d+ seconds", values["$SYS/broker/uptime"])
    for topic in BROKER_TOPICS - {"$SYS/broker/version", "$SYS/broker/uptime"}:
        assert values[topic].isdigit(), (topic, values[topic])
    assert "$SYS/broker/devicemq/persisted/backlog" not in values  # persistence is off
    connected = "$SYS/broker/clients/connected"
    sub.wait_for(lambda v: v[connected] == "1", "counting the subscriber itself")
    other = clients.paho(broker, names.client("other"))
    assert other.connect().reason_code == 0
    sub.wait_for(lambda v: v[connected] == "2", "counting a second client")
    other.disconnect()
    sub.wait_for(lambda v: v[connected] == "1", "counting the client gone")
    sub.wait_for(lambda v: int(v["$SYS/broker/bytes/received"]) > 0, "counting bytes")


LAG = "$SYS/broker/devicemq/kafka/consumer_lag"
BACKLOG = "$SYS/broker/devicemq/persisted/backlog"


def _devicemq_numbers(
    broker: BrokerProcess, clients: Clients, wanted: set[str]
) -> dict[str, bytes]:
    """The retained $SYS/broker/devicemq/... messages a new subscriber gets, once
    ``wanted`` are among them (the backlog's first count may come a publish later)."""
    watcher = clients.paho(broker)
    assert watcher.connect().reason_code == 0
    assert watcher.subscribe("$SYS/broker/devicemq/#", 0) == [0]
    seen: dict[str, bytes] = {}
    deadline = time.monotonic() + 30
    while not wanted <= seen.keys():
        assert time.monotonic() < deadline, f"{wanted} not all published within 30 s: {seen}"
        seen.update((m.topic, m.payload) for m in watcher.get_optional(1.0))
    seen.update((m.topic, m.payload) for m in watcher.drain())
    return seen


@devicemq_only("$SYS/broker/devicemq/..., persistence")
def test_persistence_numbers_on_the_durable_broker(broker: BrokerProcess, clients: Clients) -> None:
    """The shared broker runs the durable path, without /metrics: the lag only (the
    backlog is counted in Redis for /metrics, not for $SYS alone)."""
    seen = _devicemq_numbers(broker, clients, {LAG})
    assert seen.keys() == {LAG}
    assert all(value.isdigit() for value in seen.values()), seen


@devicemq_only("$SYS/broker/devicemq/..., persistence")
def test_the_backlog_comes_with_metrics(broker_factory: Factory, clients: Clients) -> None:
    broker = broker_factory(
        {
            "persistence.enabled": True,
            "metrics.enabled": True,
            "metrics.port": free_port("127.0.0.1"),
            "sys_interval": 1,
        }
    )
    seen = _devicemq_numbers(broker, clients, {LAG, BACKLOG})
    assert all(value.isdigit() for value in seen.values()), seen


@devicemq_only("presence events are EMQX's, not Mosquitto's")
def test_presence_events(broker_factory: Factory, clients: Clients, names: Names) -> None:
    broker = broker_factory({"sys_interval": 1, "cluster.node_id": "e2e-node"})
    watcher = clients.paho(broker, names.client("watcher"))
    assert watcher.connect().reason_code == 0
    assert watcher.subscribe("$SYS/brokers/+/clients/+/+", 0) == [0]
    device_id = names.client("device")
    device = clients.paho(broker, device_id, V311)
    assert device.connect(keepalive=30).reason_code == 0
    device.terminate()  # the socket drops, no DISCONNECT
    received = watcher.get_n(2, timeout=DEADLINE)  # seen gone before it comes back
    assert device.connect().reason_code == 0
    device.disconnect()
    events = []
    for message in received + watcher.get_n(2, timeout=DEADLINE):
        assert not message.retain
        events.append((message.topic, orjson.loads(message.payload)))
    prefix = f"$SYS/brokers/e2e-node/clients/{device_id}"
    assert [topic for topic, _ in events] == [
        f"{prefix}/connected",
        f"{prefix}/disconnected",
        f"{prefix}/connected",
        f"{prefix}/disconnected",
    ]
    first = events[0][1]
    assert (first["clientid"], first["ipaddress"]) == (device_id, "127.0.0.1")
    assert (first["proto_ver"], first["keepalive"], first["clean_start"]) == (4, 30, True)
    assert isinstance(first["connected_at"], int) and first["connected_at"] > 1.6e12  # epoch ms
    assert [body.get("reason") for _, body in events] == [
        None,
        "connection_lost",
        None,
        "normal",
    ]


def test_clients_cannot_publish_to_sys(broker_factory: Factory, clients: Clients) -> None:
    """PUBACK 0x87, and nobody gets the forgery; Mosquitto does the same."""
    broker = broker_factory({"sys_interval": 1})
    watcher = clients.paho(broker, "watcher")
    assert watcher.connect().reason_code == 0
    assert watcher.subscribe("$SYS/broker/uptime", 0) == [0]
    assert watcher.get(timeout=DEADLINE).retain  # the broker's own, retained
    forger = clients.paho(broker, "forger")
    assert forger.connect().reason_code == 0
    assert forger.publish("$SYS/broker/uptime", b"forged", qos=1, retain=True) == 0x87
    # Had it been taken, it would have been routed before this PUBACK: the next
    # message is the broker's next round.
    assert re.fullmatch(rb"\d+ seconds", watcher.get(timeout=DEADLINE).payload)


@devicemq_only("auth.* settings")
def test_with_an_acl_only_clients_granted_sys_see_it(
    broker_factory: Factory, clients: Clients, names: Names, tmp_path: Path
) -> None:
    passwd = tmp_path / "passwd"
    write_password_file(passwd, dict.fromkeys(("ops", "dev"), hash_password(b"pw")))
    acl = tmp_path / "acl"
    acl.write_text("user ops\ntopic read $SYS/#\nuser dev\ntopic readwrite #\n")
    broker = broker_factory({"sys_interval": 1, "auth.password_file": passwd, "auth.acl_file": acl})
    dev = login(clients.paho(broker, names.client("dev")), "dev")
    assert dev.subscribe([("$SYS/#", 0), ("$SYS/broker/uptime", 0)]) == [0x87, 0x87]
    assert dev.subscribe("#", 0) == [0]  # '#' does not reach $SYS (MQTT-4.7.2-1)
    ops = login(clients.paho(broker, names.client("ops")), "ops")
    assert ops.subscribe("$SYS/broker/uptime", 0) == [0]
    live = ops.get(timeout=DEADLINE)
    while live.retain:  # the retained copy; then one of a round after dev subscribed
        live = ops.get(timeout=DEADLINE)
    marker = names.topic("marker")
    assert dev.publish(marker, b"m", qos=2) == 0
    assert dev.until(marker, timeout=DEADLINE) == []  # no $SYS message came before it


def login(client: Paho, user: str) -> Paho:
    client.username, client.password = user, "pw"
    assert client.connect().reason_code == 0
    return client
