"""The checker's own rules, driven by hand with a fake clock (no broker).

A rule that excuses too little reports a broker bug that is not one (seed 216 of
the 60-minute run); a rule that excuses too much hides real losses. Each case
here pins one rule with the smallest history that exercises it.
"""

from __future__ import annotations

from tests.model.clients import Subscriber
from tests.model.model import Config, Model


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float = 0.01) -> None:
        self.now += seconds


def _crowd(model: Model, clock: Clock, count: int) -> list[bytes]:
    """s1 (persistent, max_inflight 4 in flight, never acking) is sent ``count``
    QoS 1 messages through a shared group, all acknowledged to the publisher."""
    model.add_client("s1", 5, paho=False)
    model.add_client("p1", 5, paho=False)
    model.connect_sent("s1", clean_start=False, expiry=600)
    conn = model.connack("s1", session_present=False)
    clock.tick()
    subs = model.subscribe_sent("s1", [("$share/g1/m/+", 1, 1)])
    model.suback(subs, [1])
    clock.tick()
    payloads = []
    for seq in range(1, count + 1):
        payload = f"r:p1:{seq}".encode()
        msg = model.publish_sent("p1", seq, 1, payload, "m/a", 1, None, 0)
        payloads.append(payload)
        clock.tick(0.001)
        model.publish_answered(msg, ok=True)
    clock.tick()
    for pid, payload in enumerate(payloads[:4], start=1):  # the broker's window
        model.received("s1", conn, pid, payload, 1, False, (1,), None, False)
    clock.tick()
    model.connection_closed("s1", conn)
    return payloads


def _lost_names(model: Model, clock: Clock) -> set[str]:
    clock.tick(30)
    return {ob.msg.name() for ob in model.check_losses(clock.now)}


def _lost_after_resume(count: int, expiry: int, application: bool = False) -> set[str]:
    """``count`` messages crowd s1 (limit 15, 4 in flight); it resumes with ``expiry``.
    ``application``: s1's session is an APPLICATION one."""
    clock = Clock()
    apps = frozenset({"s1"} if application else ())
    model = Model(
        Config(limit=15, max_inflight=4, default_ttl=None, cluster=False, application=apps),
        clock,
    )
    _crowd(model, clock, count)
    model.connect_sent("s1", clean_start=False, expiry=expiry)
    model.connack("s1", session_present=True)
    return _lost_names(model, clock)


def test_trim_excuses_the_oldest_beyond_the_limit() -> None:
    # 20 stored, 15 kept: 1-4 in flight stay, the 5 oldest after them may be gone
    # (the rule is coarse by one: 10 is excused too); 11-20 were never trimmed.
    assert _lost_after_resume(20, 600) == {f"r:p1:{n}" for n in range(11, 21)}


def test_trim_still_excuses_after_a_resume_with_expiry_0() -> None:
    """Seed 216: the messages were stored (and trimmed) while the session had an
    expiry; resuming it with expiry 0 does not make them owed beyond the limit."""
    assert _lost_after_resume(20, 0) == {f"r:p1:{n}" for n in range(11, 21)}


def test_an_application_session_is_never_excused_as_trimmed() -> None:
    """Its messages wait in its Kafka topic, bounded by retention, not by the limit
    (docs/application-sessions.md): 20 stored, 4 received, 16 lost."""
    assert _lost_after_resume(20, 600, application=True) == {f"r:p1:{n}" for n in range(5, 21)}


def _restart_then_publish(connect_between: bool) -> set[str]:
    """s1 (APPLICATION, subscribed) got 1 of 3; Kafka restarts empty; it comes back
    (or not) and leaves; 2 more are published. The losses reported."""
    clock = Clock()
    config = Config(15, 4, None, cluster=False, application=frozenset({"s1"}))
    model = Model(config, clock)
    model.add_client("s1", 5, paho=False)
    model.add_client("p1", 5, paho=False)
    model.connect_sent("s1", clean_start=False, expiry=600)
    conn = model.connack("s1", session_present=False)
    model.suback(model.subscribe_sent("s1", [("m/a", 1, None)]), [1])
    clock.tick()

    def publish(seq: int) -> None:
        msg = model.publish_sent("p1", seq, 1, f"r:p1:{seq}".encode(), "m/a", 1, None, 0)
        clock.tick(0.01)
        model.publish_answered(msg, ok=True)

    for seq in (1, 2, 3):
        publish(seq)
    model.received("s1", conn, 1, b"r:p1:1", 1, False, (), None, False)
    model.connection_closed("s1", conn)
    clock.tick(1)
    model.fault("restart_kafka")
    clock.tick(1)
    if connect_between:
        model.connect_sent("s1", clean_start=False, expiry=600)
        model.connection_closed("s1", model.connack("s1", session_present=True))
    clock.tick(3)
    for seq in (4, 5):
        publish(seq)
    return _lost_names(model, clock)


