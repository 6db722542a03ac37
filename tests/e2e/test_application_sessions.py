"""APPLICATION sessions (issue 43, docs/application-sessions.md), end to end.

A broker with ``application.client_ids`` set, its embedded Redis and Tansu
real: the backend's session keeps its messages in a Kafka topic of its own
(persistence/application_feed.py), so a backlog far past
``persistence.max_messages_per_client`` comes back whole and in order; the
unacknowledged tail is re-sent with DUP under its packet ids; a QoS 2 message
in its PUBREL stage gets its PUBREL again, never its PUBLISH; a DEVICE session
on the same broker still keeps only its limit. On the code before it the
setting does not exist and the broker refuses to start (so every test fails).
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from app import cli
from app.admin_cli import AdminClient, ApiError
from app.embedded_services import EmbeddedServices
from broker.packets import (
    ConnAck,
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
from persistence.application_feed import app_topic
from tests.conftest import free_port
from tests.e2e.admin import TOKEN
from tests.e2e.clients import Raw
from tests.e2e.conftest import BrokerProcess, devicemq_only, start_broker

pytestmark = devicemq_only("APPLICATION sessions are devicemq's")

DEVICE_LIMIT = 1000  # persistence.max_messages_per_client on this broker
BACKLOG = 30_000  # thirty times the DEVICE limit
WINDOW = 100  # a publisher's PUBLISHes in flight at once


@pytest.fixture(scope="module")
def app_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    broker = start_broker(
        tmp_path_factory.mktemp("app-broker"),
        {
            "persistence.max_messages_per_client": DEVICE_LIMIT,
            "application.client_ids": '["^app-"]',
            "metrics.enabled": True,
            "metrics.port": free_port("127.0.0.1"),
            "admin.port": free_port("127.0.0.1"),
            "admin.token": TOKEN,
            "sys_interval": 1.0,
        },
    )
    try:
        yield broker
    finally:
        broker.stop()
        code = broker.proc.returncode
        assert code in (0, -15), f"broker exited with {code}:\n{broker.log()[-4000:]}"


def _name(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:10]}"


def _connect(
    broker: BrokerProcess,
    client_id: str,
    clean: bool,
    expiry: int = 3600,
    receive_maximum: int | None = None,
) -> tuple[Raw, ConnAck]:
    raw = Raw(broker)
    connack = raw.connect(
        client_id,
        # An APPLICATION session's CONNACK waits for its Kafka topic to be made and its
        # progress read: seconds on a loaded machine (CI, 3 test processes on 2 cores).
        timeout=30,
        clean_start=clean,
        properties=Properties(session_expiry_interval=expiry, receive_maximum=receive_maximum),
    )
    assert isinstance(connack, ConnAck) and connack.reason_code == 0, connack
    return raw, connack


def _subscribe(raw: Raw, topic_filter: str, qos: int) -> None:
    raw.send(Subscribe(1, [Subscription(topic_filter, qos)]))
    suback = raw.recv()
    assert isinstance(suback, SubAck) and list(suback.reason_codes) == [qos], suback


def _publish_many(broker: BrokerProcess, topics: list[str], count: int, qos: int = 1) -> None:
    """``count`` messages of ``qos``, payload = their number, round-robin over ``topics``,
    WINDOW at a time; returns once every one is acknowledged 0x00."""
    pub = Raw(broker)
    try:
        assert pub.connect(_name("pub")).reason_code == 0  # type: ignore[attr-defined]
        sent = 0
        while sent < count:
            batch = min(WINDOW, count - sent)
            for i in range(sent, sent + batch):
                pub.send(
                    Publish(topics[i % len(topics)], str(i).encode(), qos, packet_id=i % WINDOW + 1)
                )
            for _ in range(batch):
                ack = pub.recv(timeout=30)
                if qos == 2:
                    assert isinstance(ack, PubRec) and ack.reason_code == 0, ack
                    pub.send(PubRel(ack.packet_id))
                    continue
                assert isinstance(ack, PubAck) and ack.reason_code == 0, ack
            for _ in range(batch if qos == 2 else 0):
                assert isinstance(pub.recv(timeout=30), PubComp)
            sent += batch
        pub.disconnect()
    finally:
        pub.close()


def _read_all(raw: Raw, count: int, timeout: float = 120.0) -> list[Publish]:
    """Read ``count`` PUBLISHes, acknowledging each as it comes."""
    got: list[Publish] = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        packet = raw.recv(timeout=max(0.1, deadline - time.monotonic()))
        assert isinstance(packet, Publish), packet
        got.append(packet)
        assert packet.packet_id is not None
        raw.send(PubAck(packet.packet_id) if packet.qos == 1 else PubRec(packet.packet_id))
    return got


def _kafka_port(broker: BrokerProcess) -> int | None:
    return next(s for s in EmbeddedServices(broker.data_dir).status() if s.name == "kafka").port


def _produce_again(broker: BrokerProcess, topic: str, offset: int) -> None:
    """Append a copy of the record at ``offset`` to ``topic``: what a produce retried
    after a lost answer leaves in Kafka."""
    bootstrap = f"127.0.0.1:{_kafka_port(broker)}"

    async def copy() -> None:
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
        await consumer.start()
        await producer.start()
        try:
            tp = TopicPartition(topic, 0)
            consumer.assign([tp])
            consumer.seek(tp, offset)
            got = await consumer.getmany(tp, timeout_ms=5000, max_records=1)
            record = got[tp][0]
            await producer.send_and_wait(topic, record.value, key=record.key, partition=0)
        finally:
            await producer.stop()
            await consumer.stop()

    asyncio.run(copy())


def _kafka_topics(broker: BrokerProcess) -> set[str]:
    kafka = next(s for s in EmbeddedServices(broker.data_dir).status() if s.name == "kafka")

    async def listed() -> set[str]:
        admin = AIOKafkaAdminClient(bootstrap_servers=f"127.0.0.1:{kafka.port}")
        await admin.start()
        try:
            return set(await admin.list_topics())
        finally:
            await admin.close()

    return asyncio.run(listed())


def test_a_backlog_thirty_times_the_device_limit_comes_back_whole_and_in_order(
    app_broker: BrokerProcess,
) -> None:
    prefix = _name("t")
    fleet = f"{prefix}/devices/+/telemetry"
    app, device = _name("app"), _name("dev")
    for client_id in (app, device):
        raw, _ = _connect(app_broker, client_id, clean=True)
        _subscribe(raw, fleet, 1)
        raw.disconnect()
    topics = [f"{prefix}/devices/d{n}/telemetry" for n in range(5)]
    _publish_many(app_broker, topics, BACKLOG)

    raw, connack = _connect(app_broker, app, clean=False, receive_maximum=1000)
    assert connack.session_present
    got = _read_all(raw, BACKLOG)
    assert [int(p.payload) for p in got] == list(range(BACKLOG))
    assert [p.topic for p in got[:5]] == topics
    assert not any(p.dup for p in got)  # none was sent before
    assert raw.recv_or_none(timeout=1.0) is None  # and nothing more
    raw.disconnect()

    # A DEVICE session on the same broker is unchanged: the newest DEVICE_LIMIT only.
    raw, connack = _connect(app_broker, device, clean=False, receive_maximum=1000)
    assert connack.session_present
    kept = _read_all(raw, DEVICE_LIMIT)
    assert [int(p.payload) for p in kept] == list(range(BACKLOG - DEVICE_LIMIT, BACKLOG))
    assert raw.recv_or_none(timeout=1.0) is None
    raw.disconnect()
    assert app_topic(app) in _kafka_topics(app_broker)
    assert app_topic(device) not in _kafka_topics(app_broker)


def test_the_unacknowledged_tail_is_sent_again_with_dup_under_its_ids(
    app_broker: BrokerProcess,
) -> None:
    prefix = _name("t")
    app = _name("app")
    raw, _ = _connect(app_broker, app, clean=True, receive_maximum=10)
    _subscribe(raw, f"{prefix}/#", 1)
    _publish_many(app_broker, [f"{prefix}/a"], 30)
    first = [raw.recv() for _ in range(10)]  # the window: 10 in flight
    assert all(isinstance(p, Publish) and not p.dup for p in first)
    assert [int(p.payload) for p in first] == list(range(10))  # type: ignore[union-attr]
    assert raw.recv_or_none(timeout=0.5) is None  # Receive Maximum holds the rest
    for p in first[:4]:
        raw.send(PubAck(p.packet_id))  # type: ignore[union-attr, arg-type]
    more = [raw.recv() for _ in range(4)]  # the window opened by those four
    assert [int(p.payload) for p in more] == list(range(10, 14))  # type: ignore[union-attr]
    assert raw.recv_or_none(timeout=0.5) is None
    ids = {int(p.payload): p.packet_id for p in first + more}  # type: ignore[union-attr]
    raw.close()  # no DISCONNECT: the network went

    raw, connack = _connect(app_broker, app, clean=False, receive_maximum=10)
    assert connack.session_present
    again = _read_all(raw, 26)
    assert [int(p.payload) for p in again] == list(range(4, 30))
    for p in again[:10]:  # sent before, unacknowledged: DUP, the same packet id
        assert p.dup and p.packet_id == ids[int(p.payload)], p
    assert not any(p.dup for p in again[10:])  # never sent before
    raw.ping()
    raw.recv()
    raw.disconnect()

    # Everything was acknowledged: nothing comes again.
    raw, _ = _connect(app_broker, app, clean=False)
    assert raw.recv_or_none(timeout=1.5) is None
    raw.disconnect()


def test_qos2_in_its_pubrel_stage_is_not_delivered_twice_across_a_reconnect(
    app_broker: BrokerProcess,
) -> None:
    prefix = _name("t")
    app = _name("app")
    raw, _ = _connect(app_broker, app, clean=True)
    _subscribe(raw, f"{prefix}/#", 2)
    pub = Raw(app_broker)
    assert pub.connect(_name("pub")).reason_code == 0  # type: ignore[attr-defined]
    for n, payload in enumerate((b"once", b"pending")):
        pub.send(Publish(f"{prefix}/q", payload, 2, packet_id=n + 1))
        assert isinstance(pub.recv(), PubRec)
        pub.send(PubRel(n + 1))
        assert isinstance(pub.recv(), PubComp)

    once = raw.recv()
    assert isinstance(once, Publish) and once.payload == b"once" and once.qos == 2
    pending = raw.recv()
    assert isinstance(pending, Publish) and pending.payload == b"pending"
    raw.send(PubRec(once.packet_id))  # type: ignore[arg-type]
    pubrel = raw.recv()
    assert isinstance(pubrel, PubRel) and pubrel.packet_id == once.packet_id
    raw.close()  # PUBCOMP never sent; "pending" not even PUBREC'd

    raw, connack = _connect(app_broker, app, clean=False)
    assert connack.session_present
    got = [raw.recv(), raw.recv()]
    # "once": its PUBREL again, never its PUBLISH; "pending": its PUBLISH again, DUP,
    # under the same packet id (the client's own duplicate check sees it).
    pubrels = [p for p in got if isinstance(p, PubRel)]
    publishes = [p for p in got if isinstance(p, Publish)]
    assert [p.packet_id for p in pubrels] == [once.packet_id], got
    assert len(publishes) == 1 and publishes[0].payload == b"pending", got
    assert publishes[0].dup and publishes[0].packet_id == pending.packet_id
    raw.send(PubComp(once.packet_id))  # type: ignore[arg-type]
    raw.send(PubRec(pending.packet_id))  # type: ignore[arg-type]
    assert isinstance(raw.recv(), PubRel)
    raw.send(PubComp(pending.packet_id))  # type: ignore[arg-type]
    raw.ping()
    raw.recv()
    raw.close()

    raw, _ = _connect(app_broker, app, clean=False)
    assert raw.recv_or_none(timeout=1.5) is None  # both completed: nothing again
    raw.disconnect()
    pub.disconnect()


def test_session_expiry_deletes_the_topic(app_broker: BrokerProcess) -> None:
    prefix = _name("t")
    app = _name("app")
    raw, _ = _connect(app_broker, app, clean=True, expiry=1)
    _subscribe(raw, f"{prefix}/#", 1)
    _publish_many(app_broker, [f"{prefix}/a"], 3)
    assert raw.recv() is not None
    assert app_topic(app) in _kafka_topics(app_broker)
    raw.disconnect()
    deadline = time.monotonic() + 15
    while app_topic(app) in _kafka_topics(app_broker):
        assert time.monotonic() < deadline, "the topic outlived its session"
        time.sleep(0.3)
    # A new session of the client ID starts empty, with a topic of its own again.
    raw, connack = _connect(app_broker, app, clean=False)
    assert not connack.session_present
    assert raw.recv_or_none(timeout=1.0) is None
    raw.disconnect()


def test_a_311_client_with_clean_session_0_is_an_application_session(
    app_broker: BrokerProcess,
) -> None:
    prefix = _name("t")
    app = _name("app")
    raw = Raw(app_broker, level=4)
    connack = raw.connect(app, clean_start=False)
    assert isinstance(connack, ConnAck) and connack.reason_code == 0
    raw.send(Subscribe(1, [Subscription(f"{prefix}/#", 1)]))
    assert isinstance(raw.recv(), SubAck)
    raw.disconnect()
    count = 3 * DEVICE_LIMIT
    _publish_many(app_broker, [f"{prefix}/a"], count)
    raw = Raw(app_broker, level=4)
    connack = raw.connect(app, clean_start=False)
    assert isinstance(connack, ConnAck) and connack.session_present
    got = _read_all(raw, count)
    assert [int(p.payload) for p in got] == list(range(count))
    raw.disconnect()
    assert app_topic(app) in _kafka_topics(app_broker)


def test_a_broker_killed_mid_backlog_resumes_from_the_committed_offset(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    settings = {"application.client_ids": '["^app-"]'}
    data_dir = tmp_path_factory.mktemp("app-kill")
    broker = start_broker(data_dir, settings)
    try:
        prefix, app = _name("t"), _name("app")
        raw, _ = _connect(broker, app, clean=True)
        _subscribe(raw, f"{prefix}/#", 1)
        raw.disconnect()
        count = 5000
        _publish_many(broker, [f"{prefix}/a"], count)
        raw, _ = _connect(broker, app, clean=False, receive_maximum=50)
        acked = _read_all(raw, 2000)  # acknowledged, each as it came
        assert [int(p.payload) for p in acked] == list(range(2000))
        sent = [raw.recv() for _ in range(50)]  # the window, never acknowledged
        assert all(isinstance(p, Publish) for p in sent)
        broker.proc.kill()  # SIGKILL: nothing drained, no last write
        broker.proc.wait(10)
        raw.close()
        broker = start_broker(data_dir, settings)  # the embedded Redis and Tansu lived on
        raw, connack = _connect(broker, app, clean=False, receive_maximum=50)
        assert connack.session_present
        first = raw.recv()
        assert isinstance(first, Publish)
        start = int(first.payload)
        # From the committed offset: nothing unacknowledged is skipped; what was
        # acknowledged but not yet committed may come again (QoS 1), with DUP.
        assert start <= 2000
        rest = [first, *_read_all(raw, count - start - 1)]
        raw.send(PubAck(first.packet_id))  # type: ignore[arg-type]
        assert [int(p.payload) for p in rest] == list(range(start, count))
        last_sent = 2000 + len(sent) - 1
        for p in rest:
            assert p.dup == (int(p.payload) <= last_sent), p  # DUP exactly on what was seen
        raw.ping()
        raw.recv()
        raw.disconnect()
    finally:
        broker.stop()


@pytest.mark.parametrize("qos", [1, 2])
def test_a_record_kafka_took_twice_is_delivered_once(app_broker: BrokerProcess, qos: int) -> None:
    prefix, app = _name("t"), _name("app")
    raw, _ = _connect(app_broker, app, clean=True)
    _subscribe(raw, f"{prefix}/#", qos)
    raw.disconnect()
    _publish_many(app_broker, [f"{prefix}/a"], 1, qos)
    _produce_again(app_broker, app_topic(app), 0)  # offset 1: a copy of message 0
    _publish_many(app_broker, [f"{prefix}/a"], 1, qos)  # offset 2

    raw, _ = _connect(app_broker, app, clean=False)
    got = _read_all(raw, 2)
    if qos == 2:
        for _ in got:
            pubrel = raw.recv()
            assert isinstance(pubrel, PubRel)
            raw.send(PubComp(pubrel.packet_id))
    assert raw.recv_or_none(timeout=1.5) is None, "a copy was delivered"
    raw.disconnect()

    # Committed past both: a copy of message 0 arriving now is still a copy.
    _produce_again(app_broker, app_topic(app), 0)
    raw, _ = _connect(app_broker, app, clean=False)
    assert raw.recv_or_none(timeout=1.5) is None, "a copy was delivered after a commit"
    raw.disconnect()


def _metric(broker: BrokerProcess, name: str, client_id: str) -> float | None:
    url = f"http://127.0.0.1:{broker.settings['metrics.port']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    found = re.search(rf'^{name}{{client_id="{re.escape(client_id)}"}} (\S+)$', text, re.M)
    return None if found is None else float(found.group(1))


def _sys_lag(broker: BrokerProcess, client_id: str, messages: bytes) -> dict[str, bytes]:
    """$SYS's lag of ``client_id``'s session (``messages`` and ``seconds``), read until
    it says ``messages`` (published every second; the first values are the retained
    ones, possibly of the count before), or for 10 s."""
    watcher = Raw(broker)
    try:
        assert watcher.connect(_name("sys")).reason_code == 0  # type: ignore[attr-defined]
        _subscribe(watcher, f"$SYS/broker/devicemq/application/{client_id}/lag/+", 0)
        values: dict[str, bytes] = {}
        deadline = time.monotonic() + 10
        last = ""
        # each publish has messages, then seconds: the seconds of the same count
        while (values.get("messages") != messages or last != "seconds") and (
            time.monotonic() < deadline
        ):
            packet = watcher.recv(timeout=5)
            assert isinstance(packet, Publish), packet
            last = packet.topic.rsplit("/", 1)[1]
            values[last] = packet.payload
        return values
    finally:
        watcher.close()


def test_the_lag_is_in_metrics_and_the_admin_session_view(app_broker: BrokerProcess) -> None:
    prefix, app = _name("t"), _name("app")
    raw, _ = _connect(app_broker, app, clean=True)
    _subscribe(raw, f"{prefix}/#", 1)
    raw.disconnect()
    _publish_many(app_broker, [f"{prefix}/a"], 250)
    time.sleep(1.0)  # the oldest is a second old at least
    api = _admin(app_broker)
    view = api.call("GET", api.session_path(app))
    assert view["session_type"] == "application" and view["backlog"] == 250, view
    detail = view["backlog_detail"]
    assert detail["messages"] == 250 and detail["oldest_age"] >= 1.0, detail
    assert detail["kafka_topic"] == app_topic(app)

    # The metrics refresh every 5 s: a refresh may have come before the oldest was a
    # second old, and a later one must say so.
    deadline = time.monotonic() + 20
    while (
        _metric(app_broker, "devicemq_application_lag_messages", app) != 250
        or (_metric(app_broker, "devicemq_application_lag_seconds", app) or 0.0) < 1.0
    ):
        assert time.monotonic() < deadline, "no lag (250 messages, a second old) in /metrics"
        time.sleep(0.5)
    in_sys = _sys_lag(app_broker, app, b"250")  # $SYS carries it too
    assert in_sys.get("messages") == b"250" and float(in_sys.get("seconds", 0)) >= 1.0, in_sys

    raw, _ = _connect(app_broker, app, clean=False)
    _read_all(raw, 250)
    raw.ping()
    raw.recv()
    deadline = time.monotonic() + 10  # the commit is written after the acknowledgements
    while api.call("GET", api.session_path(app))["backlog"] != 0:
        assert time.monotonic() < deadline, "the lag stayed after everything was acknowledged"
        time.sleep(0.2)
    raw.disconnect()
    assert _sys_lag(app_broker, app, b"0").get("messages") == b"0"


def test_qos2_in_its_pubrel_stage_survives_a_broker_killed(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    settings = {"application.client_ids": '["^app-"]'}
    data_dir = tmp_path_factory.mktemp("app-kill-qos2")
    broker = start_broker(data_dir, settings)
    try:
        prefix, app = _name("t"), _name("app")
        raw, _ = _connect(broker, app, clean=True)
        _subscribe(raw, f"{prefix}/#", 2)
        _publish_many(broker, [f"{prefix}/q"], 2, qos=2)
        first, second = raw.recv(), raw.recv()
        assert isinstance(first, Publish) and isinstance(second, Publish)
        raw.send(PubRec(first.packet_id))  # type: ignore[arg-type]
        pubrel = raw.recv()
        assert isinstance(pubrel, PubRel) and pubrel.packet_id == first.packet_id
        broker.proc.kill()  # the PUBREL went out: its stage was recorded before
        broker.proc.wait(10)
        raw.close()
        broker = start_broker(data_dir, settings)
        raw, connack = _connect(broker, app, clean=False)
        assert connack.session_present
        got = [raw.recv(), raw.recv()]
        pubrels = [p.packet_id for p in got if isinstance(p, PubRel)]
        publishes = [p for p in got if isinstance(p, Publish)]
        assert pubrels == [first.packet_id], got  # never its PUBLISH again
        assert [(p.payload, p.dup, p.packet_id) for p in publishes] == [
            (second.payload, True, second.packet_id)
        ], got
        assert raw.recv_or_none(timeout=1.0) is None
        raw.disconnect()
    finally:
        broker.stop()


def _admin(broker: BrokerProcess) -> AdminClient:
    return AdminClient(f"http://127.0.0.1:{broker.settings['admin.port']}", TOKEN)


def _committed(api: AdminClient, client_id: str, offset: int) -> None:
    deadline = time.monotonic() + 10
    view = api.call("GET", api.session_path(client_id))
    while view["backlog_detail"]["committed_offsets"] != {"0": offset}:
        assert time.monotonic() < deadline, view
        time.sleep(0.2)
        view = api.call("GET", api.session_path(client_id))


def test_a_session_rewound_to_an_offset_or_a_time_gets_its_messages_again_with_dup(
    app_broker: BrokerProcess, tmp_path: Path
) -> None:
    prefix, app = _name("t"), _name("app")
    api = _admin(app_broker)
    raw, _ = _connect(app_broker, app, clean=True)
    _subscribe(raw, f"{prefix}/#", 1)
    _publish_many(app_broker, [f"{prefix}/a"], 10)
    time.sleep(0.05)
    between = time.time()
    time.sleep(0.05)
    _publish_many(app_broker, [f"{prefix}/b"], 10)
    assert len(_read_all(raw, 20)) == 20
    _committed(api, app, 20)

    # Connected: the rewound messages come at once, with DUP.
    answer = api.call("POST", api.session_path(app, "rewind"), body={"offset": 17})
    assert answer["offsets"] == {"0": 17}
    again = _read_all(raw, 3)
    assert [(p.topic, int(p.payload), p.dup) for p in again] == [
        (f"{prefix}/b", n, True) for n in (7, 8, 9)
    ]
    _committed(api, app, 20)
    raw.disconnect()

    # Offline, by time: from the first message published after ``between``.
    answer = api.call("POST", api.session_path(app, "rewind"), body={"since": between})
    assert answer["offsets"] == {"0": 10}
    raw, _ = _connect(app_broker, app, clean=False)
    again = _read_all(raw, 10)
    assert [(p.topic, int(p.payload)) for p in again] == [(f"{prefix}/b", n) for n in range(10)]
    assert all(p.dup for p in again)
    _publish_many(app_broker, [f"{prefix}/c"], 1)
    new = _read_all(raw, 1)[0]
    assert (new.topic, new.dup) == (f"{prefix}/c", False)  # never sent before: no DUP
    raw.disconnect()

    # Never forward: a rewind past the committed offset moves nothing.
    _committed(api, app, 21)
    answer = api.call("POST", api.session_path(app, "rewind"), body={"offset": 1000})
    assert answer["offsets"] == {"0": 21}
    for body in ({}, {"offset": -1}, {"offset": 1, "since": 0}, {"offset": "1"}):
        with pytest.raises(ApiError) as refused:
            api.call("POST", api.session_path(app, "rewind"), body=body)
        assert refused.value.status == 400, body

    # The command line: from offset 20, the last message again.
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    common = ["--url", api.url, "--token-file", str(token_file)]
    assert cli.main(["sessions", "rewind", app, "--offset", "20", *common]) == 0
    raw, _ = _connect(app_broker, app, clean=False)
    again = _read_all(raw, 1)
    assert (again[0].topic, again[0].dup) == (f"{prefix}/c", True)
    raw.disconnect()


def test_with_several_partitions_order_holds_per_topic_and_every_partition_commits(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    settings = {"application.client_ids": '["^app-"]', "application.partitions": 3}
    broker = start_broker(tmp_path_factory.mktemp("app-partitions"), settings)
    try:
        prefix, app = _name("t"), _name("app")
        raw, _ = _connect(broker, app, clean=True)
        _subscribe(raw, f"{prefix}/#", 1)
        raw.disconnect()
        topics = [f"{prefix}/d{n}" for n in range(6)]
        _publish_many(broker, topics, 600)
        raw, _ = _connect(broker, app, clean=False, receive_maximum=20)
        got = _read_all(raw, 600)
        by_topic: dict[str, list[int]] = {}
        for p in got:
            by_topic.setdefault(p.topic, []).append(int(p.payload))
        assert by_topic == {t: list(range(n, 600, 6)) for n, t in enumerate(topics)}
        raw.ping()
        raw.recv()
        raw.disconnect()  # the reader of the next connection waits for the last write
        raw, _ = _connect(broker, app, clean=False)
        assert raw.recv_or_none(timeout=1.5) is None  # every partition committed to its end
        raw.disconnect()
    finally:
        broker.stop()


def test_user_names_narrow_the_type_and_the_acl_is_asked_at_delivery(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """``application.usernames``: a client ID that matches is not enough. And the read
    rules are asked when a message goes out, not when it went into the topic: a rule
    revoked while the backend was offline applies to its backlog."""
    from broker.auth import hash_password, write_password_file

    directory = tmp_path_factory.mktemp("app-acl")
    passwords = directory / "passwd"
    write_password_file(passwords, {u: hash_password(u + "-pw") for u in ("svc", "alice")})
    acl = directory / "acl"
    rules = "user svc\ntopic readwrite fleet/#\nuser alice\ntopic readwrite fleet/#\n"
    acl.write_text(rules)
    settings = {
        "application.client_ids": '["^app-"]',
        "application.usernames": '["^svc$"]',
        "auth.password_file": passwords,
        "auth.acl_file": acl,
    }
    broker = start_broker(directory / "broker", settings)

    def login(client_id: str, user: str, clean: bool) -> Raw:
        raw = Raw(broker)
        connack = raw.connect(
            client_id,
            clean_start=clean,
            username=user,
            password=(user + "-pw").encode(),
            properties=Properties(session_expiry_interval=600),
        )
        assert isinstance(connack, ConnAck) and connack.reason_code == 0, connack
        return raw

    try:
        backend, other = _name("app"), _name("app")
        raw = login(backend, "svc", True)
        _subscribe(raw, "fleet/#", 1)
        raw.disconnect()
        raw = login(other, "alice", True)  # its client ID matches, its user does not
        raw.disconnect()
        listed = _kafka_topics(broker)
        assert app_topic(backend) in listed and app_topic(other) not in listed

        sender = login(_name("pub"), "svc", True)
        for n, topic in enumerate(("fleet/ok", "fleet/secret/1", "fleet/ok")):
            sender.send(Publish(topic, str(n).encode(), 1, packet_id=n + 1))
            ack = sender.recv()
            assert isinstance(ack, PubAck) and ack.reason_code == 0, ack
        sender.disconnect()
        acl.write_text(rules.replace("user alice", "topic deny fleet/secret/#\nuser alice"))
        broker.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "ACL file reloaded" not in broker.log():
            assert time.monotonic() < deadline, "the ACL was not reloaded"
            time.sleep(0.1)

        raw = login(backend, "svc", False)
        got = _read_all(raw, 2)
        assert [(p.topic, p.payload) for p in got] == [("fleet/ok", b"0"), ("fleet/ok", b"2")]
        assert raw.recv_or_none(timeout=1.0) is None
        raw.disconnect()  # the dropped one is done with: the commit passed it
        raw = login(backend, "svc", False)
        assert raw.recv_or_none(timeout=1.5) is None
        raw.disconnect()
    finally:
        broker.stop()


def test_a_message_sent_before_is_sent_again_past_its_expiry(app_broker: BrokerProcess) -> None:
    """Once sent, a message's flow completes whatever its expiry (MQTT-4.4.0-1): the
    re-send after a reconnect goes, DUP, under its id; an expired one never sent
    before does not."""
    prefix, app = _name("t"), _name("app")
    raw, _ = _connect(app_broker, app, clean=True, receive_maximum=1)
    _subscribe(raw, f"{prefix}/#", 1)
    pub = Raw(app_broker)
    assert isinstance(pub.connect(_name("pub")), ConnAck)
    for n in range(2):
        expiring = Properties(message_expiry_interval=1)
        pub.send(Publish(f"{prefix}/e", str(n).encode(), 1, packet_id=n + 1, properties=expiring))
        assert isinstance(pub.recv(), PubAck)
    pub.disconnect()
    sent = raw.recv()  # the window is 1: message 1 waits, unsent
    assert isinstance(sent, Publish) and sent.payload == b"0"
    raw.close()
    time.sleep(1.5)  # both expire
    raw, _ = _connect(app_broker, app, clean=False, receive_maximum=1)
    again = raw.recv()
    assert isinstance(again, Publish)
    assert (again.payload, again.dup, again.packet_id) == (b"0", True, sent.packet_id)
    raw.send(PubAck(again.packet_id))  # type: ignore[arg-type]
    assert raw.recv_or_none(timeout=1.0) is None  # message 1 expired before its first send
    raw.disconnect()
