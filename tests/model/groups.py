"""The model of durable group queues ($queue, broker/group_queue.py) and their promises.

A group ``g{i}`` is the subscription ``$queue/g{i}/gq/g{i}/#`` (no plan filter
matches ``gq/``, so the session model sees nothing of it); a write is a
PUBLISH to ``gq/g{i}/w`` (the model's :class:`Msg`, found by payload). At the
drain, one subscriber joins every group written to, so whatever a group kept
while members came and went has somewhere to go. Checked:

``group-lost``
    an acknowledged QoS 1/2 write, published while the group certainly had a
    member (its SUBACK before the PUBLISH, no UNSUBSCRIBE and no end of its
    session before the PUBACK), never reached any member.
``group-dup``
    a member got a write that some member had received before, without DUP
    (a member that leaves gives back what it was sent, for the next one to get
    with DUP; a broker that dies frees its members' claims, with DUP).
``group-stranger``
    a write reached a client that never joined its group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.model.model import Inc, Model, Msg

PREFIX = "gq/"
ROUTE_MARGIN = {False: 0.0, True: 1.0}  # s: a SUBSCRIBE reaches the other replicas


def group_filter(group: str) -> str:
    return f"$queue/{group}/{PREFIX}{group}/#"


def group_topic(group: str) -> str:
    return f"{PREFIX}{group}/w"


def group_of(topic: str) -> str | None:
    if not topic.startswith(PREFIX):
        return None
    return topic[len(PREFIX) :].partition("/")[0] or None


@dataclass
class _Membership:
    cid: str
    inc: Inc
    joined_at: float  # SUBACK received
    left_at: float | None = None  # UNSUBSCRIBE sent


@dataclass
class _Receipt:
    cid: str
    conn: int
    at: float
    dup: bool


@dataclass
class GroupModel:
    model: Model
    clock: Callable[[], float]
    cluster: bool = False
    members: dict[str, list[_Membership]] = field(default_factory=dict)  # by group
    joined_ever: dict[str, set[str]] = field(default_factory=dict)  # group -> clients
    receipts: dict[bytes, list[_Receipt]] = field(default_factory=dict)  # by payload
    written: set[str] = field(default_factory=set)  # groups a write was sent to

    # -- events ----------------------------------------------------------------------

    def joining(self, cid: str, group: str) -> None:
        """SUBSCRIBE sent: from now on the client may get the group's writes."""
        self.joined_ever.setdefault(group, set()).add(cid)

    def joined(self, cid: str, group: str) -> None:
        """SUBACK granted."""
        inc = self.model.clients[cid].inc
        if inc is None:
            return
        self.members.setdefault(group, []).append(_Membership(cid, inc, self.clock()))
        self.model.log(f"{cid} JOINED group {group}")

    def left(self, cid: str, group: str) -> None:
        now = self.clock()
        for membership in self.members.get(group, ()):
            if membership.cid == cid and membership.left_at is None:
                membership.left_at = now
        self.model.log(f"{cid} LEAVES group {group}")

    def writing(self, group: str) -> None:
        self.written.add(group)

    def received(self, cid: str, conn: int, topic: str, payload: bytes, dup: bool) -> None:
        now = self.clock()
        msg = self.model.msgs.get(payload)
        group = group_of(topic)
        if msg is None or group is None or group_of(msg.topic) != group:
            self.model.violate("group-stranger", f"{cid} got {topic} {payload!r}: never written")
            return
        self.model.log(f"{cid} GROUP RECV {msg.name()} {topic} dup={dup} c{conn}")
        if cid not in self.joined_ever.get(group, ()):
            self.model.violate(
                "group-stranger", f"{cid} got {msg.name()} of group {group}, never joined"
            )
        before = self.receipts.get(payload)
        # A write its publisher may have sent twice (paho sends it again after a
        # reconnect) is two publications: the second goes out without DUP as the
        # session model excuses it (MQTT-3.3.1-3; tests/model/FINDINGS.md, finding 30).
        if before and not dup and not msg.ambiguous and self._excuse(msg) is None:
            first = before[0]
            self.model.violate(
                "group-dup",
                f"{cid} got {msg.name()} of group {group} at c{conn} without DUP; "
                f"{first.cid} had it {now - first.at:.1f} s before on c{first.conn}; "
                f"faults: {self.model.faults_around(first.at)}",
                dedupe=f"group-dup:{msg.name()}",
            )
        self.receipts.setdefault(payload, []).append(_Receipt(cid, conn, now, dup))

    # -- the drain -------------------------------------------------------------------

    def owed(self) -> list[Msg]:
        """Acknowledged writes the broker had to keep for their group."""
        out = []
        margin = ROUTE_MARGIN[self.cluster]
        for msg in list(self.model.msgs.values()):
            group = group_of(msg.topic)
            if group is None or not msg.ok or msg.acked_at is None or msg.qos == 0:
                continue
            acked = msg.acked_at
            if any(
                m.joined_at + margin < msg.sent_at
                and (m.left_at is None or m.left_at > acked)
                and (m.inc.ended is None or m.inc.ended > acked)
                and not m.inc.maybe_ended
                for m in self.members.get(group, ())
            ):
                out.append(msg)
        return out

    def open(self) -> int:
        """Owed writes no member has received yet."""
        return sum(1 for msg in self.owed() if msg.payload not in self.receipts)

    def _excuse(self, msg: Msg) -> str | None:
        """What the session promises excuse too (tests/model/model.py): the message
        expired; a Kafka that restarted empty and handed the write's offset out again."""
        model = self.model
        gone = msg.expires(None)  # a group queue keeps it whatever the sessions' TTL
        if gone is not None and self.clock() >= gone - 0.5:
            return "expired"
        if model.kafka_reused_offsets and any(
            kind == "restart_kafka" and at <= (msg.acked_at or at) for at, kind in model.fault_log
        ):
            return "kafka reused offsets"
        return None

    def check(self) -> None:
        stats = self.model.stats
        missing = []
        for msg in self.owed():
            stats.checked += 1
            if msg.payload in self.receipts:
                stats.delivered += 1
                continue
            why = self._excuse(msg)
            if why is None:
                missing.append(msg)
            else:
                stats.excused[why] = stats.excused.get(why, 0) + 1
        if missing:
            names = ", ".join(f"{m.name()} ({m.topic})" for m in missing[:8])
            self.model.violate(
                "group-lost",
                f"{len(missing)} acknowledged group write(s) reached no member: {names}; "
                f"faults around the first: {self.model.faults_around(missing[0].sent_at)}",
                dedupe=f"group-lost:{missing[0].name()}",
            )