def test_an_application_topic_lost_by_kafka_excuses_what_it_held_not_what_came_after() -> None:
    """2 and 3 were in the topic Kafka lost: excused. 4 and 5 came after the restart:
    owed, whether or not the session came back in between (finding 32: the broker
    makes the topic again before it sends to it)."""
    assert _restart_then_publish(connect_between=True) == {"r:p1:4", "r:p1:5"}
    assert _restart_then_publish(connect_between=False) == {"r:p1:4", "r:p1:5"}


def test_under_the_limit_nothing_is_excused() -> None:
    """The other side: 10 messages fit in a limit of 15, so the 6 never delivered
    are lost (the rule does not excuse everything)."""
    assert _lost_after_resume(10, 0) == {f"r:p1:{n}" for n in range(5, 11)}


def _left_then_resumed(failed_connect_first: bool) -> list[str]:
    """s0 (expiry 600, subscribed) leaves; optionally a resume with expiry 0 gets no
    CONNACK; then a resume finds no session. The violations' kinds."""
    clock = Clock()
    model = Model(Config(limit=15, max_inflight=4, default_ttl=None, cluster=False), clock)
    model.add_client("s0", 5, paho=True)
    model.connect_sent("s0", clean_start=False, expiry=600)
    conn = model.connack("s0", session_present=False)
    model.suback(model.subscribe_sent("s0", [("m/#", 1, None)]), [1])
    clock.tick()
    model.connection_closed("s0", conn)
    if failed_connect_first:
        model.connect_sent("s0", clean_start=False, expiry=0)
        model.connect_failed("s0")
        clock.tick()
    model.connect_sent("s0", clean_start=False, expiry=0)
    model.connack("s0", session_present=False)
    return [v.kind for v in model.violations]


def test_a_resume_with_expiry_0_that_got_no_connack_may_have_ended_the_session() -> None:
    """Seed 225: a CONNECT resuming with Session Expiry 0 reached the broker but its
    connection closed before the CONNACK; the close ended the session, and the
    next resume rightly found none."""
    assert _left_then_resumed(failed_connect_first=True) == []


def test_a_session_left_with_its_expiry_must_still_be_there() -> None:
    """The other side: without that failed CONNECT, present 0 is a lost session."""
    assert _left_then_resumed(failed_connect_first=False) == ["session-lost"]


def _one_owed(model: Model, clock: Clock, payload: bytes) -> None:
    msg = model.publish_sent("p1", int(payload.split(b":")[-1]), 1, payload, "m/a", 1, None, 0)
    clock.tick()
    model.publish_answered(msg, ok=True)


def test_kafka_reusing_offsets_excuses_only_what_was_acknowledged_after_its_restart() -> None:
    """docs/guarantees.md: the embedded Kafka, restarted, can write over offsets it acknowledged.
    Only messages acknowledged after a Kafka restart are excused, and only when
    Tansu's log shows it happened."""
    model, clock = _owed_across_a_kafka_restart(cluster=False, subscribers=("s1",))
    model.kafka_reused_offsets = True
    lost = _lost_names(model, clock)
    assert model.stats.excused == {"kafka reused offsets": 1}
    assert lost == {"r:p1:1"}


def _group_copy_at_qos0(member_qos: int) -> set[str]:
    """Group g1: s0 subscribed with ``member_qos``, s3 with QoS 1. A QoS 1 message
    reaches s0 at QoS 0 before the publisher's PUBACK. What is reported lost."""
    clock = Clock()
    model = Model(Config(limit=100, max_inflight=4, default_ttl=None, cluster=False), clock)
    model.add_client("p1", 5, paho=False)
    conns = {}
    for cid, qos, sub_id in (("s0", member_qos, 2), ("s3", 1, 3)):
        model.add_client(cid, 5, paho=True)
        model.connect_sent(cid, clean_start=False, expiry=600)
        conns[cid] = model.connack(cid, session_present=False)
        model.suback(model.subscribe_sent(cid, [("$share/g1/m/+", qos, sub_id)]), [qos])
        clock.tick()
    msg = model.publish_sent("p1", 1, 1, b"r:p1:1", "m/a", 1, None, 0)
    clock.tick()
    model.received("s0", conns["s0"], None, b"r:p1:1", 0, False, (2,), None, False)
    model.publish_answered(msg, ok=True)
    return _lost_names(model, clock)


