"""Several replicas, one broker: the sans-IO half of clustering (``cluster.enabled``).

Every replica keeps the whole subscription tree. A session whose connection
lives on another replica is a :class:`RemoteSession` there: it carries that
replica's subscriptions (so ``Broker.resolve`` finds them) and no connection;
a delivery to it is forwarded to its replica. :class:`ClusterState` turns
local events (connect, subscribe, unsubscribe, session end, a message stored
for a remote client) into control messages and applies the other replicas'
messages to this broker. It never touches a socket: the Redis pub/sub edge
(``persistence/cluster_link.py``) drains :meth:`ClusterState.data_to_send`
and feeds :meth:`ClusterState.receive` and :meth:`ClusterState.delivered`.

Control messages (orjson objects on ``<prefix>:subscriptions``; ``n`` is the
sending node, ``c`` the client id, ``e`` subscription entries as
``[filter, qos, no_local, retain_as_published, retain_handling, sub_id]``):

- ``conn``: ``c`` connected on ``n`` (``d`` durable, ``k`` clean start, ``s``
  its subscriptions, ``g`` its session generation, ``o`` its owner, ``ap``
  an APPLICATION session (docs/application-sessions.md); ``a``,
  ``p``, ``t`` its address, protocol level and connect time, for operators, ``t``
  also naming the connection in ``kept``): whoever
  holds a connection for ``c`` disconnects it with 0x8E and everyone records
  ``c`` as remote on ``n``;
- ``sub`` / ``unsub``: one subscription added / removed by ``c``'s owner
  (``sub`` with ``d``, ``g``, ``o``, ``u``, ``ap`` as ``conn``);
- ``off``: ``c``'s durable session lost its connection on ``n`` (kept);
- ``end``: ``c``'s session ended on ``n`` (its subscriptions go);
- ``sync``: ``n`` just started: every replica answers with ``snaps``, the
  snapshots of its sessions that have a live connection;
- ``tick``: sent every ``TICK_INTERVAL``: ``n``'s last sequence number;
- ``block`` / ``unblock``: a block-list entry ``v`` (broker/blocklist.py) was
  added / the one of key ``k`` removed: applied at once (every replica also
  re-reads the whole list from Redis now and then, pub/sub being at most once);
- ``kick``: an operator disconnects ``c`` (``x``: and ends its session) on the
  replica ``t`` holding it.
- ``kept``: ``n`` was holding ``c``'s durable session when the ``conn`` of time
  ``t`` from replica ``to`` took it over, and the group writes it had in flight
  are kept in Redis: ``to`` reads them back now (:meth:`ClusterState.await_kept`).

Every message a replica publishes on ``subscriptions``, ``stored`` and
``retained`` carries ``b``, a token of the sending process, and ``q``, its
sequence number in that process (``tick`` repeats the last one), and ``kv``:
1, this replica answers a takeover with ``kept``. A replica of a version
before ``kept`` sends no ``kv``: a takeover from it waits for nothing, as
before (:meth:`ClusterState.sends_kept`). Pub/sub
is at most once: a receiver that sees a sequence number skip (or a ``tick``
ahead of what it heard) missed something, and catches up as after a lost
connection (:meth:`ClusterState.resync`, and every connected persistent
session's store feed re-reads the store). A stored message thus reaches its client
within about ``TICK_INTERVAL`` plus a page read, whatever pub/sub lost.

The order of one replica's messages is kept (one Redis connection publishes
them in order; Redis delivers them in order). Rules that make late or
crossed messages harmless: a replica never lets a remote message change a
session it holds with a live connection except by ``conn`` (takeover); a
remote record is changed only by its owner, except that an offline durable
record is dropped by any replica that ended the session (it expired there).

Semantics (docs/deployment.md "Running several replicas"): persistent (durable) QoS 1/2
deliveries still go through Kafka, whichever replica routes them, and the
replica that stores them tells the replica holding the connection to re-read
the store (``stored``). Everything else to a remote client (QoS 0, clean
sessions) is forwarded over pub/sub: at most once, and the publisher's
PUBACK/PUBREC does not wait for it. A shared group picks among the members
of every replica, each replica round-robin on its own.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from broker.blocklist import BadEntry, BlockEntry, entry_from_json
from broker.group_queue import is_group_store
from broker.message import Delivery
from broker.outflow import MemoryFeed
from broker.session import NEVER_EXPIRES, Session
from broker.stats import BrokerStats
from broker.topics import SubscriptionEntry

if TYPE_CHECKING:
    from collections.abc import Sequence, Sized

    from broker.acl import Authorizer
    from broker.config import Settings
    from broker.connection_state import WillMessage
    from broker.persistent_path import PersistentPath
    from broker.topics import SubscriptionTree

log = logging.getLogger("devicemq.cluster")

SUBSCRIPTIONS = "subscriptions"  # channel suffixes; the edge adds "<prefix>:"
STORED = "stored"
RETAINED = "retained"  # topics whose retained message changed (persistence/retained_persistence.py)
DELIVER = "deliver:"  # + node id
SNAPSHOT_CHUNK = 500  # sessions per ``snaps`` message
RESYNC_WINDOW = 2.0  # seconds the snapshots of a re-sync have to confirm remote records
# A replica heard within this many seconds is waited for by a re-sync (ticks come every
# TICK_INTERVAL; the liveness key of a replica gone lasts 5 s).
ANSWER_FROM = 5.0
TICK_INTERVAL = 0.5  # seconds between a replica's ``tick`` (its last sequence number)
KEPT_REMEMBERED = 60.0  # seconds a ``kept`` notice no one waited for yet is remembered

Forward = Callable[[str, str, Delivery], None]


class _KeptWait:
    """A wait for a ``kept`` notice from ``node`` (:meth:`ClusterState.await_kept`), and
    the notices of this replica's own that must follow it."""

    __slots__ = ("followers", "node", "then")

    def __init__(self, node: str, then: Callable[[], None]) -> None:
        self.node = node
        self.then = then
        self.followers: list[Callable[[], None]] = []


