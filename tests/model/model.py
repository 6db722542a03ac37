"""The model: what the clients did and saw, and the promises checked against it.

Clients (``tests/model/clients.py``) report every packet that matters, with
the time they sent or received it; the runner reports faults. The model
keeps sessions (one *incarnation* per session: a clean start or an expiry
begins a new one), subscriptions, messages and every receipt, and checks:

``lost``
    a message acknowledged to its publisher (PUBACK < 0x80, or PUBREC < 0x80
    then PUBCOMP) for a subscription SUBACKed before the PUBLISH was sent and
    not unsubscribed before the acknowledgement, of a session that still
    exists, never reached that session. Excused: its message expiry (or the
    broker's default TTL) passed; it may have been trimmed (at some moment
    while it was pending, at least ``limit - max_inflight`` messages that are
    not certainly older were pending for that session too); its session
    ended. A shared subscription's copy is owed to one member of the group.
    With replicas only, after a Kafka restart that left Tansu listing the topic
    at fewer partitions than ``persistence.partitions``: its records lie past
    them (a known limit, tests/model/FINDINGS.md findings 28 and 38).
``order``
    per publisher, first receipts (per session, non-shared subscriptions) of
    acknowledged messages come in publish order.
``dup``
    a second receipt of a message by a session (same route) carries DUP=1,
    unless the publisher itself re-sent it; a *first* receipt with DUP=1 on a
    connection that was open before the PUBLISH was sent, with no broker,
    Redis or Kafka restart in between, is a violation too (DUP means "may
    have been seen").
``qos2-twice``
    a QoS 2 message is delivered once per session (receiver method B: a
    PUBLISH whose packet id the client holds unreleased is not a delivery).
``ended-session``
    a message reaches a session incarnation that had no matching
    subscription sent before the message was acknowledged, while an earlier
    incarnation of that client id had one: it was published for a session
    that has ended.
``unexpected``
    a message reaches a session that never subscribed to it.
``id-reuse``
    a packet id is given to a new PUBLISH while the same id is still in
    flight to that client (received and not yet PUBACKed / PUBCOMPed, across
    reconnects of a persistent session).
``pubrel``
    after a resume, a QoS 2 id whose PUBREL the client saw and did not
    complete gets its PUBREL again (MQTT-4.4.0-1) within a bound; an id it
    PUBREC'd without seeing PUBREL gets PUBREL or the PUBLISH again (unless
    the message expired or may have been trimmed: the PUBREC may not have
    reached the broker).
``session-lost``
    a session is present after a resume unless it may have expired;
``session-present``
    a clean start never finds a session, nor does a resume find one that
    ended (expired, or ended with its connection).
``broker``
    a broker exits by itself, or stops answering.

After Redis lost writes it had acknowledged (the ``failover`` scenario: the
Sentinel promoted a replica that had been cut off), only ``lost`` (and
``ecq-lost``, ``group-lost``), ``unexpected`` and ``broker`` are checked from
then on: with ``redis_wait: replicas`` nothing acknowledged may
be lost (docs/backends.md "Redis Sentinel"), but Redis forgot deliveries, packet ids
and session changes it had acknowledged, so a message may come again without
DUP, a packet id may be handed out again, a session may be as it was, and
(seed 9700, not analysed yet: tests/model/FINDINGS.md) a message may come
after later ones.

APPLICATION sessions (``Config.application``: the client ids that
``application.client_ids`` matches; docs/application-sessions.md) are held to
the same promises, with two differences. Nothing is trimmed: their backlog is
bounded by the Kafka topic's retention, not by ``limit``, so no ``lost`` is
excused as trimmed, nor a ``pubrel`` as "may have been trimmed". And the
topic lives in Kafka only: a Kafka restart here is Tansu restarted empty
(memory storage), which loses the topic and what was in it (documented under
"Not yet"), so a message acknowledged before a ``restart_kafka`` and not
received before it is excused for them, and so is a packet id the client held
for one of them given to a new message (``id-reuse``). Everything acknowledged
after it is owed, in order, QoS 2 once, and a QoS 2 id held from before gets
its PUBREL (``pubrel``) (findings 31 and 32).

Exclusive compacted queues have their own promises (``ecq-lost``,
``ecq-again``, ``ecq-exclusive``): ``tests/model/queues.py``.

Times are ``time.monotonic()``, one clock for every thread of the test.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka.partitioner import murmur2

from tests.model.groups import GroupModel
from tests.model.queues import QueueModel

# The promises that still hold after Redis lost acknowledged writes (redis_wait:
# replicas and a failover to a replica that lagged): nothing acknowledged is lost.
KEPT_AFTER_LOST_WRITES = frozenset({"lost", "ecq-lost", "group-lost", "unexpected", "broker"})
# s a connection must have been open before a PUBLISH for DUP=1 on its first receipt to be
# wrong: a replica may not have seen the old connection go yet (it stores the message
# marked for a send on it, and the resume replays it with DUP, honestly)
DUP_MARGIN = {False: 0.2, True: 1.0}
SESSION_EXPIRY_MARGIN = 2.0  # s: the broker's 0.5 s sweep, Redis round trips, our clocks
ACK_SLACK = 1.0  # s an acknowledged copy may still count as stored (coalesced writes)
REDIS_RESTART_SLACK = 4.0  # s after a Redis restart until failed writes were tried again
TTL_MARGIN = 0.5  # s: an expiry counted from our send, the broker counts from its receipt
# s: with replicas, a connection (Session Expiry 0) the client closed this long before
# its next CONNECT may not have been seen closed by its replica when another one took
# the session over (seed 1549): the takeover resumes it, as MQTT-3.1.4-3 says.
CLOSE_RACE = 0.5
CLOSED_NO_EXPIRY = "connection closed (no session expiry)"

Route = tuple[str, ...]  # ("d",) direct, or ("s", group, inner filter)
DIRECT: Route = ("d",)


def topic_matches(topic_filter: str, topic: str) -> bool:
    """MQTT filter matching (``+`` one level, ``#`` the rest), no ``$`` topics here."""
    f = topic_filter.split("/")
    t = topic.split("/")
    for i, level in enumerate(f):
        if level == "#":
            return True
        if i >= len(t):
            return False
        if level != "+" and level != t[i]:
            return False
    return len(f) == len(t)


def split_shared(topic_filter: str) -> tuple[str | None, str]:
    if topic_filter.startswith("$share/"):
        group, _, inner = topic_filter[len("$share/") :].partition("/")
        return group, inner
    return None, topic_filter


@dataclass
class Violation:
    kind: str
    text: str
    at: float

    def __str__(self) -> str:
        return f"[{self.kind}] {self.text}"


def kafka_partition(client_id: str, partitions: int) -> int:
    """The partition of a record keyed ``client_id`` in a topic of ``partitions``
    (aiokafka's default partitioner, which persistence/kafka_path.py uses)."""
    hashed: int = murmur2(client_id.encode())
    return (hashed & 0x7FFFFFFF) % partitions


@dataclass(eq=False)
class Inc:
    """One incarnation of a session (a client id's session between two starts)."""

    cid: str
    n: int
    expiry: int  # Session Expiry Interval, s (0: ends with its connection)
    started: float
    ended: float | None = None
    end_reason: str = ""
    subs: list[Sub] = field(default_factory=list)
    detached_at: float | None = None  # its last connection ended then (None: connected)
    maybe_ended: bool = False  # a clean start that got no CONNACK may have ended it
    saved_at: float | None = None  # last CONNACK or SUBACK: the broker has it in Redis
    resumed_at: float = 0.0  # last CONNACK: its terms (expiry) are saved only later
    # ever had an expiry > 0: its messages went to the store, where the per-client
    # limit trims them, even if a later resume set its expiry to 0
    was_persistent: bool = False
    # an APPLICATION session (made persistent by a client id application.client_ids
    # matches; a resume keeps the type it was made with): its messages wait in a
    # Kafka topic of its own, never trimmed
    application: bool = False

    def __post_init__(self) -> None:
        self.was_persistent = self.expiry > 0

    @property
    def persistent(self) -> bool:
        return self.expiry > 0

    def name(self) -> str:
        return f"{self.cid}#{self.n}"


@dataclass(eq=False)
class Sub:
    inc: Inc
    filter: str
    group: str | None
    inner: str
    qos: int
    sub_id: int | None
    sent_at: float
    suback_at: float | None = None
    granted: int | None = None
    unsub_at: float | None = None  # UNSUBSCRIBE sent
    replaced_at: float | None = None  # a SUBSCRIBE of the same filter sent (new terms)

    @property
    def route(self) -> Route:
        return DIRECT if self.group is None else ("s", self.group, self.inner)

    def matches(self, topic: str) -> bool:
        return topic_matches(self.inner, topic)

    def possible(self, sent: float, answered: float) -> bool:
        """Could the broker have routed a PUBLISH sent at ``sent`` (answered at
        ``answered``) through it? Sent before the answer, not unsubscribed before
        the PUBLISH went out."""
        return self.sent_at < answered and (self.unsub_at is None or self.unsub_at > sent)

    def owed(self, sent_at: float) -> bool:
        """SUBACKed before ``sent_at``, granted, neither unsubscribed nor replaced so far."""
        return (
            self.suback_at is not None
            and self.suback_at < sent_at
            and self.granted is not None
            and self.granted < 0x80
            and self.unsub_at is None
            and self.replaced_at is None
        )


@dataclass(eq=False)
class Msg:
    payload: bytes
    pub: str
    seq: int
    pub_conn: int
    topic: str
    qos: int
    expiry: int | None
    sent_at: float
    broker: int
    acked_at: float | None = None  # PUBACK / PUBREC (success) received
    answered_at: float | None = None  # the final answer (or the give-up) came
    ok: bool | None = None  # None: unanswered so far; False: failed or never answered
    ambiguous: bool = False  # the publisher may have sent it twice (paho re-send)
    potential: list[tuple[Inc, Route, int]] = field(default_factory=list)  # copies, eff. QoS
    obs: list[Ob] = field(default_factory=list)

    def expires(self, default_ttl: float | None) -> float | None:
        """When it may be gone for good (its expiry, or the store's default TTL)."""
        limit = None
        if self.expiry is not None:
            limit = self.sent_at + self.expiry
        if default_ttl is not None:
            t = self.sent_at + default_ttl
            limit = t if limit is None else min(limit, t)
        return limit

    def name(self) -> str:
        return self.payload.decode(errors="replace")


@dataclass(eq=False)
class Ob:
    """A copy owed: ``msg`` to one of ``incs`` (one, or a shared group's members)."""

    msg: Msg
    route: Route
    incs: list[Inc]
    qos: int
    satisfied_at: float | None = None
    reported: bool = False


@dataclass(eq=False)
class Copy:
    """What one session saw of one message through one route."""

    inc: Inc
    msg: Msg
    route: Route
    receipts: list[tuple[float, int, bool]] = field(default_factory=list)  # (t, conn, dup)
    deliveries: int = 0  # QoS 2 deliveries to the application (method B)
    final_ack: float | None = None  # PUBACK / PUBCOMP sent (last time)


@dataclass
class ClientState:
    cid: str
    version: int
    paho: bool
    inc: Inc | None = None
    incs: list[Inc] = field(default_factory=list)
    conn: int = 0  # connections so far (CONNACKs)
    conn_started: dict[int, float] = field(default_factory=dict)  # conn -> CONNACK time
    connected: bool = False
    pending_clean: bool = False
    pending_expiry: int = 0
    pending_since: float = 0.0
    sub_ids: dict[int, Sub] = field(default_factory=dict)


@dataclass
class Config:
    limit: int  # persistence.max_messages_per_client
    max_inflight: int  # mqtt.max_inflight
    default_ttl: float | None  # persistence.default_message_ttl when it is short
    cluster: bool
    application: frozenset[str] = frozenset()  # client ids of APPLICATION sessions


@dataclass
class Stats:
    published: int = 0
    acked: int = 0
    receipts: int = 0
    checked: int = 0  # obligations checked
    delivered: int = 0  # ... of which satisfied
    excused: dict[str, int] = field(default_factory=dict)


class Model:
    def __init__(self, config: Config, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.lock = threading.RLock()
        self.clients: dict[str, ClientState] = {}
        self.msgs: dict[bytes, Msg] = {}
        self.copies: dict[tuple[Inc, bytes, Route], Copy] = {}
        self.by_inc: dict[Inc, list[Copy]] = {}
        # A shared group's QoS 0 member got the message: when it came (_group_chose_qos0)
        self.qos0_group_copies: dict[tuple[Inc, bytes, Route], float] = {}
        self.violations: list[Violation] = []
        self.ignore: set[str] = set()  # kinds recorded but not reported (--ignore)
        self.writes_lost_at: float | None = None  # Redis lost acknowledged writes then
        self.ignored: list[Violation] = []
        self.faults: list[float] = []  # times of broker kills, Redis and Kafka restarts
        self.fault_log: list[tuple[float, str]] = []  # every fault injected, pauses too
        self.redis_paused: list[tuple[float, float]] = []  # [start, end) of pauses
        # The embedded Kafka wrote over offsets it had handed out (AlreadyExists in its
        # log) after a restart: docs/guarantees.md "What is guaranteed" (set by the runner).
        self.kafka_reused_offsets = False
        # Replicas only: (partitions Tansu lists the topic with, persistence.partitions)
        # when they differ after a Kafka restart (set by the runner): finding 28.
        self.kafka_topic_size: tuple[int, int] | None = None
        self._redis_pause_start: float | None = None
        self.stats = Stats()
        self._dup_margin = DUP_MARGIN[config.cluster]
        self.first_order: dict[tuple[Inc, str], list[Msg]] = {}  # first receipts, direct
        self._order_reported: set[tuple[Inc, str]] = set()
        self._seen: set[str] = set()
        self.on_violation: Callable[[Violation], None] | None = None
        self.trace: list[tuple[float, str]] = []  # what happened, for a failing run's trace.log
        self._t0 = clock()
        self.queues = QueueModel(self, clock)  # $ECQ writes and receipts (tests/model/queues.py)
        # $queue group writes and receipts (tests/model/groups.py)
        self.groups = GroupModel(self, clock, cluster=config.cluster)

    def log(self, text: str) -> None:
        self.trace.append((self.clock(), text))

    def write_trace(self, path: Path) -> None:
        with path.open("w") as f:
            for t, text in self.trace:
                f.write(f"{t - self._t0:9.3f} {text}\n")

    # -- reporting -------------------------------------------------------------------

    def violate(self, kind: str, text: str, dedupe: str | None = None) -> None:
        key = dedupe or f"{kind}:{text}"
        if key in self._seen:
            return
        self._seen.add(key)
        v = Violation(kind, text, self.clock())
        if self.writes_lost_at is not None and kind not in KEPT_AFTER_LOST_WRITES:
            self.ignored.append(v)
            self.log(f"EXCUSED (redis lost writes at {self.writes_lost_at:.3f}) {v}")
            return
        if kind in self.ignore:
            self.ignored.append(v)
            self.log(f"IGNORED {v}")
            return
        self.violations.append(v)
        self.log(f"VIOLATION {v}")
        if self.on_violation is not None:
            self.on_violation(v)

    # -- clients and sessions ----------------------------------------------------------

    def add_client(self, cid: str, version: int, paho: bool) -> ClientState:
        with self.lock:
            state = self.clients[cid] = ClientState(cid, version, paho)
            return state

    def fault(self, what: str) -> None:
        """A broker kill, Redis or Kafka restart: DUP may be set on anything in flight."""
        self.log(f"FAULT {what}")
        with self.lock:
            self.faults.append(self.clock())
            self.fault_log.append((self.clock(), what))

    def redis_lost_writes(self) -> None:
        """A failover to a replica that lacked the master's last writes: from now on
        only the promises of KEPT_AFTER_LOST_WRITES hold (see the module docstring)."""
        with self.lock:
            if self.writes_lost_at is None:
                self.writes_lost_at = self.clock()
            self.log("REDIS LOST WRITES")

    def note_fault(self, what: str) -> None:
        """A fault that changes no promise (a pause), for the violation texts."""
        self.log(f"FAULT {what}")
        with self.lock:
            self.fault_log.append((self.clock(), what))

    def faults_around(self, at: float) -> str:
        """The faults injected, relative to ``at`` (for a violation's text)."""
        parts = [f"{k} {t - at:+.1f} s" for t, k in self.fault_log]
        return ", ".join(parts) if parts else "none"

    def pause_redis(self) -> None:
        with self.lock:
            if self._redis_pause_start is None:
                self._redis_pause_start = self.clock()
                self.fault_log.append((self._redis_pause_start, "pause_redis"))

    def resume_redis(self) -> None:
        with self.lock:
            if self._redis_pause_start is not None:
                self.redis_paused.append((self._redis_pause_start, self.clock()))
                self._redis_pause_start = None

    def fault_between(self, start: float, end: float) -> bool:
        i = bisect.bisect_left(self.faults, start)
        return i < len(self.faults) and self.faults[i] <= end

    def connect_sent(self, cid: str, clean_start: bool, expiry: int) -> None:
        """CONNECT about to go out (a clean start ends the session once CONNACKed)."""
        with self.lock:
            state = self.clients[cid]
            state.pending_clean = clean_start
            state.pending_expiry = expiry
            state.pending_since = self.clock()
            self.log(f"{cid} CONNECT clean={clean_start} expiry={expiry}")

    def connect_failed(self, cid: str) -> None:
        """No CONNACK came: the CONNECT may or may not have reached the broker. A clean
        start may have ended the session; a resume may have changed its expiry (to 0:
        then the connection's close ended it; seed 225)."""
        with self.lock:
            state = self.clients[cid]
            inc = state.inc
            if inc is None or inc.ended is not None:
                return
            if state.pending_clean or state.pending_expiry < inc.expiry:
                inc.maybe_ended = True
            inc.expiry = max(inc.expiry, state.pending_expiry)  # it may outlive our guess

    def connack(self, cid: str, session_present: bool) -> int:
        """A CONNACK accepted the connection; returns its connection number."""
        with self.lock:
            state = self.clients[cid]
            now = self.clock()
            state.conn += 1
            state.conn_started[state.conn] = now
            state.connected = True
            inc = state.inc
            self.log(f"{cid} CONNACK present={int(session_present)} conn={state.conn}")
            if (
                session_present
                and not state.pending_clean
                and self.config.cluster
                and inc is not None
                and inc.ended is not None
                and inc.end_reason == CLOSED_NO_EXPIRY
                and state.pending_since - inc.ended <= CLOSE_RACE
            ):
                # A takeover of a connection its replica had not yet seen closed: the
                # session goes on (nothing published meanwhile was owed to it).
                self.log(f"{cid} took its session over, closed {now - inc.ended:.3f} s before")
                inc.ended = None
                inc.end_reason = ""
            if state.pending_clean:
                if session_present:
                    self.violate("session-present", f"{cid}: session present after a clean start")
                if inc is not None and inc.ended is None:
                    self._end(inc, state.pending_since, "clean start")
            elif session_present and inc is not None and inc.ended is None:
                inc.expiry = state.pending_expiry
                inc.was_persistent = inc.was_persistent or inc.expiry > 0
                inc.detached_at = None
                inc.resumed_at = now
                inc.saved_at = now  # the terms of a CONNECT are saved before its CONNACK
                return state.conn
            elif session_present:
                why = "no session was ever created" if inc is None else inc.end_reason
                self.violate(
                    "session-present",
                    f"{cid}: session present on resume though it ended ({why}, "
                    f"{now - inc.ended:.1f} s before)"
                    if inc is not None and inc.ended is not None
                    else f"{cid}: session present on resume though it ended ({why})",
                )
            elif inc is not None and inc.ended is None:
                if self._certainly_alive(inc, now):
                    self.violate(
                        "session-lost",
                        f"{cid}: session {inc.name()} lost: session present 0 on resume "
                        f"{now - (inc.detached_at or now):.1f} s after it was left, "
                        f"expiry {inc.expiry} s",
                    )
                self._end(inc, now, "not present on resume")
            new = Inc(cid, len(state.incs) + 1, state.pending_expiry, now, saved_at=now)
            new.application = new.persistent and cid in self.config.application
            state.incs.append(new)
            state.inc = new
            return state.conn

    def _certainly_alive(self, inc: Inc, now: float) -> bool:
        """Must the session still exist? Only one the broker saved survives a crash:
        its state is saved before every CONNACK and SUBACK (``saved_at``)."""
        if not inc.persistent or inc.maybe_ended:
            return False
        since = max(inc.started, inc.resumed_at)
        if self.fault_between(since, now) and (
            inc.saved_at is None or inc.saved_at < since or self.fault_between(since, inc.saved_at)
        ):
            return False  # a crash before a SUBACK confirmed the latest CONNECT's terms
        if inc.detached_at is None:
            return True  # connected until now (a takeover)
        return now < inc.detached_at + inc.expiry - SESSION_EXPIRY_MARGIN

    def connection_closed(self, cid: str, conn: int) -> None:
        """The client's connection ``conn`` ended (either side)."""
        with self.lock:
            self.queues.connection_closed(cid, conn)
            state = self.clients[cid]
            if conn != state.conn or not state.connected:
                return
            self.log(f"{cid} closed conn={conn}")
            state.connected = False
            now = self.clock()
            inc = state.inc
            if inc is None or inc.ended is not None:
                return
            inc.detached_at = now
            if not inc.persistent:
                self._end(inc, now, CLOSED_NO_EXPIRY)

    def expire_sessions(self) -> None:
        """Sessions left longer than their expiry (plus margin) have certainly ended."""
        with self.lock:
            now = self.clock()
            for state in self.clients.values():
                inc = state.inc
                if (
                    inc is not None
                    and inc.ended is None
                    and inc.detached_at is not None
                    and inc.persistent
                    and now > inc.detached_at + inc.expiry + SESSION_EXPIRY_MARGIN
                    and not self.fault_between(inc.detached_at, now)
                ):
                    self._end(inc, inc.detached_at + inc.expiry, "expired")

    def _end(self, inc: Inc, at: float, why: str) -> None:
        inc.ended = at
        inc.end_reason = why

    # -- subscriptions -----------------------------------------------------------------

    def subscribe_sent(self, cid: str, entries: Iterable[tuple[str, int, int | None]]) -> list[Sub]:
        with self.lock:
            state = self.clients[cid]
            inc = state.inc
            assert inc is not None, "subscribe before CONNACK"
            now = self.clock()
            subs = []
            for topic_filter, qos, sub_id in entries:
                group, inner = split_shared(topic_filter)
                for old in inc.subs:
                    if old.filter == topic_filter and old.replaced_at is None:
                        old.replaced_at = now
                sub = Sub(inc, topic_filter, group, inner, qos, sub_id, now)
                self.log(f"{cid} SUBSCRIBE {topic_filter} qos={qos} id={sub_id}")
                inc.subs.append(sub)
                if sub_id is not None:
                    state.sub_ids[sub_id] = sub
                subs.append(sub)
            return subs

    def suback(self, subs: list[Sub], codes: list[int]) -> None:
        with self.lock:
            now = self.clock()
            for sub, code in zip(subs, codes, strict=False):
                sub.suback_at = now
                sub.granted = code
                if code < 0x80:
                    sub.inc.saved_at = now
                self.log(f"{sub.inc.cid} SUBACK {sub.filter} {code}")

    def unsubscribe_sent(self, cid: str, filters: Iterable[str]) -> None:
        with self.lock:
            inc = self.clients[cid].inc
            if inc is None:
                return
            now = self.clock()
            wanted = set(filters)
            self.log(f"{cid} UNSUBSCRIBE {' '.join(wanted)}")
            for sub in inc.subs:
                if sub.filter in wanted and sub.unsub_at is None:
                    sub.unsub_at = now

    # -- publishing --------------------------------------------------------------------

    def publish_sent(
        self,
        pub: str,
        seq: int,
        pub_conn: int,
        payload: bytes,
        topic: str,
        qos: int,
        expiry: int | None,
        broker: int,
    ) -> Msg:
        with self.lock:
            now = self.clock()
            msg = Msg(payload, pub, seq, pub_conn, topic, qos, expiry, now, broker)
            self.log(f"{pub} PUBLISH {msg.name()} {topic} qos={qos} expiry={expiry} b{broker}")
            self.msgs[payload] = msg
            self.stats.published += 1
            return msg

    def _routes(
        self, topic: str, qos: int, at: float, usable: Callable[[Sub], bool]
    ) -> list[tuple[Inc, Route, int]]:
        """(incarnation, route, effective QoS) of every copy the subscriptions give."""
        out: dict[tuple[Inc, Route], int] = {}
        for state in self.clients.values():
            for inc in state.incs:
                if inc.ended is not None and inc.ended < at:
                    continue
                for sub in inc.subs:
                    if sub.matches(topic) and usable(sub):
                        granted = sub.granted if sub.granted is not None else sub.qos
                        if granted >= 0x80:
                            continue
                        eff = min(qos, granted)
                        key = (inc, sub.route)
                        out[key] = max(out.get(key, 0), eff)
        return [(inc, route, eff) for (inc, route), eff in out.items()]

    def publish_answered(self, msg: Msg, ok: bool) -> None:
        """PUBACK / PUBCOMP (``ok``), a failure code, or never (``ok`` False)."""
        with self.lock:
            if msg.ok is not None:
                return
            now = self.clock()
            msg.ok = ok
            msg.answered_at = now
            self.log(f"{msg.pub} {'ACKED' if ok else 'FAILED'} {msg.name()}")
            msg.potential = self._potential(msg, now)
            if not ok:
                return
            msg.acked_at = msg.acked_at or now
            self.stats.acked += 1
            self._oblige(msg)

    def publish_received(self, msg: Msg) -> None:
        """QoS 2: PUBREC with success: the broker took it (acknowledged at PUBCOMP)."""
        with self.lock:
            if msg.acked_at is None:
                msg.acked_at = self.clock()

    def _potential(self, msg: Msg, answered: float) -> list[tuple[Inc, Route, int]]:
        return self._routes(
            msg.topic, msg.qos, msg.sent_at, lambda s: s.possible(msg.sent_at, answered)
        )

    def _oblige(self, msg: Msg) -> None:
        owed = self._routes(msg.topic, msg.qos, msg.sent_at, lambda s: s.owed(msg.sent_at))
        owed = [(inc, route, eff) for inc, route, eff in owed if eff > 0]
        for inc, route, eff in owed:
            if route == DIRECT:
                if self.config.cluster and not inc.persistent:
                    continue  # clean sessions of another replica: at most once (docs/deployment.md)
                msg.obs.append(Ob(msg, route, [inc], eff))
        groups = {route for _, route, _ in owed if route != DIRECT}
        for route in groups:
            members = [inc for inc, r, _ in msg.potential if r == route]
            if self.config.cluster and any(not m.persistent for m in members):
                continue
            eff = max(e for _, r, e in owed if r == route)
            msg.obs.append(Ob(msg, route, members, eff))
        for ob in msg.obs:
            for inc in ob.incs:
                copy = self.copies.get((inc, msg.payload, ob.route))
                if copy is not None and copy.receipts:
                    ob.satisfied_at = copy.receipts[0][0]
                chosen = self.qos0_group_copies.get((inc, msg.payload, ob.route))
                if chosen is not None and ob.satisfied_at is None:
                    ob.satisfied_at = chosen

    # -- receiving ---------------------------------------------------------------------

    def route_of(self, cid: str, sub_ids: Iterable[int]) -> Route:
        state = self.clients[cid]
        for sid in sub_ids:
            sub = state.sub_ids.get(sid)
            if sub is not None and sub.group is not None:
                return sub.route
        return DIRECT

    def received(
        self,
        cid: str,
        conn: int,
        packet_id: int | None,
        payload: bytes,
        qos: int,
        dup: bool,
        sub_ids: tuple[int, ...],
        held: bytes | None,
        qos2_held: bool,
    ) -> Copy | None:
        """A PUBLISH reached client ``cid`` on connection ``conn``.

        ``held``: the payload the client still holds under this packet id
        (received, not yet PUBACKed / PUBCOMPed), if any; ``qos2_held``: held as
        QoS 2 (so this one is not a new delivery, method B).
        """
        with self.lock:
            now = self.clock()
            self.stats.receipts += 1
            state = self.clients[cid]
            self.log(
                f"{cid} got {payload.decode(errors='replace')} pid={packet_id} qos={qos} "
                f"dup={int(dup)} ids={list(sub_ids)} conn={conn} held={held is not None}"
            )
            inc = state.inc
            msg = self.msgs.get(payload)
            if msg is None:
                self.violate("unexpected", f"{cid} received unknown payload {payload!r}")
                return None
            self._check_held(state, conn, packet_id, msg.name(), payload, held)
            if inc is None:
                return None
            route = self.route_of(cid, sub_ids)
            if qos == 0:
                self._group_chose_qos0(state, inc, msg, route, sub_ids, now)
                return None
            key = (inc, payload, route)
            copy = self.copies.get(key)
            first = copy is None or not copy.receipts
            if copy is None:
                copy = self.copies[key] = Copy(inc, msg, route)
                self.by_inc.setdefault(inc, []).append(copy)
            copy.receipts.append((now, conn, dup))
            if first:
                self._first_receipt(state, inc, msg, route, conn, dup, now)
            elif not dup and not msg.ambiguous:
                self.violate(
                    "dup",
                    f"{cid} session {inc.name()} received {msg.name()} again with DUP=0 "
                    f"(connection {conn}, receipt {len(copy.receipts)}, "
                    f"packet id {packet_id})",
                    dedupe=f"dup-repeat:{cid}:{payload!r}",
                )
            if qos == 2 and not qos2_held:
                copy.deliveries += 1
                if copy.deliveries == 2 and not msg.ambiguous:
                    self.violate(
                        "qos2-twice",
                        f"QoS 2 {msg.name()} delivered twice to {cid} session {inc.name()} "
                        f"(second time packet id {packet_id}, DUP={int(dup)}, "
                        f"connection {conn})",
                    )
            return copy

    def held_reused(
        self,
        cid: str,
        conn: int,
        packet_id: int,
        payload: bytes,
        held: bytes | None,
    ) -> None:
        """A group write or a queue entry reached ``cid`` under ``packet_id`` while the
        client held ``held`` under it (``id-reuse``, as for any PUBLISH; finding 36:
        the client's bookkeeping replaced the old one without a word)."""
        with self.lock:
            msg = self.msgs.get(payload)
            name = msg.name() if msg is not None else repr(payload)
            state = self.clients[cid]
            self._check_held(state, conn, packet_id, name, payload, held)

    def _check_held(
        self,
        state: ClientState,
        conn: int,
        packet_id: int | None,
        name: str,
        payload: bytes,
        held: bytes | None,
    ) -> None:
        """``id-reuse``: the client held ``held`` under the id a new PUBLISH came with,
        whatever ended the connection it got ``held`` on: a broker killed with a group
        write in flight leaves it recorded with the member's session (finding 43)."""
        if held is None or held == payload:
            return
        cid = state.cid
        if self._held_went_with_topic(state, held):
            self.log(f"{cid}: id {packet_id} held for a message of a lost topic, given again")
            return
        self.violate(
            "id-reuse",
            f"{cid} (connection {conn}) got packet id {packet_id} for {name} "
            f"while {held.decode(errors='replace')} still held that id unacknowledged",
            dedupe=f"id-reuse:{cid}:{conn}",
        )

    def _held_went_with_topic(self, state: ClientState, held: bytes) -> bool:
        """Was the message the client holds under an id one of an APPLICATION session's
        topic that Kafka lost (restarted empty after it was acknowledged)? Its flow can
        end no more (the client holds a QoS 1 id until the message comes again, and it
        cannot): its id is given again."""
        inc, msg = state.inc, self.msgs.get(held)
        return (
            inc is not None
            and inc.application
            and msg is not None
            and self.kafka_lost_since(msg.acked_at or msg.sent_at)
        )

    def _group_chose_qos0(
        self,
        state: ClientState,
        inc: Inc,
        msg: Msg,
        route: Route,
        sub_ids: tuple[int, ...],
        now: float,
    ) -> None:
        """A shared group may give a QoS 1/2 message to a member that subscribed
        with QoS 0 (round robin does not look at QoS; MQTT-4.8.2 lets each member
        choose its own): that member's QoS 0 copy is the group's delivery. Seed 340
        of the 25-minute run, reported as lost, was this."""
        if route == DIRECT:
            return
        subs = [state.sub_ids.get(sid) for sid in sub_ids]
        if not any(s is not None and s.route == route and s.granted == 0 for s in subs):
            return  # a member granted QoS 1/2 must get it at QoS 1/2
        self.qos0_group_copies.setdefault((inc, msg.payload, route), now)
        for ob in msg.obs:
            if ob.route == route and inc in ob.incs and ob.satisfied_at is None:
                ob.satisfied_at = now

    def _first_receipt(
        self, state: ClientState, inc: Inc, msg: Msg, route: Route, conn: int, dup: bool, now: float
    ) -> None:
        limit = msg.acked_at if msg.acked_at is not None else now
        legit = any(s.matches(msg.topic) and s.sent_at < limit for s in inc.subs)
        if not legit:
            earlier = [
                i
                for i in state.incs
                if i is not inc and any(s.matches(msg.topic) and s.sent_at < limit for s in i.subs)
            ]
            if earlier:
                alive = [
                    i
                    for i in earlier
                    if i.started <= msg.sent_at and (i.ended is None or i.ended >= msg.sent_at)
                ]
                old = (alive or earlier)[-1]
                ended = f"{old.end_reason} {now - old.ended:.1f} s ago" if old.ended else "?"
                self.violate(
                    "ended-session",
                    f"{state.cid}: {msg.name()} (published {now - msg.sent_at:.2f} s ago "
                    f"{'while' if alive else 'for'} session {old.name()} existed; it ended: "
                    f"{ended}) reached the new "
                    f"session {inc.name()} (session present 0), which had not subscribed to it "
                    "before the publisher's acknowledgement",
                    dedupe=f"ended:{state.cid}:{inc.n}",
                )
            else:
                self.violate(
                    "unexpected",
                    f"{state.cid} session {inc.name()} received {msg.name()} on "
                    f"{msg.topic} without a subscription to it",
                    dedupe=f"unexpected:{state.cid}:{msg.topic}",
                )
        if dup:
            started = state.conn_started.get(conn, now)
            if started < msg.sent_at - self._dup_margin and not self.fault_between(
                msg.sent_at, now
            ):
                self.violate(
                    "dup",
                    f"{state.cid} session {inc.name()}: first receipt of {msg.name()} "
                    f"carried DUP=1 on connection {conn}, open since before the PUBLISH "
                    f"was sent ({msg.sent_at - started:.2f} s) and not interrupted",
                    dedupe=f"dup-first:{state.cid}",
                )
        for ob in msg.obs:
            if ob.route == route and inc in ob.incs and ob.satisfied_at is None:
                ob.satisfied_at = now
        if route == DIRECT:
            self.first_order.setdefault((inc, msg.pub), []).append(msg)

    def final_ack(self, copy: Copy | None) -> None:
        """The client sent PUBACK (QoS 1) or PUBCOMP (QoS 2) for this copy."""
        if copy is None:
            return
        with self.lock:
            copy.final_ack = self.clock()
            self.log(f"{copy.inc.cid} acked {copy.msg.name()}")

    # -- checks at a quiet point -------------------------------------------------------

    def open_obligations(self, before: float) -> list[Ob]:
        """Obligations of messages answered before ``before``, neither met nor excused."""
        with self.lock:
            self.expire_sessions()
            now = self.clock()
            out: list[Ob] = []
            for msg in self.msgs.values():
                if not msg.ok or msg.acked_at is None or msg.acked_at > before:
                    continue
                out.extend(
                    ob
                    for ob in msg.obs
                    if ob.satisfied_at is None
                    and not ob.reported
                    and self._cheap_excuse(ob, now) is None
                )
            return out

    def open_for(self, cid: str) -> int:
        """Owed copies to ``cid``'s current session not received yet (nor excused)."""
        with self.lock:
            inc = self.clients[cid].inc
            if inc is None:
                return 0
            now = self.clock()
            return sum(
                1
                for msg in self.msgs.values()
                if msg.ok
                for ob in msg.obs
                if inc in ob.incs
                and ob.satisfied_at is None
                and self._cheap_excuse(ob, now) is None
            )

    def stored_for(self, cid: str, topic: str) -> tuple[int, int]:
        """(copies stored so far for ``cid``'s session, copies one PUBLISH on ``topic``
        adds now), counting every copy its subscriptions may have given it."""
        with self.lock:
            inc = self.clients[cid].inc
            if inc is None:
                return 0, 0
            stored = sum(
                1
                for msg in self.msgs.values()
                for i, _, eff in msg.potential
                if i is inc and eff > 0
            )
            routes = {
                s.route
                for s in inc.subs
                if s.matches(topic)
                and s.unsub_at is None
                and s.replaced_at is None
                and (s.granted or 0) in (1, 2)
            }
            return stored, len(routes)

    def _cheap_excuse(self, ob: Ob, now: float) -> str | None:
        msg = ob.msg
        gone = msg.expires(self.config.default_ttl)
        if gone is not None and now >= gone - TTL_MARGIN:
            return "expired"
        for inc in ob.incs:
            if inc.ended is not None:
                return "session ended"
        if self.kafka_reused_offsets and any(
            kind == "restart_kafka" and at <= (msg.acked_at or now) for at, kind in self.fault_log
        ):
            return "kafka reused offsets"
        if any(i.application for i in ob.incs) and self.kafka_lost_since(msg.acked_at or now):
            return "application topic lost"
        if self._in_a_partition_kafka_no_longer_lists(ob, now):
            return "kafka topic at another size (replicas)"
        return None

    def _in_a_partition_kafka_no_longer_lists(self, ob: Ob, now: float) -> bool:
        """Replicas on a Kafka that forgets topics (Tansu, memory storage) keep
        sending to the partitions they knew, which a topic made again at Tansu's
        size no longer has, and no consumer reads: a known limit
        (docs/guarantees.md, tests/model/FINDINGS.md findings 28 and 38). Excused
        only for a message acknowledged after a Kafka restart whose every possible
        record (keyed by the member's client id, persistence/kafka_path.py) lies in
        such a partition."""
        size = self.kafka_topic_size
        if size is None or not self.config.cluster:
            return False
        listed, configured = size
        if not any(
            kind == "restart_kafka" and at <= (ob.msg.acked_at or now)
            for at, kind in self.fault_log
        ):
            return False
        return all(kafka_partition(inc.cid, configured) >= listed for inc in ob.incs)

    def kafka_lost_since(self, at: float) -> bool:
        """Did Kafka restart empty (Tansu, memory storage) at or after ``at``? An
        APPLICATION session's topic and the messages in it went with it."""
        return any(kind == "restart_kafka" and t >= at for t, kind in self.fault_log)

    def check_losses(self, before: float) -> list[Ob]:
        """Report obligations (answered before ``before``) neither met nor excused."""
        with self.lock:
            open_obs = self.open_obligations(before)
            trimmed = self._trim_excused(open_obs)
            lost = []
            for msg in self.msgs.values():
                if not msg.ok or msg.acked_at is None or msg.acked_at > before:
                    continue
                for ob in msg.obs:
                    if ob.reported:
                        continue
                    self.stats.checked += 1
                    ob.reported = True
                    if ob.satisfied_at is not None:
                        self.stats.delivered += 1
                        continue
                    why = self._cheap_excuse(ob, self.clock())
                    if why is None and ob in trimmed:
                        why = "trimmed"
                    if why is not None:
                        self.stats.excused[why] = self.stats.excused.get(why, 0) + 1
                        continue
                    lost.append(ob)
            by_inc: dict[str, list[Ob]] = {}
            for ob in lost:
                by_inc.setdefault("/".join(i.name() for i in ob.incs), []).append(ob)
            for who, obs in by_inc.items():
                names = ", ".join(
                    f"{o.msg.name()} (QoS {o.qos}, route {'/'.join(o.route)}, acked "
                    f"{self.clock() - (o.msg.acked_at or 0):.1f} s ago)"
                    for o in obs[:8]
                )
                self.violate(
                    "lost",
                    f"{len(obs)} acknowledged message(s) never reached session {who}: {names}; "
                    f"faults relative to the first one's publish: "
                    f"{self.faults_around(obs[0].msg.sent_at)}",
                    dedupe=f"lost:{who}:{obs[0].msg.name()}",
                )
            return lost

    def _trim_excused(self, obs: list[Ob]) -> set[Ob]:
        """Obligations whose message may have been trimmed by the per-client limit.

        A message is trimmed only as the oldest stored for its session, when the
        limit is reached. For each obligation, the copies for the same session
        that are not certainly older (not acknowledged to their publisher before
        it was sent) are counted while pending (from their publish until the
        client's final ack, plus slack), at every moment the message itself was
        pending: ``limit - max_inflight`` at some moment excuses it.

        Older copies count too while the client's acknowledgement of them may not
        be written yet (seed 7508): the store still holds them marked sent, so
        more than ``max_inflight`` messages are in flight as the limit sees it.
        """
        threshold = self.config.limit - self.config.max_inflight
        if threshold <= 0:
            return {ob for ob in obs if not any(inc.application for inc in ob.incs)}
        wanted: dict[Inc, list[tuple[Ob, Msg]]] = {}
        for ob in obs:
            for inc in ob.incs:
                if inc.application:
                    continue  # its topic keeps everything (retention, not a count)
                if inc.was_persistent:  # not .persistent: a resume with expiry 0 keeps the store
                    wanted.setdefault(inc, []).append((ob, ob.msg))
        out: set[Ob] = set()
        for inc, items in wanted.items():
            out.update(self._crowded(inc, items, threshold))
        return out

    def _crowded(self, inc: Inc, items: list[tuple[Ob, Msg]], threshold: int) -> set[Ob]:
        """One sweep for a session: copies inserted newest-acknowledged first, queried
        newest-sent first, on a segment tree of pending counts over time."""
        now = self.clock()
        # (older-than key, start, end of the part counted only for newer queries)
        copies: list[tuple[float, float, float]] = []
        # [final ack, pending end): counted for every query, older copies included
        lags: list[tuple[float, float]] = []
        for msg in self.msgs.values():
            potential = msg.potential if msg.answered_at is not None else self._potential(msg, now)
            key = msg.acked_at if msg.ok and msg.acked_at is not None else float("inf")
            for i, route, eff in potential:
                if i is inc and eff > 0:
                    end = self._pending_end(inc, msg, route)
                    acked = self._final_ack(inc, msg, route)
                    if acked is None:
                        copies.append((key, msg.sent_at, end))
                    else:
                        copies.append((key, msg.sent_at, max(msg.sent_at, acked)))
                        lags.append((max(msg.sent_at, acked), end))
        times = [c[1] for c in copies] + [c[2] for c in copies] + [t for lag in lags for t in lag]
        coords = sorted({t for t in times if t != float("inf")})
        index = {t: k for k, t in enumerate(coords)}
        size = len(coords) + 1  # the last slot stands for "forever"
        tree = _MaxTree(size)

        def span(start: float, end: float) -> tuple[int, int]:
            lo = index[start]
            hi = index[end] if end != float("inf") else size
            return lo, hi  # [lo, hi)

        for start, end in lags:
            lo, hi = span(start, end)
            if lo < hi:
                tree.add(lo, hi, 1)
        copies.sort(key=lambda c: c[0], reverse=True)
        queries = sorted(items, key=lambda it: it[1].sent_at, reverse=True)
        out: set[Ob] = set()
        k = 0
        for ob, msg in queries:
            while k < len(copies) and copies[k][0] >= msg.sent_at:
                lo, hi = span(copies[k][1], copies[k][2])
                if lo < hi:
                    tree.add(lo, hi, 1)
                k += 1
            end = self._pending_end(inc, msg, ob.route)
            first = index.get(msg.sent_at)
            if first is None:
                continue
            lo = first
            hi = index.get(end, size) if end != float("inf") else size
            if hi > lo and tree.max(lo, hi) - 1 >= threshold:  # less its own copy
                out.add(ob)
        return out

    def _final_ack(self, inc: Inc, msg: Msg, route: Route) -> float | None:
        copy = self.copies.get((inc, msg.payload, route))
        return None if copy is None else copy.final_ack

    def _pending_end(self, inc: Inc, msg: Msg, route: Route) -> float:
        copy = self.copies.get((inc, msg.payload, route))
        if copy is None or copy.final_ack is None:
            return float("inf")
        end = copy.final_ack + ACK_SLACK
        for start, stop in self.redis_paused:
            if start <= end and stop >= copy.final_ack:
                end = max(end, stop + ACK_SLACK)
        # A write that failed on a restarting Redis is tried again after the
        # writer's back-off (persistence/coalescing.py: 0.5, 1, 2 s).
        for at, kind in self.fault_log:
            if kind in ("restart_redis", "failover") and copy.final_ack - ACK_SLACK <= at <= end:
                end = max(end, at + REDIS_RESTART_SLACK)
        if self._redis_pause_start is not None and self._redis_pause_start <= end:
            end = float("inf")
        return end

    def check_order(self) -> None:
        """First receipts per (session, publisher) in publish order, for acknowledged ones."""
        with self.lock:
            for key, msgs in self.first_order.items():
                if key in self._order_reported:
                    continue
                max_seq: dict[int, Msg] = {}
                latest: Msg | None = None
                for msg in msgs:
                    if not msg.ok or msg.ambiguous or msg.acked_at is None:
                        continue
                    prev = max_seq.get(msg.pub_conn)
                    culprit = None
                    if prev is not None and prev.seq > msg.seq:
                        culprit = prev
                    elif latest is not None and latest.sent_at > msg.acked_at:
                        culprit = latest
                    if culprit is not None:
                        self._order_reported.add(key)
                        self.violate(
                            "order",
                            f"{key[0].name()}: {msg.name()} first received after "
                            f"{culprit.name()}, published after it",
                        )
                        break
                    if prev is None or msg.seq > prev.seq:
                        max_seq[msg.pub_conn] = msg
                    if latest is None or msg.sent_at > latest.sent_at:
                        latest = msg


class _MaxTree:
    """Range add, range max over slots 0..n-1 (a lazy segment tree)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.size = 1
        while self.size < n:
            self.size *= 2
        self.mx = [0] * (2 * self.size)
        self.lazy = [0] * (2 * self.size)

    def add(self, lo: int, hi: int, value: int) -> None:
        self._add(1, 0, self.size, lo, hi, value)

    def _add(self, node: int, nlo: int, nhi: int, lo: int, hi: int, value: int) -> None:
        if hi <= nlo or nhi <= lo:
            return
        if lo <= nlo and nhi <= hi:
            self.mx[node] += value
            self.lazy[node] += value
            return
        mid = (nlo + nhi) // 2
        self._add(2 * node, nlo, mid, lo, hi, value)
        self._add(2 * node + 1, mid, nhi, lo, hi, value)
        self.mx[node] = self.lazy[node] + max(self.mx[2 * node], self.mx[2 * node + 1])

    def max(self, lo: int, hi: int) -> int:
        return self._max(1, 0, self.size, lo, hi)

    def _max(self, node: int, nlo: int, nhi: int, lo: int, hi: int) -> int:
        if hi <= nlo or nhi <= lo:
            return -(1 << 60)
        if lo <= nlo and nhi <= hi:
            return self.mx[node]
        mid = (nlo + nhi) // 2
        return self.lazy[node] + max(
            self._max(2 * node, nlo, mid, lo, hi), self._max(2 * node + 1, mid, nhi, lo, hi)
        )