def test_a_shared_group_may_give_a_qos1_message_to_its_qos0_member() -> None:
    """Seed 340: round robin chose the member that subscribed with QoS 0; its QoS 0
    copy, received before the PUBACK, is the group's one delivery."""
    assert _group_copy_at_qos0(member_qos=0) == set()


def test_a_qos1_member_given_the_message_at_qos0_has_not_got_it() -> None:
    """The other side: a member granted QoS 1 that gets a QoS 0 copy was downgraded."""
    assert _group_copy_at_qos0(member_qos=1) == {"r:p1:1"}


def _present_after_close(cluster: bool, gap: float) -> list[str]:
    """s1 (Session Expiry 0) closes its connection and, ``gap`` s later, resumes; the
    CONNACK says session present."""
    clock = Clock()
    model = Model(Config(limit=15, max_inflight=4, default_ttl=None, cluster=cluster), clock)
    model.add_client("s1", 5, paho=False)
    model.connect_sent("s1", clean_start=False, expiry=0)
    conn = model.connack("s1", session_present=False)
    clock.tick()
    model.connection_closed("s1", conn)
    clock.tick(gap)
    model.connect_sent("s1", clean_start=False, expiry=0)
    clock.tick()
    model.connack("s1", session_present=True)
    return [v.kind for v in model.violations]


def test_with_replicas_a_takeover_right_after_a_close_may_resume_the_session() -> None:
    """Seed 1549: the replica of the closed connection had not seen it closed when
    another replica took the session over; a takeover resumes (MQTT-3.1.4-3)."""
    assert _present_after_close(cluster=True, gap=0.0) == []
    assert _present_after_close(cluster=True, gap=2.0) == ["session-present"]
    assert _present_after_close(cluster=False, gap=0.0) == ["session-present"]


def _acked_then_crowded(gap: float, restart: bool) -> set[str]:
    """Seed 7508's shape (limit 15, 4 in flight): s1 receives and acknowledges a1, a2;
    then b1..b4 fill its window unacknowledged and c1..c12 follow, ``gap`` s after
    the acknowledgements, a Redis restart in between if ``restart``. While the
    acknowledgements are not written, the store holds 6 messages marked sent, so 9 of
    the c's fit: c1..c3 may be trimmed, c4..c12 may not."""
    clock = Clock()
    model = Model(Config(limit=15, max_inflight=4, default_ttl=None, cluster=False), clock)
    model.add_client("s1", 5, paho=False)
    model.add_client("p1", 5, paho=False)
    model.connect_sent("s1", clean_start=False, expiry=600)
    conn = model.connack("s1", session_present=False)
    model.suback(model.subscribe_sent("s1", [("m/+", 1, None)]), [1])
    clock.tick()
    seq = 0

    def publish(name: str) -> bytes:
        nonlocal seq
        seq += 1
        payload = f"r:p1:{name}".encode()
        msg = model.publish_sent("p1", seq, 1, payload, "m/a", 1, None, 0)
        clock.tick(0.001)
        model.publish_answered(msg, ok=True)
        return payload

    for pid, name in enumerate(("a1", "a2"), start=1):
        copy = model.received("s1", conn, pid, publish(name), 1, False, (), None, False)
        model.final_ack(copy)
    clock.tick(gap * 0.4)
    if restart:
        model.fault("restart_redis")
    clock.tick(gap * 0.6)
    for pid, name in enumerate(("b1", "b2", "b3", "b4"), start=3):
        model.received("s1", conn, pid, publish(name), 1, False, (), None, False)
    for n in range(1, 13):
        publish(f"c{n}")
    clock.tick()
    model.connection_closed("s1", conn)
    model.connect_sent("s1", clean_start=False, expiry=600)
    model.connack("s1", session_present=True)
    return _lost_names(model, clock)


