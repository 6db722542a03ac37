"""Retained messages (spec 3.3.1.3): the last retained message per topic.

Indexed by a topic tree, like the subscriptions (:mod:`broker.topics`): a
topic filter walks only the levels it names, so what a SUBSCRIBE costs
depends on the retained messages under its literal levels, not on all of
them (a ``+`` level visits the children of its node; ``#`` everything below
it). The walk is a generator that can be resumed across event-loop
iterations (:class:`RetainedSender`): a subscription that matches 100,000
retained messages is sent a chunk at a time while other clients are served.

The store is bounded (SECURITY.md "Limits"): ``mqtt.max_retained_messages`` and
``mqtt.max_retained_bytes`` for the broker, ``..._per_client`` for what one
client ID has published (the client whose message is stored now owns it).
:meth:`RetainedStore.over_limit` tells the PUBLISH handler which limit a new
retained message would break; it then refuses the message. Messages loaded
from Redis or another replica (:meth:`RetainedStore.replace`) are counted but
never refused: they were accepted once already.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from broker.message import Delivery, Message
from broker.outflow import MemoryFeed

if TYPE_CHECKING:
    from collections.abc import Sequence

    from broker.acl import Authorizer
    from broker.session import Session

__all__ = ["RetainedSender", "RetainedStore", "retained_size"]

# A walk yields None (a "still working" tick) every this many tree nodes it
# visits without a match, so a caller can bound the work it does at once.
_TICK_NODES = 64


def retained_size(message: Message) -> int:
    """What a retained message counts against the byte limits: topic, payload and the
    variable-length properties kept with it (approximately their bytes)."""
    size = len(message.topic) + len(message.payload)
    props = message.properties
    if props is not None:
        for key, value in props.user_properties:
            size += len(key) + len(value)
        size += len(props.content_type or "") + len(props.response_topic or "")
        size += len(props.correlation_data or b"")
    return size


class _Node:
    __slots__ = ("children", "message")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.message: Message | None = None


class RetainedStore:
    def __init__(
        self,
        max_messages: int = 0,
        max_bytes: int = 0,
        max_messages_per_client: int = 0,
        max_bytes_per_client: int = 0,
    ) -> None:
        """Limits of 0 are off."""
        self._root = _Node()
        self._by_topic: dict[str, Message] = {}
        self._own: dict[str, Message] = {}  # the broker's own (keep_own), by topic
        self._sizes: dict[str, int] = {}
        self._by_origin: dict[str, list[int]] = {}  # client ID -> [messages, bytes]
        self.bytes = 0
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.max_messages_per_client = max_messages_per_client
        self.max_bytes_per_client = max_bytes_per_client
        # persistence.enabled: every change is also written to Redis
        # (persistence/retained_persistence.py)
        self.on_change: Callable[[Message, Callable[[bool], None] | None], None] | None = None

    def __len__(self) -> int:
        return len(self._by_topic)

    # -- limits ----------------------------------------------------------------------

    def over_limit(self, message: Message) -> str | None:
        """Which limit storing ``message`` would break (a counter name), or None.

        A deletion (empty payload) never breaks one; a message replacing the
        topic's current one counts only its growth.
        """
        if not message.payload:
            return None
        old = self._sizes.get(message.topic)
        size = retained_size(message)
        count = 0 if old is not None else 1
        grow = size - (old or 0)
        if self.max_messages and len(self._by_topic) + count > self.max_messages:
            return "retained_limit"
        if self.max_bytes and self.bytes + grow > self.max_bytes:
            return "retained_limit"
        origin = message.origin
        if origin is None or not (self.max_messages_per_client or self.max_bytes_per_client):
            return None
        used = self._by_origin.get(origin, (0, 0))
        previous = self._by_topic.get(message.topic)
        if previous is None or previous.origin != origin:
            count, grow = 1, size  # the topic is not this client's yet
        if self.max_messages_per_client and used[0] + count > self.max_messages_per_client:
            return "retained_client_limit"
        if self.max_bytes_per_client and used[1] + grow > self.max_bytes_per_client:
            return "retained_client_limit"
        return None

    def used_by(self, client_id: str) -> tuple[int, int]:
        """(messages, bytes) of the retained messages ``client_id`` published."""
        used = self._by_origin.get(client_id)
        return (used[0], used[1]) if used is not None else (0, 0)

    # -- changes ---------------------------------------------------------------------

    def store(self, message: Message, done: Callable[[bool], None] | None = None) -> None:
        """Keep ``message``; an empty payload deletes the topic's message (MQTT-3.3.1-6).

        The caller checked :meth:`over_limit`. ``done(ok)`` once it is kept for good:
        at once in memory; with persistence, when Redis has it (``on_change``).
        """
        self.replace(message.topic, message if message.payload else None)
        if self.on_change is not None:
            self.on_change(message, done)
        elif done is not None:
            done(True)

    def topics(self) -> list[str]:
        return list(self._by_topic)

    def replace(self, topic: str, message: Message | None) -> None:
        """Set or delete ``topic``'s message as loaded or learned from elsewhere."""
        if message is None:
            self._delete(topic)
            return
        self._forget(topic)
        self._node(topic).message = message
        self._by_topic[topic] = message
        size = retained_size(message)
        self._sizes[topic] = size
        self.bytes += size
        if message.origin is not None:
            used = self._by_origin.get(message.origin)
            if used is None:
                used = self._by_origin[message.origin] = [0, 0]
            used[0] += 1
            used[1] += size

    def keep_own(self, message: Message) -> None:
        """Keep one of the broker's own retained messages (``$SYS``, broker/sys_topics.py).

        Subscribers get it as any retained message, but it is outside the limits,
        ``len`` and :meth:`topics`, and never passed to ``on_change``: made again
        every interval by this process, it is neither a client's nor shared. A
        client's message on its topic (loaded from Redis, kept from before ``$SYS``
        was read-only) is uncounted: this one replaces it.
        """
        self._forget(message.topic)
        self._node(message.topic).message = message
        self._own[message.topic] = message

    def drop_own(self, topic: str) -> None:
        """Remove one of the broker's own retained messages (:meth:`keep_own`)."""
        if self._own.pop(topic, None) is None or topic in self._by_topic:
            return
        self._clear(topic)

    def _node(self, topic: str) -> _Node:
        node = self._root
        for level in topic.split("/"):
            child = node.children.get(level)
            if child is None:
                child = node.children[level] = _Node()
            node = child
        return node

    def _forget(self, topic: str) -> None:
        """Uncount ``topic``'s message (the tree node stays)."""
        old = self._by_topic.pop(topic, None)
        if old is None:
            return
        size = self._sizes.pop(topic)
        self.bytes -= size
        if old.origin is not None:
            used = self._by_origin[old.origin]
            used[0] -= 1
            used[1] -= size
            if used[0] <= 0:
                del self._by_origin[old.origin]

    def _delete(self, topic: str) -> None:
        if topic not in self._by_topic:
            return
        self._forget(topic)
        self._clear(topic)

    def _clear(self, topic: str) -> None:
        """No message at ``topic`` in the tree; the levels left empty go."""
        levels = topic.split("/")
        path = [self._root]
        for level in levels:
            path.append(path[-1].children[level])
        path[-1].message = None
        for depth in range(len(levels), 0, -1):  # prune levels left empty
            node = path[depth]
            if node.message is not None or node.children:
                break
            del path[depth - 1].children[levels[depth - 1]]

    # -- matching --------------------------------------------------------------------

    def matching(self, topic_filter: str, now: float) -> list[Message]:
        """Unexpired retained messages for a new subscription, dropping expired ones."""
        return [m for m in self.walk(topic_filter, now) if m is not None]

    def walk(self, topic_filter: str, now: float) -> Iterator[Message | None]:
        """The retained messages ``topic_filter`` matches, lazily, with a None every
        :data:`_TICK_NODES` nodes visited in between (see the module docstring).

        Safe to resume after the store changed: each node's children are read
        when the walk reaches it, a message deleted meanwhile is not yielded,
        one added under a node already passed is not either. Expired messages
        met on the way are deleted.
        """
        if "+" not in topic_filter and "#" not in topic_filter:
            message = self._by_topic.get(topic_filter)
            if message is None:
                message = self._own.get(topic_filter)  # never expires
            if message is not None:
                if message.expired(now):
                    self._delete(topic_filter)
                else:
                    yield message
            return
        levels = topic_filter.split("/")
        last = len(levels)
        root = self._root
        visited = 0
        # Frames of (nodes to visit, the filter depth they are matched at, or -1
        # for "everything below a '#'"). A node's children are copied (at C
        # speed) when the walk gets to them and visited one per step, so no step
        # costs more than a node, however many children it has.
        frames: list[tuple[Iterator[_Node], int]] = [(iter((root,)), 0)]
        while frames:
            nodes, depth = frames[-1]
            node = next(nodes, None)
            if node is None:
                frames.pop()
                continue
            visited += 1
            if visited % _TICK_NODES == 0:
                yield None
            if depth == -1 or (depth < last and levels[depth] == "#"):
                # "#": this node ("a/#" matches "a") and everything below it;
                # from the root, not the $-topics [MQTT-4.7.2-1].
                if node.message is not None:
                    message = self._live(node, now)
                    if message is not None:
                        yield message
                if node.children:
                    frames.append((_children(node, node is root), -1))
            elif depth == last:
                if node.message is not None:
                    message = self._live(node, now)
                    if message is not None:
                        yield message
            elif levels[depth] == "+":
                if node.children:
                    frames.append((_children(node, node is root), depth + 1))
            else:
                child = node.children.get(levels[depth])
                if child is not None:
                    frames.append((iter((child,)), depth + 1))

    def _live(self, node: _Node, now: float) -> Message | None:
        message = node.message
        if message is not None and message.expired(now):
            self._delete(message.topic)
            return None
        return message


