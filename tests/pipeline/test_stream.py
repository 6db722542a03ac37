"""``--stream`` on a running broker: the summary is rewritten every interval while
load runs, with nothing counted lost, and a message deleted from Redis by hand
is counted lost at the next update.

The broker, Tansu and Redis are this module's own (the session's are the exact
workload's of test_audit.py); a second test runs a broker on its embedded
Kafka, whose topic it empties and creates anew under the stream. The audit
runs in a thread; its ``on_summary`` waits for the test between updates, so
what each update must have seen is known: every PUBACKed message before it
was released, and the deletion.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from redis import Redis

from app.embedded_services import EmbeddedServices
from persistence.format import client_keys
from pipeline.audit import stream_audit
from pipeline.common import Endpoints, Window, resolve_endpoints
from pipeline.kafka_source import latest_offsets
from tests.conftest import free_port
from tests.integration.redis_servers import RedisServer
from tests.kafka_fixtures import bootstrap_of, start_tansu, stop_tansu
from tests.pipeline.conftest import Client, _publish, _start_broker, _stop, start_broker

PERSISTED, EVENTS = "devicemq.device.persisted", "devicemq.events"
AWAY = 3  # messages stored for the offline client (under the broker's limit of 10)
UPDATES = 3
GRACE = 2.0  # a message stored this recently may be gone from Redis before its event is read


class Load:
    """A publisher sending QoS 1 to the connected client in a thread, each message
    waited for (PUBACK: it is in Kafka), counting them."""

    def __init__(self, publisher: mqtt.Client) -> None:
        self.publisher = publisher
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            _publish(self.publisher, f"live/{self.sent % 5}", b"x" * 32)
            self.sent += 1

    def start(self) -> None:
        self._thread.start()

    def wait_sent(self, n: int) -> None:
        deadline = time.monotonic() + 30
        while self.sent < n:
            assert time.monotonic() < deadline, f"only {self.sent} of {n} published"
            time.sleep(0.01)

    def stop(self) -> int:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)
        return self.sent


@pytest.fixture
def running(tmp_path: Path) -> Iterator[tuple[int, Endpoints]]:
    redis = RedisServer()
    kafka = start_tansu()
    port = free_port()
    try:
        endpoints = Endpoints(bootstrap_of(kafka), redis.url)
        broker = _start_broker(port, endpoints.bootstrap, redis.url, tmp_path)
        try:
            yield port, endpoints
        finally:
            _stop(broker)
    finally:
        stop_tansu(kafka)
        redis.stop()


def test_stream_updates_under_load_and_reports_a_deleted_message_lost(
    spark: Any, running: tuple[int, Endpoints], tmp_path: Path
) -> None:
    port, endpoints = running
    reader = Client(port, "reader")
    reader.subscribe("live/#")
    away = Client(port, "away")
    away.subscribe("away/#")
    away.close()
    publisher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, "pub", protocol=mqtt.MQTTv5)
    publisher.connect("127.0.0.1", port)
    publisher.loop_start()
    for _ in range(AWAY):
        _publish(publisher, "away/a", b"kept")

    updates: queue.Queue[dict[str, Any]] = queue.Queue()
    proceed = threading.Semaphore(0)

    def on_summary(summary: dict[str, Any]) -> None:
        updates.put(summary)
        proceed.acquire()  # the next update waits for the test

    out = tmp_path / "out"
    failed: list[BaseException] = []

    def audit() -> None:
        try:
            stream_audit(
                spark,
                endpoints,
                persisted_topic=PERSISTED,
                events_topic=EVENTS,
                window=Window(),
                out=out,
                interval=0.5,
                max_iterations=UPDATES,
                grace=GRACE,
                on_summary=on_summary,
            )
        except BaseException as error:  # reported by the test, not lost in the thread
            failed.append(error)
            updates.put({})

    thread = threading.Thread(target=audit, daemon=True)
    thread.start()
    load = Load(publisher)
    try:
        first = updates.get(timeout=180)
        first_seen = time.time()  # the offline client's messages were stored before
        assert not failed, failed
        assert first["stream"]["iteration"] == 1
        assert first["totals"]["persisted"] == AWAY and first["totals"]["pending"] == AWAY
        assert json.loads((out / "audit.json").read_text())["stream"]["iteration"] == 1

        # Load runs across the second update: what is in Kafka and not yet stored
        # or acknowledged is in flight or pending, never lost (the reader's queue,
        # over the broker's limit of 10, is trimmed: accounted for too).
        load.start()
        load.wait_sent(20)
        sent_before = load.sent
        proceed.release()
        second = updates.get(timeout=180)
        assert not failed, failed
        totals = second["totals"]
        assert second["stream"]["iteration"] == 2
        assert totals["persisted"] >= AWAY + sent_before
        assert totals["lost"] == 0, second["lost_messages"]
        clients = {c["cid"]: c for c in second["clients"]}
        assert clients["away"]["pending"] == AWAY
        on_disk = json.loads((out / "audit.json").read_text())
        assert on_disk["stream"]["iteration"] == 2
        assert on_disk["totals"]["persisted"] == totals["persisted"]
        sent = load.stop()

        # A stored message deleted behind the broker's back: lost at the next update,
        # as it was stored more than GRACE before (a younger one is in flight, in
        # case its acknowledgement's event has not reached Kafka yet).
        while time.time() < first_seen + GRACE:
            time.sleep(0.05)
        keys = client_keys("away")
        redis = Redis.from_url(endpoints.redis_url)
        try:
            [(member, _score)] = redis.zrange(keys.messages, 0, 0, withscores=True)
            pid = int(member)
            assert redis.zrem(keys.messages, member) == 1
            assert redis.delete(keys.message(pid)) == 1
        finally:
            redis.close()
        proceed.release()
        third = updates.get(timeout=180)
        assert not failed, failed
        proceed.release()
        assert third["stream"]["iteration"] == 3
        assert third["totals"]["persisted"] == AWAY + sent
        assert third["totals"]["lost"] == 1
        [lost] = third["lost_messages"]
        assert (lost["cid"], lost["pid"], lost["reason"]) == ("away", pid, "missing from redis")
        assert json.loads((out / "audit.json").read_text())["totals"]["lost"] == 1
        assert "LOST" in (out / "audit.html").read_text()
    finally:
        load.stop()
        for _ in range(UPDATES):
            proceed.release()
        thread.join(120)
        publisher.disconnect()
        publisher.loop_stop()
        reader.close()
    assert not thread.is_alive()
    assert not failed, failed


COMPACT_AFTER = 30  # records: the embedded Kafka's topic is emptied past this


@pytest.fixture
def embedded(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A broker on its own embedded Kafka and Redis, whose topic is emptied (created
    anew, a new epoch) past :data:`COMPACT_AFTER` records; all stopped by PID after."""
    data = tmp_path / "data"
    data.mkdir()
    port = free_port()
    try:
        proc = start_broker(
            port,
            data,
            {
                "DEVICEMQ_PERSISTENCE_ENABLED": "true",
                "DEVICEMQ_PERSISTENCE_EMBEDDED_KAFKA_COMPACT_AFTER": str(COMPACT_AFTER),
            },
            timeout=60,
        )
    except BaseException:
        EmbeddedServices(data).stop()  # started by the broker before it failed
        raise
    try:
        yield port, data
    finally:
        _stop(proc)
        EmbeddedServices(data).stop()


