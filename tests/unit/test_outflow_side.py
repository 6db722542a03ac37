"""A session's side feed, the queue its client consumes ($ECQ, broker/outflow.py).

Side messages get their packet identifiers from the outflow at first send; the
session's own durable feed brings identifiers stored with its messages. When
a stored identifier is held by a side message in flight, that message (and
every one after it) waits, in order, until the side message is acknowledged.
A resumed session re-sends side messages in flight with their identifiers
(MQTT-4.4.0-1), as it does the messages of its own feed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection

from broker.message import Delivery, Message
from broker.outflow import Outflow, Outgoing
from broker.packets import PubAck
from tests.unit.core_harness import payloads, publishes
from tests.unit.test_outflow import _setup


def _item(payload: bytes) -> Outgoing:
    return Outgoing(0, Delivery(Message("$ECQ/sub/k", payload, 1, False), 1, False), marked=True)


class SideFeed:
    """A queue-like side feed: messages without identifiers, no marks to wait for."""

    durable = True
    decline = None

    def __init__(self) -> None:
        self.consuming = True
        self.restoring = False
        self.outflow: Outflow | None = None
        self.queue: deque[Outgoing] = deque()
        self.finished_ids: list[int] = []
        self.restarts = 0

    def add(self, payload: bytes) -> None:
        self.queue.append(_item(payload))
        assert self.outflow is not None
        self.outflow.pump()

    def offer(self, delivery: Delivery) -> None:
        raise AssertionError("a side feed is fed by its store")

    def take(self, n: int) -> list[Outgoing]:
        items = []
        while self.queue and len(items) < n:
            items.append(self.queue.popleft())
        return items

    def mark(self, items: list[Outgoing], done: Callable[[Collection[int]], None]) -> None:
        done([item.packet_id for item in items])

    def release(self, item: Outgoing, done: Callable[[], None]) -> None:
        done()

    def finished(self, item: Outgoing) -> None:
        self.finished_ids.append(item.packet_id)

    def undeliverable(self, item: Outgoing) -> None:
        pass

    def sent(self, item: Outgoing, dup: bool) -> None:
        pass

    def restart(self) -> None:
        self.restarts += 1

    def discard(self) -> None:
        self.queue.clear()

    def queued(self) -> int:
        return len(self.queue)


def test_a_stored_message_whose_id_a_side_message_holds_waits_for_it_in_order() -> None:
    h, feed, sub, pub = _setup()
    side = SideFeed()
    h.broker.sessions["sub"].outflow.attach_side(side)
    side.add(b"queued")
    (first,) = publishes(sub.read())
    assert first.packet_id == 1 and first.payload == b"queued"
    pub.publish_acked("t", b"a", qos=1)  # stored with id 1: held by the side message
    pub.publish_acked("t", b"b", qos=1)  # id 2: free, but after "a"
    assert feed.marks == [] and sub.read() == []
    sub.send(PubAck(1))
    assert side.finished_ids == [1]
    feed.complete_mark()
    assert payloads(sub.read()) == [b"a", b"b"]


def test_side_messages_take_identifiers_no_message_in_flight_has() -> None:
    h, feed, sub, pub = _setup()
    pub.publish_acked("t", b"a", qos=1)
    feed.complete_mark()
    (stored,) = publishes(sub.read())
    side = SideFeed()
    h.broker.sessions["sub"].outflow.attach_side(side)
    side.add(b"q1")
    side.add(b"q2")
    got = publishes(sub.read())
    assert [p.payload for p in got] == [b"q1", b"q2"]
    assert stored.packet_id not in {p.packet_id for p in got}
    assert len({p.packet_id for p in got}) == 2


def test_a_resumed_session_resends_side_messages_with_their_ids_and_dup() -> None:
    h, _feed, sub, _pub = _setup()
    side = SideFeed()
    h.broker.sessions["sub"].outflow.attach_side(side)
    side.add(b"q")
    (first,) = publishes(sub.read())
    restarts = side.restarts
    sub.conn.connection_lost()
    again = h.connected("sub", session_expiry_interval=3600, clean_start=False)
    assert side.restarts == restarts + 1  # re-reads what waits; what is in flight is resent
    (resent,) = publishes(again.pending)
    assert (resent.packet_id, resent.payload, resent.dup) == (first.packet_id, b"q", True)
    again.send(PubAck(first.packet_id or 0))
    assert side.finished_ids == [first.packet_id]


def test_the_queue_and_the_session_take_turns() -> None:
    h, feed, sub, pub = _setup(max_inflight=1)
    for n in range(3):
        pub.publish_acked("t", b"s%d" % n, qos=1)
    side = SideFeed()
    h.broker.sessions["sub"].outflow.attach_side(side)
    for n in range(3):
        side.queue.append(_item(b"q%d" % n))
    sent = []
    for _ in range(6):
        while feed.marks:
            feed.complete_mark()
        (message,) = publishes(sub.read())
        sent.append(message.payload)
        sub.send(PubAck(message.packet_id or 0))
    assert sent == [b"s0", b"q0", b"s1", b"q1", b"s2", b"q2"]  # neither starves the other


def test_nothing_takes_an_identifier_until_the_side_feed_has_read_what_it_had_in_flight() -> None:
    """A broker that restarted: the queue's record of its entries in flight comes
    first (their identifiers), then the session's own messages may take others."""
    h, feed, sub, pub = _setup()
    side = SideFeed()
    side.restoring = True
    outflow = h.broker.sessions["sub"].outflow
    outflow.attach_side(side)
    pub.publish_acked("t", b"stored", qos=1)  # stored with id 1
    assert feed.marks == [] and sub.read() == []
    side.restoring = False
    held = _item(b"held")
    held.packet_id, held.sent = 1, True
    assert outflow.restore_side(side, [held]) == [held]
    (again,) = publishes(sub.read())
    assert (again.packet_id, again.payload, again.dup) == (1, b"held", True)
    assert feed.marks == []  # the stored message waits for id 1
    sub.send(PubAck(1))
    feed.complete_mark()
    assert payloads(sub.read()) == [b"stored"]