class ClusterHost(Protocol):
    """What the cluster state uses of the broker (``Broker`` is one)."""

    @property
    def sessions(self) -> dict[str, Session]: ...
    @property
    def connections(self) -> Sized: ...
    @property
    def subscriptions(self) -> SubscriptionTree: ...
    @property
    def stats(self) -> BrokerStats: ...
    @property
    def acl(self) -> Authorizer: ...
    @property
    def persistent_path(self) -> PersistentPath: ...
    def add_block(self, entry: BlockEntry, *, share: bool = True) -> int: ...
    def remove_block(self, key: str, *, share: bool = True) -> BlockEntry | None: ...
    def kick(self, client_id: str, *, end_session: bool = False) -> bool: ...
    def dispatch(
        self, targets: Sequence[tuple[Session, Delivery]], on_accepted: Callable[[bool], None]
    ) -> None: ...
    def publish_will(self, will: WillMessage) -> None: ...
    def bind_owner(self, session: Session, owner: str | None) -> None: ...
    def forget_session(self, session: Session) -> None: ...


class RemoteSession(Session):
    """A session whose connection (or durable state's owner) is replica ``node``."""

    def __init__(
        self,
        client_id: str,
        node: str,
        durable: bool,
        online: bool,
        stats: BrokerStats,
        forward: Forward,
    ) -> None:
        super().__init__(
            client_id, NEVER_EXPIRES if durable else 0, 1, MemoryFeed(1, stats), stats, durable
        )
        self.node = node
        self.online = online
        self._forward = forward
        self._application = False  # what its replica said (``ap``)

    @property
    def application(self) -> bool:
        return self._application

    def deliver(self, delivery: Delivery) -> None:
        self._forward(self.node, self.client_id, delivery)


def entry_fields(entry: SubscriptionEntry) -> list[Any]:
    return [
        entry.topic_filter,
        entry.qos,
        entry.no_local,
        entry.retain_as_published,
        entry.retain_handling,
        entry.subscription_id,
    ]


def entry_of(client_id: str, fields: list[Any]) -> SubscriptionEntry:
    topic_filter, qos, no_local, rap, handling, sid = fields
    return SubscriptionEntry(client_id, topic_filter, qos, no_local, rap, handling, sid)


def node_id_of(settings: Settings) -> str:
    """This replica's name among the others: ``cluster.node_id``, else host and PID."""
    return settings.cluster.node_id or f"{socket.gethostname()}-{os.getpid()}"


