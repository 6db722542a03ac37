"""A session's outgoing QoS 1 and 2 flow, sans-IO (spec 4.3, 4.4, 4.9).

One :class:`Outflow` per session holds the protocol rules every feed shares:

- the in-flight table and the window: at most the smaller of the configured
  cap and the client's Receive Maximum unacknowledged PUBLISH packets
  (MQTT-3.3.4-9); a PUBREL still waiting for PUBCOMP counts too;
- DUP on exactly what may have been seen before (MQTT-3.3.1-1);
- PUBREL after PUBREC (MQTT-4.3.3-4), PUBCOMP ends the flow;
- a resumed session re-sends every unacknowledged PUBLISH and PUBREL with its
  original packet identifier (MQTT-4.4.0-1), whatever its expiry: once sent,
  a message is never dropped for being old, so its identifier stays taken
  until the client acknowledges it.

Where messages come from and where progress is recorded is a :class:`Feed`:
:class:`MemoryFeed` keeps a queue in process memory; the persistent path
supplies one that reads and writes the persisted-message store. A feed that
records progress durably makes two steps wait for its writes (``mark`` and
``release``): a message's first send waits for its "may have been seen" mark,
so a replay after a crash sets DUP; a PUBREL waits for the PUBREL stage, so a
replay never re-sends a PUBLISH the client already completed.

A session may also have a *side* feed: the exclusive compacted queue its
client consumes (broker/ecq.py, persistence/queue_feed.py). Its messages
share the window and get packet identifiers here, at first send (QoS 1;
a persistent session's are recorded in flight under their identifiers
before they go, its ``mark``). A message of the session's own feed whose stored
identifier a side message holds waits, with those after it, until that one
is acknowledged. A resumed session re-sends the side messages in flight
with their identifiers, as every other (MQTT-4.4.0-1), even when the
session's own feed re-reads its record.

Group queues the client is a member of (broker/group_queue.py,
persistence/group_feed.py) are side feeds too, any number of them, taking
turns with the others. A member that leaves gives back to its group what it
had not acknowledged, for another member to get (MQTT 5 section 4.8.2 allows
it as soon as the connection is lost); its resumed session still re-sends
them under their identifiers, as every message in flight, so an identifier
the client holds is never given to another message. A persistent session
keeps them as it leaves (the group feed's ``keep``, with the session in
Redis), so that holds across a restart of the broker too: the first
connection of the session in a process reads them back before any
identifier is given (:meth:`Outflow.restore_side`, ``restoring_groups``;
tests/model/FINDINGS.md, finding 35).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from enum import Enum
from functools import partial
from typing import TYPE_CHECKING, Protocol

from broker.message import Delivery
from broker.packets import PubRel

if TYPE_CHECKING:
    from broker.connection import MQTTConnection
    from broker.session import Session
    from broker.stats import BrokerStats

MAX_PACKET_ID = 65535


class OutgoingState(Enum):
    MARKING = 0  # taken from the feed, waiting for its mark before going on the wire
    AWAIT_PUBACK = 1  # QoS 1 sent
    AWAIT_PUBREC = 2  # QoS 2 sent
    RELEASING = 3  # PUBREC received, waiting for the feed to record the PUBREL stage
    AWAIT_PUBCOMP = 4  # PUBREL sent


# The members as module constants, for the per-message path: on Python 3.11 the
# metaclass's __getattr__ makes each look-up of a member on an Enum class cost
# about 120 ns, against 11 for a global (BENCHMARKS.md, "Enum members").
_MARKING, _AWAIT_PUBACK, _AWAIT_PUBREC, _RELEASING, _AWAIT_PUBCOMP = (
    OutgoingState.MARKING,
    OutgoingState.AWAIT_PUBACK,
    OutgoingState.AWAIT_PUBREC,
    OutgoingState.RELEASING,
    OutgoingState.AWAIT_PUBCOMP,
)


@dataclass(slots=True)
class Outgoing:
    """One message as the outflow handles it.

    ``delivery`` None: only PUBREL is left (a QoS 2 message whose PUBREC the
    feed recorded before). ``sent``: it may have been seen, so a send carries
    DUP. ``marked``: the feed already recorded its mark, it needs no ``mark``
    before its first send. ``ref`` is the feed's own record of it. ``state``:
    where its flow is, once the outflow holds it in flight (its own entry in
    the in-flight table: no second object per message).
    """

    packet_id: int
    delivery: Delivery | None
    sent: bool = False
    marked: bool = False
    ref: object | None = None  # (not bare `object`: mypyc looks that name up in the module)
    side: SideFeed | None = None  # from the side feed (its identifier given here)
    replay: bool = False  # seen before this flow (a rewind's copy): DUP on its first send
    state: OutgoingState = _MARKING

    @property
    def item(self) -> Outgoing:
        """The message of an in-flight entry (the entry is the message itself)."""
        return self


class Feed(Protocol):
    """Where an outflow's messages come from and where its progress goes."""

    durable: bool  # progress is recorded elsewhere: a new connection re-reads it
    outflow: Outflow | None  # the outflow it feeds (set by the outflow)

    def offer(self, delivery: Delivery) -> None:
        """A QoS 1/2 message routed to the session in memory."""

    def take(self, n: int) -> list[Outgoing]:
        """Up to ``n`` messages, next in order; fewer or none if that is all for now
        (the feed calls :meth:`Outflow.pump` when more arrive)."""

    def mark(self, items: list[Outgoing], done: Callable[[Collection[int]], None]) -> None:
        """Record that ``items`` may be seen, then ``done(ids)``: the ids that may go
        out. An item left out is gone (trimmed or expired before its first send)."""

    def release(self, item: Outgoing, done: Callable[[], None]) -> None:
        """PUBREC received: record the PUBREL stage, then ``done()``."""

    def finished(self, item: Outgoing) -> None:
        """PUBACK, PUBCOMP or a failed PUBREC: the message is done with."""

    def undeliverable(self, item: Outgoing) -> None:
        """Dropped unsent: expired before its first send, or too large for the client."""

    def sent(self, item: Outgoing, dup: bool) -> None:
        """A PUBLISH of ``item`` went on the wire, with DUP=``dup`` (counters, events)."""

    def restart(self) -> None:
        """A new connection (durable feeds): re-read from the record, in order."""

    def discard(self) -> None:
        """The session ended: drop everything held."""

    def queued(self) -> int:
        """Messages held and not yet taken."""