class GroupFeed(SideFeed):
    """A group queue's side feed (persistence/group_feed.py): what the member had not
    acknowledged goes back to the group when it leaves (``discard``)."""

    def __init__(self) -> None:
        super().__init__()
        self.discards = 0

    def discard(self) -> None:
        self.discards += 1
        self.queue.clear()


def _sided(payload: bytes) -> Outgoing:
    return Outgoing(0, Delivery(Message("t", payload, 1, False), 1, False), marked=True)


def test_the_session_its_queue_and_its_groups_all_take_turns() -> None:
    h, feed, sub, pub = _setup(max_inflight=1)
    outflow = h.broker.sessions["sub"].outflow
    for n in range(2):
        pub.publish_acked("t", b"s%d" % n, qos=1)
    side, g1, g2 = SideFeed(), GroupFeed(), GroupFeed()
    outflow.attach_side(side)
    outflow.attach_group("$queue/a/t", g1)
    outflow.attach_group("$queue/b/t", g2)
    for n in range(2):
        side.queue.append(_item(b"q%d" % n))
        g1.queue.append(_sided(b"a%d" % n))
        g2.queue.append(_sided(b"b%d" % n))
    sent = []
    for _ in range(8):
        while feed.marks:
            feed.complete_mark()
        (message,) = publishes(sub.read())
        sent.append(message.payload)
        sub.send(PubAck(message.packet_id or 0))
    # The session and the side feeds alternate; the side feeds take turns among them.
    assert sent == [b"s0", b"q0", b"s1", b"a0", b"b0", b"q1", b"a1", b"b1"]


def test_a_member_that_leaves_gives_back_and_its_resumed_session_still_resends() -> None:
    """The group gets back what the member had not acknowledged (another member may
    take it); the member's session re-sends it all the same, under its identifier
    (MQTT-4.4.0-1): an identifier the client holds is never another message's (found
    by the model checker, seeds 9005 and 9010: ``id-reuse``)."""
    h, _feed, sub, _pub = _setup()
    outflow = h.broker.sessions["sub"].outflow
    side, group = SideFeed(), GroupFeed()
    outflow.attach_side(side)
    outflow.attach_group("$queue/g/t", group)
    side.add(b"q")
    group.add(b"g")
    first = {p.payload: p for p in publishes(sub.read())}
    assert set(first) == {b"q", b"g"}
    sub.conn.connection_lost()
    assert group.discards == 1  # given back to the group at once
    again = h.connected("sub", session_expiry_interval=3600, clean_start=False)
    resent = publishes(again.pending)
    assert sorted((p.payload, p.packet_id, p.dup) for p in resent) == [
        (b"g", first[b"g"].packet_id, True),
        (b"q", first[b"q"].packet_id, True),
    ]
    assert group.restarts == 2  # at attach, then a member again: it claims anew
    group.add(b"g2")
    (fresh,) = publishes(again.read())
    assert fresh.payload == b"g2" and not fresh.dup
    assert fresh.packet_id not in {first[b"g"].packet_id, first[b"q"].packet_id}


