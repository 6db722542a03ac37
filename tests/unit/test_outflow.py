"""The shared outgoing flow (broker/outflow.py) with a feed whose writes complete on demand.

The durable feed of the persistent path records a "may have been seen" mark
before a message's first send and the PUBREL stage before PUBREL; the rules
that depend on those writes live in the outflow and are tested here with the
core harness, no Redis: order on the wire whatever order the marks land in,
nothing sent that the record refused, PUBREL only after its stage is
recorded, and re-sends with the original ids and DUP on a new connection.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Sequence

from broker.message import Delivery
from broker.outflow import Outflow, Outgoing
from broker.packets import PubAck, PubComp, PubRec, PubRel
from broker.persistent_path import InMemoryPersistentPath
from tests.unit.core_harness import Client, Harness, payloads, publishes


class DeferredFeed:
    """A durable-style feed: ids given at offer, marks and releases completed by the test."""

    durable = True

    def __init__(self) -> None:
        self.outflow: Outflow | None = None
        self.stored: list[Outgoing] = []  # the "record", in order, not yet acknowledged
        self.queue: deque[Outgoing] = deque()
        self.marks: list[tuple[list[int], Callable[[Collection[int]], None]]] = []
        self.releases: list[tuple[int, Callable[[], None]]] = []
        self.finished_ids: list[int] = []
        self.undeliverable_ids: list[int] = []
        self.restarts = 0
        self._next_id = 0

    def offer(self, delivery: Delivery) -> None:
        self._next_id += 1
        item = Outgoing(self._next_id, delivery)
        self.stored.append(item)
        self.queue.append(item)

    def take(self, n: int) -> list[Outgoing]:
        items = []
        while self.queue and len(items) < n:
            items.append(self.queue.popleft())
        return items

    def mark(self, items: list[Outgoing], done: Callable[[Collection[int]], None]) -> None:
        self.marks.append(([i.packet_id for i in items], done))

    def release(self, item: Outgoing, done: Callable[[], None]) -> None:
        self.releases.append((item.packet_id, done))

    def finished(self, item: Outgoing) -> None:
        self.finished_ids.append(item.packet_id)
        self.stored = [s for s in self.stored if s.packet_id != item.packet_id]

    def undeliverable(self, item: Outgoing) -> None:
        self.undeliverable_ids.append(item.packet_id)

    def sent(self, item: Outgoing, dup: bool) -> None:
        pass

    def restart(self) -> None:
        """Re-read the record: everything not acknowledged, in order, as it stands."""
        self.restarts += 1
        self.queue = deque(self.stored)

    def discard(self) -> None:
        self.queue.clear()
        self.stored.clear()

    def queued(self) -> int:
        return len(self.queue)

    # -- the test's hands -------------------------------------------------------------------

    def complete_mark(self, index: int = 0, refuse: Sequence[int] = ()) -> None:
        ids, done = self.marks.pop(index)
        done([i for i in ids if i not in refuse])

    def complete_release(self, index: int = 0) -> None:
        self.releases.pop(index)[1]()


class DeferredPath(InMemoryPersistentPath):
    """Durable sessions get a :class:`DeferredFeed`; storing completes at once."""

    def __init__(self) -> None:
        self.feeds: dict[str, DeferredFeed] = {}

    def feed_for(self, client_id: str) -> DeferredFeed:
        feed = self.feeds[client_id] = DeferredFeed()
        return feed


def _setup(**mqtt: object) -> tuple[Harness, DeferredFeed, Client, Client]:
    path = DeferredPath()
    h = Harness(persistent_path=path, **mqtt)
    sub = h.connected("sub", session_expiry_interval=3600)
    sub.subscribe("t", qos=2)
    return h, path.feeds["sub"], sub, h.connected("pub")


def _state(h: Harness, packet_id: int) -> str:
    return h.broker.sessions["sub"].outflow.inflight[packet_id].state.name


def test_first_send_waits_for_its_mark() -> None:
    h, feed, sub, pub = _setup()
    pub.publish_acked("t", b"a", qos=1)
    assert len(feed.marks) == 1
    assert _state(h, 1) == "MARKING"
    assert sub.read() == []
    feed.complete_mark()
    assert _state(h, 1) == "AWAIT_PUBACK"
    assert payloads(sub.read()) == [b"a"]


def test_sends_keep_the_order_taken_when_marks_land_out_of_order() -> None:
    _h, feed, sub, pub = _setup()
    pub.publish_acked("t", b"1", qos=1)
    pub.publish_acked("t", b"2", qos=1)
    assert len(feed.marks) == 2  # one batch per delivery
    feed.complete_mark(1)  # the second batch lands first: it must wait
    assert sub.read() == []
    feed.complete_mark(0)
    assert payloads(sub.read()) == [b"1", b"2"]


def test_a_message_the_record_refused_is_not_sent_and_frees_its_turn() -> None:
    h, feed, sub, pub = _setup()
    pub.publish_acked("t", b"trimmed", qos=1)
    pub.publish_acked("t", b"kept", qos=1)
    feed.complete_mark(0, refuse=[1])  # gone from the record before its first send
    feed.complete_mark(0)
    assert payloads(sub.read()) == [b"kept"]
    assert 1 not in h.broker.sessions["sub"].outflow.inflight


def test_pubrel_only_after_its_stage_is_recorded() -> None:
    h, feed, sub, pub = _setup()
    pub.publish_acked("t", b"q2", qos=2)
    feed.complete_mark()
    (publish,) = publishes(sub.read())
    packet_id = publish.packet_id or 0
    sub.send(PubRec(packet_id))
    assert sub.read() == []  # PUBREL waits for the stage
    assert _state(h, packet_id) == "RELEASING"
    feed.complete_release()
    assert sub.read() == [PubRel(packet_id)]
    sub.send(PubComp(packet_id))
    assert feed.finished_ids == [packet_id]


def test_pubrel_waiting_for_pubcomp_counts_in_the_window() -> None:
    _h, feed, sub, pub = _setup(max_inflight=1)
    pub.publish_acked("t", b"1", qos=2)
    pub.publish_acked("t", b"2", qos=2)
    feed.complete_mark()
    (first,) = publishes(sub.read())
    packet_id = first.packet_id or 0
    sub.send(PubRec(packet_id))
    feed.complete_release()
    assert sub.read() == [PubRel(packet_id)]
    assert feed.marks == []  # the second waits: the window holds the PUBREL
    sub.send(PubComp(packet_id))
    feed.complete_mark()
    assert payloads(sub.read()) == [b"2"]


def test_new_connection_rereads_the_record_and_resends_with_dup() -> None:
    h, feed, sub, pub = _setup()
    pub.publish_acked("t", b"m", qos=1)
    feed.complete_mark()
    (first,) = publishes(sub.read())
    assert not first.dup
    sub.conn.connection_lost()
    again = h.connected("sub", session_expiry_interval=3600, clean_start=False)
    assert feed.restarts == 2  # every CONNACK resumes: first connection, then this one
    (resent,) = publishes(again.pending)
    assert resent.dup and resent.packet_id == first.packet_id and resent.payload == b"m"
    again.send(PubAck(first.packet_id or 0))
    assert feed.finished_ids == [first.packet_id]


def test_a_late_mark_of_an_earlier_connection_sends_nothing() -> None:
    h, feed, sub, pub = _setup()
    pub.publish_acked("t", b"m", qos=1)
    sub.conn.connection_lost()
    again = h.connected("sub", session_expiry_interval=3600, clean_start=False)
    feed.complete_mark(0)  # the first connection's mark lands after the reconnect
    feed.complete_mark(0)  # the new connection's own mark
    assert payloads(again.pending + again.read()) == [b"m"]


def test_memory_resend_of_an_expired_message_still_goes_out() -> None:
    """MQTT-4.4.0-1: a sent, unacknowledged message is re-sent whatever its age."""
    h = Harness()
    sub = h.connected("sub", session_expiry_interval=3600)
    sub.subscribe("t", qos=1)
    pub = h.connected("pub")
    pub.publish_acked("t", b"short", qos=1, message_expiry_interval=2)
    (first,) = publishes(sub.read())
    sub.conn.connection_lost()
    h.advance(10)  # its expiry passed while it was in flight
    again = h.connected("sub", session_expiry_interval=3600, clean_start=False)
    (resent,) = publishes(again.pending)
    assert resent.dup and resent.packet_id == first.packet_id
    assert resent.properties is not None and resent.properties.message_expiry_interval == 0


def test_an_expired_message_never_sent_is_dropped() -> None:
    h = Harness(max_inflight=1)
    sub = h.connected("sub", session_expiry_interval=3600)
    sub.subscribe("t", qos=1)
    pub = h.connected("pub")
    pub.publish_acked("t", b"first", qos=1)
    pub.publish_acked("t", b"waits", qos=1, message_expiry_interval=2)
    pub.publish_acked("t", b"last", qos=1)
    (first,) = publishes(sub.read())
    h.advance(10)
    sub.send(PubAck(first.packet_id or 0))
    assert payloads(sub.read()) == [b"last"]
