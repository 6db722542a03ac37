"""mosquitto_pub / mosquitto_sub (Debian mosquitto-clients) against the broker.

The subscriber runs with ``-d`` so its debug output says when the SUBACK
arrived; only then does the publisher start. Message lines are printed with
``-F`` behind a ``MSG`` prefix so they stand apart from the debug lines.
"""

from __future__ import annotations

import contextlib
import queue
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from tests.e2e.clients import TIMEOUT, V5
from tests.e2e.conftest import is_mosquitto

pytestmark = pytest.mark.e2e

VERSIONS = ["mqttv311", "mqttv5"]
FORMAT = "MSG %q|%r|%t|%p"  # qos|retain|topic|payload
LINE_BUFFERED = ["stdbuf", "-oL"] if shutil.which("stdbuf") else []


class Sub:
    """A running mosquitto_sub whose output lines are read by a thread."""

    def __init__(self, broker, *args: str) -> None:
        # stdbuf: line-buffered stdout, else the SUBACK line sits in stdio's buffer
        argv = [*LINE_BUFFERED, "mosquitto_sub", "-h", broker.host, "-p", str(broker.port)]
        argv += ["-d", *args]
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put(raw.decode(errors="replace").rstrip("\n"))
        self.lines.put(None)

    def _next(self, deadline: float) -> str | None:
        try:
            line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.001))
        except queue.Empty:
            raise AssertionError(f"mosquitto_sub: timed out; output so far {self.seen}") from None
        if line is not None:
            self.seen.append(line)
        return line

    def wait_subscribed(self, timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while True:
            line = self._next(deadline)
            if line is None:
                raise AssertionError(f"mosquitto_sub exited before SUBACK: {self.seen}")
            if "received SUBACK" in line:
                return

    def messages(self, count: int, timeout: float = TIMEOUT) -> list[str]:
        """The next ``count`` formatted message lines (without the prefix)."""
        deadline = time.monotonic() + timeout
        got: list[str] = []
        while len(got) < count:
            line = self._next(deadline)
            if line is None:
                raise AssertionError(
                    f"mosquitto_sub exited after {len(got)} of {count}: {self.seen[-5:]}"
                )
            if line.startswith("MSG "):
                got.append(line[4:])
        return got

    def wait(self, timeout: float = TIMEOUT) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(3)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture
def subs() -> Iterator[list[Sub]]:
    running: list[Sub] = []
    yield running
    for sub in running:
        with contextlib.suppress(Exception):
            sub.stop()


def start_sub(subs: list[Sub], broker, *args: str) -> Sub:
    sub = Sub(broker, *args)
    subs.append(sub)
    return sub


def pub(broker, *args: str, stdin: bytes | None = None) -> None:
    """Run mosquitto_pub to completion; fail with its output if it fails."""
    argv = ["mosquitto_pub", "-h", broker.host, "-p", str(broker.port), *args]
    done = subprocess.run(argv, input=stdin, capture_output=True, timeout=30, check=False)
    assert done.returncode == 0, (argv, done.stdout, done.stderr)


def sub_once(broker, *args: str, timeout: float = TIMEOUT) -> bytes:
    """Run mosquitto_sub to completion (give it -C or -E) and return its stdout."""
    argv = ["mosquitto_sub", "-h", broker.host, "-p", str(broker.port), *args]
    done = subprocess.run(argv, capture_output=True, timeout=timeout, check=False)
    assert done.returncode == 0, (argv, done.stdout, done.stderr)
    return done.stdout


@pytest.mark.parametrize("qos", [0, 1, 2])
@pytest.mark.parametrize("version", VERSIONS)
def test_pub_sub_qos(broker, subs, names, version, qos):
    """One message at each QoS, over MQTT 3.1.1 and 5.0, subscription at the same QoS."""
    topic = names.topic("qos")
    sub = start_sub(
        subs, broker, "-V", version, "-q", str(qos), "-t", topic, "-C", "1", "-F", FORMAT
    )
    sub.wait_subscribed()
    pub(broker, "-V", version, "-q", str(qos), "-t", topic, "-m", f"hello qos {qos}")
    assert sub.messages(1) == [f"{qos}|0|{topic}|hello qos {qos}"]
    assert sub.wait() == 0


@pytest.mark.parametrize("version", VERSIONS)
def test_qos_downgrade(broker, subs, names, version):
    """Delivered QoS is the lower of the published and the granted QoS."""
    topic = names.topic("downgrade")
    sub = start_sub(subs, broker, "-V", version, "-q", "1", "-t", topic, "-C", "2", "-F", FORMAT)
    sub.wait_subscribed()
    pub(broker, "-V", version, "-q", "2", "-t", topic, "-m", "two")
    pub(broker, "-V", version, "-q", "0", "-t", topic, "-m", "zero")
    assert sub.messages(2) == [f"1|0|{topic}|two", f"0|0|{topic}|zero"]


@pytest.mark.parametrize("version", VERSIONS)
def test_retained(broker, clients, names, version):
    """-r keeps the message for later subscribers, RETAIN set; -r -n clears it."""
    topic = names.topic("retained")
    pub(broker, "-V", version, "-q", "1", "-r", "-t", topic, "-m", "kept")
    out = sub_once(broker, "-V", version, "-t", topic, "-C", "1", "-F", "%r|%p")
    assert out == b"1|kept\n"
    pub(broker, "-V", version, "-q", "1", "-r", "-n", "-t", topic)

    check = clients.paho(broker, names.client("check"))
    check.connect()
    check.subscribe(topic, 1)
    check.publish(topic, b"live", 2)
    assert [m.payload for m in check.get_n(1)] == [b"live"], "the cleared message came back"
    check.disconnect()


def test_count(broker, subs, names):
    """mosquitto_sub -C 3 prints three messages and exits by itself."""
    topic = names.topic("count")
    sub = start_sub(subs, broker, "-q", "1", "-t", topic, "-C", "3", "-F", "MSG %p")
    sub.wait_subscribed()
    pub(broker, "-q", "1", "-t", topic, "-l", stdin=b"one\ntwo\nthree\nfour\nfive\n")
    assert sub.messages(3) == ["one", "two", "three"]
    assert sub.wait() == 0


def test_properties_v5(broker, subs, clients, names):
    """-D publish ... properties reach MQTT 5 subscribers (mosquitto_sub and paho)."""
    topic = names.topic("props")
    sub = start_sub(
        subs, broker, "-V", "mqttv5", "-q", "1", "-t", topic, "-C", "1",
        "-F", "MSG %P|%C|%R|%F|%p",
    )  # fmt: skip
    sub.wait_subscribed()
    check = clients.paho(broker, names.client("check"), version=V5)
    check.connect()
    check.subscribe(topic, 1)
    pub(
        broker, "-V", "mqttv5", "-q", "1", "-t", topic, "-m", "with properties",
        "-D", "publish", "user-property", "k1", "v1",
        "-D", "publish", "user-property", "k2", "v2",
        "-D", "publish", "content-type", "text/plain",
        "-D", "publish", "response-topic", names.topic("reply"),
        "-D", "publish", "correlation-data", "c0ffee",
        "-D", "publish", "message-expiry-interval", "60",
        "-D", "publish", "payload-format-indicator", "1",
    )  # fmt: skip
    reply = names.topic("reply")
    assert sub.messages(1) == [f"k1:v1 k2:v2|text/plain|{reply}|1|with properties"]
    m = check.get()
    p = m.properties
    assert p.UserProperty == [("k1", "v1"), ("k2", "v2")]
    assert (p.ContentType, p.ResponseTopic, p.CorrelationData) == ("text/plain", reply, b"c0ffee")
    assert p.PayloadFormatIndicator == 1
    assert 0 < p.MessageExpiryInterval <= 60
    check.disconnect()


@pytest.mark.parametrize("version", VERSIONS)
def test_large_payload(broker, names, tmp_path, version):
    """A 900 KiB binary payload goes through unchanged (retained, then fetched)."""
    topic = names.topic("large")
    payload = bytes(range(256)) * (900 * 4)
    path = tmp_path / "payload.bin"
    path.write_bytes(payload)
    pub(broker, "-V", version, "-q", "1", "-r", "-t", topic, "-f", str(path))
    out = sub_once(broker, "-V", version, "-q", "1", "-t", topic, "-C", "1", "-N", timeout=15)
    assert len(out) == len(payload) and out == payload
    pub(broker, "-V", version, "-q", "1", "-r", "-n", "-t", topic)


@pytest.mark.parametrize("qos", [1, 2])
def test_many_messages_in_order(broker, subs, names, qos):
    """2000 messages from one mosquitto_pub -l arrive complete and in order (MQTT-4.6.0-6)."""
    if is_mosquitto() and qos == 2:
        pytest.skip("mosquitto 2.0.11 ends this stream with a protocol error towards mosquitto_sub")
    topic = names.topic("many")
    count = 2000
    sub = start_sub(
        subs, broker, "-V", "mqttv5", "-q", str(qos), "-t", topic, "-C", str(count), "-F", "MSG %p"
    )
    sub.wait_subscribed()
    lines = b"".join(b"msg-%04d\n" % i for i in range(count))
    pub(broker, "-V", "mqttv5", "-q", str(qos), "-t", topic, "-l", stdin=lines)
    assert sub.messages(count, timeout=30) == [f"msg-{i:04d}" for i in range(count)]
    assert sub.wait() == 0


def test_offline_queue_in_order(broker, names):
    """A 3.1.1 persistent session (-c) made with -E gets 2000 QoS 1 messages sent
    while it was away, in order, when it comes back."""
    topic = names.topic("offline")
    cid = names.client("offline")
    count = 2000
    sub_once(broker, "-V", "mqttv311", "-c", "-i", cid, "-q", "1", "-t", topic, "-E")
    lines = b"".join(b"queued-%04d\n" % i for i in range(count))
    pub(broker, "-V", "mqttv311", "-q", "1", "-t", topic, "-l", stdin=lines)
    out = sub_once(
        broker, "-V", "mqttv311", "-c", "-i", cid, "-q", "1", "-t", topic, "-C", str(count),
        timeout=30,
    )  # fmt: skip
    assert out.decode().splitlines() == [f"queued-{i:04d}" for i in range(count)]
    # discard the session
    sub_once(broker, "-V", "mqttv311", "-i", cid, "-t", topic, "-E")