def test_an_unsubscribed_group_gives_back_and_its_messages_in_flight_complete() -> None:
    h, _feed, sub, _pub = _setup()
    outflow = h.broker.sessions["sub"].outflow
    group = GroupFeed()
    outflow.attach_group("$queue/g/t", group)
    group.add(b"g")
    (message,) = publishes(sub.read())
    outflow.detach_group("$queue/g/t")
    assert group.discards == 1 and outflow.groups == {}
    sub.send(PubAck(message.packet_id or 0))
    assert group.finished_ids == [message.packet_id]  # its acknowledgement still counts


class RecordingSideFeed(SideFeed):
    """A queue whose marks (in-flight records) land when the test says."""

    def __init__(self) -> None:
        super().__init__()
        self.pending_marks: list[tuple[list[int], Callable[[Collection[int]], None]]] = []
        self.forgotten: list[int] = []

    def mark(self, items: list[Outgoing], done: Callable[[Collection[int]], None]) -> None:
        self.pending_marks.append(([item.packet_id for item in items], done))

    def never_sent(self, item: Outgoing) -> None:
        self.forgotten.append(item.packet_id)


def test_a_queue_entry_whose_record_landed_as_its_connection_closed_is_forgotten() -> None:
    """Found by the model checker (seed 8112, ``ecq-again``): the entry's in-flight
    record landed while its connection was closing, so it never went out; the next
    connection took it again under another identifier, and the record of the first
    brought it back, acknowledged, after a broker restart. The outflow now tells the
    feed to forget it when it drops it."""
    h, _feed, sub, _pub = _setup()
    outflow = h.broker.sessions["sub"].outflow
    side = RecordingSideFeed()
    outflow.attach_side(side)
    item = _item(b"q")
    item.marked = False  # a persistent session's entry: recorded before it goes
    side.queue.append(item)
    outflow.pump()
    ((ids, done),) = side.pending_marks
    sub.conn.connection_lost()
    done(ids)  # the record lands now: no connection to send on
    assert side.forgotten == []
    h.connected("sub", session_expiry_interval=3600, clean_start=False)
    assert side.forgotten == ids  # dropped unsent: its record must go


