"""broker/retained.py: the topic tree of retained messages, its limits, and sending
them on SUBSCRIBE a chunk per event-loop iteration (issue 19, finding 2)."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from broker.message import Message
from broker.packets import Publish, Subscribe, Subscription
from broker.retained import CHUNK, RetainedStore, retained_size
from broker.topics import is_valid_topic_filter, is_valid_topic_name, topic_matches
from tests.unit.core_harness import Harness, payloads

# ------------------------------------------------------------------ the tree

LEVEL = st.sampled_from(["a", "b", "", "$x", "c"])
TOPIC = st.lists(LEVEL, min_size=1, max_size=4).map("/".join).filter(is_valid_topic_name)
FILTER_LEVEL = st.sampled_from(["a", "b", "", "$x", "+"])


@st.composite
def filters(draw: st.DrawFn) -> str:
    levels = draw(st.lists(FILTER_LEVEL, min_size=1, max_size=4))
    if draw(st.booleans()):
        levels.append("#")
    topic_filter = "/".join(levels)
    assume(is_valid_topic_filter(topic_filter))
    return topic_filter


@settings(max_examples=300, deadline=None)
@given(st.lists(TOPIC, max_size=30), st.lists(TOPIC, max_size=10), filters())
def test_walk_matches_exactly_what_topic_matches_does(
    topics: list[str], deleted: list[str], topic_filter: str
) -> None:
    store = RetainedStore()
    for t in topics:
        store.store(Message(t, b"p", 0, True))
    for t in deleted:
        store.store(Message(t, b"", 0, True))
    expected = {t for t in set(topics) - set(deleted) if topic_matches(topic_filter, t)}
    got = [m.topic for m in store.matching(topic_filter, 0.0)]
    assert sorted(got) == sorted(expected)
    assert len(got) == len(set(got))
    assert len(store) == len(set(topics) - set(deleted))


def test_deleting_prunes_the_tree_and_expired_messages_go_on_the_way() -> None:
    store = RetainedStore()
    store.store(Message("a/b/c", b"1", 0, True))
    store.store(Message("a/b", b"2", 0, True, expires_at=5.0))
    store.store(Message("a/b/c", b"", 0, True))
    assert store._root.children["a"].children["b"].children == {}
    assert [m.payload for m in store.matching("a/#", 1.0)] == [b"2"]
    assert store.matching("a/#", 6.0) == [] and len(store) == 0
    assert store._root.children == {} and store.bytes == 0


def test_walk_ticks_while_it_searches() -> None:
    """A filter matching nothing under many nodes still yields control (None)."""
    store = RetainedStore()
    for i in range(1000):
        store.store(Message(f"bob/{i}/status", b"x", 0, True))
    steps = list(store.walk("bob/+/none", 0.0))
    assert steps and all(step is None for step in steps)
    assert len(steps) >= 1000 // 64


def test_walk_survives_changes_between_steps() -> None:
    store = RetainedStore()
    for i in range(300):
        store.store(Message(f"t/{i}", b"x", 0, True))
    walk = store.walk("t/#", 0.0)
    first = [m for m in (next(walk) for _ in range(50)) if m is not None]
    for i in range(300):
        store.store(Message(f"t/{i}", b"", 0, True))  # all deleted mid-walk
    rest = [m for m in walk if m is not None]
    assert len(first) > 0 and rest == []


# ------------------------------------------------------------------ limits


def message(topic: str, payload: bytes = b"x", origin: str | None = "c1") -> Message:
    return Message(topic, payload, 0, True, origin=origin)


def test_limits_per_client_and_per_broker() -> None:
    store = RetainedStore(
        max_messages=4, max_bytes=100, max_messages_per_client=2, max_bytes_per_client=50
    )
    for t in ("a", "b"):
        assert store.over_limit(message(t)) is None
        store.store(message(t))
    assert store.over_limit(message("c")) == "retained_client_limit"
    assert store.over_limit(message("a", b"replaced")) is None  # no new message
    assert store.over_limit(message("a", b"")) is None  # a deletion always may
    assert store.over_limit(message("a", b"y" * 49)) == "retained_client_limit"  # bytes
    assert store.used_by("c1") == (2, 4)
    # Another client taking over c1's topic: counted for the new owner.
    store.store(message("a", b"mine", origin="c2"))
    assert store.used_by("c1") == (1, 2) and store.used_by("c2") == (1, 5)
    store.store(message("c", origin="c3"))
    store.store(message("d", origin="c3"))
    assert store.over_limit(message("e", origin="c4")) == "retained_limit"  # 4 of 4
    assert store.over_limit(message("e", b"z" * 200, origin=None)) == "retained_limit"
    store.replace("z", message("z", origin="c9"))  # loaded: counted, never refused
    assert len(store) == 5 and store.bytes == sum(
        retained_size(m) for m in store._by_topic.values()
    )


def test_retained_limit_refuses_the_publish() -> None:
    h = Harness(max_retained_messages_per_client=1)
    watcher = h.connected("w")
    watcher.subscribe("#")
    pub = h.connected("pub")
    assert pub.publish_acked("t/1", qos=1, retain=True) == 0
    assert pub.publish_acked("t/2", qos=1, retain=True) == 0x97
    pub.publish("t/3", retain=True)  # QoS 0: dropped, counted
    old = h.connected("old", level=4)
    old.publish("o/1", retain=True, qos=1, packet_id=1)
    old.publish("o/2", retain=True, qos=1, packet_id=2)
    assert [p.packet_id for p in old.read()] == [1, 2]  # type: ignore[attr-defined]
    assert [p.topic for p in watcher.read()] == ["t/1", "o/1"]  # type: ignore[attr-defined]
    assert h.broker.stats.dropped["retained_client_limit"] == 3
    assert sorted(h.broker.retained.topics()) == ["o/1", "t/1"]


# ------------------------------------------------------------------ sending on SUBSCRIBE


class Loop:
    """A stand-in for loop.call_soon: callbacks run when the test says."""

    def __init__(self) -> None:
        self.ready: list[Callable[[], None]] = []

    def call_soon(self, callback: Callable[[], None]) -> None:
        self.ready.append(callback)

    def run_once(self) -> int:
        ready, self.ready = self.ready, []
        for callback in ready:
            callback()
        return len(ready)


def retained_harness(count: int, **mqtt: object) -> tuple[Harness, Loop]:
    h = Harness(max_retained_messages_per_client=0, **mqtt)
    pub = h.connected("pub")
    for i in range(count):
        pub.publish(f"r/{i}", b"%d" % i, retain=True)
    loop = Loop()
    h.broker.call_soon = loop.call_soon
    return h, loop


def test_retained_go_a_chunk_per_loop_iteration() -> None:
    h, loop = retained_harness(1000)
    sub = h.connected("sub")
    assert sub.subscribe("r/#") == [0]
    assert sub.pending == []  # nothing sent within the SUBSCRIBE's own iteration
    got = []
    iterations = 0
    while loop.run_once():
        iterations += 1
        batch = sub.read()
        assert len(batch) <= CHUNK
        got += batch
    assert len(got) == 1000 and iterations >= 1000 // CHUNK
    assert sorted(payloads(got)) == sorted(b"%d" % i for i in range(1000))


def test_retained_wait_while_the_connection_is_congested() -> None:
    h, loop = retained_harness(600)
    sub = h.connected("sub")
    sub.subscribe("r/#")
    loop.run_once()
    first = sub.read()
    sub.conn.congested = True  # the socket buffer passed its high-water mark
    assert loop.run_once() == 1 and sub.read() == []
    assert loop.run_once() == 0  # and nothing is scheduled until it drains
    sub.conn.congested = False
    h.broker.resume_retained(sub.conn.session)  # type: ignore[arg-type]
    while loop.run_once():
        pass
    assert len(first) + len(sub.read()) == 600


def test_retained_wait_for_room_in_the_session_queue() -> None:
    """QoS 1 retained messages to a client that does not ack fill its window, then its
    queue: the sender stops at half the queue (mqtt.max_queued_messages) instead
    of dropping the rest, and goes on as PUBACKs come."""
    h, loop = retained_harness(0, max_inflight=4, max_queued_messages=20)
    pub = h.connected("pub")
    for i in range(100):
        pub.publish_acked(f"q/{i}", b"%d" % i, qos=1, retain=True)
    sub = h.connected("sub")
    sub.subscribe("q/#", qos=1)
    while loop.run_once():
        pass
    first = sub.read()
    assert len(first) == 4  # the window
    assert "queue_full" not in h.broker.stats.dropped
    got, unacked = list(first), list(first)
    while len(got) < 100:
        for packet in unacked:
            sub.ack(packet)  # each PUBACK opens the window and resumes the sender
        while loop.run_once():
            pass
        unacked = sub.read()
        assert unacked, f"stalled after {len(got)}"
        got += unacked
    assert "queue_full" not in h.broker.stats.dropped
    assert sorted(payloads(got)) == sorted(b"%d" % i for i in range(100))


def test_live_message_supersedes_a_retained_one_still_to_come() -> None:
    h, loop = retained_harness(600)
    sub = h.connected("sub")
    sub.subscribe("r/#")
    h.connected("live").publish("r/599", b"new")  # not retained: the store keeps "599"
    assert payloads(sub.read()) == [b"new"]
    while loop.run_once():
        pass
    rest = payloads(sub.read())
    assert len(rest) == 599 and b"599" not in rest  # the old one is not sent after it


def test_session_end_stops_the_sending() -> None:
    h, loop = retained_harness(600)
    sub = h.connected("sub")
    sub.subscribe("r/#")
    loop.run_once()
    sub.conn.connection_lost()
    assert "sub" not in h.broker.sessions
    while loop.run_once():
        pass


def test_a_filter_repeated_in_one_subscribe_is_sent_once() -> None:
    """Issue 19: ``bob/+/none`` 40 times in one SUBSCRIBE scanned every retained
    message 40 times. The SUBACK still answers each of them."""
    h, _ = retained_harness(10)
    h.broker.call_soon = None
    sub = h.connected("sub")
    sub.send(Subscribe(1, [Subscription("r/+", 0)] * 40 + [Subscription("r/1", 1)]))
    packets = sub.read()
    assert packets[0].reason_codes == [0] * 40 + [1]  # type: ignore[attr-defined]
    published = [p for p in packets[1:] if isinstance(p, Publish)]
    assert sorted(p.topic for p in published) == sorted([f"r/{i}" for i in range(10)] + ["r/1"])


def test_a_sender_with_nothing_left_is_dropped_and_a_new_subscribe_makes_another() -> None:
    """Once its retained messages are all sent the session keeps no sender (a live
    delivery then asks nothing of it); the next SUBSCRIBE gets its own, which a
    live message supersedes as before."""
    h, loop = retained_harness(600)
    sub = h.connected("sub")
    session = h.broker.sessions["sub"]
    sub.subscribe("r/7")
    while loop.run_once():
        pass
    assert payloads(sub.read()) == [b"7"]
    assert session.retained_sender is None
    h.connected("live").publish("r/7", b"live")  # delivered, no sender asked
    assert payloads(sub.read()) == [b"live"]
    sub.subscribe("r/#")
    assert session.retained_sender is not None
    h.connected("live2").publish("r/599", b"new")
    assert payloads(sub.read()) == [b"new"]
    while loop.run_once():
        pass
    rest = payloads(sub.read())
    assert len(rest) == 599 and b"599" not in rest
    assert session.retained_sender is None
