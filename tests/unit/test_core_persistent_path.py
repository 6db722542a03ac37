"""Acknowledging the publisher only once the persistent path has stored the message.

docs/ARCHITECTURE.md (hop 7, and the first invariant): for persistent
subscribers the PUBACK/PUBREC is sent only after storage; acknowledgements
still leave in the order the PUBLISH packets arrived (MQTT-4.6.0-2). These
tests drive a persistent path whose storage completes when the test says so.
"""

from __future__ import annotations

from broker.packets import (
    ConnAck,
    Connect,
    Disconnect,
    Properties,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    ReasonCode,
    SubAck,
    Subscribe,
    Subscription,
)
from broker.persistent_path import DoneCallback, InMemoryPersistentPath
from broker.session import Session
from tests.unit.core_harness import V5, V311, Client, DeferredPersistentPath, Harness, payloads


def _setup(**mqtt: object) -> tuple[Harness, DeferredPersistentPath]:
    path = DeferredPersistentPath()
    h = Harness(persistent_path=path, **mqtt)
    durable = h.connected("durable", session_expiry_interval=3600)
    durable.subscribe("t", qos=2)
    return h, path


def test_puback_only_after_stored() -> None:
    h, path = _setup()
    pub = h.connected("pub")
    pub.publish("t", b"m", qos=1, packet_id=1)
    assert pub.read() == []
    assert len(path.pending) == 1
    path.complete()
    assert pub.read() == [PubAck(1)]


def test_persistent_subscriber_gets_message_after_storage_others_at_once() -> None:
    path = DeferredPersistentPath()
    h = Harness(persistent_path=path)
    durable = h.connected("durable", session_expiry_interval=3600)
    durable.subscribe("t", qos=1)
    volatile = h.connected("volatile")
    volatile.subscribe("t", qos=1)
    pub = h.connected("pub")
    pub.publish("t", b"m", qos=1, packet_id=1)
    assert payloads(volatile.read()) == [b"m"]
    assert durable.read() == []
    assert pub.read() == []
    path.complete()
    assert payloads(durable.read()) == [b"m"]
    assert pub.read() == [PubAck(1)]


def test_acks_leave_in_publish_order_when_storage_completes_out_of_order() -> None:
    """MQTT-4.6.0-2: PUBACKs in the order the PUBLISH packets were received."""
    h, path = _setup()
    pub = h.connected("pub")
    pub.publish("t", b"1", qos=1, packet_id=1)
    pub.publish("t", b"2", qos=2, packet_id=2)
    pub.publish("t", b"3", qos=1, packet_id=3)
    path.complete(2)
    path.complete(1)
    assert pub.read() == []
    path.complete(0)
    assert pub.read() == [PubAck(1), PubRec(2), PubAck(3)]


def test_storage_failure_v5_acks_with_0x80() -> None:
    h, path = _setup()
    pub = h.connected("pub")
    pub.publish("t", b"1", qos=1, packet_id=1)
    pub.publish("t", b"2", qos=2, packet_id=2)
    path.complete(0, ok=False)
    path.complete(0, ok=False)
    assert pub.read() == [
        PubAck(1, ReasonCode.UNSPECIFIED_ERROR),
        PubRec(2, ReasonCode.UNSPECIFIED_ERROR),
    ]
    # The QoS 2 id was released: a re-send is a new message, routed afresh.
    pub.publish("t", b"2", qos=2, packet_id=2)
    assert len(path.pending) == 1


def test_storage_failure_v311_closes_without_ack() -> None:
    """3.1.1 has no failure code: the connection closes and the client resends."""
    h, path = _setup()
    pub = h.connected("pub", V311)
    pub.publish("t", b"1", qos=1, packet_id=1)
    path.complete(0, ok=False)
    assert pub.read() == []
    assert pub.closed


def test_qos2_resent_while_storing_gets_one_pubrec_and_one_routing() -> None:
    """MQTT-4.3.3-10: not routed twice; the PUBREC follows the storage."""
    h, path = _setup()
    pub = h.connected("pub")
    pub.publish("t", b"m", qos=2, packet_id=4)
    pub.send(Publish("t", b"m", 2, False, True, 4))
    assert pub.read() == []
    assert len(path.pending) == 1
    path.complete()
    assert pub.read() == [PubRec(4)]
    pub.send(PubRel(4))
    assert pub.read() == [PubComp(4)]


