"""The broker core: sessions, subscriptions, retained messages and routing.

Sans-IO: it never touches a socket or a clock of its own. Connections are
:class:`~broker.connection.MQTTConnection` objects fed by the I/O edge, time
comes from the injected ``clock``, and the edge calls :meth:`Broker.tick`
periodically to run keep-alive, will-delay and session-expiry deadlines.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from broker.acl import Authorizer
from broker.auth import Authenticator, certificate_identity
from broker.blocklist import BlockEntry, BlockList, FlapDetector
from broker.budget import BYTES_LIMIT, GROUP, QUEUES_LIMIT, SESSION, OwnerBudget
from broker.cluster import ClusterState, RemoteSession, node_id_of
from broker.ecq import consumer_filter
from broker.group_queue import GroupTarget, is_group_filter
from broker.integrations import IntegrationRecord, IntegrationRules, IntegrationSink, Refusal
from broker.limits import LogLimiter, SourceBuckets, bucket_or_none
from broker.message import Delivery, Message
from broker.outflow import MemoryFeed
from broker.ownership import (
    CLIENT_ID,
    QUEUE,
    Claim,
    MemoryOwners,
    Owners,
    client_id_allowed,
    parse_patterns,
)
from broker.packets import ReasonCode
from broker.persistent_path import (
    AcceptedCallback,
    DoneCallback,
    InMemoryPersistentPath,
    OpenedSession,
    OpenRequest,
    PersistentPath,
)
from broker.retained import RetainedSender, RetainedStore
from broker.session import NEVER_EXPIRES, Session
from broker.stats import BrokerStats
from broker.sys_topics import SysTopics, node_name
from broker.topics import SubscriptionEntry, SubscriptionTree

if TYPE_CHECKING:
    from broker.config import Settings
    from broker.connection import MQTTConnection
    from broker.connection_state import WillMessage

log = logging.getLogger("devicemq.broker")

SLOW_CONNACK = 1.0  # seconds: a CONNACK that waited this long for the store is logged
# seconds: how often a detached session's passed deadline is looked at again while a
# CONNECT of its client is still being decided (Broker.connect_began)
DECIDING_RECHECK = 0.25
PRUNE_INTERVAL = 10.0  # seconds between two sweeps of ended block-list entries


# (session, session present, why it was refused: "" if it was not). Refusals:
# "unavailable" (the session's store could not be reached), "not_owner" (the
# client id's session belongs to someone else, auth.session_owner).
SessionOpened = Callable[["Session | None", bool, str], None]

# Where block-list entries the broker makes itself (flapping) are kept, shared
# with the other replicas (persistence/blocklist_store.py); returns at once.
KeepBlock = Callable[[BlockEntry], None]


def owner_policy(settings: Settings) -> str:
    """auth.session_owner resolved: username, certificate or none."""
    auth = settings.auth
    if auth.session_owner != "auto":
        return auth.session_owner
    if auth.password_file or auth.chain_members or auth.use_identity_as_username:
        return "username"
    if settings.tls.cafile:
        return "certificate"
    return "none"


def names_clients(settings: Settings) -> bool:
    """Can a client have a name (authentication configured)? Without one every client
    is anonymous: there is no owner to bind a client ID or a queue to."""
    auth = settings.auth
    return bool(
        auth.password_file
        or auth.chain_members
        or auth.use_identity_as_username
        or settings.tls.cafile
    )


def client_id_policy(settings: Settings) -> str:
    """auth.client_id_owner as it applies: ``off`` while nobody can have a name (no
    authentication configured: every client is anonymous, nothing to bind an ID to).
    ``username`` needs authentication, and each pattern must name the user (``%u``):
    a start error naming the setting otherwise."""
    from broker.config import ConfigError

    auth = settings.auth
    policy = auth.client_id_owner
    for pattern in parse_patterns(auth.client_id_pattern):
        if "%u" not in pattern:
            raise ConfigError(
                f"pattern {pattern!r} does not name the user (%u): it would give every "
                "user the same client IDs",
                name="auth.client_id_pattern",
            )
    if policy == "username" and not (
        auth.password_file or auth.chain_members or auth.use_identity_as_username
    ):
        raise ConfigError(
            "username needs authentication (auth.password_file, auth.chain or "
            "auth.use_identity_as_username): without it no client has a user name",
            name="auth.client_id_owner",
        )
    return policy if names_clients(settings) else "off"


def _ignore_stored(ok: bool) -> None:
    """QoS 0 publishers are owed nothing."""


def _ignore_claim(claim: Claim | None) -> None:
    """A claim refreshed as a connection ends: nobody waits on it."""


def _refusal_of(claim: Claim | None, quota: str = "") -> str:
    """A claim's answer as a refusal ("" granted, "not_owner", "unavailable", or
    ``quota``: the owner may hold no more)."""
    if claim is None:
        return "unavailable"
    if claim.quota:
        return quota
    return "" if claim.granted else "not_owner"


def _online(session: Session) -> bool:
    """Is a client connected to ``session``, here or on another replica?"""
    if isinstance(session, RemoteSession):
        return session.online
    return session.connection is not None


def _identity_of_session(session: Session) -> str | None:
    """:meth:`Broker.identity_of` of whoever holds ``session``."""
    return session.owner if session.owner is not None else session.username


def _unwatch(watched: MQTTConnection | Session) -> None:
    """Drop ``watched``'s deadline from the tick's heap (its entry stays, empty)."""
    entry = watched.due_entry
    if entry is not None:
        entry[2] = None
        watched.due_entry = None
    watched.watched_at = None


class Broker:
    def __init__(
        self,
        settings: Settings,
        clock: Callable[[], float] = time.monotonic,
        persistent_path: PersistentPath | None = None,
        *,
        wall_clock: Callable[[], float] = time.time,
        keep_block: KeepBlock | None = None,
        integration_sink: IntegrationSink | None = None,
        owners: Owners | None = None,
        authenticator: Authenticator | None = None,
        authorizer: Authorizer | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.wall_clock = wall_clock  # block-list deadlines are epoch seconds, shared
        self.persistent_path: PersistentPath = persistent_path or InMemoryPersistentPath()
        self.sessions: dict[str, Session] = {}
        self.connections: set[MQTTConnection] = set()
        self.subscriptions = SubscriptionTree()
        mqtt = settings.mqtt
        self.retained = RetainedStore(
            mqtt.max_retained_messages,
            mqtt.max_retained_bytes,
            mqtt.max_retained_messages_per_client,
            mqtt.max_retained_bytes_per_client,
        )
        # How the core defers work to the next event-loop iteration (the server
        # sets loop.call_soon); None: do it now (sans-IO tests).
        self.call_soon: Callable[[Callable[[], None]], object] | None = None
        self.stats = BrokerStats()
        # Built with their files and chain by the root (app/authentication.py); the
        # defaults, for settings that name no file and no chain, do no I/O.
        self.auth = authenticator or Authenticator(settings.auth, clock)
        self.acl = authorizer or Authorizer(
            settings.auth.acl_file, clock, grants=bool(self.auth.chain)
        )
        self._detached: set[Session] = set()  # sessions waiting for expiry or a will delay
        # Deadlines, earliest first, so a tick costs what is due, not one look at every
        # connection and offline session (BENCHMARKS.md, "The fleet shape"):
        # (when, seq, connection) and (when, seq, session); a session's live entry is
        # the one at its ``watched_at`` (the others are stale, dropped when they come).
        # An entry is a list [when, seq, object]: the object is set to None when it is
        # watched again or leaves (a closed connection, a session back or ended), so
        # the heap never keeps it alive until its old deadline.
        self._conn_due: list[list[Any]] = []
        self._session_due: list[list[Any]] = []
        self._due_seq = itertools.count()
        # Sessions whose retained messages are still being sent: the tick resumes them
        # in case nothing else wakes them.
        self._retained_waiting: set[Session] = set()
        self._connect_bucket = bucket_or_none(settings.mqtt.max_connection_rate, clock())
        per_source = settings.mqtt.max_connection_rate_per_source
        self._connect_by_source = SourceBuckets(per_source) if per_source > 0 else None
        # Refused CONNECTs are all counted (stats) but logged at a bounded rate.
        self.refusal_log = LogLimiter(logging.getLogger("devicemq.connect"), "connection refusals")
        # cluster.enabled: the other replicas (their edge plugs in: persistence/cluster_link.py)
        self.cluster: ClusterState | None = (
            ClusterState(self, node_id_of(settings)) if settings.cluster.enabled else None
        )
        # Client ids whose durable session the persistent path is opening: the
        # CONNECTs that came meanwhile, to open once it is done.
        self._opening: dict[str, list[Callable[[], None]]] = {}
        # Client ids being opened here while another replica holds their connection.
        self._taken_from: dict[str, str] = {}
        self._opening_since: dict[str, float] = {}  # when each began (a slow one is logged)
        # CONNECTs accepted and not yet answered, by client id, with when each began
        # (connect_began): while one waits (its client ID's claim, its session read
        # from the store), the client's detached session neither expires nor sends
        # its will, if that CONNECT began first and may resume it.
        self._deciding: dict[str, dict[MQTTConnection, float]] = {}
        self.owner_policy = owner_policy(settings)
        # Who holds each client ID (auth.client_id_owner) and $ECQ queue: shared by the
        # replicas through Redis (persistence/owner_store.py), else here.
        self.owners: Owners = owners or MemoryOwners(wall_clock)
        self.client_id_policy = client_id_policy(settings)
        self._names_clients = names_clients(settings)
        self._client_id_patterns = parse_patterns(settings.auth.client_id_pattern)
        # owner -> client ids of the sessions it holds (local, stored, other replicas')
        self._owned: dict[str, set[str]] = {}
        # auth.max_bytes_per_owner: who is over, as the last tally (persistence) found
        self.budget = OwnerBudget(settings.auth.max_bytes_per_owner)
        self._budget_log = LogLimiter(  # messages not stored for such an owner, 1 a second
            logging.getLogger("devicemq.budget"), "messages not stored", rate=1.0, burst=5.0
        )
        # $SYS topics and presence events (broker/sys_topics.py); sys_interval 0: none
        self.sys_topics = SysTopics(self, node_name(settings)) if settings.sys_interval else None
        # Refused before authentication (broker/blocklist.py); flapping adds to it.
        self.blocklist = BlockList()
        flapping = settings.flapping
        self._flapping = (
            FlapDetector(flapping.max_connects, flapping.window) if flapping.enabled else None
        )
        self._keep_block = keep_block
        self._pruned = clock()
        # Topic-to-Kafka rules (broker/integrations.py); none without a sink to produce to.
        self.integration_sink = integration_sink
        self.integration_rules = (
            IntegrationRules(settings.integrations)
            if integration_sink is not None and settings.integrations
            else None
        )

    # -- connections and sessions -------------------------------------------------------

    def connect_allowed(self, source: str) -> str | None:
        """Take a CONNECT token of ``source`` (a :func:`~broker.limits.source_key`), then
        one of the broker-wide rate; None if both had one, else which limit refused.

        The source's own bucket comes first and a CONNECT it refuses takes nothing
        from the broker-wide one, so one address cannot use up everyone's rate.
        """
        now = self.clock()
        by_source = self._connect_by_source
        if by_source is not None and not by_source.take(source, now):
            return "connection_rate_exceeded_per_source"
        bucket = self._connect_bucket
        if bucket is not None and not bucket.take(now):
            return "connection_rate_exceeded"
        return None

    def blocked(self, client_id: str, username: str | None, address: str) -> BlockEntry | None:
        """The block-list entry refusing this CONNECT, or None. A lookup only: it
        runs before authentication too, where nothing the client sends may be kept."""
        if len(client_id) > self.settings.mqtt.max_client_id_length:
            return None  # refused as too long later; never handed to a pattern
        return self.blocklist.match(client_id, username, address, self.wall_clock())

    def flapping(self, client_id: str) -> BlockEntry | None:
        """Count a CONNECT of ``client_id`` that authenticated and was let use the ID
        and its session (so nobody gets another client blocked by naming it); the one
        too many is the entry blocking it for ``flapping.ban_time``, to be put in force
        with :meth:`ban` once that CONNECT is refused."""
        if self._flapping is None or not client_id:
            return None
        now = self.wall_clock()
        if not self._flapping.connected(client_id, now):
            return None
        flapping = self.settings.flapping
        entry = BlockEntry(
            "client_id",
            client_id,
            f"flapping: more than {flapping.max_connects} connects in {flapping.window:g} s",
            now + flapping.ban_time,
            now,
            "flapping",
        )
        log.warning("client %s is flapping: blocked for %g s", client_id, flapping.ban_time)
        self.stats.flapping_blocks += 1
        return entry

    def ban(self, entry: BlockEntry) -> None:
        """Put an entry the broker made (:meth:`flapping`) in force, here and on every
        replica, and keep it with the shared list."""
        self.add_block(entry)
        if self._keep_block is not None:
            self._keep_block(entry)

    def add_block(self, entry: BlockEntry, *, share: bool = True) -> int:
        """Put ``entry`` in force here (and, with ``share``, on every replica): the
        open connections it matches are closed. Returns how many were."""
        self.blocklist.add(entry)
        if share and self.cluster is not None:
            self.cluster.blocked(entry)
        now = self.wall_clock()
        matched = [
            conn
            for conn in self.connections
            if conn.client_id is not None
            and entry.matches(conn.client_id, conn.username, conn.address)
            and not entry.expired(now)
        ]
        for conn in matched:
            log.info("client %s disconnected: blocked (%s)", conn.client_id, entry.key)
            conn.disconnect(ReasonCode.ADMINISTRATIVE_ACTION)
        return len(matched)

    def remove_block(self, key: str, *, share: bool = True) -> BlockEntry | None:
        if share and self.cluster is not None:
            self.cluster.unblocked(key)
        return self.blocklist.remove(key)

    def kick(self, client_id: str, *, end_session: bool = False) -> bool:
        """An operator's disconnect (DISCONNECT 0x98 on MQTT 5, a close on 3.1.1),
        and with ``end_session`` the end of the session and its stored messages,
        wherever the client is connected. False: no such session here or known
        on another replica."""
        session = self.sessions.get(client_id)
        if session is None:
            return False
        if isinstance(session, RemoteSession):
            if end_session and not session.online:
                # Nobody holds a connection: ended from here (the replica that held
                # it may be gone; the others drop their records on the "end").
                log.info("session %s ended by an operator", client_id)
                self.end_session(session)
            elif self.cluster is not None:
                self.cluster.kick(session, end_session)
            return True
        conn = session.connection
        if conn is not None:
            log.info("client %s disconnected by an operator", client_id)
            conn.disconnect(ReasonCode.ADMINISTRATIVE_ACTION)
        if end_session and self.sessions.get(client_id) is session:
            log.info("session %s ended by an operator", client_id)
            self.end_session(session)
        return True

    def assign_client_id(self) -> str:
        """An ID for a client that sent none: ``devicemq-`` and 32 characters from
        ``secrets`` (192 bits), cut to ``mqtt.max_client_id_length`` (at least 23: 84
        bits left), never one a session holds. No counter and no clock in it: one
        assigned ID must not tell another client's."""
        limit = self.settings.mqtt.max_client_id_length
        while True:
            client_id = f"devicemq-{secrets.token_urlsafe(24)}"[:limit]
            if client_id not in self.sessions:
                return client_id

    def open_session(
        self,
        conn: MQTTConnection,
        client_id: str,
        clean_start: bool,
        expiry_interval: int,
        then: SessionOpened,
    ) -> None:
        """Attach ``conn`` to its session, then ``then(session, session_present)``;
        ``then(None, False)`` if the session's store could not be reached.

        A client id already connected is taken over (MQTT-3.1.4-3); clean start
        discards the old session (MQTT-3.1.2-4), otherwise it is resumed and a
        will still waiting out its delay is cancelled (MQTT-3.1.3-9). A durable
        session this broker does not hold (new, or held by another replica, or
        stored only) is opened through the persistent path, which resumes the
        stored state or starts a new session with a new generation: ``then``
        may come later. CONNECTs of one client id are opened one at a time.
        """
        waiting = self._opening.get(client_id)
        if waiting is not None:
            waiting.append(
                lambda: self.open_session(conn, client_id, clean_start, expiry_interval, then)
            )
            return
        owner = self.owner_of(conn)
        existing = self.sessions.get(client_id)
        if existing is None and expiry_interval and self._over_budget(owner):
            # A new store for an owner over auth.max_bytes_per_owner (a session it holds
            # resumes, or is replaced by a clean start).
            self.budget.refused(SESSION, BYTES_LIMIT)
            then(None, False, "owner_budget")
            return
        if existing is not None and not self._may_own(existing.owner, owner):
            # Another owner's session (here, on another replica): not taken over,
            # not resumed, not ended by a clean start.
            then(None, False, "not_owner")
            return
        remote = self.cluster.to_reopen(client_id, clean_start) if self.cluster else None
        if (
            isinstance(remote, RemoteSession)
            and remote.online
            and remote.durable
            and not clean_start
            and any(is_group_filter(f) for f in remote.subscriptions)
            and self.cluster is not None
            and self.cluster.sends_kept(remote.node)
        ):
            # A group member connected there: what that replica keeps of its group
            # writes as the connection leaves is waited for (restore_group_writes).
            # Not from a replica of a version before ``kept``: it would never say.
            self._taken_from[client_id] = remote.node
        else:
            self._taken_from.pop(client_id, None)
        existing = self.sessions.get(client_id) if remote is None else None
        if existing is not None and existing.connection is not None:
            from broker.packets import ReasonCode

            log.info("client %s taken over by a new connection from %s", client_id, conn.peer)
            existing.connection.disconnect(ReasonCode.SESSION_TAKEN_OVER)
            existing = self.sessions.get(client_id)
        # A stored session discarded by clean start is gone from the store before
        # CONNACK says so (MQTT-3.1.2-4): a crash must not bring it back.
        ends = _Ends()
        if existing is not None and clean_start:
            self.end_session(existing, ends.one() if existing.durable else None)
            existing = None
        remote_durable = remote is not None and remote.durable
        if remote_durable and clean_start:
            assert remote is not None
            self.persistent_path.session_ended(remote, ends.one())  # fenced by generation
        if existing is not None:
            self._attach_then(conn, existing, clean_start, expiry_interval, True, then)
            return
        resuming_remote = remote_durable and not clean_start
        if not resuming_remote and self._over_owner_quota(owner):
            then(None, False, "owner_quota")
            return
        if expiry_interval == 0 and not resuming_remote:
            if ends.count:
                self._begin_opening(client_id)
                ends.then(lambda ok: self._open_in_memory(conn, client_id, clean_start, ok, then))
            else:
                self._open_in_memory(conn, client_id, clean_start, True, then)
            return
        self._begin_opening(client_id)
        request = OpenRequest(
            clean_start,
            None if expiry_interval == NEVER_EXPIRES else expiry_interval,
            conn.protocol_level,
            owner,
            conn.username,
            self.owner_policy != "none",
        )
        self.persistent_path.open(
            client_id,
            request,
            lambda opened: self._opened(
                conn, client_id, clean_start, expiry_interval, opened, then
            ),
        )

    def _open_in_memory(
        self,
        conn: MQTTConnection,
        client_id: str,
        clean_start: bool,
        ended: bool,
        then: SessionOpened,
    ) -> None:
        """A session that ends with its connection (expiry 0), once the session it
        replaces is ended in the store (``ended`` False: it could not be)."""
        queued = self._end_opening(client_id)
        try:
            if not ended:
                then(None, False, "unavailable")
            elif not conn.close_requested:
                if self.cluster is not None:
                    self.cluster.claim(client_id)  # the remote record it replaces
                session = self._new_session(client_id, 0, durable=False)
                self.sessions[client_id] = session
                self._attach(conn, session, clean_start, 0)
                then(session, False, "")
        finally:
            for retry in queued:
                retry()

    def _opened(
        self,
        conn: MQTTConnection,
        client_id: str,
        clean_start: bool,
        expiry_interval: int,
        opened: OpenedSession | None,
        then: SessionOpened,
    ) -> None:
        """The persistent path opened (or could not open) a durable session."""
        queued = self._end_opening(client_id)
        try:
            if opened is None:
                then(None, False, "unavailable")
                return
            if opened.refused:
                then(None, False, "not_owner")
                return
            if self.cluster is not None:
                # What this replica held (or learnt meanwhile) of the session: the
                # store's state replaces it.
                self.cluster.claim(client_id)
            session = self._new_session(client_id, expiry_interval, durable=True)
            session.generation = opened.generation
            session.opens = opened.opens
            if opened.resumed:
                for entry in opened.subscriptions:
                    self.subscriptions.add(entry)
                    session.subscriptions[entry.topic_filter] = entry
                session.incoming_qos2 = dict.fromkeys(opened.qos2_received, True)
            self.sessions[client_id] = session
            self.bind_owner(session, opened.owner)
            if conn.close_requested:
                # Gone while the session was opened: it stays, disconnected.
                self._start_expiry(session, self.clock())
                self.persistent_path.save_session(session, _ignore_stored)
                return
            self._attach_then(conn, session, clean_start, expiry_interval, opened.resumed, then)
        finally:
            for retry in queued:
                retry()

    def _attach_then(
        self,
        conn: MQTTConnection,
        session: Session,
        clean_start: bool,
        expiry_interval: int,
        present: bool,
        then: SessionOpened,
    ) -> None:
        """Attach, then answer: a durable session's terms as of this CONNECT (its
        expiry, connected) are saved before CONNACK, so a crash right after it
        neither brings back an older expiry (a resume with expiry 0 would outlive
        its connection) nor counts the expiry from an earlier disconnect. Later
        CONNECTs of the client id wait; a save that fails answers 0x88."""
        if not session.durable:
            self._attach(conn, session, clean_start, expiry_interval)
            then(session, present, "")
            return
        client_id = session.client_id
        self._begin_opening(client_id)
        asked = self.clock()

        def saved(ok: bool) -> None:
            waited = self.clock() - asked
            if waited >= SLOW_CONNACK:
                log.info(
                    "CONNACK to %s waited %.1f s for its session to be saved", client_id, waited
                )
            queued = self._end_opening(client_id)
            try:
                if ok:
                    then(session, present, "")
                else:
                    then(None, False, "unavailable")
            finally:
                for retry in queued:
                    retry()

        self._attach(conn, session, clean_start, expiry_interval, saved)

    def _attach(
        self,
        conn: MQTTConnection,
        session: Session,
        clean_start: bool,
        expiry_interval: int,
        on_saved: DoneCallback = _ignore_stored,
    ) -> None:
        session.expiry_interval = expiry_interval
        session.pending_will = None
        session.will_at = None
        session.expires_at = None
        self._detached.discard(session)
        _unwatch(session)
        session.connection = conn
        conn.session = session
        if session.owner is None:  # an unbound session is bound to its first owner
            self.bind_owner(session, self.owner_of(conn))
        session.username = conn.username
        session.connected_at = session.last_seen = self.wall_clock()
        session.address, session.protocol_level = conn.address, conn.protocol_level
        self.connections.add(conn)
        self.stats.connections_total += 1
        if self.sys_topics is not None:
            self.sys_topics.connected(conn, session, clean_start)
        if self.cluster is not None:
            self.cluster.opened(session, clean_start)  # other replicas drop theirs
        if session.durable:
            self.persistent_path.save_session(session, on_saved)

    def consume_queue(self, session: Session) -> bool:
        """Deliver the client's exclusive compacted queue to ``session`` (broker/ecq.py),
        once it holds ``$ECQ/{cid}/#``. False: this broker keeps no queues."""
        outflow = session.outflow
        if outflow.side is not None:
            # Perhaps one attached by restore_queue_inflight, still reading what was in
            # flight: it goes on with the queue once done (seed 9101).
            outflow.side.consuming = True
            return True
        feed = outflow.detached_side or self.persistent_path.queue_feed(session)
        if feed is None:
            return False
        feed.consuming = True
        session.outflow.attach_side(feed)
        return True

    def join_group(self, session: Session, topic_filter: str) -> None:
        """``session`` holds ``$queue/{group}/{filter}``: its share of the group queue
        is delivered to it (broker/group_queue.py); once per connection is enough."""
        if topic_filter in session.outflow.groups:
            return
        feed = self.persistent_path.group_feed(session, topic_filter)
        if feed is not None:
            session.outflow.attach_group(topic_filter, feed)

    def restore_queue_inflight(self, session: Session) -> None:
        """A persistent session resumed without its queue's subscription may still
        hold queue entries in flight (sent before an unsubscribe, then a restart of
        the broker): their packet ids are read back before any other goes out, and
        they complete; nothing more is taken from the queue."""
        outflow = session.outflow
        if outflow.side is not None or outflow.detached_side is not None:
            return  # this process knows what it sent
        feed = self.persistent_path.queue_feed(session)
        if feed is not None:
            feed.consuming = False
            outflow.attach_side(feed)

    def restore_group_writes(self, session: Session) -> None:
        """A resumed persistent session's first connection in this process (after a
        restart, or taken over from another replica): the group writes it left with
        in flight are read back (this process knows nothing of them) and sent again
        under their packet ids, before any other identifier is given."""
        taken_from = self._taken_from.pop(session.client_id, None)
        if not session.outflow.resumed_here:
            self.persistent_path.restore_group_writes(session, taken_from)

    def restore_session(
        self,
        client_id: str,
        expiry_interval: int,
        subscriptions: list[SubscriptionEntry],
        expires_in: float | None,
    ) -> Session:
        """Recreate a durable session saved before a restart, disconnected."""
        session = self._new_session(client_id, expiry_interval, durable=True)
        for entry in subscriptions:
            self.subscriptions.add(entry)
            session.subscriptions[entry.topic_filter] = entry
        if expires_in is not None:
            session.expires_at = self.clock() + expires_in
        self.sessions[client_id] = session
        self._detached.add(session)
        self._watch_session(session)
        return session

    def _new_session(self, client_id: str, expiry_interval: int, durable: bool) -> Session:
        """A session whose outgoing messages wait in memory, or where the persistent
        path keeps them (durable)."""
        mqtt = self.settings.mqtt
        feed = self.persistent_path.feed_for(client_id) if durable else None
        if feed is None:
            drop_oldest = mqtt.queue_drop_policy == "oldest"
            feed = MemoryFeed(
                mqtt.max_queued_messages, self.stats, drop_oldest, mqtt.max_queued_bytes
            )
        acl = self.acl
        may_receive = (lambda topic: acl.can_receive(client_id, topic)) if acl.active else None
        return Session(
            client_id, expiry_interval, mqtt.max_inflight, feed, self.stats, durable, may_receive
        )

    def detach(self, conn: MQTTConnection, publish_will: bool) -> None:
        """The connection ended: start the will delay and the session expiry."""
        self.connections.discard(conn)
        _unwatch(conn)
        if self._deciding and conn.client_id is not None:
            self.connect_settled(conn, conn.client_id)  # closed before its CONNACK
        session = conn.session
        will = conn.will
        conn.will = None
        if session is None:
            return
        self._touch_client_id(conn)
        conn.session = None
        session.connection = None
        session.outflow.left()  # what group queues gave it goes to other members
        session.last_seen = self.wall_clock()
        if self.sys_topics is not None:
            self.sys_topics.disconnected(conn, session)
        if self.cluster is not None and self.cluster.handed_over(
            session, will if publish_will else None
        ):
            return  # another replica took the client over: it owns the session now
        now = self.clock()
        if will is not None and publish_will:
            delay = min(will.delay, session.expiry_interval)
            if delay <= 0:
                self.publish_will(will)
            else:
                session.pending_will = will
                session.will_at = now + delay
        if session.expiry_interval == 0:
            # Its expiry (0) ends it, as the tick's would: fenced like it, so a resume
            # on another replica that answered first keeps the session (finding 42).
            self.end_session(session, expired=True)
            return
        self._start_expiry(session, now)
        if session.durable:
            self.persistent_path.save_session(session, _ignore_stored)
            if self.cluster is not None:
                self.cluster.went_offline(session)

    def _touch_client_id(self, conn: MQTTConnection) -> None:
        """auth.client_id_owner first: the client ID was used until now, so its claim
        lasts client_id_release_after from here. A connection shorter than a tenth of
        that leaves the claim its CONNECT made (at least 90% of it is left): most
        disconnects, and a shutdown's, write nothing."""
        identity = self.identity_of(conn)
        if self.client_id_policy != "first" or not conn.client_id or identity is None:
            return
        ttl = self.settings.auth.client_id_release_after
        if ttl and self.clock() - conn.opened_at < ttl / 10:
            return
        self.owners.claim(CLIENT_ID, conn.client_id, identity, ttl, _ignore_claim)

    def owner_of(self, conn: MQTTConnection) -> str | None:
        """Who a session opened by ``conn`` belongs to (auth.session_owner)."""
        policy = self.owner_policy
        if policy == "username":
            return conn.username
        if policy == "certificate" and conn.peer_certificate is not None:
            return certificate_identity(
                conn.peer_certificate, self.settings.auth.certificate_identity
            )
        return None

    def identity_of(self, conn: MQTTConnection) -> str | None:
        """Who owns the client ID and the queue ``conn`` claims (broker/ownership.py): its
        session owner (auth.session_owner), else its authenticated user name; None:
        anonymous, who owns nothing."""
        owner = self.owner_of(conn)
        return owner if owner is not None else conn.username

    def client_id_refusal(self, conn: MQTTConnection, client_id: str) -> str:
        """auth.client_id_owner username: why ``conn`` may not use ``client_id`` ("":
        it may), said in the CONNACK's log line."""
        if self.client_id_policy != "username" or client_id_allowed(
            client_id, conn.username, self._client_id_patterns
        ):
            return ""
        who = f"user {conn.username!r}" if conn.username is not None else "an anonymous client"
        return f"client id {client_id!r} is not {who}'s (auth.client_id_owner: username)"

    def claim_client_id(
        self, conn: MQTTConnection, client_id: str, then: Callable[[str], None]
    ) -> None:
        """auth.client_id_owner first: ``then("")`` if ``conn``'s owner holds the client
        ID now (claimed if it was free), ``then("not_owner")`` if another owner does,
        ``then("unavailable")`` if the claims could not be reached. A client connected
        with it as another owner holds it too (its claim may have run out meanwhile)."""
        if self.client_id_policy != "first":
            then("")
            return
        identity = self.identity_of(conn)
        live = self.sessions.get(client_id)
        if live is not None and _online(live) and _identity_of_session(live) != identity:
            then("not_owner")
            return
        ttl = self.settings.auth.client_id_release_after
        self.owners.claim(CLIENT_ID, client_id, identity, ttl, lambda c: then(_refusal_of(c)))

    def claim_queue(self, conn: MQTTConnection, then: Callable[[str], None]) -> None:
        """May ``conn`` consume its client ID's $ECQ queue (broker/ecq.py)? Its ACL must
        let it read ``$ECQ/{cid}/#``, as any topic (``then("not_authorized")``), and the
        queue must be its owner's: the owner of its first consumer, claimed now if
        the queue has none (``then("not_owner")``: another's). ``then("")``: it may."""
        client_id = conn.client_id
        assert client_id is not None
        if not self.acl.can_subscribe(
            client_id, conn.username, consumer_filter(client_id), conn.address
        ):
            then("not_authorized")
            return
        if not self._names_clients:
            then("")  # every client is anonymous: nobody to bind the queue to
            return
        identity = self.identity_of(conn)
        most: int | None = self.settings.ecq.max_queues_per_owner or None
        quota = QUEUES_LIMIT  # then("max_queues_per_owner"): one queue more than that
        if self._over_budget(identity):
            most, quota = 0, BYTES_LIMIT  # a queue it holds, not a new one
        self.owners.claim(
            QUEUE, client_id, identity, 0, lambda c: then(_refusal_of(c, quota)), most
        )

    def _over_budget(self, owner: str | None) -> bool:
        """Is ``owner`` over auth.max_bytes_per_owner (the last tally)?"""
        over = self.budget.over
        return bool(over) and owner in over

    def _over_owner_quota(self, owner: str | None) -> bool:
        """Would one more session be over auth.max_sessions_per_owner for ``owner``?"""
        limit = self.settings.auth.max_sessions_per_owner
        return bool(limit) and owner is not None and len(self._owned.get(owner, ())) >= limit

    def group_queues_of(self, owner: str) -> set[str]:
        """The group queues ($queue/...) the sessions of ``owner`` this broker knows
        (other replicas' included) are members of."""
        held: set[str] = set()
        sessions = self.sessions
        for client_id in self._owned.get(owner, ()):
            session = sessions.get(client_id)
            if session is not None:
                held.update(f for f in session.subscriptions if is_group_filter(f))
        return held

    def sessions_owned(self, owner: str) -> int:
        """How many sessions ``owner`` holds (auth.max_sessions_per_owner counts them)."""
        return len(self._owned.get(owner, ()))

    def stores_by_owner(self) -> dict[str, tuple[list[str], set[str]]]:
        """Each owner's stores this broker knows of (other replicas' sessions included):
        the client ids of its durable sessions, and the group queues they are members
        of (each once). Read by the tally of auth.max_bytes_per_owner."""
        out: dict[str, tuple[list[str], set[str]]] = {}
        sessions = self.sessions
        for owner, client_ids in self._owned.items():
            durable: list[str] = []
            groups: set[str] = set()
            for client_id in client_ids:
                session = sessions.get(client_id)
                if session is None or not session.durable:
                    continue
                durable.append(client_id)
                for topic_filter in session.subscriptions:
                    if is_group_filter(topic_filter):
                        groups.add(topic_filter)
            if durable:
                out[owner] = (durable, groups)
        return out

    def bind_owner(self, session: Session, owner: str | None) -> None:
        """``session`` (here, or a record of another replica's) belongs to ``owner``."""
        self.unbind_owner(session)
        session.owner = owner
        if owner is not None:
            self._owned.setdefault(owner, set()).add(session.client_id)

    def unbind_owner(self, session: Session) -> None:
        """``session`` is gone from this broker's view: its owner holds one less."""
        owner = session.owner
        if owner is None:
            return
        held = self._owned.get(owner)
        if held is not None and self.sessions.get(session.client_id) is not session:
            held.discard(session.client_id)
            if not held:
                del self._owned[owner]

    def _may_own(self, session_owner: str | None, owner: str | None) -> bool:
        return self.owner_policy == "none" or session_owner is None or session_owner == owner

    def _start_expiry(self, session: Session, now: float) -> None:
        if session.expiry_interval != NEVER_EXPIRES:
            session.expires_at = now + session.expiry_interval
        self._detached.add(session)
        self._watch_session(session)

    def forget_session(self, session: Session) -> None:
        """Forget a session on this broker only: its filters, queue, index entry,
        owner and timers. Nothing is written; its end is someone else's (another
        replica owns it now) or :meth:`end_session`'s."""
        for topic_filter in session.subscriptions:
            self.subscriptions.remove(session.client_id, topic_filter)
        session.subscriptions.clear()
        session.outflow.discard()
        if self.sessions.get(session.client_id) is session:
            del self.sessions[session.client_id]
        self.unbind_owner(session)
        self._detached.discard(session)
        _unwatch(session)

    def end_session(
        self, session: Session, on_ended: DoneCallback | None = None, expired: bool = False
    ) -> None:
        """Discard a session; a will still waiting for its delay is sent now.
        ``on_ended(ok)``: a durable session's end was written (or could not be).
        ``expired``: ended by its expiry (the tick's deadline, or 0 at its
        disconnect); the store keeps it if a client resumed it since (on another
        replica: ``Session.opens``)."""
        if self.cluster is not None:
            self.cluster.ended(session)
        self.forget_session(session)
        if session.durable:
            self.persistent_path.session_ended(session, on_ended, expired)
        elif on_ended is not None:
            on_ended(True)
        self.acl.forget(session.client_id)
        if session.retained_sender is not None:
            session.retained_sender.cancel()
            session.retained_sender = None
        if session.pending_will is not None:
            will, session.pending_will = session.pending_will, None
            self.publish_will(will)

    def publish_will(self, will: WillMessage) -> None:
        """Publish a will; its expiry interval starts now (spec 3.1.3.2.4).

        The ACL is asked again: it may have been reloaded since CONNECT, and a
        will whose topic its client may no longer write is dropped.
        """
        message = will.message
        acl = self.acl
        if acl.active and not acl.may_publish(
            will.client_id, will.username, will.grant, message.topic
        ):
            self.stats.drop("will_not_authorized")
            log.info(
                "will of %s on %r not published: the ACL no longer allows it",
                will.client_id,
                message.topic,
            )
            return
        if will.expiry_interval is not None:
            message = replace(message, expires_at=self.clock() + will.expiry_interval)
        if message.retain:
            over = self.retained.over_limit(message)
            if over is None:
                self.retained.store(message)
            else:  # still published, not kept
                self.stats.drop(over)
                log.info("will of %s on %r not retained: %s", will.client_id, message.topic, over)
        self.dispatch(self.resolve(message), _ignore_stored)
        records = self.integration_records(message, will.client_id, will.username)
        if records:
            self.integrate(records, _ignore_stored, best_effort=True)  # nobody sends again

    def integration_records(
        self, message: Message, client_id: str, username: str | None
    ) -> list[IntegrationRecord]:
        """The records the integration rules make of ``message``, published by
        ``client_id`` and allowed by the ACL: one per matching rule."""
        rules = self.integration_rules
        if rules is None:
            return []
        return rules.records(message, client_id, username, self.wall_clock())

    def integrate(
        self,
        records: Sequence[IntegrationRecord],
        on_accepted: AcceptedCallback,
        on_settled: AcceptedCallback | None = None,
        *,
        best_effort: bool = False,
    ) -> Refusal | None:
        """Produce ``records`` to the user's Kafka topics; ``on_accepted(ok)`` and
        ``on_settled`` as for :meth:`dispatch` (a PUBACK waits for both). A
        :class:`~broker.integrations.Refusal`: refused at once, nothing produced and
        no callback runs (:meth:`broker.integrations.IntegrationSink.submit`)."""
        assert self.integration_sink is not None
        return self.integration_sink.submit(
            records, on_accepted, on_settled, best_effort=best_effort
        )

    def connect_began(self, conn: MQTTConnection, client_id: str) -> None:
        """``conn``'s CONNECT names ``client_id`` and is accepted so far: until it is
        answered (:meth:`connect_settled`) or its socket closes, a detached session of
        ``client_id`` whose expiry or will delay passes after it began waits for it,
        if it may resume the session (:meth:`_may_resume`: a stranger's CONNECT holds
        nothing back). The client came back before the deadline: the session is
        resumed, not ended in the store while the CONNECT reads it from there
        (finding 40), and its will is not sent (MQTT-3.1.3-9). The connect timeout
        bounds the wait."""
        self._deciding.setdefault(client_id, {})[conn] = self.clock()

    def connect_settled(self, conn: MQTTConnection, client_id: str) -> None:
        """``conn``'s CONNECT of ``client_id`` is answered, or its socket closed."""
        deciding = self._deciding.get(client_id)
        if deciding is not None:
            deciding.pop(conn, None)
            if not deciding:
                del self._deciding[client_id]

    def _resuming(self, session: Session, deadline: float) -> bool:
        """Is a CONNECT that began by ``deadline`` and may resume ``session`` still
        being decided?"""
        deciding = self._deciding.get(session.client_id)
        return deciding is not None and any(
            began <= deadline and self._may_resume(session, conn)
            for conn, began in deciding.items()
        )

    def _may_resume(self, session: Session, conn: MQTTConnection) -> bool:
        """Could ``conn``'s CONNECT resume ``session``: its owner's (auth.session_owner),
        and under auth.client_id_owner first the same identity as the client ID's
        last holder? A stranger's CONNECT is refused, so it waits for nothing."""
        if not self._may_own(session.owner, self.owner_of(conn)):
            return False
        return self.client_id_policy != "first" or (
            _identity_of_session(session) == self.identity_of(conn)
        )

    def _begin_opening(self, client_id: str) -> None:
        """CONNECTs of ``client_id`` wait until :meth:`_end_opening`."""
        self._opening.setdefault(client_id, [])
        self._opening_since.setdefault(client_id, self.clock())

    def _end_opening(self, client_id: str) -> list[Callable[[], None]]:
        self._opening_since.pop(client_id, None)
        return self._opening.pop(client_id, [])

    def tick(self) -> None:
        """Run every deadline that has passed: connect timeout, keep-alive, wills, expiry."""
        now = self.clock()
        self.refusal_log.flush(now)
        self._budget_log.flush(now)
        if now - self._pruned >= PRUNE_INTERVAL:
            self._pruned = now
            self.blocklist.prune(self.wall_clock())
        for client_id, since in list(self._opening_since.items()):
            if now - since >= SLOW_CONNACK * 3:
                self._opening_since[client_id] = now  # logged again if it goes on
                log.warning(
                    "CONNECT of %s has waited %.1f s for its session store (%d more queued)",
                    client_id,
                    now - since,
                    len(self._opening.get(client_id, ())),
                )
        due = self._conn_due
        connections = self.connections
        while due and due[0][0] <= now:
            conn = heapq.heappop(due)[2]
            if conn is None or conn not in connections:
                continue  # watched again since, or it ended
            conn.watched_at, conn.due_entry = None, None
            next_look = conn.check_timeouts(now)
            if next_look is not None and conn in connections:
                # A deadline reached but not passed (the rules say "more than") is
                # looked at again by the next tick.
                self.watch_connection(conn, max(next_look, math.nextafter(now, math.inf)))
        for session in list(self._retained_waiting):
            sender = session.retained_sender
            if sender:
                sender.resume()  # in case nothing else woke it
            else:
                self._retained_waiting.discard(session)
        sessions_due = self._session_due
        while sessions_due and sessions_due[0][0] <= now:
            # its own name: ``session`` above is a Session, and None is no Session
            # (compiled with mypyc the assignment of None raised TypeError)
            popped: Session | None = heapq.heappop(sessions_due)[2]
            if popped is None or popped not in self._detached:
                continue  # watched again since, back, or ended
            session = popped
            session.watched_at, session.due_entry = None, None
            if session.client_id in self._deciding and self._resuming(
                session, min(t for t in (session.will_at, session.expires_at) if t is not None)
            ):
                # A CONNECT of its client, made before this deadline, is still being
                # decided: the deadline waits for it (connect_began).
                self._watch_session_at(session, now + DECIDING_RECHECK)
                continue
            if session.will_at is not None and now >= session.will_at:
                will, session.pending_will, session.will_at = session.pending_will, None, None
                if will is not None:
                    self.publish_will(will)
            if session.expires_at is not None and now >= session.expires_at:
                log.info("session %s expired", session.client_id)
                self.end_session(session, expired=True)
            elif session in self._detached:
                self._watch_session(session)

    def watch_connection(self, conn: MQTTConnection, when: float) -> None:
        """Look at ``conn``'s deadlines (connect timeout, keep-alive, in-flight timeout)
        at ``when``, instead of when it was to be looked at before."""
        if when == conn.watched_at:
            return
        _unwatch(conn)
        conn.watched_at = when
        conn.due_entry = entry = [when, next(self._due_seq), conn]
        heapq.heappush(self._conn_due, entry)

    def _watch_session(self, session: Session) -> None:
        """Queue the offline session's next deadline (its will delay or its expiry)."""
        deadlines = [t for t in (session.will_at, session.expires_at) if t is not None]
        if not deadlines:
            _unwatch(session)
            return
        self._watch_session_at(session, min(deadlines))

    def _watch_session_at(self, session: Session, when: float) -> None:
        if when == session.watched_at:
            return  # its entry is queued already
        _unwatch(session)
        session.watched_at = when
        session.due_entry = entry = [when, next(self._due_seq), session]
        heapq.heappush(self._session_due, entry)

    # -- routing ------------------------------------------------------------------------

    def resolve(self, message: Message) -> list[tuple[Session | GroupTarget, Delivery]]:
        """Who gets ``message``, and on what terms.

        A client whose subscriptions overlap gets one copy at the highest
        granted QoS carrying every matching subscription identifier; each
        shared group gives the message to one member (MQTT-4.8.2), chosen
        among the members whose ACL lets them read the topic.
        """
        match = self.subscriptions.match(message.topic)
        by_client: dict[str, Delivery] = {}
        more_ids: dict[str, list[int]] | None = None  # a client's further subscription ids
        origin = message.origin
        message_qos = message.qos
        for entry in match.entries:
            client_id = entry.client_id
            if entry.no_local and client_id == origin:
                continue  # MQTT-3.8.3-3
            qos = entry.qos if entry.qos < message_qos else message_qos
            delivery = by_client.get(client_id)
            if delivery is None:
                retain = message.retain and entry.retain_as_published
                ids = (entry.subscription_id,) if entry.subscription_id else ()
                by_client[client_id] = Delivery(message, qos, retain, ids)
                continue
            # The same client by another of its filters: one copy, merged in
            # constant time per filter (ids collected in a list, not tuple copies).
            if qos > delivery.qos:
                delivery.qos = qos
            if entry.retain_as_published and message.retain:
                delivery.retain = True
            if entry.subscription_id:
                if more_ids is None:
                    more_ids = {}
                extra = more_ids.get(client_id)
                if extra is None:
                    extra = more_ids[client_id] = []
                extra.append(entry.subscription_id)
        if more_ids is not None:
            for client_id, extra in more_ids.items():
                delivery = by_client[client_id]
                delivery.subscription_ids = (*delivery.subscription_ids, *extra)
        sessions = self.sessions
        may_receive: Callable[[str], bool] | None = None
        if self.acl.active:  # a client whose ACL denies reading the topic gets nothing
            can_receive, topic = self.acl.can_receive, message.topic
            for cid in [cid for cid in by_client if not can_receive(cid, topic)]:
                del by_client[cid]
                self.stats.drop("not_authorized_receive")

            def may_receive(client_id: str) -> bool:
                return can_receive(client_id, topic)

        # A loop, not a comprehension: no Python frame per PUBLISH on Python 3.11 (for
        # one target, 3.1k against 4.0k instructions; zip(strict=True) took 7.6k).
        targets: list[tuple[Session | GroupTarget, Delivery]] = []
        for cid, delivery in by_client.items():
            targets.append((sessions[cid], delivery))
        for group in match.groups:
            if group.queue:
                # A durable group queue keeps it once for the group (broker/group_queue.py),
                # if some member may read it; at QoS 0 it is not queued. Kept nowhere
                # (group_queues.enabled turned off since members subscribed): not routed.
                if not self.persistent_path.keeps_groups:
                    continue
                if message.qos and self.budget.over and self._group_over(group.members):
                    # Every member's owner is over auth.max_bytes_per_owner: not stored.
                    self._not_stored(GROUP, f"{group.name}/{group.topic_filter}", message)
                elif message.qos and (
                    may_receive is None or any(may_receive(m.client_id) for m in group.members)
                ):
                    target = GroupTarget(f"{group.name}/{group.topic_filter}")
                    targets.append((target, Delivery(message, 1, False, ())))
                elif message.qos:
                    self.stats.drop("not_authorized_receive")
                continue
            # A shared group picks among the members the ACL lets read the topic.
            member = group.pick(self._is_online, may_receive)
            if member is None:
                self.stats.drop("not_authorized_receive")
            else:
                qos = member.qos if member.qos < message.qos else message.qos
                ids = (member.subscription_id,) if member.subscription_id else ()
                retain = message.retain and member.retain_as_published
                targets.append((sessions[member.client_id], Delivery(message, qos, retain, ids)))
        return targets

    def send_retained(
        self, session: Session, topic_filter: str, qos: int, subscription_ids: tuple[int, ...]
    ) -> None:
        """Send ``session`` the retained messages of a granted subscription, a chunk per
        event-loop iteration (:class:`~broker.retained.RetainedSender`)."""
        sender = session.retained_sender
        if sender is None:
            sender = session.retained_sender = RetainedSender(self, session)
        sender.add(topic_filter, qos, subscription_ids)
        self._retained_waiting.add(session)

    def resume_retained(self, session: Session) -> None:
        """The session's socket or queue drained: its retained messages may go on."""
        if session.retained_sender:
            session.retained_sender.resume()

    def dispatch(
        self,
        targets: Sequence[tuple[Session | GroupTarget, Delivery]],
        on_accepted: AcceptedCallback,
        retained: bool = False,
        on_settled: AcceptedCallback | None = None,
    ) -> None:
        """Deliver in memory, or through the persistent path for persistent sessions.

        ``retained``: these are retained messages sent on subscribe; anything
        else is live, and supersedes a retained message of its topic that the
        session has yet to be sent. ``on_settled``: see
        :meth:`PersistentPath.submit`.
        """
        persistent = []
        over = self.budget.over  # empty unless an owner is over auth.max_bytes_per_owner
        for session, delivery in targets:
            if not retained and session.retained_sender:
                session.retained_sender.live(delivery.message.topic)
            if isinstance(session, GroupTarget) or (session.durable and delivery.qos > 0):
                if over and not isinstance(session, GroupTarget) and session.owner in over:
                    self._not_stored(SESSION, session.client_id, delivery.message)
                    continue
                persistent.append((session, delivery))
            else:
                session.deliver(delivery)
        if persistent:
            self.persistent_path.submit(persistent, on_accepted, on_settled)
        else:
            on_accepted(True)

    def _not_stored(self, store: str, name: str, message: Message) -> None:
        """A message for a store whose owner is over auth.max_bytes_per_owner is dropped
        at routing: counted, and logged at a bounded rate."""
        self.budget.refused(store, BYTES_LIMIT)
        self.stats.drop("owner_budget")
        self._budget_log.log(
            self.clock(),
            logging.INFO,
            "message on %r not stored for %s %s: its owner is over auth.max_bytes_per_owner",
            message.topic,
            store,
            name,
        )

    def _group_over(self, members: Sequence[SubscriptionEntry]) -> bool:
        """Is the owner of every member of a group over auth.max_bytes_per_owner?"""
        over, sessions = self.budget.over, self.sessions
        if not members:
            return False
        for member in members:
            session = sessions.get(member.client_id)
            if session is None or session.owner not in over:
                return False
        return True

    def _is_online(self, client_id: str) -> bool:
        session = self.sessions.get(client_id)
        if isinstance(session, RemoteSession):
            return session.online  # connected to another replica
        return session is not None and session.connection is not None


class _Ends:
    """Joins the store's answers to the session ends one CONNECT caused."""

    __slots__ = ("_answers", "_ok", "_waiter", "count")

    def __init__(self) -> None:
        self.count = 0
        self._answers = 0
        self._ok = True
        self._waiter: DoneCallback | None = None

    def one(self) -> DoneCallback:
        self.count += 1
        return self._answer

    def _answer(self, ok: bool) -> None:
        self._answers += 1
        self._ok = self._ok and ok
        self._fire()

    def then(self, waiter: DoneCallback) -> None:
        self._waiter = waiter
        self._fire()

    def _fire(self) -> None:
        if self._waiter is not None and self._answers == self.count:
            waiter, self._waiter = self._waiter, None
            waiter(self._ok)
