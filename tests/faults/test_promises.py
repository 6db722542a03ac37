"""One deterministic example per broken promise the model checker found (tests/model).

Each test drives its fault on purpose (SIGSTOP a backend to hold a write, a
client that holds its acknowledgement, tiny limits and expiries) and checks
one promise black-box, through MQTT only; tests/model/FINDINGS.md has the
failure each one shows on the code before the fixes.

1. a packet id still in flight to a client (unacknowledged) is never given
   to another message, even after the message was trimmed;
2. after Kafka restarts empty under a running broker, acknowledged messages
   are still delivered, also when a client names the topic before the broker
   makes it again (Tansu then makes it at its own size);
3. a session that ended (clean start) gets nothing published for it into
   the next one;
4. after a resume, a PUBREL the client has not completed is re-sent, even
   once the message's expiry has passed;
5. a first delivery carries DUP=0;
6. a QoS 2 message is delivered once, even when Kafka stalled past the
   produce timeout while the publisher re-sent it;
7. a retained message is acknowledged only once it is stored; a 3.1.1
   publisher cannot queue without bound while Kafka does not answer;
8. a stored session discarded by clean start does not come back after a
   crash once CONNACK said it was gone;
9. a session resumed with Session Expiry Interval 0 ends with the crash
   that closes its connection;
10. after Kafka restarts empty under a broker that has not produced yet,
    messages acknowledged later survive a crash of that broker.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from pathlib import Path

import redis
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties as PahoProperties

from app.embedded_services import free_port
from broker.codec import PacketDecoder, encode
from broker.packets import (
    ConnAck,
    Connect,
    Packet,
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
from tests.faults.checker import Publisher, RawSubscriber, parse, wait_until
from tests.faults.conftest import HOST, Stack
from tests.kafka_fixtures import freeze
from tests.model.system import System, parse_metrics

TOPIC = "promise"


class RawPeer:
    """A bare MQTT client on a socket: send packets, read them back synchronously."""

    def __init__(self, address: tuple[str, int], client_id: str, level: int = 5) -> None:
        self.address = address
        self.client_id = client_id
        self.level = level
        self.sock: socket.socket | None = None
        self._decoder = PacketDecoder(protocol_level=level)
        self._pending: list[Packet] = []

    def connect(self, clean_start: bool = True, expiry: int | None = None) -> ConnAck:
        self.close()
        self.sock = socket.create_connection(self.address, timeout=5)
        self._decoder = PacketDecoder(protocol_level=self.level)
        self._pending = []
        props = Properties(session_expiry_interval=expiry) if self.level == 5 and expiry else None
        self.send(
            Connect(
                self.client_id,
                protocol_level=self.level,
                clean_start=clean_start,
                keep_alive=0,
                properties=props,
            )
        )
        connack = self.recv(5)
        assert isinstance(connack, ConnAck) and connack.reason_code == 0, connack
        return connack

    def send(self, packet: Packet) -> None:
        assert self.sock is not None
        self.sock.sendall(encode(packet, self.level))

    def recv(self, timeout: float) -> Packet | None:
        """The next packet, or None if the connection closed or nothing came in time."""
        deadline = time.monotonic() + timeout
        while not self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or self.sock is None:
                return None
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return None
            except OSError:
                return None
            if not data:
                return None
            self._pending.extend(self._decoder.feed(data))
        return self._pending.pop(0)

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()


def _metrics(port: int) -> dict[str, float]:
    import http.client

    conn = http.client.HTTPConnection(HOST, port, timeout=5)
    try:
        conn.request("GET", "/metrics")
        return parse_metrics(conn.getresponse().read().decode())
    finally:
        conn.close()


def _metric(port: int, name: str) -> float:
    return sum(v for k, v in _metrics(port).items() if k.split("{")[0] == name)


def _metrics_settings(**extra: object) -> dict[str, object]:
    return {"metrics.enabled": True, "metrics.host": HOST, "metrics.port": free_port(HOST), **extra}


def _expiring(seconds: int) -> PahoProperties:
    props = PahoProperties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    props.MessageExpiryInterval = seconds
    return props


# ---------------------------------------------------------------------------
# 1. packet ids
# ---------------------------------------------------------------------------


def test_packet_id_in_flight_is_not_reused_after_a_trim(stack_factory) -> None:  # type: ignore[no-untyped-def]
    """Finding 1: a trimmed message still in flight gives its packet id to a new one.

    The client holds the PUBACK of the first message (packet id 1), goes
    away, newer messages push it out over ``max_messages_per_client``, and
    ~65,535 more copies bring the packet ids round to 1 again (99 shared
    groups give the session 100 copies of each PUBLISH). On resume packet id
    1, still unacknowledged, must not arrive carrying another message.
    """
    stack: Stack = stack_factory({"persistence.max_messages_per_client": 1000})
    topic = stack.topic(TOPIC)
    groups = 99
    sub = RawSubscriber(stack.broker.address, stack.client("sub"), receive_maximum=1)
    pub = Publisher(stack.broker.address, stack.client("pub"), topic, window=200)
    try:
        sub.ack = lambda packet: False  # hold every acknowledgement
        filters = [(topic, 1)] + [(f"$share/g{i}/{topic}", 1) for i in range(groups)]
        sub.connect(subscribe=filters)
        pub.publish(1)
        wait_until(lambda: len(sub.snapshot()) == 1, 10, "the first copy")
        first = sub.snapshot()[0]
        assert first.packet_id == 1
        sub.abort()  # packet id 1 stays unacknowledged: still in flight for this session
        per = groups + 1
        # 100 copies of the first PUBLISH, then enough for the score to pass 65536
        pub.publish((65_536 - per) // per + 2)
        pub.stop(60)
        assert not pub.unanswered and not pub.failed
        sub.ack = lambda packet: packet.packet_id != 1
        sub.receive_maximum = None
        assert sub.connect().session_present
        last = pub.last_seq  # its copies come last: everything stored before them came too
        wait_until(
            lambda: sum(parse(r.payload)[1] == last for r in sub.snapshot()) >= per,
            60,
            "the stored backlog",
        )
        reused = [r for r in sub.snapshot()[1:] if r.packet_id == 1 and r.payload != first.payload]
        assert not reused, (
            f"packet id 1, never acknowledged for {first.payload!r}, was given to "
            f"{reused[0].payload!r}"
        )
    finally:
        sub.close()
        pub.close()


# ---------------------------------------------------------------------------
# 2. Kafka restarts
# ---------------------------------------------------------------------------


def test_messages_after_a_kafka_restart_are_delivered(tmp_path: Path) -> None:
    """Finding 2: Kafka recreated empty restarts offsets at 0; the broker skips them.

    Everything acknowledged before the restart is stored first (consumer lag
    0), so Tansu loses nothing the broker owes; what is published afterwards
    must arrive.
    """
    system = System(tmp_path / "system", 1, {})
    sub = pub = pub2 = None
    try:
        system.start()
        address = system.address(0)
        sub = RawSubscriber(address, "sub", level=5)
        sub.connect(subscribe=[(TOPIC, 1)])
        pub = Publisher(address, "pub", TOPIC)
        pub.publish(50)
        pub.stop()
        sub.wait_all([pub], 15)
        wait_until(system.quiesced, 20, "consumer lag 0")
        system.restart_kafka()
        pub2 = Publisher(address, "pub2", TOPIC)
        pub2.publish(20)
        pub2.stop(30)
        assert pub2.acked == set(range(1, 21)), pub2.outcomes
        sub.wait_all([pub2], 10)
    finally:
        for client in (sub, pub, pub2):
            if client is not None:
                client.close()
        system.stop()


def _settled_subscriber(system: System) -> tuple[RawSubscriber, Publisher]:
    """The system started; a persistent subscriber ("sub") got 10 messages of "pub",
    and Kafka holds nothing that is not stored."""
    system.start()
    address = system.address(0)
    sub = RawSubscriber(address, "sub", level=5)
    sub.connect(subscribe=[(TOPIC, 1)], reconnect=True)
    pub = Publisher(address, "pub", TOPIC)
    pub.publish(10)
    pub.stop()
    sub.wait_all([pub], 15)
    wait_until(system.quiesced, 20, "consumer lag 0")
    return sub, pub


def test_a_topic_kafka_lost_is_made_again_before_a_crash_can_lose_its_records(
    tmp_path: Path,
) -> None:
    """Seed 1183: a Tansu restarted empty no longer lists the topic, yet acknowledges
    records sent to it (from offset 0 again) while refusing commits; the next
    broker to start created the topic over them. The broker that finds the topic
    gone stores what Kafka still serves and makes the topic again, so messages
    acknowledged afterwards are in a topic that a broker starting after a crash
    reads. Redis is paused while they are published and during the crash: none
    of them was stored before it.
    """
    system = System(tmp_path / "system", 1, {})
    sub = pub = pub2 = None
    try:
        sub, pub = _settled_subscriber(system)
        address = system.address(0)
        system.kill_broker(0)  # the next process has produced nothing before the restart
        system.start_broker(0)
        system.restart_kafka()
        wait_until(
            lambda: system.counter("devicemq_kafka_topics_restored_total") >= 1,
            30,
            "the broker to make the lost topic again",
        )
        assert system.counter("devicemq_kafka_topic_restores_incomplete_total") == 0
        system.pause_redis()
        pub2 = Publisher(address, "pub2", TOPIC)
        pub2.publish(10)
        pub2.stop(30)
        assert pub2.acked == set(range(1, 11)), pub2.outcomes
        system.kill_broker(0)
        system.resume_redis()
        system.start_broker(0)
        sub.wait_all([pub, pub2], 20)
    finally:
        for client in (sub, pub, pub2):
            if client is not None:
                client.close()
        system.stop()


def test_a_topic_a_client_names_after_kafka_restarts_empty_is_made_at_its_size(
    tmp_path: Path,
) -> None:
    """Finding 26: Tansu creates a topic that a metadata request names, at its own
    default size (4 partitions). Named after a restart empty, before the broker
    looks (any Kafka client may: a reader, a consumer whose fetch failed), the
    topic came back with 4 partitions while the broker's producer, which knew
    12, went on writing to partitions 4-11: Tansu acknowledged those records and
    no consumer ever reads them. ``sub`` is keyed to partition 10 of 12.
    """
    system = System(tmp_path / "system", 1, {"persistence.partitions": 12})
    sub = pub = pub2 = None
    try:
        sub, pub = _settled_subscriber(system)
        address = system.address(0)
        # Named at once, before the broker's next look (a second) as a rule: what
        # must hold holds either way (the next test makes the order certain).
        system.restart_kafka()
        system.name_topic()
        pub2 = Publisher(address, "pub2", TOPIC)
        pub2.publish(20)
        pub2.stop(30)
        assert pub2.acked, pub2.outcomes
        sub.wait_all([pub, pub2], 30)
        assert system.listed_partitions() == 12
    finally:
        for client in (sub, pub, pub2):
            if client is not None:
                client.close()
        system.stop()


def test_a_topic_tansu_made_at_its_own_size_while_the_broker_was_stopped_is_made_again(
    tmp_path: Path,
) -> None:
    """Finding 26, the order made certain: the broker is stopped (SIGSTOP) while
    Tansu restarts empty and a client names the topic, so Tansu lists it at its
    own 4 partitions first. The broker must make it again at 12 (on the old code
    it kept the 4) and deliver what it acknowledges afterwards: finding 27 lost
    the first of them (sent by one partition count, stored behind later records
    sent by another), then the consumer did not read the partitions the topic
    gained (tests/model/FINDINGS.md)."""
    system = System(tmp_path / "system", 1, {"persistence.partitions": 12})
    sub = pub = pub2 = None
    try:
        sub, pub = _settled_subscriber(system)
        broker = system.brokers[0].proc
        assert broker is not None
        freeze(broker.pid)
        try:
            system.restart_kafka()
            system.name_topic()
            assert system.listed_partitions() == 4  # Tansu's own size
        finally:
            os.kill(broker.pid, signal.SIGCONT)
        pub2 = Publisher(system.address(0), "pub2", TOPIC)
        # Refused (0x80, not acknowledged: not owed) until the broker has made the
        # topic again; how long that takes depends on the machine: publish until
        # something is acknowledged, a minute at most.
        deadline = time.monotonic() + 60
        while True:
            pub2.publish(20)
            wait_until(lambda: pub2._pending() == 0, 30, "pub2's answers")
            if pub2.acked or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        pub2.stop(30)
        assert pub2.acked, pub2.outcomes
        sub.wait_all([pub, pub2], 30)
        wait_until(lambda: system.listed_partitions() == 12, 30, "the topic made at 12")
    finally:
        for client in (sub, pub, pub2):
            if client is not None:
                client.close()
        system.stop()


def test_a_broker_restarted_with_more_partitions_stores_what_kafka_held_first(
    tmp_path: Path,
) -> None:
    """A review of finding 26's fix: a topic listed at another size than
    ``persistence.partitions`` was taken at start-up for one Tansu had lost, and
    replaced at once. A broker restarted with more partitions (12 -> 16) then
    deleted a topic holding 20 acknowledged messages not stored yet (Redis
    paused while they were published, the broker killed). They must be stored
    before the topic is made at its new size."""
    system = System(tmp_path / "system", 1, {"persistence.partitions": 12})
    sub = pub = None
    try:
        system.start()
        address = system.address(0)
        sub = RawSubscriber(address, "sub", level=5)
        sub.connect(subscribe=[(TOPIC, 1)])
        sub.close()  # offline: what follows is stored for it
        system.pause_redis()
        pub = Publisher(address, "pub", TOPIC)
        pub.publish(20)
        pub.stop(20)
        assert pub.acked == set(range(1, 21)), pub.outcomes
        system.kill_broker(0)
        system.resume_redis()
        system.brokers[0].settings["persistence.partitions"] = 16
        system.start_broker(0)
        sub.connect(subscribe=None, reconnect=True)
        sub.wait_all([pub], 30)
        wait_until(lambda: system.listed_partitions() == 16, 30, "the topic made at 16")
    finally:
        for client in (sub, pub):
            if client is not None:
                client.close()
        system.stop()


# ---------------------------------------------------------------------------
# 3. clean start
# ---------------------------------------------------------------------------


def test_clean_start_gets_nothing_of_the_old_session(stack_factory) -> None:  # type: ignore[no-untyped-def]
    """Finding 3: records in Kafka for an ended session are stored into the next one.

    Redis holds every write (``CLIENT PAUSE WRITE``) while the consumer tries
    to store a first batch, so the messages published next stay in Kafka; the
    client then starts clean, and its session's delete waits in Redis behind
    that batch. Once writes resume, the new session (session present 0,
    subscribed only afterwards) must get nothing published before it began;
    a message published after its SUBSCRIBE, delivered in order behind
    anything stored for it, marks the end.
    """
    settings = _metrics_settings()
    stack: Stack = stack_factory(settings)
    port = int(settings["metrics.port"])  # type: ignore[call-overload]
    topic = stack.topic(TOPIC)
    sub = RawSubscriber(stack.broker.address, stack.client("sub"), level=5)
    pub = Publisher(stack.broker.address, stack.client("pub"), topic)
    rds = redis.Redis(port=stack.redis.port)
    paused = False

    def blocked() -> int:
        return int(rds.info("clients")["blocked_clients"])

    try:
        sub.connect(subscribe=[(topic, 1)])
        sub.close()
        consumed = _metric(port, "devicemq_kafka_records_consumed_total")
        rds.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")  # type: ignore[no-untyped-call]
        paused = True
        pub.publish(1)  # the batch the consumer is held storing
        wait_until(
            lambda: (
                _metric(port, "devicemq_kafka_records_consumed_total") > consumed and blocked() >= 1
            ),
            10,
            "the consumer's first batch waiting in Redis",
        )
        pub.publish(5)  # acknowledged by Kafka, not yet stored
        pub.stop()
        assert pub.acked == set(range(1, 7))
        # The clean start's own Redis work (the old session's end, or the new
        # session's opening before CONNACK) waits in Redis behind that batch too.
        connacks: list[object] = []
        starter = threading.Thread(target=lambda: connacks.append(sub.connect(clean_start=True)))
        starter.start()
        wait_until(lambda: blocked() >= 2, 10, "the clean start waiting in Redis")
        rds.execute_command("CLIENT", "UNPAUSE")  # type: ignore[no-untyped-call]
        paused = False
        starter.join(20)
        assert connacks and not connacks[0].session_present  # type: ignore[attr-defined]
        sub.close()
        assert sub.connect(subscribe=[(topic, 1)]).session_present  # the new session
        marker = Publisher(stack.broker.address, stack.client("marker"), topic)
        try:
            marker.publish(1)
            marker.stop()
            wait_until(
                lambda: marker.name.encode() in b"".join(r.payload for r in sub.snapshot()),
                20,
                "the marker",
            )
        finally:
            marker.close()
        old = [r.payload for r in sub.snapshot() if parse(r.payload)[0] == pub.name]
        assert not old, f"the new session got messages published for the old one: {old}"
    finally:
        if paused:
            rds.execute_command("CLIENT", "UNPAUSE")  # type: ignore[no-untyped-call]
        rds.close()
        sub.close()
        pub.close()


# ---------------------------------------------------------------------------
# 4. PUBREL after the message's expiry
# ---------------------------------------------------------------------------


def test_pubrel_is_resent_after_the_message_expiry(stack: Stack) -> None:
    """Finding 4: the PUBREL stage keeps the message's TTL and vanishes with it.

    The client receives a QoS 2 message with a 2 s expiry, PUBRECs it, sees
    the PUBREL and does not complete it; it comes back after the expiry
    passed. The PUBREL must be sent again (MQTT-4.4.0-1): expiry ends a
    PUBLISH, not the release of one the client already has.
    """
    topic = stack.topic(TOPIC)
    sub = RawSubscriber(stack.broker.address, stack.client("sub"), level=5)
    pub = Publisher(
        stack.broker.address, stack.client("pub"), topic, qos=2, properties=_expiring(2)
    )
    try:
        sub.complete = False  # PUBREL is not answered
        sub.connect(subscribe=[(topic, 2)])
        published = time.monotonic()
        pub.publish(1)
        wait_until(lambda: bool(sub.pubrels), 10, "the PUBREL")
        packet_id = sub.pubrels[0][0]
        sub.abort()
        time.sleep(max(0.0, published + 3.5 - time.monotonic()))  # the expiry has passed
        sub.complete = True
        assert sub.connect().session_present
        wait_until(
            lambda: any(pid == packet_id and conn == 2 for pid, conn in sub.pubrels),
            10,
            f"PUBREL {packet_id} re-sent after the resume",
        )
    finally:
        sub.close()
        pub.close()


# ---------------------------------------------------------------------------
# 5. DUP on a first delivery
# ---------------------------------------------------------------------------


def test_first_delivery_after_a_resume_has_no_dup(stack_factory) -> None:  # type: ignore[no-untyped-def]
    """Finding 5: after a resume with nothing stored, the next message arrives DUP=1.

    The resume's replay read (one page, empty) is waited for through the
    ``devicemq_persisted_replay_page_messages`` histogram, so the next message
    is a live one: it never went out before, DUP must be 0.
    """
    settings = _metrics_settings()
    stack: Stack = stack_factory(settings)
    port = int(settings["metrics.port"])  # type: ignore[call-overload]
    topic = stack.topic(TOPIC)
    sub = RawSubscriber(stack.broker.address, stack.client("sub"), level=5)
    pub = Publisher(stack.broker.address, stack.client("pub"), topic)
    pages = "devicemq_persisted_replay_page_messages_count"
    try:
        sub.connect(subscribe=[(topic, 1)])
        pub.publish(1)
        wait_until(lambda: len(sub.snapshot()) == 1, 10, "the first message")
        sub.close()
        before = _metric(port, pages)
        assert sub.connect().session_present
        wait_until(lambda: _metric(port, pages) > before, 10, "the resume's replay read")
        pub.publish(1)
        wait_until(lambda: len(sub.snapshot()) == 2, 10, "the second message")
        got = sub.snapshot()
        assert [r.dup for r in got] == [False, False], [(r.payload, r.dup) for r in got]
    finally:
        sub.close()
        pub.close()


def _qos2(peer: RawPeer, publish: Publish) -> None:
    """A complete QoS 2 flow from ``peer``: PUBLISH, PUBREC (success), PUBREL, PUBCOMP."""
    assert publish.packet_id is not None
    peer.send(publish)
    rec = peer.recv(15)
    assert isinstance(rec, PubRec) and rec.reason_code < 0x80, rec
    peer.send(PubRel(publish.packet_id))
    assert isinstance(peer.recv(10), PubComp)


# ---------------------------------------------------------------------------
# 6. QoS 2 through a stalled Kafka
# ---------------------------------------------------------------------------


def test_qos2_once_when_kafka_stalls_past_the_produce_timeout(stack_factory) -> None:  # type: ignore[no-untyped-def]
    """Finding 6: a record Kafka appended after the produce timed out is a second copy.

    Kafka (Tansu) is paused while a 3.1.1 publisher (clean session 0) sends a
    QoS 2 PUBLISH: the broker gives up after ``kafka_request_timeout_ms`` and
    closes the connection (3.1.1 has no failure code); Kafka, resumed, appends
    the record it was sent. The publisher re-sends its PUBLISH (DUP) on
    reconnect as MQTT requires and completes the flow: the subscriber must
    get the message once.
    """
    stack: Stack = stack_factory({"persistence.kafka_request_timeout_ms": 1000})
    assert stack.tansu_pid is not None
    topic = stack.topic(TOPIC)
    sub = RawSubscriber(stack.broker.address, stack.client("sub"), level=5)
    pub = RawPeer(stack.broker.address, stack.client("pub"), level=4)
    paused = False
    try:
        sub.connect(subscribe=[(topic, 2)])
        pub.connect(clean_start=False)
        _qos2(pub, Publish(topic, b"warm", 2, False, False, 1))  # the producer is connected
        freeze(stack.tansu_pid)
        paused = True
        message = Publish(topic, b"once", 2, False, False, 7)
        pub.send(message)
        answer = pub.recv(10)  # the broker gives up on Kafka: the connection closes
        assert answer is None, f"no acknowledgement while Kafka is stalled: {answer}"
        os.kill(stack.tansu_pid, signal.SIGCONT)
        paused = False
        pub.connect(clean_start=False)
        _qos2(pub, Publish(topic, b"once", 2, False, True, 7))  # the re-send MQTT requires
        marker = Publish(topic, b"marker", 2, False, False, 8)
        _qos2(pub, marker)  # stored after anything of the first attempt: it comes last
        wait_until(lambda: b"marker" in sub.delivered_qos2, 10, "the marker")
        assert sub.delivered_qos2 == [b"warm", b"once", b"marker"], (
            f"QoS 2 delivered {sub.delivered_qos2}"
        )
    finally:
        if paused:
            os.kill(stack.tansu_pid, signal.SIGCONT)
        pub.close()
        sub.close()


# ---------------------------------------------------------------------------
# 7. smaller breaks
# ---------------------------------------------------------------------------


def test_retained_message_is_acknowledged_only_once_stored(stack: Stack) -> None:
    """Finding 7a: a retained PUBLISH is PUBACKed before its Redis write.

    Redis is down when a retained QoS 1 message is published. A PUBACK with
    success promises it is kept: after the broker is killed and everything
    restarts, a new subscriber must get it.
    """
    topic = stack.topic(TOPIC)
    pub = RawPeer(stack.broker.address, stack.client("pub"), level=5)
    try:
        pub.connect()
        stack.redis.stop()
        pub.send(Publish(topic, b"kept", 1, True, False, 1))
        ack = pub.recv(3)
        if ack is None:  # held until stored: let Redis back and take the answer
            stack.redis.start()
            ack = pub.recv(15)
        assert isinstance(ack, PubAck), ack
        if ack.reason_code >= 0x80:
            return  # refused: nothing was promised
        stack.broker.kill()
        if not stack.redis.alive():
            stack.redis.start()
        stack.broker.start()
        sub = RawPeer(stack.broker.address, stack.client("sub"), level=5)
        try:
            sub.connect()
            sub.send(Subscribe(1, [Subscription(topic, qos=1)]))
            assert isinstance(sub.recv(5), SubAck)
            retained = sub.recv(5)
            assert isinstance(retained, Publish) and retained.payload == b"kept", (
                f"the retained message acknowledged with {ack.reason_code:#x} is gone: {retained}"
            )
        finally:
            sub.close()
    finally:
        pub.close()


def test_v311_publisher_is_bounded_while_kafka_stalls(stack_factory) -> None:  # type: ignore[no-untyped-def]
    """Finding 7b: a 3.1.1 publisher has no Receive Maximum; the broker takes all.

    With Kafka paused no QoS 1 PUBLISH can be acknowledged; a 3.1.1 client
    sending 1,000 of them must not get them all taken in (read and queued in
    memory): the broker should stop at about ``mqtt.receive_maximum`` in
    flight, as it does for MQTT 5 clients.
    """
    settings = _metrics_settings(**{"mqtt.receive_maximum": 20})
    stack: Stack = stack_factory(settings)
    port = int(settings["metrics.port"])  # type: ignore[call-overload]
    assert stack.tansu_pid is not None
    topic = stack.topic(TOPIC)
    sub = RawSubscriber(stack.broker.address, stack.client("sub"), level=4)
    pub = RawPeer(stack.broker.address, stack.client("pub"), level=4)
    paused = False
    received = 'devicemq_messages_received_total{qos="1"}'
    try:
        sub.connect(subscribe=[(topic, 1)])
        sub.close()  # persistent and away: every message goes to Kafka
        pub.connect()
        before = _metrics(port).get(received, 0.0)
        freeze(stack.tansu_pid)
        paused = True
        assert pub.sock is not None
        pub.sock.setblocking(False)
        data = b"".join(
            encode(Publish(topic, b"x" * 100, 1, False, False, i), 4) for i in range(1, 1001)
        )
        with contextlib.suppress(BlockingIOError, OSError):
            pub.sock.send(data)
        time.sleep(2.0)  # Kafka cannot answer before the 10 s produce timeout
        taken = _metrics(port).get(received, 0.0) - before
        assert taken <= 2 * 20, f"the broker took in {taken:.0f} unacknowledged QoS 1 PUBLISHes"
    finally:
        if paused:
            os.kill(stack.tansu_pid, signal.SIGCONT)
        pub.close()
        sub.close()


# ---------------------------------------------------------------------------
# 8. A session ended by clean start or by its connection stays ended
# ---------------------------------------------------------------------------


def test_clean_session_connack_waits_until_the_old_session_is_gone(stack: Stack) -> None:
    """Finding 8: a 3.1.1 clean session replacing a stored one was CONNACKed while
    the old session's delete still waited for Redis; a broker crash then restored
    the old session, and the client's next resume found it present.

    Redis holds writes (``CLIENT PAUSE WRITE``): no CONNACK may come while the
    delete waits. Once writes resume the CONNACK comes, and after a SIGKILL and
    a restart the old session is gone.
    """
    topic = stack.topic(TOPIC)
    peer = RawPeer(stack.broker.address, stack.client("sub"), level=4)
    rds = redis.Redis(port=stack.redis.port)
    paused = False
    try:
        peer.connect(clean_start=False)
        peer.send(Subscribe(1, [Subscription(topic, qos=1)]))
        assert isinstance(peer.recv(5), SubAck)
        peer.close()
        rds.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")  # type: ignore[no-untyped-call]
        paused = True
        peer.sock = socket.create_connection(stack.broker.address, timeout=5)
        peer.send(Connect(peer.client_id, protocol_level=4, clean_start=True, keep_alive=0))
        early = peer.recv(1.5)
        assert early is None, f"CONNACK while the old session's delete waited in Redis: {early}"
        rds.execute_command("CLIENT", "UNPAUSE")  # type: ignore[no-untyped-call]
        paused = False
        connack = peer.recv(15)
        assert isinstance(connack, ConnAck) and connack.reason_code == 0, connack
        assert not connack.session_present
        stack.broker.kill()
        stack.broker.start()
        resumed = peer.connect(clean_start=False)
        assert not resumed.session_present, "the session discarded by clean session came back"
    finally:
        if paused:
            rds.execute_command("CLIENT", "UNPAUSE")  # type: ignore[no-untyped-call]
        rds.close()
        peer.close()


def test_session_resumed_with_expiry_0_ends_with_a_crash(stack: Stack) -> None:
    """Finding 9: a session resumed with Session Expiry Interval 0 ends when its
    connection closes; a crash closes it without the end being written, and the
    restarted broker restored it, due to expire at its first sweep 0.5 s later.

    The client resumes as soon as the broker listens again: the session must
    not be present. (On the old code this fails because the reconnect beats
    the first sweep by about 0.5 s; the fixed restore ends such a session
    before the broker listens.)
    """
    topic = stack.topic(TOPIC)
    peer = RawPeer(stack.broker.address, stack.client("sub"), level=5)
    try:
        peer.connect(clean_start=False, expiry=600)
        peer.send(Subscribe(1, [Subscription(topic, qos=1)]))
        assert isinstance(peer.recv(5), SubAck)
        peer.close()
        assert peer.connect(clean_start=False).session_present  # expiry 0 from now on
        peer.send(Subscribe(2, [Subscription(topic + "/more", qos=1)]))
        assert isinstance(peer.recv(5), SubAck)  # the session's new terms are saved
        stack.broker.kill()
        stack.broker.start()
        resumed = peer.connect(clean_start=False, expiry=600)
        assert not resumed.session_present, "a session with expiry 0 outlived its connection"
    finally:
        peer.close()