def test_qos2_resent_on_new_connection_while_storing_gets_pubrec_there() -> None:
    h, path = _setup()
    pub = h.connected("pub", session_expiry_interval=60)
    pub.publish("t", b"m", qos=2, packet_id=4)
    pub.conn.connection_lost()
    back = h.client()
    assert back.connect("pub", clean_start=False, session_expiry_interval=60).session_present
    back.send(Publish("t", b"m", 2, False, True, 4))
    assert back.read() == []
    path.complete()
    assert back.read() == [PubRec(4)]
    assert pub.read() == []
    assert len(path.pending) == 0
    back.send(PubRel(4))
    assert back.read() == [PubComp(4)]


def test_unstored_publishes_count_against_receive_maximum() -> None:
    h, _ = _setup(receive_maximum=2)
    pub = h.connected("pub")
    pub.publish("t", qos=1, packet_id=1)
    pub.publish("t", qos=1, packet_id=2)
    pub.publish("t", qos=1, packet_id=3)
    assert pub.read() == [Disconnect(ReasonCode.RECEIVE_MAXIMUM_EXCEEDED)]


def test_storage_completing_after_publisher_left_sends_nothing() -> None:
    h, path = _setup()
    pub = h.connected("pub")
    pub.publish("t", qos=1, packet_id=1)
    pub.conn.connection_lost()
    path.complete()
    assert pub.read() == []


def test_qos0_to_persistent_subscriber_bypasses_storage() -> None:
    path = DeferredPersistentPath()
    h = Harness(persistent_path=path)
    durable = h.connected("durable", V5, session_expiry_interval=3600)
    durable.subscribe("t", qos=0)
    pub = h.connected("pub")
    pub.publish_acked("t", b"m", qos=1)
    assert payloads(durable.read()) == [b"m"]
    assert path.pending == []


def test_qos2_storage_failure_after_resend_on_new_connection_is_answered_there() -> None:
    """A v5 client resending on a new connection waits for PUBREC: when storage
    fails it must get PUBREC 0x80 there (spec 4.3.3), not silence that keeps its
    packet id in use forever."""
    h, path = _setup()
    pub = h.connected("pub", session_expiry_interval=60)
    pub.publish("t", b"m", qos=2, packet_id=4)
    pub.conn.connection_lost()
    back = h.client()
    back.connect("pub", clean_start=False, session_expiry_interval=60)
    back.send(Publish("t", b"m", 2, False, True, 4))
    path.complete(0, ok=False)
    assert back.read() == [PubRec(4, ReasonCode.UNSPECIFIED_ERROR)]


def test_qos2_storage_failure_after_resend_on_new_v311_connection_closes_it() -> None:
    h, path = _setup()
    pub = h.connected("pub", V311, clean_start=False)
    pub.publish("t", b"m", qos=2, packet_id=4)
    pub.conn.connection_lost()
    back = h.client(V311)
    back.connect("pub", clean_start=False)
    back.send(Publish("t", b"m", 2, False, True, 4))
    path.complete(0, ok=False)
    assert back.read() == []
    assert back.closed


def test_a_publisher_owed_receive_maximum_acks_is_not_read_until_they_go_out() -> None:
    """Finding 7 of the persistent path: a 3.1.1 publisher (no Receive Maximum of its
    own) could queue publishes into a slow Kafka without bound. At the broker's
    Receive Maximum owed acknowledgements the edge stops reading it; at half, again."""
    h, path = _setup(receive_maximum=10)
    pub = h.client(V311)
    pub.connect("pub")
    for i in range(1, 10):
        pub.publish("t", b"m", qos=1, packet_id=i)
    assert pub.reading == []
    pub.publish("t", b"m", qos=1, packet_id=10)
    assert pub.reading == [False]
    for _ in range(4):
        path.complete()
    assert pub.reading == [False]  # 6 still owed
    path.complete()
    assert pub.reading == [False, True]
    assert [a.packet_id for a in pub.read()] == [1, 2, 3, 4, 5]  # type: ignore[attr-defined]
    assert h.broker.stats.input_pauses == 1


def _qos2_publisher_times_out(h: Harness, path: DeferredPersistentPath) -> tuple[object, object]:
    pub = h.client(V311)
    pub.connect("pub", clean_start=False)
    pub.publish("t", b"once", qos=2, packet_id=7)
    path.complete(0, ok=False, settled=None)  # the store timed out: outcome unknown
    assert pub.closed  # 3.1.1 has no failure code: the client will re-send
    again = h.client(V311)
    again.connect("pub", clean_start=False)
    again.send(Publish("t", b"once", 2, False, True, 7))  # the re-send MQTT requires
    return pub, again