def _nothing() -> None:
    pass


class ClusterState:
    """What this replica tells the others and what it heard from them, sans IO.

    The broker builds it (``cluster.enabled``) and calls it from the core and the
    handlers; the edge that carries it (persistence/cluster_link.py) plugs in
    with :meth:`connect_edge` and takes what is to be sent from
    :meth:`data_to_send`. Until then, and after :meth:`disconnect_edge`, what is
    to be sent waits.
    """

    def __init__(self, broker: ClusterHost, node_id: str) -> None:
        self.broker = broker
        self.node_id = node_id
        self._wake: Callable[[], None] = _nothing  # the edge: data_to_send() has something
        self._missed: Callable[[], None] = _nothing  # the edge: a sequence gap, catch up
        self.boot = secrets.token_hex(8)  # this process, to tell a restarted replica's numbers
        self._seq = 0  # the last sequence number sent
        self._heard: dict[str, tuple[str, int]] = {}  # node -> (its boot token, last number)
        self._sends_kept: set[str] = set()  # nodes whose last message carried ``kv``
        # False while this replica may not know every subscription the others hold
        # (its link dropped, or it missed messages): QoS 1/2 publishes wait (hold).
        self.current = True
        self._behind_waiting: list[Callable[[], None]] = []  # resumed once current
        self._answers_due: set[str] = set()  # replicas whose re-sync answer is awaited
        self.last_heard: dict[str, float] = {}  # node -> when it last spoke (epoch seconds)
        self.gaps = 0
        self._control: list[dict[str, Any]] = []
        self._stored: set[str] = set()
        self._deliveries: dict[str, list[tuple[str, Delivery]]] = {}
        self._handing: dict[Session, dict[str, Any]] = {}  # taken over by another node
        # (client id, the new connection's ``t``) -> what waits for the old replica's
        # ``kept`` (:meth:`await_kept`); and ``kept`` notices heard before a wait began.
        self._kept_waiting: dict[tuple[str, Any], _KeptWait] = {}
        self._kept_early: dict[tuple[str, Any], float] = {}
        self.forwarded = 0
        self.received = 0
        self._retained: list[str] = []
        self._unconfirmed: set[str] | None = None  # re-sync under way: not yet confirmed

    def connect_edge(self, wake: Callable[[], None], missed: Callable[[], None]) -> None:
        """The edge is up: ``wake()`` when something waits in :meth:`data_to_send`,
        ``missed()`` when a gap in another replica's numbers says notices were lost."""
        self._wake, self._missed = wake, missed

    def disconnect_edge(self) -> None:
        self._wake = self._missed = _nothing

    # -- local events (called by the broker core and handlers) -----------------------

    def opened(self, session: Session, clean_start: bool) -> None:
        """A client connected here: every other replica drops its connection (takeover)."""
        self._send(
            op="conn",
            c=session.client_id,
            d=session.durable,
            k=clean_start,
            s=[entry_fields(e) for e in session.subscriptions.values()],
            g=session.generation,
            o=session.owner,
            u=session.username,
            a=session.address,
            p=session.protocol_level,
            t=session.connected_at,
            ap=session.application,
        )

    def subscribed(self, session: Session, entry: SubscriptionEntry) -> None:
        self._send(
            op="sub",
            c=session.client_id,
            d=session.durable,
            e=entry_fields(entry),
            g=session.generation,
            o=session.owner,
            u=session.username,
            ap=session.application,
        )

    def unsubscribed(self, session: Session, topic_filter: str) -> None:
        self._send(op="unsub", c=session.client_id, f=topic_filter)

    def went_offline(self, session: Session) -> None:
        self._send(op="off", c=session.client_id)

    def ended(self, session: Session) -> None:
        """A session ended here: held here, or an offline durable record (an
        operator's delete, Broker.kick), which every replica drops on ``end``."""
        if not isinstance(session, RemoteSession) or (session.durable and not session.online):
            self._send(op="end", c=session.client_id)

    def to_reopen(self, client_id: str, clean_start: bool) -> Session | None:
        """Before a CONNECT opens ``client_id`` here: the session it must not resume
        from this replica's memory (None: none). A durable session is resumed from
        the store, which holds its state (held QoS 2 ids, subscriptions), or ended
        there by a clean start: the replicated view is only for routing, and a
        detached copy here may be stale (a ``conn`` or ``sub`` of another replica
        missed), so it is reopened from the store too, unless a clean start ends
        it. Durable ones keep routing until :meth:`claim` (the store answered); a
        clean remote record, with nothing stored, is forgotten now."""
        record = self.broker.sessions.get(client_id)
        if isinstance(record, RemoteSession):
            if not record.durable:
                self._drop(record)
            return record
        if record is not None and record.durable and record.connection is None:
            if clean_start or not all(record.incoming_qos2.values()):
                # A QoS 2 PUBLISH of the last connection is still being stored: its
                # outcome lands on this copy, which is then current (resumed as is).
                return None
            return record
        return None

    def claim(self, client_id: str) -> None:
        """``client_id`` is opened here from the store: forget the remote record or
        detached copy this replica held (without touching Redis)."""
        record = self.broker.sessions.get(client_id)
        if isinstance(record, RemoteSession) or (
            record is not None and record.durable and record.connection is None
        ):
            self._drop(record)

    def handed_over(self, session: Session, will: WillMessage | None) -> bool:
        """``broker.detach`` of a session another replica took over: no state is saved
        (the new owner has it); the will follows the single-node rules; the session
        becomes a remote record. False: not taken over, detach as usual."""
        change = self._handing.pop(session, None)
        if change is None:
            return False
        broker = self.broker
        if will is not None:
            delay = min(will.delay, session.expiry_interval)
            if delay <= 0 or change["k"]:  # resumed elsewhere: a delayed will is cancelled
                broker.publish_will(will)
        self._install(change)
        if session.durable:
            self._announce_kept(session, change)
        return True

    def _announce_kept(self, session: Session, change: dict[str, Any]) -> None:
        """The ``conn`` of ``change`` took over ``session``, durable, from here: its new
        owner reads back the group writes this replica keeps as the connection leaves
        (Outflow.left), told with ``kept`` once they are in Redis. A session still
        waiting for its own previous owner's notice passes this one on only after
        it (what that owner keeps is the new owner's to read too)."""
        client_id, since, to = session.client_id, change.get("t"), change["n"]

        def announce() -> None:
            self.broker.persistent_path.after_keeps(
                client_id, lambda: self._send(op="kept", c=client_id, t=since, to=to)
            )

        waiting = self._kept_waiting.get((client_id, session.connected_at))
        if waiting is None:
            announce()
        else:
            waiting.followers.append(announce)

    def await_kept(
        self, client_id: str, since: object, node: str, then: Callable[[], None]
    ) -> Callable[[], None]:
        """``then()`` once replica ``node``, which held ``client_id``'s connection, says
        the group writes it left with are kept: its answer to the ``conn`` of the
        connection opened here at ``since`` (tests/model/FINDINGS.md, finding 37).
        Answers a call that forgets the wait (given up: pub/sub is at most once, and
        that replica may be dead); :meth:`node_gone` ends the waits on ``node``."""
        key = (client_id, since)
        if self._kept_early.pop(key, None) is not None:
            then()
            return _nothing
        wait = _KeptWait(node, then)
        self._kept_waiting[key] = wait
        return lambda: self._end_kept_wait(key, wait)

    def _end_kept_wait(self, key: tuple[str, Any], wait: _KeptWait) -> None:
        """The wait is over: heard, given up, or its replica gone."""
        if self._kept_waiting.get(key) is not wait:
            return
        del self._kept_waiting[key]
        wait.then()
        for follower in wait.followers:
            follower()

    def _kept(self, change: dict[str, Any]) -> None:
        if change.get("to", self.node_id) != self.node_id:
            return  # another replica's takeover
        key = (change["c"], change.get("t"))
        wait = self._kept_waiting.get(key)
        if wait is not None:
            self._end_kept_wait(key, wait)
            return
        # Before the wait began: remembered a while (oldest first, dropped first).
        now = time.monotonic()
        early = self._kept_early
        early.pop(key, None)
        early[key] = now
        while early:
            oldest, at = next(iter(early.items()))
            if now - at <= KEPT_REMEMBERED:
                break
            del early[oldest]

    def blocked(self, entry: BlockEntry) -> None:
        self._send(op="block", v=entry.to_json())

    def unblocked(self, key: str) -> None:
        self._send(op="unblock", k=key)

    def kick(self, record: RemoteSession, end_session: bool) -> None:
        """An operator's disconnect of a client connected on ``record.node``."""
        self._send(op="kick", c=record.client_id, t=record.node, x=end_session)

    def stored_elsewhere(self, client_id: str, queue: bool = False) -> None:
        """Messages were stored for ``client_id``, whose connection is not here. A
        detached durable copy here may be stale (restored at start before the
        snapshots came, or a ``conn`` was missed): its client may be connected
        elsewhere, so it is announced too; a replica without it ignores the notice.
        ``queue``: entries of the queue it consumes ($ECQ), for any session; or of a
        group queue (``$queue/...``, broker/group_queue.py): every replica is told."""
        record = self.broker.sessions.get(client_id)
        if is_group_store(client_id) or (
            record is not None and (record.durable or queue) and record.connection is None
        ):
            if not self._stored:
                self._wake()
            self._stored.add(client_id)

    def forward(self, node: str, client_id: str, delivery: Delivery) -> None:
        batch = self._deliveries.get(node)
        if batch is None:
            if not self._deliveries and not self._control and not self._stored:
                self._wake()
            batch = self._deliveries[node] = []
        batch.append((client_id, delivery))
        self.forwarded += 1

    def request_sync(self) -> None:
        self._send(op="sync")

    def node_gone(self, node: str) -> None:
        """Nobody listens on ``node``'s channel (or its heartbeat expired): drop its
        clean sessions' records; its durable ones go offline (still routed, via Kafka)."""
        for record in list(self.broker.sessions.values()):
            if isinstance(record, RemoteSession) and record.node == node:
                self._lost(record)
        for key, wait in list(self._kept_waiting.items()):
            if wait.node == node:
                self._end_kept_wait(key, wait)  # it will not answer
        self._sends_kept.discard(node)
        self._answered(node)  # nor answer a re-sync

    def remote_nodes(self) -> set[str]:
        """The replicas this one holds live records of (their heartbeats are checked)."""
        return {
            s.node
            for s in self.broker.sessions.values()
            if isinstance(s, RemoteSession) and (s.online or not s.durable)
        }

    def replicas(self) -> list[dict[str, Any]]:
        """The cluster as this replica sees it (GET /api/v1/replicas): itself, then
        every replica it heard from or holds sessions of, with when it last spoke
        and how many clients are connected there."""
        connected: dict[str, int] = {}
        for s in self.broker.sessions.values():
            if isinstance(s, RemoteSession) and s.online:
                connected[s.node] = connected.get(s.node, 0) + 1
        others = sorted((set(self.last_heard) | set(connected)) - {self.node_id})
        here = {
            "node": self.node_id,
            "here": True,
            "last_seen": time.time(),
            "connected": len(self.broker.connections),
        }
        return [here] + [
            {
                "node": n,
                "here": False,
                "last_seen": self.last_heard.get(n),
                "connected": connected.get(n, 0),
            }
            for n in others
        ]

    def retained_changed(self, topics: list[str]) -> None:
        """Retained messages of ``topics`` were written to Redis: the others re-read them."""
        if not self._control and not self._stored and not self._deliveries and not self._retained:
            self._wake()
        self._retained.extend(topics)

    def resync(self) -> None:
        """Control messages may have been missed (the pub/sub connection dropped): ask
        for snapshots again; :meth:`resync_done` (``RESYNC_WINDOW`` later) forgets the
        live remote records that no snapshot or message confirmed. Until every replica
        heard from lately has answered (or that window ends), this one is not
        :attr:`current`."""
        self._unconfirmed = {
            s.client_id
            for s in self.broker.sessions.values()
            if isinstance(s, RemoteSession) and s.online
        }
        now = time.time()
        self._answers_due = {n for n, t in self.last_heard.items() if now - t < ANSWER_FROM}
        self.current = False
        self.request_sync()
        if not self._answers_due:  # nobody heard lately: nobody to wait for
            self._caught_up()

    def link_lost(self) -> None:
        """The pub/sub link dropped: what the others say meanwhile is lost, so a new
        subscription of theirs may be unknown here until the re-sync
        (tests/model/FINDINGS.md, finding 39). QoS 1/2 publishes wait (:meth:`hold`);
        the edge bounds the wait (:meth:`stop_holding`)."""
        self.current = False

    def hold(self, resume: Callable[[], None]) -> None:
        """Call ``resume`` once this replica is :attr:`current` again."""
        self._behind_waiting.append(resume)

    def stop_holding(self) -> None:
        """Route with what is known: the link stayed down, or the answers did not come."""
        self._caught_up()

    def _answered(self, node: str) -> None:
        if node in self._answers_due:
            self._answers_due.discard(node)
            if not self._answers_due:
                self._caught_up()

    def _caught_up(self) -> None:
        self.current = True
        self._answers_due = set()
        waiting, self._behind_waiting = self._behind_waiting, []
        for resume in waiting:
            resume()

    def resync_done(self) -> None:
        self._caught_up()  # at the latest: a replica that did not answer is not waited for
        unconfirmed, self._unconfirmed = self._unconfirmed, None
        for cid in unconfirmed or ():
            record = self.broker.sessions.get(cid)
            if isinstance(record, RemoteSession):
                log.info("cluster: %s on %s not confirmed by a re-sync", cid, record.node)
                self._lost(record)

    # -- output for the edge ---------------------------------------------------------

    def data_to_send(
        self,
    ) -> tuple[list[tuple[str, bytes]], dict[str, list[tuple[str, Delivery]]]]:
        """(channel suffix, payload) control messages in order, each with the next
        sequence number, and deliveries by node."""
        out = [(SUBSCRIPTIONS, self._numbered(change)) for change in self._control]
        if self._stored:
            out.append((STORED, self._numbered({"c": sorted(self._stored)})))
        if self._retained:
            topics = list(dict.fromkeys(self._retained))
            out.append((RETAINED, self._numbered({"t": topics})))
            self._retained = []
        deliveries = self._deliveries
        self._control, self._stored, self._deliveries = [], set(), {}
        return out, deliveries

    def tick(self) -> tuple[str, bytes]:
        """The periodic ``tick``: the last sequence number, so a lost last message
        is noticed without waiting for the next one."""
        return SUBSCRIPTIONS, orjson.dumps(
            {"op": "tick", "n": self.node_id, "b": self.boot, "q": self._seq, "kv": 1}
        )

    def _numbered(self, change: dict[str, Any]) -> bytes:
        self._seq += 1
        change["n"], change["b"], change["q"] = self.node_id, self.boot, self._seq
        change["kv"] = 1
        return orjson.dumps(change)

    def sends_kept(self, node: str) -> bool:
        """``node`` answers a takeover with ``kept`` (its last message said so): a
        replica of an older version never does, and waiting for it would hold every
        group member taken over from it for ``KEPT_WAIT`` during a rolling upgrade."""
        return node in self._sends_kept

    def _in_sequence(self, change: dict[str, Any]) -> bool:
        """Track the sender's sequence numbers; False: already heard (a re-send).
        A number skipped means messages were lost: the edge catches up."""
        node, boot, seq = change["n"], change.get("b"), change.get("q")
        if boot is None or seq is None:
            return True  # an older replica: no numbers
        heard = self._heard.get(node)
        is_tick = change.get("op") == "tick"
        if heard is None or heard[0] != boot:
            # First words of this process: nothing to compare with (whatever it said
            # before this replica subscribed, the ``sync`` answers cover).
            self._heard[node] = (boot, seq)
            return not is_tick
        last = heard[1]
        if seq <= last:
            return False  # a tick with nothing new, or a batch sent again after a failure
        if seq > last + 1 or is_tick:
            self.gaps += 1
            log.warning(
                "cluster: missed messages %d-%d of replica %s, catching up",
                last + 1,
                seq if is_tick else seq - 1,
                node,
            )
            self._missed()
        self._heard[node] = (boot, seq)
        return not is_tick

    # -- input from the edge -----------------------------------------------------------

    def receive(self, channel: str, payload: bytes) -> list[str]:
        """Apply a control message; returns the client ids of a ``stored`` notice
        (their sessions' store feeds re-read the store: the persistence layer's business), or
        the topics of a ``retained`` notice (re-read from Redis, likewise)."""
        change = orjson.loads(payload)
        if change.get("n") not in (None, self.node_id):
            self.last_heard[change["n"]] = time.time()  # ticks too: at least every tick
            if change.get("kv"):
                self._sends_kept.add(change["n"])
            else:  # an older version, or one that restarted as one
                self._sends_kept.discard(change["n"])
        if change.get("n") == self.node_id or not self._in_sequence(change):
            return []
        if channel == STORED:
            return list(change["c"])
        if channel == RETAINED:
            return list(change["t"])
        op = change["op"]
        if self._unconfirmed and op in ("conn", "sub", "unsub", "off"):
            self._unconfirmed.discard(change["c"])  # its owner spoke: it is current
        if op == "conn":
            self._connected_elsewhere(change)
        elif op == "sub":
            self._remote_subscribe(change)
        elif op == "unsub":
            record = self._owned_by(change)
            if record is not None:
                record.subscriptions.pop(change["f"], None)
                self.broker.subscriptions.remove(record.client_id, change["f"])
        elif op == "off":
            record = self._owned_by(change)
            if record is not None:
                record.online = False
        elif op == "end":
            self._remote_end(change)
        elif op == "sync":
            self._answer_sync()
        elif op == "block":
            try:
                entry = entry_from_json(change["v"])
            except (BadEntry, TypeError, AttributeError) as e:
                log.warning("a block-list entry from %s was not applied: %s", change["n"], e)
            else:
                self.broker.add_block(entry, share=False)
        elif op == "unblock":
            self.broker.remove_block(change["k"], share=False)
        elif op == "kept":
            self._kept(change)
        elif op == "kick":
            local = self.broker.sessions.get(change["c"])
            if change["t"] == self.node_id and not isinstance(local, RemoteSession):
                self.broker.kick(change["c"], end_session=bool(change["x"]))
        elif op == "snaps":
            for cid, durable, entries, *rest in change["l"]:
                if self._unconfirmed:
                    self._unconfirmed.discard(cid)
                generation, owner, username, address, protocol, since, application = [
                    *rest,
                    0,
                    None,
                    None,
                    None,
                    None,
                    None,
                    False,
                ][:7]
                self._snapshot(
                    {
                        "n": change["n"],
                        "c": cid,
                        "d": durable,
                        "s": entries,
                        "g": generation,
                        "o": owner,
                        "u": username,
                        "a": address,
                        "p": protocol,
                        "t": since,
                        "ap": application,
                    }
                )
            if change.get("e"):
                self._answered(change["n"])
        return []

    def delivered(self, client_id: str, delivery: Delivery) -> None:
        """A delivery another replica forwarded to a client connected here."""
        self.received += 1
        session = self.broker.sessions.get(client_id)
        if session is None or isinstance(session, RemoteSession):
            self.broker.stats.drop("cluster_forward_no_session")
            return
        self.broker.dispatch([(session, delivery)], _ignore)

    # -- rules -------------------------------------------------------------------------

    def _connected_elsewhere(self, change: dict[str, Any]) -> None:
        broker = self.broker
        session = broker.sessions.get(change["c"])
        if session is not None and not isinstance(session, RemoteSession):
            conn = session.connection
            if conn is not None:
                from broker.packets import ReasonCode

                log.info("client %s taken over by replica %s", session.client_id, change["n"])
                self._handing[session] = change
                conn.disconnect(ReasonCode.SESSION_TAKEN_OVER)  # -> broker.detach -> handed_over
                if self._handing.pop(session, None) is None:
                    return  # handed_over() installed the remote record
            else:
                if session.pending_will is not None and change["k"]:
                    will, session.pending_will = session.pending_will, None
                    broker.publish_will(will)  # ended by the clean start elsewhere
                if session.durable:
                    # Its connection broke here before the takeover was heard: what it
                    # kept as it left is the new owner's to read, once it landed.
                    self._announce_kept(session, change)
        self._install(change)

    def _snapshot(self, change: dict[str, Any]) -> None:
        session = self.broker.sessions.get(change["c"])
        if session is not None and session.connection is not None:
            return  # connected here: ours wins (a takeover comes as ``conn``)
        self._install(change)

    def _remote_subscribe(self, change: dict[str, Any]) -> None:
        broker = self.broker
        cid = change["c"]
        record = broker.sessions.get(cid)
        if isinstance(record, RemoteSession):
            if record.node != change["n"]:
                return  # stale: someone else owns it now
            if "ap" in change:
                record._application = bool(change["ap"])
        elif record is not None and record.connection is not None:
            return  # connected here
        else:
            record = self._install(
                {
                    "n": change["n"],
                    "c": cid,
                    "d": change["d"],
                    "s": [],
                    "g": change.get("g", 0),
                    "o": change.get("o"),
                    "u": change.get("u"),
                    "ap": change.get("ap"),
                }
            )
        entry = entry_of(cid, change["e"])
        broker.subscriptions.add(entry)
        record.subscriptions[entry.topic_filter] = entry

    def _remote_end(self, change: dict[str, Any]) -> None:
        session = self.broker.sessions.get(change["c"])
        if session is None or session.connection is not None:
            return
        if isinstance(session, RemoteSession):
            if session.node == change["n"] or (session.durable and not session.online):
                self._drop(session)
        else:
            # A detached durable copy here: the session expired or was ended elsewhere.
            session.pending_will = None
            self._drop(session)

    def _answer_sync(self) -> None:
        live = [
            [
                s.client_id,
                s.durable,
                [entry_fields(e) for e in s.subscriptions.values()],
                s.generation,
                s.owner,
                s.username,
                s.address,
                s.protocol_level,
                s.connected_at,
                s.application,
            ]
            for s in self.broker.sessions.values()
            if not isinstance(s, RemoteSession) and s.connection is not None
        ]
        # The last chunk says it is the last (``e``), an empty answer too: the asker
        # routes again by every subscription once each replica's answer is in.
        chunks = [live[i : i + SNAPSHOT_CHUNK] for i in range(0, len(live), SNAPSHOT_CHUNK)]
        chunks = chunks or [[]]
        for chunk in chunks[:-1]:
            self._send(op="snaps", l=chunk)
        self._send(op="snaps", l=chunks[-1], e=1)

    def _owned_by(self, change: dict[str, Any]) -> RemoteSession | None:
        record = self.broker.sessions.get(change["c"])
        if isinstance(record, RemoteSession) and record.node == change["n"]:
            return record
        return None

    def _install(self, change: dict[str, Any]) -> RemoteSession:
        """Record ``c`` as remote on ``n`` with the subscriptions ``s``, replacing
        whatever this replica had (a local copy is dropped without touching Redis)."""
        broker = self.broker
        cid = change["c"]
        old = broker.sessions.get(cid)
        if old is not None:
            self._drop(old)
        record = RemoteSession(
            cid, change["n"], bool(change["d"]), True, broker.stats, self.forward
        )
        record.generation = int(change.get("g") or 0)
        # An APPLICATION session's messages are produced to its topic by whichever
        # replica routes them (persistence/device_persistence.py submit).
        record._application = bool(change.get("ap"))
        broker.sessions[cid] = record
        broker.bind_owner(record, change.get("o"))
        record.username = change.get("u")
        record.address, record.protocol_level = change.get("a"), change.get("p")
        record.connected_at = record.last_seen = change.get("t")
        # The ACL decides for this client as its own replica does (user rules, %u).
        broker.acl.client_connected(cid, record.username)
        for fields in change["s"]:
            entry = entry_of(cid, fields)
            broker.subscriptions.add(entry)
            record.subscriptions[entry.topic_filter] = entry
        return record

    def _lost(self, record: RemoteSession) -> None:
        """``record``'s replica is gone or the record is stale: a clean session is
        dropped, a durable one kept offline (its messages still go to Kafka)."""
        if record.durable:
            record.online = False
        else:
            self._drop(record)

    def _drop(self, session: Session) -> None:
        """Forget a session here only: its tree entries, queue and timers; no Redis."""
        self.broker.forget_session(session)

    def _send(self, **change: Any) -> None:
        if not self._control and not self._stored and not self._deliveries:
            self._wake()
        self._control.append(change)


def _ignore(ok: bool) -> None:
    """Nobody waits for a forwarded delivery."""