def test_stream_follows_the_embedded_topic_created_anew(
    spark: Any, embedded: tuple[int, Path], tmp_path: Path
) -> None:
    """The embedded Kafka's topic emptied under a running stream: the records of the
    topic before (whose partitions and offsets the new one reuses, whose events are
    of another epoch) counted lost by the thousand in a 10-minute run, and the
    stream's offsets, past the new topic's end, skipped its first records."""
    port, data = embedded
    endpoints = resolve_endpoints(str(data), None, None)
    reader = Client(port, "reader")
    reader.subscribe("live/#")
    publisher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, "pub", protocol=mqtt.MQTTv5)
    publisher.connect("127.0.0.1", port)
    publisher.loop_start()
    updates: queue.Queue[dict[str, Any]] = queue.Queue()
    proceed = threading.Semaphore(0)
    failed: list[BaseException] = []

    def on_summary(summary: dict[str, Any]) -> None:
        updates.put(summary)
        proceed.acquire()

    def audit() -> None:
        try:
            stream_audit(
                spark,
                endpoints,
                persisted_topic=PERSISTED,
                events_topic=EVENTS,
                window=Window(),
                out=tmp_path / "out",
                interval=0.5,
                max_iterations=2,
                grace=GRACE,
                on_summary=on_summary,
            )
        except BaseException as error:
            failed.append(error)
            updates.put({})

    def epoch() -> int:
        redis = Redis.from_url(endpoints.redis_url)
        try:
            return int(redis.get(f"devicemq:epoch:{PERSISTED}") or 0)
        finally:
            redis.close()

    thread = threading.Thread(target=audit, daemon=True)
    try:
        for i in range(10):
            _publish(publisher, f"live/{i}", b"before")
        reader.wait_for(10)
        thread.start()
        first = updates.get(timeout=180)
        assert not failed, failed
        assert first["totals"]["persisted"] == 10 and first["totals"]["lost"] == 0
        before = epoch()
        assert first["topics"]["epoch"] == before
        sent = 10
        while epoch() == before:  # past COMPACT_AFTER, once all is stored
            _publish(publisher, "live/more", b"more")
            sent += 1
            assert sent < 50 * COMPACT_AFTER, "the embedded topic was never emptied"
        for _ in range(5):
            _publish(publisher, "live/after", b"after")
        reader.wait_for(sent + 5)
        proceed.release()
        second = updates.get(timeout=180)
        assert not failed, failed
        assert second["topics"]["epoch"] == epoch() > before
        # The new topic's records, all of them and no other (they were all
        # PUBACKed, so in Kafka, before the update was let go).
        in_topic = sum(
            high - low for low, high in latest_offsets(endpoints.bootstrap, PERSISTED).values()
        )
        assert in_topic >= 5
        assert second["totals"]["persisted"] == in_topic
        # The events of the new topic's first records carry its epoch at once
        # (persistence/consumer.py, log_recreated): they counted lost while the
        # broker waited for its next look at the announced resets.
        assert second["totals"]["lost"] == 0, second["lost_messages"]
    finally:
        proceed.release()
        proceed.release()
        thread.join(120)
        publisher.disconnect()
        publisher.loop_stop()
        reader.close()
    assert not thread.is_alive()