def _children(node: _Node, at_root: bool) -> Iterator[_Node]:
    """A snapshot of ``node``'s children; at the root without the $-topics, which a
    filter starting with a wildcard never matches [MQTT-4.7.2-1]."""
    if at_root:
        return iter([c for k, c in node.children.items() if k[:1] != "$"])
    return iter(list(node.children.values()))


# --------------------------------------------------------------------------
# Sending them on SUBSCRIBE, a chunk at a time
# --------------------------------------------------------------------------

# Work done per event-loop iteration for one session: deliveries plus walk ticks.
CHUNK = 256


@dataclass(slots=True)
class _Job:
    """The retained messages of one granted subscription, still to be sent."""

    messages: Iterator[Message | None]
    qos: int
    subscription_ids: tuple[int, ...]
    since: int  # the sender's clock when queued: live messages after it supersede


class SenderHost(Protocol):
    """What a :class:`RetainedSender` uses of the broker (``Broker`` is one)."""

    @property
    def retained(self) -> RetainedStore: ...
    @property
    def clock(self) -> Callable[[], float]: ...
    @property
    def call_soon(self) -> Callable[[Callable[[], None]], object] | None: ...
    @property
    def sessions(self) -> dict[str, Session]: ...
    @property
    def acl(self) -> Authorizer: ...
    def dispatch(
        self,
        targets: Sequence[tuple[Session, Delivery]],
        on_accepted: Callable[[bool], None],
        retained: bool = False,
    ) -> None: ...


