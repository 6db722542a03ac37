"""Topic-to-Kafka integration rules end to end: ``devicemq run`` processes, real
paho clients, Tansu, records read back with aiokafka (docs/integrations.md).

The rules' topics are made by the tests, as a user makes theirs: devicemq creates
none on a Kafka it did not start. Kafka outages are driven by pausing Tansu
(SIGSTOP), as in test_backend_outages.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from aiokafka import AIOKafkaConsumer
from paho.mqtt.enums import CallbackAPIVersion

from app.embedded_services import free_port
from persistence.kafka_path import ensure_topic
from tests.faults.checker import Publisher, wait_until
from tests.faults.conftest import REPO, Stack
from tests.kafka_fixtures import freeze

V5, V311 = 5, 4


def make_topics(bootstrap: str, *names: str, partitions: int = 2) -> None:
    async def make() -> None:
        for name in names:
            await ensure_topic(bootstrap, name, partitions)

    asyncio.run(make())


def read_records(
    bootstrap: str, topic: str, count: int, timeout: float = 20.0
) -> list[tuple[bytes | None, bytes]]:
    """At least ``count`` records of ``topic`` (key, value), all partitions, from the start;
    then whatever else came with them."""

    async def read() -> list[tuple[bytes | None, bytes]]:
        consumer = AIOKafkaConsumer(
            topic,
            bootstrap_servers=bootstrap,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            fetch_max_wait_ms=20,
        )
        await consumer.start()
        try:
            records: list[tuple[bytes | None, bytes]] = []
            deadline = time.monotonic() + timeout
            while len(records) < count and time.monotonic() < deadline:
                batches = await consumer.getmany(timeout_ms=200)
                for batch in batches.values():
                    records.extend((r.key, r.value) for r in batch)
            return records
        finally:
            await consumer.stop()

    return asyncio.run(read())


def rules(*rules: dict[str, str]) -> str:
    return json.dumps(list(rules))


def get_json(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
        return json.loads(response.read())


def test_records_land_in_the_users_topics_with_keys_and_envelopes(stack_factory, kafka) -> None:  # type: ignore[no-untyped-def]
    """Two rules, a message matching both: one record in each, with its key and value;
    the audit counts say so in /metrics and the admin stats."""
    tag = uuid.uuid4().hex[:8]
    raw, envelope = f"it.raw.{tag}", f"it.env.{tag}"
    admin_port, metrics_port = free_port(), free_port()
    prefix = f"plant-{tag}"
    integrations = rules(
        {"name": "raw", "topic_filter": f"{prefix}/#", "kafka_topic": raw},
        {
            "name": "temp",
            "topic_filter": f"{prefix}/+/temp",
            "kafka_topic": envelope,
            "key": "{topic[1]}",
            "payload": "envelope",
        },
    )
    bootstrap = kafka[0]
    make_topics(bootstrap, raw, envelope)
    stack: Stack = stack_factory(
        {
            "integrations": integrations,
            "admin.port": admin_port,
            "metrics.enabled": True,
            "metrics.port": metrics_port,
        }
    )
    pub = Publisher(stack.broker.address, f"dev-{tag}", f"{prefix}/line4/temp", version=V5)
    other = Publisher(
        stack.broker.address, f"dev2-{tag}", f"{prefix}/line4/pressure", version=V311, qos=2
    )
    try:
        pub.publish(3)
        other.publish(2)
        wait_until(lambda: len(pub.acked) == 3 and len(other.acked) == 2, 20, "PUBACK/PUBCOMP")
        assert pub.failed == set() and other.failed == set()
        got = read_records(bootstrap, raw, 5)
        assert sorted(got) == sorted(
            [(f"dev-{tag}".encode(), f"dev-{tag}:{i}".encode()) for i in (1, 2, 3)]
            + [(f"dev2-{tag}".encode(), f"dev2-{tag}:{i}".encode()) for i in (1, 2)]
        )
        enveloped = read_records(bootstrap, envelope, 3)
        assert [key for key, _ in enveloped] == [b"line4"] * 3
        documents = [json.loads(value) for _, value in enveloped]
        assert [d["payload"] for d in documents] == [f"dev-{tag}:{i}" for i in (1, 2, 3)]
        first = documents[0]
        assert first["topic"] == f"{prefix}/line4/temp"
        assert first["client_id"] == f"dev-{tag}"
        assert first["qos"] == 1 and first["retain"] is False
        assert first["payload_encoding"] == "utf-8"
        assert abs(first["timestamp_ms"] / 1000 - time.time()) < 300
        stats = get_json(admin_port, "/api/v1/stats")["integrations"]
        assert stats == [
            {
                "name": "raw",
                "topic_filter": f"{prefix}/#",
                "kafka_topic": raw,
                "produced": 5,
                "failed": 0,
            },
            {
                "name": "temp",
                "topic_filter": f"{prefix}/+/temp",
                "kafka_topic": envelope,
                "produced": 3,
                "failed": 0,
            },
        ]
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics") as response:
            text = response.read().decode()
        assert 'devicemq_integration_records_produced_total{rule="raw"} 5.0' in text
        assert 'devicemq_integration_records_failed_total{rule="temp"} 0.0' in text
    finally:
        pub.close()
        other.close()


def test_puback_comes_only_once_kafka_has_the_record(stack_factory, kafka) -> None:  # type: ignore[no-untyped-def]
    """Tansu paused: no PUBACK; resumed: the PUBACK, then the record is there. With
    persistence disabled: the rules need only Kafka."""
    tag = uuid.uuid4().hex[:8]
    topic = f"it.hold.{tag}"
    bootstrap = kafka[0]
    make_topics(bootstrap, topic)
    stack: Stack = stack_factory(
        {
            "integrations": rules({"topic_filter": f"hold-{tag}/#", "kafka_topic": topic}),
            "persistence.enabled": False,
            "persistence.kafka_request_timeout_ms": 60_000,
        }
    )
    assert stack.tansu_pid is not None
    pub = Publisher(stack.broker.address, f"dev-{tag}", f"hold-{tag}/x", version=V5)
    paused = False
    try:
        pub.publish(1)
        wait_until(lambda: pub.acked == {1}, 20, "the first PUBACK")
        freeze(stack.tansu_pid)
        paused = True
        pub.publish(1)
        # Nothing can acknowledge it while Kafka is frozen: a PUBACK now would be a lie.
        time.sleep(2.0)
        assert pub.outcomes[2] is None, pub.outcomes
        os.kill(stack.tansu_pid, signal.SIGCONT)
        paused = False
        wait_until(lambda: pub.acked == {1, 2}, 30, "the PUBACK after SIGCONT")
        records = read_records(bootstrap, topic, 2)
        assert [value for _, value in records] == [f"dev-{tag}:1".encode(), f"dev-{tag}:2".encode()]
    finally:
        if paused:
            os.kill(stack.tansu_pid, signal.SIGCONT)
        pub.close()


def test_kafka_away_past_the_deadline_is_0x80_and_the_record_may_land_later(
    stack_factory, kafka
) -> None:  # type: ignore[no-untyped-def]
    """Tansu paused past ``persistence.kafka_request_timeout_ms``: the publisher hears
    0x80 while Kafka is still away; resumed, the producer delivers the record anyway
    (at least once, never a false success) and counts it produced."""
    tag = uuid.uuid4().hex[:8]
    topic = f"it.late.{tag}"
    bootstrap = kafka[0]
    make_topics(bootstrap, topic)
    admin_port = free_port()
    stack: Stack = stack_factory(
        {
            "integrations": rules(
                {"name": "late", "topic_filter": f"late-{tag}/#", "kafka_topic": topic}
            ),
            "persistence.enabled": False,
            "persistence.kafka_request_timeout_ms": 1000,
            "admin.port": admin_port,
        }
    )
    assert stack.tansu_pid is not None
    pub = Publisher(stack.broker.address, f"dev-{tag}", f"late-{tag}/x", version=V5)
    paused = False
    try:
        pub.publish(1)
        wait_until(lambda: pub.acked == {1}, 20, "the first PUBACK")
        freeze(stack.tansu_pid)
        paused = True
        pub.publish(1)
        wait_until(lambda: pub.outcomes.get(2) is not None, 20, "the failure code")
        assert pub.outcomes[2] == 0x80
        assert "integration rule 'late': kafka did not acknowledge within 1 s" in stack.broker.log()
        os.kill(stack.tansu_pid, signal.SIGCONT)
        paused = False
        records = read_records(bootstrap, topic, 2)
        assert [value for _, value in records] == [f"dev-{tag}:1".encode(), f"dev-{tag}:2".encode()]

        def counted() -> tuple[int, int]:
            (late,) = get_json(admin_port, "/api/v1/stats")["integrations"]
            return late["produced"], late["failed"]

        # Kafka's answer to the producer may follow the record a reader already sees.
        wait_until(lambda: counted() == (2, 0), 20, f"produced 2, failed 0; got {counted()}")
    finally:
        if paused:
            os.kill(stack.tansu_pid, signal.SIGCONT)
        pub.close()


def test_a_rule_whose_topic_is_missing_fails_its_publishers_only(stack_factory, kafka) -> None:  # type: ignore[no-untyped-def]
    """A missing topic: its publishers get 0x80 at once (not at the deadline), a log
    line names the rule, everyone else is served; once the topic is made, it works."""
    tag = uuid.uuid4().hex[:8]
    present, missing = f"it.present.{tag}", f"it.missing.{tag}"
    bootstrap = kafka[0]
    make_topics(bootstrap, present)
    stack: Stack = stack_factory(
        {
            "integrations": rules(
                {"name": "good", "topic_filter": f"good-{tag}/#", "kafka_topic": present},
                {"name": "gone", "topic_filter": f"gone-{tag}/#", "kafka_topic": missing},
            ),
            "persistence.kafka_request_timeout_ms": 60_000,
        }
    )
    good = Publisher(stack.broker.address, f"good-{tag}", f"good-{tag}/x", version=V5)
    gone = Publisher(stack.broker.address, f"gone-{tag}", f"gone-{tag}/x", version=V5)
    try:
        started = time.monotonic()
        gone.publish(1)
        wait_until(lambda: gone.outcomes.get(1) is not None, 20, "the failed PUBACK")
        assert gone.outcomes[1] == 0x80
        assert time.monotonic() - started < 30  # not the 60 s deadline
        good.publish(2)
        wait_until(lambda: good.acked == {1, 2}, 20, "the other rule's PUBACKs")
        log = stack.broker.log()
        assert f"integration rule 'gone': kafka topic '{missing}' does not exist" in log
        assert stack.broker.alive()
        make_topics(bootstrap, missing)

        def retried() -> bool:
            gone.publish(1)
            wait_until(lambda: gone.outcomes.get(gone.last_seq) is not None, 20, "a PUBACK")
            return gone.outcomes[gone.last_seq] == 0

        wait_until(retried, 30, "a success once the topic exists")
        records = read_records(bootstrap, missing, 1)
        assert [value for _, value in records] == [f"gone-{tag}:{gone.last_seq}".encode()]
    finally:
        good.close()
        gone.close()


def test_nothing_acknowledged_is_lost_across_a_broker_kill(stack_factory, kafka) -> None:  # type: ignore[no-untyped-def]
    """SIGKILL under a stream of QoS 1 publishes, then a restart: every message that got
    a PUBACK has its record (at least once)."""
    tag = uuid.uuid4().hex[:8]
    topic = f"it.kill.{tag}"
    bootstrap = kafka[0]
    make_topics(bootstrap, topic, partitions=4)
    stack: Stack = stack_factory(
        {"integrations": rules({"topic_filter": f"kill-{tag}/#", "kafka_topic": topic})}
    )
    pubs = [
        Publisher(stack.broker.address, f"dev{i}-{tag}", f"kill-{tag}/{i}", version=version)
        for i, version in enumerate((V5, V311))
    ]
    try:
        for pub in pubs:
            pub.start(interval=0.002)
        wait_until(lambda: all(len(p.acked) >= 100 for p in pubs), 30, "traffic before the kill")
        stack.broker.kill()
        stack.broker.start()
        wait_until(lambda: all(p.connects >= 2 for p in pubs), 30, "reconnects")
        mark = {p.name: len(p.acked) for p in pubs}
        wait_until(
            lambda: all(len(p.acked) >= mark[p.name] + 100 for p in pubs), 30, "traffic after"
        )
        for pub in pubs:
            pub.stop()
        acked = {(p.name, seq) for p in pubs for seq in p.acked}
        records = read_records(bootstrap, topic, len(acked), timeout=30)
        stored = set()
        for key, value in records:
            name, _, seq = value.decode().rpartition(":")
            assert key == name.encode()
            stored.add((name, int(seq)))
        assert acked - stored == set(), f"{len(acked - stored)} acknowledged, not in Kafka"
    finally:
        for pub in pubs:
            pub.close()


def test_a_bad_rule_stops_the_start_with_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVICEMQ_")}
    env["DEVICEMQ_INTEGRATIONS"] = rules({"topic_filter": "a/#", "kafka_topic": "k", "key": "{id}"})
    result = subprocess.run(
        [sys.executable, "-m", "app.cli", "run", "--data-dir", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert result.returncode != 0
    lines = result.stderr.decode().strip().splitlines()
    assert len(lines) == 1, lines
    assert "env DEVICEMQ_INTEGRATIONS: integrations[0].key: unknown placeholder {id}" in lines[0]


def test_a_kafka_that_does_not_answer_stops_the_start_with_one_line(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVICEMQ_")}
    env.update(
        {
            "DEVICEMQ_PERSISTENCE_ENABLED": "false",
            "DEVICEMQ_ADMIN_ENABLED": "false",
            "DEVICEMQ_PERSISTENCE_KAFKA_BOOTSTRAP": f"127.0.0.1:{port}",
            "DEVICEMQ_INTEGRATIONS": rules({"topic_filter": "a/#", "kafka_topic": "k"}),
        }
    )
    argv = [sys.executable, "-m", "app.cli", "run", "--data-dir", str(tmp_path)]
    argv += ["--port", str(free_port())]
    result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, timeout=60)
    assert result.returncode != 0
    last = result.stderr.decode().strip().splitlines()[-1]
    assert last.startswith(
        f"devicemq: error: cannot use kafka at 127.0.0.1:{port} for the integrations: "
    ), last


class _Client311:
    """A paho 3.1.1 client (a persistent session: a QoS 2 PUBLISH without its PUBREC is
    sent again, same packet id, at every reconnect) recording what it receives."""

    def __init__(self, address: tuple[str, int], client_id: str) -> None:
        self.lock = threading.Lock()
        self.payloads: list[bytes] = []
        self.disconnects = 0
        self.completed: set[int] = set()
        self.connected = threading.Event()
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=client_id, protocol=V311, clean_session=False
        )
        client.reconnect_delay_set(0.1, 0.3)
        client.on_message = self._on_message
        client.on_connect = lambda *args: self.connected.set()
        client.on_disconnect = self._on_disconnect
        client.on_publish = lambda c, u, mid, rc, p: self.completed.add(mid)
        client.connect(*address)
        client.loop_start()
        self.client = client
        assert self.connected.wait(10), f"{client_id} did not connect"

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        with self.lock:
            self.payloads.append(msg.payload)

    def _on_disconnect(self, *args: Any) -> None:
        with self.lock:
            self.disconnects += 1

    def received(self) -> list[bytes]:
        with self.lock:
            return list(self.payloads)

    def subscribe(self, topic: str) -> None:
        done = threading.Event()
        self.client.on_subscribe = lambda *args: done.set()
        self.client.subscribe(topic, 2)
        assert done.wait(10), "no SUBACK"

    def publish(self, topic: str, payload: bytes) -> int:
        return int(self.client.publish(topic, payload, 2).mid)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _delivered_once_then_marker(sub: _Client311, pub: _Client311, topic: str) -> None:
    """A marker after the message, from the same publisher: once the subscriber has it,
    any copy of the message sent before it has arrived too (one connection, in order)."""
    mid = pub.publish(topic, b"marker")
    wait_until(lambda: mid in pub.completed, 30, "the marker's PUBCOMP")
    wait_until(lambda: b"marker" in sub.received(), 30, "the marker")
    assert sub.received() == [b"once", b"marker"]


def test_a_311_qos2_publish_a_rule_refuses_reaches_no_subscriber_until_it_is_taken(
    stack_factory, kafka
) -> None:  # type: ignore[no-untyped-def]
    """A rule whose topic is missing refuses the records before anything goes to Kafka:
    nothing of the PUBLISH is taken, not even for its subscribers. 3.1.1 has no failure
    code: the connection is closed and the client sends again, same packet id; every
    re-send was routed afresh, and the subscriber got the message at each (issue 18).
    Now the subscriber gets it once, when the topic exists and the re-send is taken."""
    tag = uuid.uuid4().hex[:8]
    topic = f"it.refused.{tag}"
    bootstrap = kafka[0]
    stack: Stack = stack_factory(
        {
            "integrations": rules({"topic_filter": f"ref-{tag}/#", "kafka_topic": topic}),
            "persistence.enabled": False,
        }
    )
    sub = _Client311(stack.broker.address, f"sub-{tag}")
    pub = _Client311(stack.broker.address, f"pub-{tag}")
    try:
        sub.subscribe(f"ref-{tag}/#")
        mid = pub.publish(f"ref-{tag}/x", b"once")
        wait_until(lambda: pub.disconnects >= 3, 30, "the refusals (connection closed)")
        assert sub.received() == []  # refused: nobody has it
        make_topics(bootstrap, topic)
        wait_until(lambda: mid in pub.completed, 30, "the PUBCOMP once the topic exists")
        _delivered_once_then_marker(sub, pub, f"ref-{tag}/x")
        assert [v for _, v in read_records(bootstrap, topic, 2)] == [b"once", b"marker"]
    finally:
        pub.close()
        sub.close()


def test_a_311_qos2_publish_whose_records_fail_after_delivery_is_not_delivered_again(
    stack_factory, kafka
) -> None:  # type: ignore[no-untyped-def]
    """The records fail after the message reached its subscribers (Kafka frozen: the
    producer cannot learn the rule topic's partitions within the deadline). 3.1.1: the
    connection is closed, and the client's re-send of that packet id makes the records
    only; the subscriber has the message once (MQTT-4.3.3: never delivered twice), and
    the record lands once Kafka is back."""
    tag = uuid.uuid4().hex[:8]
    target, probe = f"it.after.{tag}", f"it.probe.{tag}"
    bootstrap = kafka[0]
    stack: Stack = stack_factory(
        {
            "integrations": rules(
                {"name": "after", "topic_filter": f"after-{tag}/#", "kafka_topic": target},
                {"name": "probe", "topic_filter": f"probe-{tag}/#", "kafka_topic": probe},
            ),
            "persistence.enabled": False,
            "persistence.kafka_request_timeout_ms": 1000,
        }
    )
    assert stack.tansu_pid is not None
    # Made after the start (the producer knows neither), the target first: a listing
    # that has the probe's topic has the target's too.
    make_topics(bootstrap, target, probe)
    sub = _Client311(stack.broker.address, f"sub-{tag}")
    pub = _Client311(stack.broker.address, f"pub-{tag}")
    prober = Publisher(stack.broker.address, f"probe-{tag}", f"probe-{tag}/x", version=V5)
    paused = False
    try:

        def listed() -> bool:
            prober.publish(1)
            wait_until(lambda: prober.outcomes[prober.last_seq] is not None, 20, "a PUBACK")
            return prober.outcomes[prober.last_seq] == 0

        wait_until(listed, 30, "the rules' topics listed")
        sub.subscribe(f"after-{tag}/#")
        freeze(stack.tansu_pid)
        paused = True
        mid = pub.publish(f"after-{tag}/x", b"once")
        wait_until(lambda: b"once" in sub.received(), 30, "the delivery")
        wait_until(lambda: pub.disconnects >= 3, 30, "the failures (connection closed)")
        assert "integration rule 'after'" in stack.broker.log()
        os.kill(stack.tansu_pid, signal.SIGCONT)
        paused = False
        wait_until(lambda: mid in pub.completed, 60, "the PUBCOMP once kafka is back")
        _delivered_once_then_marker(sub, pub, f"after-{tag}/x")
        values = [v for _, v in read_records(bootstrap, target, 2)]
        assert values[0] == b"once" and values[-1] == b"marker", values
    finally:
        if paused:
            os.kill(stack.tansu_pid, signal.SIGCONT)
        prober.close()
        pub.close()
        sub.close()


def test_a_stop_during_a_topic_listing_with_kafka_frozen_is_not_held(stack_factory, kafka) -> None:  # type: ignore[no-untyped-def]
    """Kafka frozen while a publish to a missing topic has the topics listed again: the
    listing waited for aiokafka's 40 s request timeout, and SIGTERM's drain waited for
    it (issue 18). Now a listing is bounded by persistence.kafka_request_timeout_ms and
    cancelled at the stop: the drain ends in a few seconds (the limit here is generous;
    only a hang exceeds it)."""
    tag = uuid.uuid4().hex[:8]
    stack: Stack = stack_factory(
        {
            "integrations": rules(
                {"name": "gone", "topic_filter": f"gone-{tag}/#", "kafka_topic": f"it.no.{tag}"}
            ),
            "persistence.enabled": False,
            "persistence.kafka_request_timeout_ms": 1000,
            "log.level": "DEBUG",
        }
    )
    assert stack.tansu_pid is not None
    line = "listing kafka topics: a record found its topic missing"
    pub = Publisher(stack.broker.address, f"gone-{tag}", f"gone-{tag}/x", version=V5)
    paused = False
    try:
        freeze(stack.tansu_pid)
        paused = True
        before = stack.broker.log().count(line)

        def listing_started() -> bool:
            pub.publish(1)
            wait_until(lambda: pub.outcomes[pub.last_seq] is not None, 20, "the failure code")
            return stack.broker.log().count(line) > before

        wait_until(listing_started, 30, "a listing started while kafka is frozen")
        pub.close()
        # A listing held the drain for 40 s; the bound now is about twice the 1 s deadline.
        assert stack.broker.terminate(timeout=25) == 0
        end = stack.broker.log()
        assert "exiting without finishing the drain" not in end
    finally:
        if paused:
            os.kill(stack.tansu_pid, signal.SIGCONT)
        pub.close()


def test_a_qos0_message_makes_the_records_of_the_rules_that_can(stack_factory, kafka) -> None:  # type: ignore[no-untyped-def]
    """QoS 0 matching a healthy rule and a rule whose topic is missing: no re-send will
    come, so the healthy rule's record is made (none was, issue 18), and only the rule
    that failed is counted failed."""
    tag = uuid.uuid4().hex[:8]
    present = f"it.q0.{tag}"
    bootstrap = kafka[0]
    make_topics(bootstrap, present, partitions=1)
    admin_port = free_port()
    stack: Stack = stack_factory(
        {
            "integrations": rules(
                {"name": "good", "topic_filter": f"q0-{tag}/#", "kafka_topic": present},
                {"name": "gone", "topic_filter": f"q0-{tag}/both/#", "kafka_topic": f"no.{tag}"},
            ),
            "persistence.enabled": False,
            "admin.port": admin_port,
        }
    )
    both = Publisher(stack.broker.address, f"q0-{tag}", f"q0-{tag}/both/x", version=V5, qos=0)
    marker = Publisher(stack.broker.address, f"q1-{tag}", f"q0-{tag}/only", version=V5)
    try:
        both.publish(1)
        wait_until(lambda: both.outcomes.get(1) is not None, 20, "the QoS 0 PUBLISH sent")
        # After the QoS 0 one, from the sink's one sender: in Kafka after it.
        marker.publish(1)
        wait_until(lambda: marker.outcomes.get(1) is not None, 20, "the marker's PUBACK")
        assert marker.outcomes[1] == 0
        records = read_records(bootstrap, present, 2)
        assert sorted(v for _, v in records) == [f"q0-{tag}:1".encode(), f"q1-{tag}:1".encode()]
        stats = get_json(admin_port, "/api/v1/stats")["integrations"]
        assert [(s["name"], s["produced"], s["failed"]) for s in stats] == [
            ("good", 2, 0),
            ("gone", 0, 1),
        ]
        assert f"integration rule 'gone': kafka topic 'no.{tag}' does not exist" in (
            stack.broker.log()
        )
    finally:
        both.close()
        marker.close()


def test_past_the_byte_budget_an_mqtt5_publish_gets_quota_exceeded(stack_factory, kafka) -> None:  # type: ignore[no-untyped-def]
    """Kafka frozen: one publish waits; with persistence.integrations_max_waiting_bytes
    below two records, the next one is answered 0x97 Quota exceeded at once, and the
    first is acknowledged once Kafka is back."""
    tag = uuid.uuid4().hex[:8]
    topic = f"it.quota.{tag}"
    bootstrap = kafka[0]
    # One partition: the records' order below is the log's (two partitions, as
    # make_topics makes by default, are read in either order: CI saw it).
    make_topics(bootstrap, topic, partitions=1)
    stack: Stack = stack_factory(
        {
            "integrations": rules({"topic_filter": f"quota-{tag}/#", "kafka_topic": topic}),
            "persistence.enabled": False,
            "persistence.kafka_request_timeout_ms": 60_000,
            "persistence.integrations_max_waiting_bytes": 1,
        }
    )
    assert stack.tansu_pid is not None
    pub = Publisher(stack.broker.address, f"dev-{tag}", f"quota-{tag}/x", version=V5)
    other = Publisher(stack.broker.address, f"oth-{tag}", f"quota-{tag}/y", version=V5)
    paused = False
    try:
        pub.publish(1)
        wait_until(lambda: pub.acked == {1}, 20, "the first PUBACK")
        freeze(stack.tansu_pid)
        paused = True
        # Two connections (a connection's PUBACKs keep their order): whichever comes
        # second is refused at once, while the first waits for Kafka.
        pub.publish(1)
        other.publish(1)
        outcomes = lambda: (pub.outcomes[2], other.outcomes[1])  # noqa: E731
        wait_until(lambda: 0x97 in outcomes(), 20, "the refusal")
        assert sorted(outcomes(), key=str) == sorted([0x97, None], key=str)
        os.kill(stack.tansu_pid, signal.SIGCONT)
        paused = False
        wait_until(lambda: None not in outcomes(), 30, "the PUBACK after SIGCONT")
        assert sorted(outcomes()) == [0, 0x97]
        accepted = f"dev-{tag}:2" if pub.outcomes[2] == 0 else f"oth-{tag}:1"
        values = [v for _, v in read_records(bootstrap, topic, 2)]
        assert values == [f"dev-{tag}:1".encode(), accepted.encode()], values
    finally:
        if paused:
            os.kill(stack.tansu_pid, signal.SIGCONT)
        pub.close()
        other.close()