class SideFeed(Feed, Protocol):
    """A feed beside the session's own, whose messages get their identifiers here: the
    queue its client consumes ($ECQ, :class:`QueueSide`) or its share of a group
    queue ($queue)."""

    @property
    def decline(self) -> Callable[[Outgoing], None] | None:
        """A group queue's: give back to the group a message this member may not or
        cannot take, for another member (MQTT 5 section 3.1.2.24 lets a shared
        subscription send it to one that can); None: the feed's messages are its
        client's alone (an $ECQ queue's: its exclusive subscription decided)."""


class QueueSide(SideFeed, Protocol):
    """The side feed of the queue the session's client consumes ($ECQ)."""

    consuming: bool  # the client holds the queue's subscription (False: in flight only)
    restoring: bool  # reading what it had in flight before a restart: no ids meanwhile


class Outflow:
    """``may_receive(topic)``: the receiver's read rules (ACL), asked of every message
    before its first send, stored ones included, so a rule changed since a message was
    queued applies to it too; None: everything may go."""

    def __init__(
        self,
        session: Session,
        max_inflight: int,
        feed: Feed,
        may_receive: Callable[[str], bool] | None = None,
    ) -> None:
        self._session = session
        self.max_inflight = max_inflight
        self.feed = feed
        self._may_receive = may_receive
        feed.outflow = self
        self.inflight: dict[int, Outgoing] = {}
        self._resend: deque[int] = deque()  # in flight, not yet re-sent on this connection
        # Taken and waiting for their marks, in order: marks of separate batches may
        # land in any order, the wire must not.
        self._marking: deque[Outgoing] = deque()
        self._may_go: set[int] = set()  # marked, waiting for their turn in _marking
        self._gone: set[int] = set()  # refused by the mark: never to be sent
        self._epoch = 0  # bumped per connection and discard: stale write callbacks are dropped
        # Broker clock of the last acknowledgement, resume, or message into an empty window.
        self.last_progress = 0.0
        self.side: QueueSide | None = None  # the queue the client consumes ($ECQ), if any
        self.detached_side: QueueSide | None = None  # the last one, after an unsubscribe
        self._side_last = 0  # the last identifier given to a side message
        self._side_turn = False  # take from the side feed first next time
        # Taken from the feed, waiting for a side message to free their identifier.
        self._parked: deque[Outgoing] = deque()
        self.groups: dict[str, SideFeed] = {}  # group queues the client is a member of
        self._next_side = 0  # which side feed goes first next time (they take turns)
        # Reading back the group writes the session left with before this process (a
        # restart): no identifier is given meanwhile, nor is anything claimed.
        self.restoring_groups = False
        self.resumed_here = False  # a connection of the session was attached in this process

    def attach_group(self, topic_filter: str, feed: SideFeed) -> None:
        """The client joined the group queue of ``topic_filter``: deliver from it too."""
        old = self.groups.get(topic_filter)
        if old is feed:
            return
        if old is not None:
            old.discard()
        self.groups[topic_filter] = feed
        feed.outflow = self
        if self.connection is not None:
            feed.restart()
        self._side_turn = True
        self.pump()

    def detach_group(self, topic_filter: str) -> None:
        """The client left the group queue: what it had not acknowledged goes back to
        the group (the feed's ``discard``); acknowledgements still in flight count."""
        feed = self.groups.pop(topic_filter, None)
        if feed is not None:
            feed.discard()

    def left(self) -> None:
        """The connection closed: every group queue gets back what it had given this
        client and it had not acknowledged (another member may take it now). What was
        sent stays in flight here, for the resumed session to send again under the
        same identifiers (MQTT-4.4.0-1); a persistent session keeps it with the
        session too, so a restart of the broker neither forgets it nor gives its
        identifier to another message (MQTT-2.2.1-3). One still waiting for its
        record never went out: its record is forgotten now, before anybody waits for
        the member's records (a takeover reads them once this replica has said so)."""
        held: list[Outgoing] = []
        for entry in self.inflight.values():
            side = entry.side
            if side is None or side.decline is None:
                continue  # not a group queue's
            if entry.state is not _MARKING:
                held.append(entry)
                continue
            never_sent = getattr(side, "never_sent", None)
            if never_sent is not None:
                never_sent(entry)
        if held:
            # Kept first: the give-backs below wait for it (persistence/group_feed.py).
            keep = getattr(held[0].side, "keep", None)  # every group feed keeps them alike
            if keep is not None:
                keep(held)
        for feed in self.groups.values():
            feed.discard()

    def attach_side(self, feed: QueueSide) -> None:
        """The client subscribed to its queue: deliver from it too."""
        if self.side is feed:
            return
        if self.side is not None:
            self.side.discard()
        self.side = feed
        self._side_turn = True  # just subscribed: its first message goes next
        feed.outflow = self
        feed.restart()
        self.pump()

    def restore_side(self, feed: SideFeed, items: list[Outgoing]) -> list[Outgoing]:
        """``feed``'s messages in flight before this process (their packet ids from
        its record): in flight again, sent again under those ids with DUP
        (MQTT-4.4.0-1), before anything else takes an identifier (``_take`` waits
        while the feed reads its record). Returns those taken back."""
        taken = []
        for item in items:
            if item.packet_id in self.inflight:
                continue  # not while it read: the record is read before anything goes
            item.side = feed
            item.state = _AWAIT_PUBACK
            self._enter(item.packet_id, item)
            self._resend.append(item.packet_id)
            taken.append(item)
        self.pump()
        return taken

    def detach_side(self) -> None:
        """The queue's subscription went: what is in flight completes, nothing more is
        taken. The feed is kept (:attr:`detached_side`): a new subscription takes it
        up again, knowing what is still in flight."""
        if self.side is not None:
            self.side.discard()
            self.detached_side = self.side
            self.side = None

    @property
    def connection(self) -> MQTTConnection | None:
        return self._session.connection

    # -- events from the handlers and the edge ------------------------------------------

    def deliver(self, delivery: Delivery) -> None:
        """A QoS 1/2 message routed in memory: the feed keeps it, the window sends it.

        The common case costs one send: a memory queue with nothing waiting, no
        queue or group feeds, and room in the window; the message takes its
        identifier and goes, as :meth:`pump` would send it (BENCHMARKS.md, "Speed
        that stays")."""
        feed = self.feed
        if (
            type(feed) is MemoryFeed
            and not feed.queue
            and not self._resend
            and not self._marking
            and not self._parked
            and self.side is None
            and self.detached_side is None
            and not self.groups
        ):
            conn = self._session.connection
            if conn is not None and self._room(conn) > 0:
                may_receive = self._may_receive
                if may_receive is not None and not may_receive(delivery.message.topic):
                    self._session.stats.drop("not_authorized_receive")
                    return
                item = feed.take_now(delivery)  # its state: MARKING
                self._enter(item.packet_id, item)
                self._send(conn, item)
                return
        feed.offer(delivery)
        self.pump()

    def resume(self) -> None:
        """A connection was attached: re-send what is unacknowledged (MQTT-4.4.0-1)."""
        self._epoch += 1
        self.resumed_here = True
        self._progress()
        if self.feed.durable:
            # The record is the truth (another replica may have served the client
            # meanwhile): forget this process's view and re-read it in order. Side
            # messages in flight are this session's own: sent again as they are.
            # (One still waiting for its in-flight record went nowhere: taken again.)
            side = {
                p: e
                for p, e in self.inflight.items()
                if e.side is not None and e.state is not _MARKING
            }
            never_sent = [
                e for e in self.inflight.values() if e.side is not None and e.state is _MARKING
            ]
            self.inflight.clear()
            self._marking.clear()
            self._may_go.clear()
            self._gone.clear()
            self._resend.clear()
            self._parked.clear()
            self.inflight.update(side)
            self._resend.extend(side)
            for item in never_sent:
                # Its record may have landed as the connection closed (seed 8112): it
                # must not bring the message back under this identifier later.
                forget = getattr(item.side, "never_sent", None)
                if forget is not None:
                    forget(item)
            self.feed.restart()
        else:
            self._marking.clear()
            self._resend = deque(self.inflight)
        if self.side is not None:
            self.side.restart()
        for feed in self.groups.values():
            feed.restart()
        self.pump()

    def pump(self) -> None:
        """The window may have opened (an ack, the socket drained, messages arrived)."""
        conn = self._session.connection
        if conn is None:
            return
        resend = self._resend
        feed = self.feed
        if (
            type(feed) is MemoryFeed
            and not feed.queue
            and not resend
            and not self._parked
            and self.side is None
            and not self.groups
        ):
            return  # nothing waits to go (the common case after an acknowledgement)
        to_mark: list[Outgoing] = []
        while True:
            room = self._room(conn)
            if room <= 0:
                break
            if resend:
                self._send_again(conn, resend.popleft())
                continue
            items = self._take(room)
            if not items:
                break
            for item in items:
                self._admit(conn, item, to_mark)
        if to_mark:
            epoch = self._epoch
            own = [item for item in to_mark if item.side is None]
            if own:
                batch = [item.packet_id for item in own]
                self.feed.mark(own, partial(self._marked, batch, epoch=epoch))
            by_side: dict[int, list[Outgoing]] = {}
            for item in to_mark:
                if item.side is not None:
                    by_side.setdefault(id(item.side), []).append(item)
            for sided in by_side.values():
                side = sided[0].side
                assert side is not None
                side_batch = [item.packet_id for item in sided]
                side.mark(sided, partial(self._marked, side_batch, epoch=epoch))

    def _take(self, room: int) -> list[Outgoing]:
        """The next messages: the session's feed and the side feeds take turns."""
        side, parked, inflight = self.side, self._parked, self.inflight
        detached = self.detached_side
        if (
            self.restoring_groups
            or (side is not None and side.restoring)
            or (detached is not None and detached.restoring)
        ):
            return []  # the identifiers it had in flight before a restart come first
        groups = self.groups
        sides: list[SideFeed] = []  # the common case, no queue at all: nothing more built
        if side is not None or groups:
            sides = [side, *groups.values()] if side is not None else list(groups.values())
        if sides and getattr(self.feed, "replaying", False):
            # A resumed durable session: until its record's first page (an APPLICATION
            # session's progress) is read, an identifier given here could be one the
            # client still holds (QoS 2).
            sides = []
        if sides and self._side_turn:
            self._side_turn = False
            first = self._take_sides(sides, max(1, room // 2))
            if first:
                return first
        self._side_turn = bool(sides)
        items: list[Outgoing] = []
        while parked and len(items) < room and parked[0].packet_id not in inflight:
            items.append(parked.popleft())
        if not parked and len(items) < room:
            for item in self.feed.take(room - len(items)):
                if parked or item.packet_id in inflight:
                    # Its stored identifier is held by a side message: it waits, in order.
                    parked.append(item)
                else:
                    items.append(item)
        if not items and sides:
            items = self._take_sides(sides, room)
        return items

    def _take_sides(self, sides: list[SideFeed], n: int) -> list[Outgoing]:
        """Up to ``n`` from the first side feed in turn that has any."""
        count = len(sides)
        for offset in range(count):
            index = (self._next_side + offset) % count
            side = sides[index]
            items = side.take(n)
            if items:
                self._next_side = index + 1
                # Ids the session's own feed may still hold for the client beyond what is in
                # flight here (an APPLICATION session's progress read back; finding 36).
                held = getattr(self.feed, "held_ids", None)
                for item in items:
                    packet_id = self.next_packet_id(self._side_last)
                    while held and packet_id in held:
                        packet_id = self.next_packet_id(packet_id)
                    self._side_last = item.packet_id = packet_id
                    item.side = side
                return items
        return []

    def acknowledge(self, packet_id: int) -> bool:
        """PUBACK: the QoS 1 flow ends. False if no such message is in flight."""
        return self._finish(packet_id, _AWAIT_PUBACK)

    def received(self, packet_id: int, failed: bool) -> bool:
        """PUBREC: the QoS 2 flow moves to PUBREL, or ends if the client refused it."""
        entry = self.inflight.get(packet_id)
        if entry is None or entry.state is not _AWAIT_PUBREC:
            return False
        if failed:
            return self._finish(packet_id, _AWAIT_PUBREC)
        self._progress()
        entry.state = _RELEASING
        epoch = self._epoch
        self.feed.release(entry, lambda: self._released(packet_id, epoch))
        return True

    def completed(self, packet_id: int) -> bool:
        """PUBCOMP: the QoS 2 flow ends."""
        return self._finish(packet_id, _AWAIT_PUBCOMP)

    def pending(self) -> int:
        """Messages not yet acknowledged, in flight or waiting."""
        side = self.side.queued() if self.side is not None else 0
        side += sum(feed.queued() for feed in self.groups.values())
        return len(self.inflight) + self.feed.queued() + len(self._parked) + side

    def room(self) -> int:
        """How many more messages would go out at once now (0 while anything waits)."""
        conn = self._session.connection
        if conn is None or self._marking or self._resend:
            return 0
        return max(0, self._room(conn))

    def discard(self) -> None:
        """The session ended: drop everything it held."""
        self._epoch += 1
        self.inflight.clear()
        self._resend.clear()
        self._marking.clear()
        self._may_go.clear()
        self._gone.clear()
        self._parked.clear()
        self.feed.discard()
        self.detach_side()
        self.detached_side = None
        for topic_filter in list(self.groups):
            self.detach_group(topic_filter)

    def next_packet_id(self, last: int) -> int:
        """The identifier after ``last``, wrapping 65535 -> 1, skipping those in flight."""
        inflight = self.inflight
        packet_id = last
        while True:
            packet_id = packet_id + 1 if packet_id < MAX_PACKET_ID else 1
            if packet_id not in inflight:
                return packet_id

    # -- internals ------------------------------------------------------------------------

    def window(self) -> int:
        """How many messages may be in flight to the client at once: our cap, and
        the client's Receive Maximum (MQTT-3.3.4-9); 0 while it is not connected."""
        conn = self._session.connection
        if conn is None:
            return 0
        return min(self.max_inflight, conn.client_receive_maximum)

    def _room(self, conn: MQTTConnection) -> int:
        if conn.congested or not conn.accepts_publish:
            return 0
        window = self.max_inflight
        receive_maximum = conn.client_receive_maximum
        if receive_maximum < window:
            window = receive_maximum
        return window - (len(self.inflight) - len(self._resend))

    def _admit(self, conn: MQTTConnection, item: Outgoing, to_mark: list[Outgoing]) -> None:
        """A message from the feed enters the table: sent now, or after its mark."""
        if item.delivery is None:  # only PUBREL is left (MQTT-4.4.0-1)
            item.state = _AWAIT_PUBCOMP
            self._enter(item.packet_id, item)
            conn.send(PubRel(item.packet_id))
            return
        may_receive = self._may_receive
        side = item.side
        decline = side.decline if side is not None else None  # a group queue's
        if (
            (not item.sent or decline is not None)
            and may_receive is not None
            # An $ECQ queue's entries: its exclusive subscription decided.
            and (item.side is None or decline is not None)
            and not may_receive(item.delivery.message.topic)
        ):
            # The receiver may not read it (any more): dropped unsent, counted, reported.
            self._session.stats.drop("not_authorized_receive")
            if decline is not None:
                decline(item)
            else:
                (item.side or self.feed).undeliverable(item)
            return
        item.state = _MARKING
        self._enter(item.packet_id, item)
        # A side feed's record is per packet identifier: one it had sent before (DUP)
        # needs a mark under the identifier given now all the same.
        ready = item.marked or (item.sent and side is None)
        if ready and not self._marking:
            self._send(conn, item)
            return
        self._marking.append(item)
        if ready:
            self._may_go.add(item.packet_id)  # only waits for its turn
        else:
            to_mark.append(item)

    def _marked(self, batch: list[int], ids: Collection[int], *, epoch: int) -> None:
        """Marks of ``batch`` landed: send, in the order taken, what is now at the head."""
        if epoch != self._epoch:
            return  # that connection is gone; the next one re-reads the record
        may_go, gone = self._may_go, self._gone
        may_go.update(ids)
        gone.update(set(batch).difference(ids))
        conn = self._session.connection
        if conn is None or not conn.accepts_publish:
            return  # not sent: the next connection re-reads or re-sends them
        marking = self._marking
        while marking:
            packet_id = marking[0].packet_id
            if packet_id in gone:
                # Gone from the record before it was ever sent (trimmed, expired):
                # nothing went on the wire, its identifier is free again.
                head = marking.popleft()
                gone.discard(packet_id)
                if self.inflight.get(packet_id) is head:
                    del self.inflight[packet_id]
                continue
            if packet_id not in may_go:
                break  # the next one's mark has not landed yet
            head = marking.popleft()
            may_go.discard(packet_id)
            self._send(conn, head)
        self.pump()

    def _send(self, conn: MQTTConnection, item: Outgoing) -> None:
        """A first send on this connection of a message not sent on it before."""
        delivery = item.delivery
        assert delivery is not None
        resend = item.sent
        if conn.send_delivery(delivery, item.packet_id, dup=resend or item.replay, resend=resend):
            item.state = _AWAIT_PUBACK if delivery.qos == 1 else _AWAIT_PUBREC
            item.sent = True
            (item.side or self.feed).sent(item, resend)
            return
        del self.inflight[item.packet_id]
        side = item.side
        decline = side.decline if side is not None else None
        if decline is not None:
            # A group queue's: another member may take it (MQTT 5 section 3.1.2.24
            # lets a shared subscription send it to one that can).
            decline(item)
        elif resend:
            # Too large for this connection's Maximum Packet Size: discarded, and the
            # flow behaves as if it completed (MQTT-3.1.2-25).
            (item.side or self.feed).finished(item)
        else:
            (item.side or self.feed).undeliverable(item)

    def _send_again(self, conn: MQTTConnection, packet_id: int) -> None:
        """Re-send on a new connection what was in flight on an earlier one."""
        entry = self.inflight[packet_id]
        if entry.state in (_AWAIT_PUBCOMP, _RELEASING):
            if entry.state is _AWAIT_PUBCOMP:
                conn.send(PubRel(packet_id))
            return
        self._send(conn, entry)

    def _released(self, packet_id: int, epoch: int) -> None:
        entry = self.inflight.get(packet_id)
        if epoch != self._epoch or entry is None or entry.state is not _RELEASING:
            return  # the next connection re-sends PUBREL from the record
        entry.state = _AWAIT_PUBCOMP
        conn = self._session.connection
        if conn is not None and conn.accepts_publish:
            conn.send(PubRel(packet_id))

    def _finish(self, packet_id: int, expected: OutgoingState) -> bool:
        entry = self.inflight.get(packet_id)
        if entry is None or entry.state is not expected or packet_id in self._resend:
            return False
        del self.inflight[packet_id]
        self._progress()
        (entry.side or self.feed).finished(entry)
        self.pump()
        return True

    def _enter(self, packet_id: int, entry: Outgoing) -> None:
        """``entry`` is in flight now. Into an empty window: the in-flight timeout's
        clock starts here, not at the last acknowledgement (a client idle for longer
        than the timeout is not stalled by the next message it is sent)."""
        inflight = self.inflight
        if not inflight:
            self._progress()
        inflight[packet_id] = entry

    def _progress(self) -> None:
        conn = self._session.connection
        if conn is not None:
            self.last_progress = conn.broker.clock()

    def stalled(self, now: float, timeout: float) -> bool:
        """The whole window has been in flight, unacknowledged, for ``timeout`` seconds."""
        conn = self._session.connection
        if conn is None or not self.inflight or now - self.last_progress < timeout:
            return False
        window = min(self.max_inflight, conn.client_receive_maximum)
        return len(self.inflight) - len(self._resend) >= window


class MemoryFeed:
    """Messages queued in process memory; identifiers given out at first send.

    While the queue is full (``max_queued`` messages, or ``max_bytes`` of
    payload; 0: no byte limit), new messages are dropped and counted, or with
    ``drop_oldest`` the head of the queue is, until the new one fits.
    """

    durable = False

    def __init__(
        self,
        max_queued: int,
        stats: BrokerStats,
        drop_oldest: bool = False,
        max_bytes: int = 0,
    ) -> None:
        self.max_queued = max_queued
        self.max_bytes = max_bytes
        self.stats = stats
        self.drop_oldest = drop_oldest  # mqtt.queue_drop_policy: oldest
        self.queue: deque[Delivery] = deque()
        self.queued_bytes = 0  # payload bytes in the queue
        self.outflow: Outflow | None = None
        self._last_packet_id = 0

    def offer(self, delivery: Delivery) -> None:
        queue = self.queue
        size = len(delivery.message.payload)
        outflow = self.outflow
        if not queue and outflow is not None and outflow.room() > 0:
            self._append(delivery, size)  # the window is open: it goes out at once
            return
        if len(queue) >= self.max_queued:
            self.stats.drop("queue_full")
            if not self.drop_oldest or not queue:
                return
            self._pop()  # make room: the newest is worth more
        max_bytes = self.max_bytes
        if max_bytes and self.queued_bytes + size > max_bytes:
            self.stats.drop("queue_bytes_full")
            if not self.drop_oldest or size > max_bytes:
                return
            while queue and self.queued_bytes + size > max_bytes:
                self._pop()
        self._append(delivery, size)

    def _append(self, delivery: Delivery, size: int) -> None:
        self.queue.append(delivery)
        self.queued_bytes += size

    def _pop(self) -> Delivery:
        delivery = self.queue.popleft()
        self.queued_bytes -= len(delivery.message.payload)
        return delivery

    def take_now(self, delivery: Delivery) -> Outgoing:
        """``delivery`` goes out at once, never queued (:meth:`Outflow.deliver`)."""
        outflow = self.outflow
        assert outflow is not None
        packet_id = self._last_packet_id = outflow.next_packet_id(self._last_packet_id)
        return Outgoing(packet_id, delivery, False, True)  # marked: memory records nothing

    def take(self, n: int) -> list[Outgoing]:
        queue, outflow = self.queue, self.outflow
        assert outflow is not None
        items: list[Outgoing] = []
        while queue and len(items) < n:
            packet_id = outflow.next_packet_id(self._last_packet_id)
            self._last_packet_id = packet_id
            items.append(Outgoing(packet_id, self._pop(), marked=True))
        return items

    def mark(self, items: list[Outgoing], done: Callable[[Collection[int]], None]) -> None:
        done([item.packet_id for item in items])

    def release(self, item: Outgoing, done: Callable[[], None]) -> None:
        done()

    def finished(self, item: Outgoing) -> None:
        pass

    def undeliverable(self, item: Outgoing) -> None:
        pass

    def sent(self, item: Outgoing, dup: bool) -> None:
        pass

    def restart(self) -> None:
        pass

    def discard(self) -> None:
        self.queue.clear()
        self.queued_bytes = 0

    def queued(self) -> int:
        return len(self.queue)