class RetainedSender:
    """A session's retained messages on their way after SUBSCRIBE.

    ``CHUNK`` units of work (a delivery, or a walk tick) per event-loop
    iteration (``Broker.call_soon``; without one, everything at once, as in the
    sans-IO tests), and none while the session's connection is congested (its
    socket buffer above mqtt.write_buffer_high_water) or, for an in-memory
    session, while its queue is half full: the server resumes it when the
    socket drains and the ack handlers when the queue does, the broker's tick
    in any case.

    A live message on a topic whose retained message is still to come
    supersedes it: the retained one, older, is skipped rather than sent after
    the newer message (:meth:`live`).
    """

    __slots__ = ("_broker", "_clock", "_jobs", "_live", "_scheduled", "_session")

    def __init__(self, broker: SenderHost, session: Session) -> None:
        self._broker = broker
        self._session = session
        self._jobs: deque[_Job] = deque()
        self._live: dict[str, int] = {}  # topic -> clock of the last live delivery
        self._clock = 0
        self._scheduled = False

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def add(self, topic_filter: str, qos: int, subscription_ids: tuple[int, ...]) -> None:
        self._clock += 1
        walk = self._broker.retained.walk(topic_filter, self._broker.clock())
        self._jobs.append(_Job(walk, qos, subscription_ids, self._clock))
        self.resume()

    def live(self, topic: str) -> None:
        """A live delivery on ``topic`` went to the session (``Broker.dispatch``)."""
        self._clock += 1
        self._live[topic] = self._clock

    def resume(self) -> None:
        """Send more, now or at the next loop iteration, unless something blocks it."""
        if self._scheduled or not self._jobs:
            return
        call_soon = self._broker.call_soon
        if call_soon is None:
            self._run()
        else:
            self._scheduled = True
            call_soon(self._scheduled_run)

    def cancel(self) -> None:
        self._jobs.clear()
        self._live.clear()

    def _scheduled_run(self) -> None:
        self._scheduled = False
        self._run()

    def _room(self) -> int:
        """How many more deliveries may go now: 0 while the connection is congested
        or an in-memory queue is half full (:data:`CHUNK` at most)."""
        session = self._session
        conn = session.connection
        if conn is None:
            return CHUNK  # QoS 0 is dropped, QoS 1/2 queued or stored as for live messages
        if conn.congested:
            return 0
        feed = session.outflow.feed
        if isinstance(feed, MemoryFeed):  # a queue of its own, bounded: keep room
            return max(0, min(CHUNK, max(1, feed.max_queued // 2) - len(feed.queue)))
        return CHUNK  # the persistent path takes them through Kafka

    def _run(self) -> None:
        broker = self._broker
        session = self._session
        if broker.sessions.get(session.client_id) is not session:
            self.cancel()  # the session ended
            return
        acl = broker.acl
        jobs = self._jobs
        client_id = session.client_id
        while jobs:
            room = self._room()
            if room == 0:
                return  # resumed when the socket or the queue drains, or by the tick
            batch: list[tuple[Session, Delivery]] = []
            budget = CHUNK
            while jobs and budget > 0 and len(batch) < room:
                job = jobs[0]
                message = next(job.messages, False)
                if message is False:
                    jobs.popleft()
                    continue
                budget -= 1
                if message is None:
                    continue  # a walk tick
                assert isinstance(message, Message)
                if self._live.get(message.topic, 0) > job.since:
                    continue  # a newer live message went out already
                if acl.active and not acl.can_receive(client_id, message.topic):
                    continue
                qos = min(message.qos, job.qos)
                batch.append((session, Delivery(message, qos, True, job.subscription_ids)))
            if batch:
                broker.dispatch(batch, _no_ack, retained=True)
            if broker.call_soon is not None:
                break
        if jobs:
            self.resume()
        else:
            self._live.clear()
            if session.retained_sender is self:
                # Nothing left to send: the session drops it, so a live delivery does
                # not ask it (Broker.dispatch, the ack handlers); a SUBSCRIBE makes another.
                session.retained_sender = None


def _no_ack(ok: bool) -> None:
    """Retained messages sent on subscribe have no publisher waiting."""