def test_a_311_qos2_resend_after_a_timeout_waits_for_the_first_ones_outcome() -> None:
    """Finding 6 of the persistent path: a produce request that timed out after Kafka
    appended it, then the publisher's re-send routed again: QoS 2 delivered twice.
    The re-send now waits for the first attempt's real outcome: stored after all, it
    gets PUBREC and is not routed again."""
    h, path = _setup()
    _pub, again = _qos2_publisher_times_out(h, path)
    assert again.read() == [] and path.pending == []  # not routed again, no answer yet
    path.settle(0, ok=True)
    assert again.read() == [PubRec(7)]
    again.send(PubRel(7))
    assert again.read() == [PubComp(7)]
    assert path.pending == []


def test_a_311_qos2_resend_is_asked_again_when_the_first_was_not_stored() -> None:
    h, path = _setup()
    _pub, again = _qos2_publisher_times_out(h, path)
    path.settle(0, ok=False)
    assert again.closed  # re-sends once more, now routed afresh
    last = h.client(V311)
    last.connect("pub", clean_start=False)
    last.send(Publish("t", b"once", 2, False, True, 7))
    assert len(path.pending) == 1


def _nothing(ok: bool) -> None:
    """Nobody waits."""


class HeldSaves(InMemoryPersistentPath):
    """Session saves complete only when the test says so."""

    def __init__(self) -> None:
        self.saves: list[tuple[int, DoneCallback]] = []  # (expiry saved, callback)

    def save_session(self, session: Session, on_saved: DoneCallback = _nothing) -> None:
        self.saves.append((session.expiry_interval, on_saved))


def _connect(client: Client, client_id: str, expiry: int) -> None:
    client.send(
        Connect(
            client_id,
            protocol_level=V5,
            clean_start=False,
            properties=Properties(session_expiry_interval=expiry),
        )
    )


def test_connack_waits_until_a_resumed_sessions_terms_are_saved() -> None:
    """Checker seed 144: a session resumed with Session Expiry 0 got CONNACK before
    its new expiry was saved; closed and crashed at once, the store still held
    expiry 600 and the restarted broker brought the session back. The terms of
    every CONNECT of a durable session are saved before CONNACK."""
    path = HeldSaves()
    h = Harness(persistent_path=path)
    c = h.client(V5, "d")
    _connect(c, "d", 600)
    assert c.read() == [] and [e for e, _ in path.saves] == [600]
    path.saves.pop()[1](True)
    assert isinstance(c.read_one(), ConnAck)
    c.send(Disconnect())
    path.saves.clear()  # the disconnected state's save

    again = h.client(V5, "d2")
    _connect(again, "d", 0)  # resumed from memory, its expiry now 0
    assert again.read() == [], "CONNACK before the new expiry was saved"
    assert [e for e, _ in path.saves] == [0]
    path.saves.pop()[1](True)
    connack = again.read_one()
    assert isinstance(connack, ConnAck) and connack.session_present


def test_a_connect_whose_terms_cannot_be_saved_is_refused_with_0x88() -> None:
    path = HeldSaves()
    h = Harness(persistent_path=path)
    c = h.client(V5, "d")
    _connect(c, "d", 600)
    path.saves.pop()[1](False)
    connack = c.read_one()
    assert isinstance(connack, ConnAck)
    assert connack.reason_code == ReasonCode.SERVER_UNAVAILABLE
    assert c.closed


def test_nothing_is_sent_before_the_connack_of_a_resume_waiting_for_its_save() -> None:
    """Checker seeds 107, 110, 114, 139, 145 (the 60-minute run): while a resume's
    CONNACK waited for its session to be saved, a message for the session went
    out on the new connection first; the client, expecting CONNACK, gave up on
    the connection (MQTT-3.2.0-1: the server's first packet is CONNACK)."""
    path = HeldSaves()
    h = Harness(persistent_path=path)
    c = h.client(V5, "d")
    _connect(c, "d", 600)
    path.saves.pop()[1](True)
    assert isinstance(c.read_one(), ConnAck)
    c.send(Subscribe(1, [Subscription("t", qos=1)]))
    for _, done in path.saves:  # SUBACK waits for the subscription to be saved
        done(True)
    assert isinstance(c.read_one(), SubAck)
    c.send(Disconnect())
    path.saves.clear()
    pub = h.connected("pub")
    pub.publish("t", b"while away", qos=1, packet_id=1)

    again = h.client(V5, "d2")
    _connect(again, "d", 600)
    pub.publish("t", b"while the CONNACK waits", qos=1, packet_id=2)
    assert again.read() == [], "a packet before CONNACK"
    path.saves.pop()[1](True)
    packets = again.read()
    assert isinstance(packets[0], ConnAck) and packets[0].session_present
    assert payloads(packets[1:]) == [b"while away", b"while the CONNACK waits"]