def test_trim_counts_older_messages_whose_acknowledgement_is_not_written_yet() -> None:
    """Seed 7508: the acknowledged a1, a2 still count as stored; before, the checker
    excused c1 and c2 alone and reported c3 and c4 lost."""
    assert _acked_then_crowded(0.1, restart=False) == {f"r:p1:c{n}" for n in range(5, 13)}


def test_a_redis_restart_delays_the_acknowledgement_writes() -> None:
    """Written within ACK_SLACK normally; across a Redis restart, after the writer's
    back-off (the c's follow 2 s later): excused only with the restart."""
    assert _acked_then_crowded(2.0, restart=True) == {f"r:p1:c{n}" for n in range(5, 13)}
    assert _acked_then_crowded(2.0, restart=False) == {f"r:p1:c{n}" for n in range(3, 13)}


def _group_write_twice(ambiguous: bool) -> list[str]:
    """Group g0 (durable, $queue): s1 joins; p2's QoS 1 write reaches s1 twice, the
    second time without DUP. ``ambiguous``: p2 may have sent it twice (paho sends
    an unanswered PUBLISH again after a reconnect). The violations reported."""
    clock = Clock()
    model = Model(Config(limit=100, max_inflight=4, default_ttl=None, cluster=False), clock)
    model.add_client("p2", 5, paho=True)
    model.add_client("s1", 5, paho=False)
    model.connect_sent("s1", clean_start=False, expiry=600)
    conn = model.connack("s1", session_present=False)
    model.groups.joining("s1", "g0")
    model.groups.joined("s1", "g0")
    clock.tick()
    msg = model.publish_sent("p2", 1, 1, b"r:p2:1", "gq/g0/w", 1, None, 0)
    msg.ambiguous = ambiguous
    clock.tick()
    for _ in range(2):
        model.groups.received("s1", conn, "gq/g0/w", b"r:p2:1", dup=False)
        clock.tick()
    return [v.kind for v in model.violations]


def test_a_group_write_its_publisher_sent_twice_may_arrive_twice_without_dup() -> None:
    """Finding 30: paho sent ten QoS 1 writes again after the Kafka path's deadline
    closed its connection; both publications reached the group. Two publications
    are two deliveries (MQTT-3.3.1-3), as the session model excuses already."""
    assert _group_write_twice(ambiguous=True) == []


def test_a_group_write_sent_once_and_delivered_twice_without_dup_is_a_violation() -> None:
    assert _group_write_twice(ambiguous=False) == ["group-dup"]


class _Receiver(Subscriber):
    """The clients' receiving bookkeeping with every acknowledgement taken as sent."""

    def _send_ack(self, pid: int, kind: str) -> bool:
        return True


def _member_of_g0(
    policy: str, cluster: bool, own: str | None = None
) -> tuple[Model, Clock, _Receiver]:
    """p1, and s1 connected (a durable session), subscribed to ``own`` at QoS 2 (if
    given) and a member of group g0, acknowledging by ``policy``."""
    clock = Clock()
    model = Model(Config(limit=100, max_inflight=16, default_ttl=None, cluster=cluster), clock)
    model.add_client("p1", 5, paho=False)
    s1 = _Receiver(model, "s1", 5, scheduler=None)  # type: ignore[arg-type]
    s1.set_policy(policy)
    model.connect_sent("s1", clean_start=False, expiry=600)
    s1.conn = model.connack("s1", session_present=False)
    s1.connected = True
    if own is not None:
        model.suback(model.subscribe_sent("s1", [(own, 2, 1)]), [2])
    model.groups.joining("s1", "g0")
    model.groups.joined("s1", "g0")
    clock.tick()
    return model, clock, s1


def _group_write_under_a_held_id(same_payload: bool) -> list[str]:
    """s1 holds its own QoS 2 message under id 36 (PUBREC'd, not completed); then a
    group write comes under 36 (or the held message again). The violations reported."""
    model, clock, s1 = _member_of_g0("hold_comp", cluster=False, own="m/a")
    own = model.publish_sent("p1", 1, 1, b"r:p1:1", "m/a", 2, None, 0)
    write = model.publish_sent("p1", 2, 1, b"r:p1:2", "gq/g0/w", 1, None, 0)
    for msg in (own, write):
        model.publish_answered(msg, ok=True)
    clock.tick()
    s1._on_publish(s1.conn, 36, b"r:p1:1", 2, False, (1,), None, "m/a")
    clock.tick()
    if same_payload:
        s1._on_publish(s1.conn, 36, b"r:p1:1", 2, True, (1,), None, "m/a")
    else:
        s1._on_publish(s1.conn, 36, b"r:p1:2", 1, False, (), None, "gq/g0/w")
    return [v.kind for v in model.violations]