class KeepingGroupFeed(GroupFeed):
    """A group feed of a persistent member: it may decline (a group's), and keeps what
    its member leaves with in flight (persistence/group_feed.py ``keep``)."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log
        self.kept: list[tuple[int, bytes]] = []

    def decline(self, item: Outgoing) -> None:  # type: ignore[override]
        raise AssertionError("nothing is declined here")

    def keep(self, items: list[Outgoing]) -> None:
        assert all(item.delivery is not None for item in items)
        self.kept = sorted((item.packet_id, item.delivery.message.payload) for item in items)  # type: ignore[union-attr]
        self.log.append("keep")

    def discard(self) -> None:
        self.log.append("discard")
        super().discard()


def test_a_member_that_leaves_keeps_what_it_was_sent_before_giving_it_back() -> None:
    """Finding 35: what was sent and not acknowledged is kept with the session (a
    restart reads it back) before the group gets it back, and only that."""
    h, _feed, sub, _pub = _setup(max_inflight=2)
    outflow = h.broker.sessions["sub"].outflow
    log: list[str] = []
    g1, g2 = KeepingGroupFeed(log), KeepingGroupFeed(log)
    outflow.attach_group("$queue/a/t", g1)
    outflow.attach_group("$queue/b/t", g2)
    g1.add(b"a0")
    g2.add(b"b0")
    g1.queue.extend([_sided(b"a1"), _sided(b"a2")])
    sent = {p.payload: p.packet_id for p in publishes(sub.read())}
    assert set(sent) == {b"a0", b"b0"}
    sub.send(PubAck(sent[b"b0"] or 0))  # acknowledged: not held any more
    sent.update((p.payload, p.packet_id) for p in publishes(sub.read()))
    assert b"a1" in sent and b"a2" not in sent  # a2: behind the full window, never sent
    sub.conn.connection_lost()
    assert log == ["keep", "discard", "discard"]  # kept first, then given back
    assert g1.kept == [(sent[b"a0"], b"a0"), (sent[b"a1"], b"a1")]


def test_nothing_takes_an_identifier_until_the_group_writes_held_before_are_read() -> None:
    """A restarted broker reads back the group writes a member left with before it
    gives any identifier: a stored message with the same id waits for it."""
    h, feed, sub, pub = _setup()
    outflow = h.broker.sessions["sub"].outflow
    outflow.restoring_groups = True
    group = KeepingGroupFeed([])
    outflow.attach_group("$queue/g/t", group)
    group.queue.append(_sided(b"new"))
    pub.publish_acked("t", b"stored", qos=1)  # stored with id 1
    outflow.pump()
    assert feed.marks == [] and sub.read() == []
    outflow.restoring_groups = False
    held = _sided(b"held")
    held.packet_id, held.sent = 1, True
    assert outflow.restore_side(group, [held]) == [held]
    (again, *_rest) = publishes(sub.read())
    assert (again.packet_id, again.payload, again.dup) == (1, b"held", True)
    assert all(p.packet_id != 1 for p in _rest)
    sub.send(PubAck(1))
    assert group.finished_ids == [1]


class RecordingGroupFeed(KeepingGroupFeed):
    """A persistent member's group feed whose records (marks) land when the test says
    (persistence/group_feed.py ``mark``, ``never_sent``)."""

    def __init__(self, log: list[str]) -> None:
        super().__init__(log)
        self.pending_marks: list[tuple[list[int], Callable[[Collection[int]], None]]] = []
        self.forgotten: list[int] = []

    def mark(self, items: list[Outgoing], done: Callable[[Collection[int]], None]) -> None:
        self.pending_marks.append(([item.packet_id for item in items], done))

    def never_sent(self, item: Outgoing) -> None:
        self.forgotten.append(item.packet_id)
        self.log.append("forget")


def _unrecorded(payload: bytes, dup: bool = False) -> Outgoing:
    """A persistent member's group write: it goes out once recorded under its id."""
    return Outgoing(0, Delivery(Message("t", payload, 1, False), 1, False), sent=dup)


def test_a_group_write_got_with_dup_is_recorded_under_its_new_id_before_it_goes() -> None:
    """Finding 43: a side feed's record is per packet identifier, so a write sent
    before (given back, DUP) needs one under the identifier given now; it used to
    go out at once, unrecorded."""
    h, _feed, sub, _pub = _setup()
    outflow = h.broker.sessions["sub"].outflow
    group = RecordingGroupFeed([])
    outflow.attach_group("$queue/g/t", group)
    group.queue.append(_unrecorded(b"seen", dup=True))
    outflow.pump()
    assert sub.read() == []  # waits for its record
    ((ids, done),) = group.pending_marks
    done(ids)
    (message,) = publishes(sub.read())
    assert (message.payload, message.packet_id, message.dup) == (b"seen", ids[0], True)


def test_a_group_write_waiting_for_its_record_is_forgotten_as_its_connection_closes() -> None:
    """Found by review of finding 43's fix: a write still waiting for its record
    when the connection closes never went out. Its record is forgotten as the
    connection closes, before the member's records are waited for (a takeover
    reads them once this replica says it kept them), not once the record lands:
    a forget that late could remove the record another replica wrote since."""
    h, _feed, sub, _pub = _setup(max_inflight=2)
    outflow = h.broker.sessions["sub"].outflow
    log: list[str] = []
    group = RecordingGroupFeed(log)
    outflow.attach_group("$queue/g/t", group)
    group.queue.append(_unrecorded(b"sent"))
    outflow.pump()
    ((sent_ids, sent_done),) = group.pending_marks
    sent_done(sent_ids)
    assert payloads(sub.read()) == [b"sent"]
    group.queue.append(_unrecorded(b"waiting"))
    outflow.pump()
    (_, (waiting_ids, waiting_done)) = group.pending_marks
    sub.conn.connection_lost()
    assert group.forgotten == waiting_ids  # at once, before the keep and the give-back
    assert log == ["forget", "keep", "discard"]
    assert group.kept == [(sent_ids[0], b"sent")]  # only what went out is kept
    waiting_done(waiting_ids)  # the record lands late: nothing more is asked
    assert group.forgotten == waiting_ids
