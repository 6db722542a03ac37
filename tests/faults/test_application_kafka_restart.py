"""APPLICATION sessions (docs/application-sessions.md) when Kafka loses their topic.

The model checker's findings 31 and 32 (tests/model/FINDINGS.md). 31: Tansu restarted on
memory storage keeps no topic; the session's topic is made again, empty, and
its new records take offsets from 0 again, below the committed offset that
Redis keeps. The reader skipped them as done with: messages acknowledged to
their publishers after the restart never reached the session. 32: until the topic
was made again Tansu acknowledged records for it and lost them, and a connected
reader read on from its position in the new log. Here Redis,
Tansu and the broker are real processes (tests/model/system.py), and Tansu is
killed and started empty at a point the test chooses.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import redis

from broker.packets import (
    ConnAck,
    Disconnect,
    Properties,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    Subscription,
)
from persistence.application_feed import app_keys
from tests.e2e.clients import Raw
from tests.faults.checker import wait_until
from tests.model.system import System

TOPIC = "fleet/telemetry"
APP = "app-backend"
SETTINGS = {"application.client_ids": '["^app-"]'}


def _connect(system: System, clean: bool) -> Raw:
    raw = Raw(SimpleNamespace(address=system.address(0)))
    connack = raw.connect(
        APP, clean_start=clean, properties=Properties(session_expiry_interval=600)
    )
    assert isinstance(connack, ConnAck) and connack.reason_code == 0, connack
    return raw


def _subscribe(raw: Raw, qos: int) -> None:
    raw.send(Subscribe(1, [Subscription(TOPIC, qos)]))
    suback = raw.recv()
    assert isinstance(suback, SubAck) and list(suback.reason_codes) == [qos], suback


def _publish(system: System, prefix: str, count: int, qos: int = 1) -> None:
    """``count`` messages ``prefix:N``, each acknowledged 0x00 before the next."""
    pub = Raw(SimpleNamespace(address=system.address(0)))
    try:
        assert pub.connect(f"pub-{prefix}").reason_code == 0  # type: ignore[attr-defined]
        for n in range(count):
            pub.send(Publish(TOPIC, f"{prefix}:{n}".encode(), qos, packet_id=n % 1000 + 1))
            ack = pub.recv(timeout=30)
            if qos == 2:
                assert isinstance(ack, PubRec) and ack.reason_code == 0, ack
                pub.send(PubRel(ack.packet_id))
                assert isinstance(pub.recv(timeout=30), PubComp)
            else:
                assert isinstance(ack, PubAck) and ack.reason_code == 0, ack
        pub.send(Disconnect())
    finally:
        pub.close()


def _read(raw: Raw, count: int, timeout: float = 20.0) -> list[Publish]:
    """``count`` PUBLISHes, each PUBACKed."""
    got: list[Publish] = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        packet = raw.recv_or_none(max(0.1, deadline - time.monotonic()))
        assert packet is not None, f"only {[p.payload for p in got]} within {timeout} s"
        assert isinstance(packet, Publish), packet
        assert packet.packet_id is not None and packet.qos == 1
        raw.send(PubAck(packet.packet_id))
        got.append(packet)
    return got


def _committed(system: System) -> int:
    client = redis.Redis.from_url(system.redis.url)
    try:
        return int(client.hget(app_keys(APP).offsets, "0") or 0)
    finally:
        client.close()


def test_an_offline_session_gets_what_was_published_after_kafka_lost_its_topic(
    tmp_path: Path,
) -> None:
    """Committed at 10; Kafka restarts empty; the session comes back (its topic is made
    again), goes, and 20 messages come: the new log is longer than the commit, so
    only the record below it tells (the session keeps its name, ``{cid}_app_tail``)
    that it is another log. On the code before, the session got the last 10 of them.

    The session comes once between the restart and the publishes (its CONNECT makes
    its topic again), so that only the committed offset is in question here; without
    that visit see the next tests (finding 32)."""
    system = System(tmp_path / "system", 1, SETTINGS)
    try:
        system.start()
        sub = _connect(system, clean=True)
        _subscribe(sub, 1)
        _publish(system, "before", 10)
        assert [p.payload for p in _read(sub, 10)] == [f"before:{n}".encode() for n in range(10)]
        wait_until(lambda: _committed(system) == 10, 10, "the commit at 10")
        sub.send(Disconnect())
        sub.close()

        system.restart_kafka()
        sub = _connect(system, clean=False)  # its topic is made again before the CONNACK
        assert sub.recv_or_none(1.0) is None
        sub.send(Disconnect())
        sub.close()
        _publish(system, "after", 20)

        sub = _connect(system, clean=False)
        got = _read(sub, 20)
        assert [p.payload for p in got] == [f"after:{n}".encode() for n in range(20)]
        assert not any(p.dup for p in got)  # never sent before
        assert sub.recv_or_none(1.0) is None
        metrics = system.metrics(0) or {}
        assert metrics.get("devicemq_application_log_resets_total") == 1, metrics
        sub.close()
    finally:
        system.stop()


def test_a_connected_session_reads_the_new_log_and_a_held_qos2_id_gets_its_pubrel(
    tmp_path: Path,
) -> None:
    """Connected, a QoS 2 message in its PUBREL stage (PUBCOMP held); Kafka restarts
    empty and 5 messages come. They arrive on the same connection, none under the
    held id, and nothing is sent again on it (MQTT-4.4.0-2); after a reconnect the
    held id gets its PUBREL (MQTT-4.4.0-1) and nothing else comes. On the code
    before, the record of the new log at the held message's offset took its PUBREL
    stage: after the reconnect it got only a PUBREL and never came."""
    system = System(tmp_path / "system", 1, SETTINGS)
    try:
        system.start()
        sub = _connect(system, clean=True)
        _subscribe(sub, 2)
        _publish(system, "held", 1, qos=2)
        first = sub.recv()
        assert isinstance(first, Publish) and first.qos == 2 and first.packet_id is not None
        held = first.packet_id
        sub.send(PubRec(held))
        assert sub.recv() == PubRel(held)  # recorded (id:r) before it went out; no PUBCOMP

        system.restart_kafka()
        _publish(system, "after", 5, qos=2)
        got: list[Publish] = []
        completed = 0
        while completed < 5:
            packet = sub.recv(timeout=20)
            if isinstance(packet, PubRel):
                assert packet.packet_id != held, "a PUBREL again on the same connection"
                sub.send(PubComp(packet.packet_id))
                completed += 1
                continue
            assert isinstance(packet, Publish) and packet.qos == 2, packet
            assert packet.packet_id != held and not packet.dup, packet
            got.append(packet)
            sub.send(PubRec(packet.packet_id or 0))
        assert [p.payload for p in got] == [f"after:{n}".encode() for n in range(5)]
        assert sub.recv_or_none(1.0) is None  # nothing again on this connection
        sub.close()  # abruptly, the PUBCOMP of the held id never sent

        sub = _connect(system, clean=False)
        assert sub.recv() == PubRel(held)
        sub.send(PubComp(held))
        assert sub.recv_or_none(2.0) is None  # the new ones were completed: not again
        sub.close()
    finally:
        system.stop()


def _acked_all(raw: Raw, count: int, timeout: float = 20.0) -> list[Publish]:
    """``count`` QoS 1 PUBLISHes, each PUBACKed; a PUBREL (a released id) answered."""
    got: list[Publish] = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        packet = raw.recv_or_none(max(0.1, deadline - time.monotonic()))
        assert packet is not None, f"only {[p.payload for p in got]} within {timeout} s"
        if isinstance(packet, PubRel):
            raw.send(PubComp(packet.packet_id))
            continue
        assert isinstance(packet, Publish) and packet.packet_id is not None, packet
        raw.send(PubAck(packet.packet_id))
        got.append(packet)
    return got


def test_what_is_published_before_anything_made_the_topic_again_is_kept(
    tmp_path: Path,
) -> None:
    """Finding 32: offline, Kafka restarts empty and 20 messages come at once. Tansu
    acknowledged records for a topic it no longer listed and lost them (the
    session, back, got nothing), and the offsets it had handed out were taken when
    the topic was made (AlreadyExists in its log: later produces failed). The
    producer now makes the topic again after its connection broke, before it sends
    to it."""
    system = System(tmp_path / "system", 1, SETTINGS)
    try:
        system.start()
        sub = _connect(system, clean=True)
        _subscribe(sub, 1)
        _publish(system, "before", 3)
        _read(sub, 3)
        wait_until(lambda: _committed(system) == 3, 10, "the commit at 3")
        sub.send(Disconnect())
        sub.close()

        system.restart_kafka()
        _publish(system, "after", 20)
        sub = _connect(system, clean=False)
        got = _acked_all(sub, 20)
        assert [p.payload for p in got] == [f"after:{n}".encode() for n in range(20)]
        _publish(system, "later", 2)
        assert [p.payload for p in _acked_all(sub, 2)] == [b"later:0", b"later:1"]
        sub.close()
    finally:
        system.stop()


def test_a_connected_reader_checks_the_log_after_its_connection_broke(tmp_path: Path) -> None:
    """Connected, 3 read; Kafka restarts empty and 5 messages come at once: the new log
    is longer than what the reader had read before it fetches again. It reads the
    record below its position again (its connection broke), finds another one, and
    reads the new log from its start: all 5, not the last 2. On a reconnect the 5,
    held unacknowledged, come again under their ids with DUP."""
    system = System(tmp_path / "system", 1, SETTINGS)
    try:
        system.start()
        sub = _connect(system, clean=True)
        _subscribe(sub, 1)
        _publish(system, "before", 3)
        _read(sub, 3)
        system.restart_kafka()
        _publish(system, "after", 5)
        held: list[Publish] = []
        while len(held) < 5:
            packet = sub.recv_or_none(10.0)
            assert packet is not None, f"only {[p.payload for p in held]}"
            assert isinstance(packet, Publish), packet
            held.append(packet)  # not acknowledged
        assert [p.payload for p in held] == [f"after:{n}".encode() for n in range(5)]
        assert sub.recv_or_none(1.0) is None
        sub.close()

        sub = _connect(system, clean=False)
        again = _acked_all(sub, 5)
        assert [(p.payload, p.packet_id, p.dup) for p in again] == [
            (p.payload, p.packet_id, True) for p in held
        ]
        sub.close()
    finally:
        system.stop()


def test_a_new_log_below_an_unacknowledged_window_is_told_from_the_old_one(
    tmp_path: Path,
) -> None:
    """Finding 33: three messages sent and never acknowledged (nothing committed:
    offset 0, so no record below it to compare); Kafka restarts empty; the next
    three publishes take offsets 0-2 of the new log, where the old log's fields
    (packet ids, "may have been seen") still are. Each field keeps the name of its
    record: another record there is a new log, read from its start, its messages new
    (no DUP). On the code before, they came with DUP under the old ids."""
    system = System(tmp_path / "system", 1, SETTINGS)
    try:
        system.start()
        sub = _connect(system, clean=True)
        _subscribe(sub, 1)
        _publish(system, "before", 3)
        first = [sub.recv(timeout=20) for _ in range(3)]  # not acknowledged
        assert [p.payload for p in first] == [f"before:{n}".encode() for n in range(3)]  # type: ignore[union-attr]
        sub.close()  # the network went

        system.restart_kafka()
        sub = _connect(system, clean=False)  # its topic is made again, empty
        released = []
        packet = sub.recv_or_none(2.0)
        while isinstance(packet, PubRel):  # the old log's ids, released (lost, see 31)
            released.append(packet.packet_id)
            sub.send(PubComp(packet.packet_id))
            packet = sub.recv_or_none(1.0)
        assert packet is None, packet
        _publish(system, "after", 3)
        got = []
        while len(got) < 3:
            packet = sub.recv(timeout=20)
            if isinstance(packet, PubRel):
                released.append(packet.packet_id)
                sub.send(PubComp(packet.packet_id))
                continue
            assert isinstance(packet, Publish) and packet.packet_id is not None, packet
            sub.send(PubAck(packet.packet_id))
            got.append(packet)
        assert [p.payload for p in got] == [f"after:{n}".encode() for n in range(3)]
        assert not any(p.dup for p in got), got  # never sent before
        assert sub.recv_or_none(1.0) is None
        sub.close()
    finally:
        system.stop()


def test_a_publish_for_an_application_session_fails_when_kafka_does_not_answer(
    tmp_path: Path,
) -> None:
    """Kafka paused: the record for the session's topic gets no answer, and the
    publisher hears 0x80 once ``persistence.kafka_request_timeout_ms`` passed (not
    before, not never); Kafka back, the next publishes go through and reach the
    session. The refused one may reach it too, once, before them: the producer had
    handed it over when the deadline passed (a failed PUBACK promises nothing
    either way; the publisher may send it again)."""
    settings = {**SETTINGS, "persistence.kafka_request_timeout_ms": 3000}
    system = System(tmp_path / "system", 1, settings)
    try:
        system.start()
        sub = _connect(system, clean=True)
        _subscribe(sub, 1)
        _publish(system, "before", 3)
        assert [p.payload for p in _read(sub, 3)] == [f"before:{n}".encode() for n in range(3)]

        pub = Raw(SimpleNamespace(address=system.address(0)))
        assert pub.connect("pub-paused").reason_code == 0  # type: ignore[attr-defined]
        system.pause_kafka()
        try:
            started = time.monotonic()
            pub.send(Publish(TOPIC, b"paused", 1, packet_id=1))
            ack = pub.recv(timeout=30)
            waited = time.monotonic() - started
        finally:
            system.resume_kafka()
        assert isinstance(ack, PubAck) and ack.reason_code == 0x80, ack
        assert 2.5 <= waited <= 10, waited  # the deadline, give or take a look at it
        pub.send(Disconnect())
        pub.close()

        _publish(system, "after", 3)
        got = [p.payload for p in _read(sub, 3, timeout=60)]
        if got[0] == b"paused":
            got = got[1:] + [p.payload for p in _read(sub, 1, timeout=60)]
        assert got == [f"after:{n}".encode() for n in range(3)]
        assert sub.recv_or_none(1.0) is None
        sub.close()
    finally:
        system.stop()