def test_a_group_write_under_an_id_the_client_holds_for_another_message_is_id_reuse() -> None:
    """Finding 36: the client's bookkeeping used to replace the held message quietly
    (seed 9809 showed it later, as a QoS 2 message delivered twice)."""
    assert _group_write_under_a_held_id(same_payload=False) == ["id-reuse"]
    assert _group_write_under_a_held_id(same_payload=True) == []


def _id_of_a_group_write_given_again(killed: bool) -> Model:
    """s1, a member of g0 holding (policy hold) the group write r:p1:1 under id 3 on
    its connection; that connection ends, by a broker kill or not; on the next one
    the write r:p1:2 comes under id 3."""
    model, clock, s1 = _member_of_g0("hold", cluster=True)
    for seq in (1, 2):
        msg = model.publish_sent("p1", seq, 1, f"r:p1:{seq}".encode(), "gq/g0/w", 1, None, 0)
        model.publish_answered(msg, ok=True)
    clock.tick()
    s1._on_publish(s1.conn, 3, b"r:p1:1", 1, False, (), None, "gq/g0/w")
    if killed:
        model.fault("kill_broker")
    s1.connected = False
    clock.tick()
    model.connect_sent("s1", clean_start=False, expiry=600)
    s1.conn = model.connack("s1", session_present=True)
    s1.connected = True
    clock.tick()
    s1._on_publish(s1.conn, 3, b"r:p1:2", 1, False, (), None, "gq/g0/w")
    return model


def test_a_killed_brokers_group_write_id_given_again_is_id_reuse() -> None:
    """Finding 43: a group write is recorded with a member's session before it is
    sent, so a broker killed with it in flight leaves its id held: given again, it is
    id-reuse, as when the connection closed (the checker excused it before the fix)."""
    for killed in (True, False):
        model = _id_of_a_group_write_given_again(killed=killed)
        assert [v.kind for v in model.violations] == ["id-reuse"]
        assert model.stats.excused == {}


def _owed_across_a_kafka_restart(
    cluster: bool, subscribers: tuple[str, ...] = ("s1", "s6")
) -> tuple[Model, Clock]:
    """``subscribers`` on ``m/#`` (s1 in partition 9 of 12, s6 in 0); r:p1:1
    acknowledged before a Kafka restart, r:p1:2 after it; none received."""
    clock = Clock()
    model = Model(Config(limit=100, max_inflight=4, default_ttl=None, cluster=cluster), clock)
    model.add_client("p1", 5, paho=False)
    for cid in subscribers:
        model.add_client(cid, 5, paho=False)
        model.connect_sent(cid, clean_start=False, expiry=600)
        model.connack(cid, session_present=False)
        model.suback(model.subscribe_sent(cid, [("m/#", 1, None)]), [1])
    clock.tick()
    _one_owed(model, clock, b"r:p1:1")
    clock.tick()
    model.fault("restart_kafka")
    clock.tick()
    _one_owed(model, clock, b"r:p1:2")
    return model, clock


def test_a_topic_at_another_size_excuses_only_partitions_it_lost_on_replicas() -> None:
    """Finding 28 (38): replicas on a Tansu that forgot the topic and made it again at
    4 partitions. Only what was acknowledged after the restart, to a session whose
    records lie past partition 3, is excused; s6's partition 0 is still read."""
    model, clock = _owed_across_a_kafka_restart(cluster=True)
    model.kafka_topic_size = (4, 12)
    lost = {(ob.msg.name(), ob.incs[0].cid) for ob in model.check_losses(clock.now + 30)}
    assert model.stats.excused == {"kafka topic at another size (replicas)": 1}
    assert lost == {("r:p1:1", "s1"), ("r:p1:1", "s6"), ("r:p1:2", "s6")}


def test_a_single_broker_is_never_excused_for_a_topic_at_another_size() -> None:
    """A single broker makes its topic again at its size (finding 26): nothing excused."""
    model, clock = _owed_across_a_kafka_restart(cluster=False)
    model.kafka_topic_size = (4, 12)
    lost = {(ob.msg.name(), ob.incs[0].cid) for ob in model.check_losses(clock.now + 30)}
    assert model.stats.excused == {}
    assert len(lost) == 4
