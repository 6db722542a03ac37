"""The hand-off point for persistent sessions.

A session is persistent when it outlives its connection (clean session 0 in
3.1.1, Session Expiry Interval > 0 in 5.0). Such a session is *durable*: the
router sends its QoS 1/2 deliveries through a :class:`PersistentPath` and
acknowledges the publisher only when the path reports them stored; its
outgoing flow is fed by the path; its state is saved through the
path before SUBACK. The durable path (Kafka, then Redis; docs/ARCHITECTURE.md,
"The life of a persistent QoS 1 message") lives in
``persistence/``; :class:`InMemoryPersistentPath` keeps everything in the
session itself, as an ordinary broker does (survives disconnects, not
restarts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from broker.group_queue import GroupTarget

if TYPE_CHECKING:
    from broker.message import Delivery
    from broker.outflow import Feed, QueueSide, SideFeed
    from broker.session import Session
    from broker.topics import SubscriptionEntry

DoneCallback = Callable[[bool], None]


class Addressee(Protocol):
    """Whom a record is routed for: a session, or a queue (broker/ecq.py)."""

    @property
    def client_id(self) -> str: ...

    @property
    def generation(self) -> int: ...


AcceptedCallback = DoneCallback


@dataclass(slots=True, frozen=True)
class OpenRequest:
    """A CONNECT for a durable session this broker does not hold."""

    clean_start: bool
    expiry_interval: int | None  # None: never expires
    protocol_level: int
    owner: str | None  # who the session belongs to (auth.session_owner), None: not bound
    username: str | None  # the authenticated user (None: anonymous)
    enforce_owner: bool  # a stored session of another owner is refused, not replaced


@dataclass(slots=True)
class OpenedSession:
    """What the persistent path found or made for an :class:`OpenRequest`.

    ``resumed``: a stored session was found (session present), with its
    subscriptions, its held QoS 2 ids and its owner; otherwise a new one was
    started. ``generation`` tells this session from earlier and later ones of
    the same client id. ``refused``: the stored session belongs to another
    owner; nothing was changed.
    """

    generation: int
    resumed: bool
    subscriptions: list[SubscriptionEntry]
    qos2_received: tuple[int, ...]
    owner: str | None
    refused: bool = False
    opens: int = 0  # a resumed session's resumes so far, this one included


OpenedCallback = Callable[[OpenedSession | None], None]


class PersistentPath(Protocol):
    keeps_queues: bool  # serves exclusive compacted queues (broker/ecq.py)

    def submit(
        self,
        deliveries: Sequence[tuple[Session | GroupTarget, Delivery]],
        on_accepted: DoneCallback,
        on_settled: DoneCallback | None = None,
    ) -> None:
        """Make ``deliveries`` durable (for the Kafka path: Kafka acknowledged them;
        Redis stores them later), then call ``on_accepted(True)``: the publisher
        may now be told the message was accepted.

        ``on_accepted(False)`` means they could not be made durable in time: the
        publisher must not be told the message was accepted. ``on_settled(ok)`` follows it
        once the outcome is final: a store that timed out may still have taken
        them (``ok`` True), so a QoS 2 publisher's re-send must not be routed
        again.
        """

    def open(self, client_id: str, request: OpenRequest, done: OpenedCallback) -> None:
        """Resume the durable session stored for ``client_id``, or start a new one
        (clean start, or none stored); then ``done(opened)``, or ``done(None)`` if
        the store could not be reached."""

    def feed_for(self, client_id: str) -> Feed | None:
        """Where a new durable session's outgoing messages come from; None: memory."""

    def save_session(self, session: Session, on_saved: DoneCallback) -> None:
        """Record the session's state (subscriptions, expiry, connected or not)."""

    def session_ended(
        self, session: Session, on_ended: DoneCallback | None = None, expired: bool = False
    ) -> None:
        """The session expired or was discarded by clean start: drop what is kept,
        then ``on_ended(ok)`` (False: the store could not be reached; what is
        kept may come back after a restart). ``expired``: kept if a client resumed
        it since ``session.opens`` (from another replica, finding 40)."""

    def enqueue(
        self,
        queue: str,
        delivery: Delivery,
        on_accepted: DoneCallback,
        on_settled: DoneCallback | None = None,
    ) -> bool:
        """Route ``delivery`` to the exclusive compacted queue ``queue`` consumes
        (broker/ecq.py), as :meth:`submit` does to a session. False: this path keeps
        no queues, and nothing is called."""

    def queue_full(self, queue: str) -> bool:
        """Is ``queue`` at its byte limit (ecq.max_bytes), as far as this path knows now?
        A write to it is refused before it goes anywhere (0x97)."""

    def queue_feed(self, session: Session) -> QueueSide | None:
        """The side feed delivering the queue of ``session``'s client; None: no queues."""

    def rewind_queue(self, client_id: str, from_seq: int) -> None:
        """Make the queue's entries from ``from_seq`` on pending again and deliver them."""

    keeps_groups: bool  # serves durable group queues (broker/group_queue.py)

    def group_feed(self, session: Session, topic_filter: str) -> SideFeed | None:
        """``session``'s share of the group queue ``topic_filter`` names (a side feed
        of its outflow); None: no group queues here."""

    def restore_group_writes(self, session: Session, taken_from: str | None = None) -> None:
        """The first connection of a persistent session in this process: the group
        writes it left with in flight before (a restart, another replica) go back in
        flight under their packet ids before any other identifier is given.
        ``taken_from``: the replica whose connection this one took over; what it
        keeps as that connection leaves is waited for (``ClusterState.await_kept``)."""

    def after_keeps(self, client_id: str, then: Callable[[], None]) -> None:
        """``then()`` once the group writes ``client_id``'s session left with here (a
        takeover by another replica) are kept with it; at once when there are none."""


def _ignore(ok: bool) -> None:
    """Nothing waits on this completion."""


class InMemoryPersistentPath:
    """Keeps durable sessions' messages in their in-memory outflow."""

    keeps_queues = False

    def submit(
        self,
        deliveries: Sequence[tuple[Session | GroupTarget, Delivery]],
        on_accepted: DoneCallback,
        on_settled: DoneCallback | None = None,
    ) -> None:
        for session, delivery in deliveries:
            if not isinstance(session, GroupTarget):  # no group queues without persistence
                session.deliver(delivery)
        on_accepted(True)

    def open(self, client_id: str, request: OpenRequest, done: OpenedCallback) -> None:
        done(OpenedSession(0, False, [], (), request.owner))

    def feed_for(self, client_id: str) -> Feed | None:
        return None

    def save_session(self, session: Session, on_saved: DoneCallback = _ignore) -> None:
        on_saved(True)

    def session_ended(
        self, session: Session, on_ended: DoneCallback | None = None, expired: bool = False
    ) -> None:
        if on_ended is not None:
            on_ended(True)

    def enqueue(
        self,
        queue: str,
        delivery: Delivery,
        on_accepted: DoneCallback,
        on_settled: DoneCallback | None = None,
    ) -> bool:
        return False  # a queue outlives restarts or it is no queue: persistence only

    def queue_full(self, queue: str) -> bool:
        return False

    def queue_feed(self, session: Session) -> QueueSide | None:
        return None

    def rewind_queue(self, client_id: str, from_seq: int) -> None:
        pass

    keeps_groups = False

    def group_feed(self, session: Session, topic_filter: str) -> SideFeed | None:
        return None

    def restore_group_writes(self, session: Session, taken_from: str | None = None) -> None:
        pass

    def after_keeps(self, client_id: str, then: Callable[[], None]) -> None:
        then()
