"""The model of exclusive compacted queues ($ECQ, broker/ecq.py) and their promises.

Writes are PUBLISHes to ``$ECQ/w/{queue}/{key}`` (the model's :class:`Msg`,
found by payload); every key is written by one publisher only, so its
acknowledged writes have one order. Checked:

``ecq-lost``
    at the drain, the consumer (subscribed to its queue then, at the latest)
    never received the latest acknowledged write of a key, nor any write of
    that key that may have replaced it (one not acknowledged, or sent later).
``ecq-again``
    an entry the consumer acknowledged came to it again, with no rewind since
    and no fault or broken connection that could have lost the
    acknowledgement.
``ecq-exclusive``
    a queue's entry reached a client other than the queue's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.model.model import Model, Msg

WRITE_PREFIX = "$ECQ/w/"
ACK_SLACK = 1.0  # s an acknowledgement needs to reach the broker and Redis


def write_topic(queue: str, key: str) -> str:
    return f"{WRITE_PREFIX}{queue}/{key}"


def parse_write(topic: str) -> tuple[str, str] | None:
    if not topic.startswith(WRITE_PREFIX):
        return None
    queue, _, key = topic[len(WRITE_PREFIX) :].partition("/")
    return queue, key


@dataclass
class _Receipt:
    at: float
    conn: int
    msg: Msg
    dup: bool


@dataclass
class _Ack:
    at: float
    conn: int


@dataclass
class QueueModel:
    model: Model
    clock: Callable[[], float]
    receipts: dict[str, list[_Receipt]] = field(default_factory=dict)  # by consumer
    acks: dict[tuple[str, bytes], _Ack] = field(default_factory=dict)  # (consumer, payload)
    rewinds: dict[str, list[float]] = field(default_factory=dict)
    closed: dict[tuple[str, int], float] = field(default_factory=dict)  # connection ends
    consumers: set[str] = field(default_factory=set)  # subscribed to their queue once

    # -- events ----------------------------------------------------------------------

    def consuming(self, cid: str) -> None:
        self.consumers.add(cid)

    def rewound(self, cid: str) -> None:
        self.rewinds.setdefault(cid, []).append(self.clock())
        self.model.log(f"{cid} REWIND its queue")

    def connection_closed(self, cid: str, conn: int) -> None:
        self.closed.setdefault((cid, conn), self.clock())

    def received(self, cid: str, conn: int, topic: str, payload: bytes, dup: bool) -> None:
        now = self.clock()
        msg = self.model.msgs.get(payload)
        if msg is None:
            self.model.violate("ecq-exclusive", f"{cid} got {topic} {payload!r}: never written")
            return
        where = parse_write(msg.topic)
        self.model.log(f"{cid} ECQ RECV {msg.name()} {topic} dup={dup} c{conn}")
        if where is None or where[0] != cid or topic != f"$ECQ/{cid}/{where[1]}":
            self.model.violate(
                "ecq-exclusive", f"{cid} got {msg.name()} written to {msg.topic} as {topic}"
            )
            return
        ack = self.acks.get((cid, payload))
        if ack is not None and not self._ack_may_be_lost(cid, ack, now):
            self.model.violate(
                "ecq-again",
                f"{cid} got {msg.name()} ({msg.topic}) again at c{conn}, acknowledged "
                f"{now - ack.at:.1f} s before on c{ack.conn}; faults: "
                f"{self.model.faults_around(ack.at)}",
                dedupe=f"ecq-again:{cid}:{msg.name()}",
            )
        self.receipts.setdefault(cid, []).append(_Receipt(now, conn, msg, dup))

    def acked(self, cid: str, payload: bytes, conn: int) -> None:
        self.acks[(cid, payload)] = _Ack(self.clock(), conn)

    def _ack_may_be_lost(self, cid: str, ack: _Ack, now: float) -> bool:
        if any(t >= ack.at - ACK_SLACK for t in self.rewinds.get(cid, ())):
            return True  # a rewind (or one racing the acknowledgement) gives it again
        # The acknowledgement is written within ACK_SLACK, or once Redis resumes if it
        # was paused then: a fault in that window may have lost it, a later one not.
        written_by = ack.at + ACK_SLACK
        for start, end in self.model.redis_paused:
            if start <= ack.at < end:
                written_by = max(written_by, end + ACK_SLACK)
        if self.model._redis_pause_start is not None and self.model._redis_pause_start <= ack.at:
            written_by = now  # still paused
        if self.model.fault_between(ack.at - ACK_SLACK, min(now, written_by)):
            return True
        closed = self.closed.get((cid, ack.conn))
        return closed is not None and closed < ack.at + ACK_SLACK

    # -- the drain -------------------------------------------------------------------

    def owed(self) -> dict[str, list[tuple[str, Msg]]]:
        """Per queue: (key, its latest acknowledged write) for every key written."""
        latest: dict[tuple[str, str], Msg] = {}
        for msg in self.model.msgs.values():
            where = parse_write(msg.topic)
            if where is None or not msg.ok:
                continue
            held = latest.get(where)
            if held is None or msg.sent_at > held.sent_at:
                latest[where] = msg
        out: dict[str, list[tuple[str, Msg]]] = {}
        for (queue, key), msg in latest.items():
            out.setdefault(queue, []).append((key, msg))
        return out

    def _met(self, queue: str, key: str, latest: Msg) -> bool:
        for receipt in self.receipts.get(queue, ()):
            msg = receipt.msg
            if msg is latest:
                return True
            if (
                parse_write(msg.topic) == (queue, key)
                and receipt.at >= latest.sent_at
                and (not msg.ok or msg.sent_at > latest.sent_at)
            ):
                return True  # replaced by a write that may have been stored after it
        return False

    def open(self) -> int:
        """Keys whose latest acknowledged write has not reached the consumer yet."""
        return sum(
            1
            for queue, keys in self.owed().items()
            for key, msg in keys
            if not self._met(queue, key, msg)
        )

    def _excuse(self, msg: Msg) -> str | None:
        """What the session promises excuse too (tests/model/model.py): a Kafka that
        restarted empty and handed the write's offset out again (docs/guarantees.md
        "What is guaranteed": replicas cannot hold a topic Kafka lost)."""
        model = self.model
        if model.kafka_reused_offsets and any(
            kind == "restart_kafka" and at <= (msg.acked_at or at) for at, kind in model.fault_log
        ):
            return "kafka reused offsets"
        return None

    def check(self) -> None:
        stats = self.model.stats
        for queue, keys in self.owed().items():
            missing, met = [], 0
            for key, msg in keys:
                if self._met(queue, key, msg):
                    met += 1
                    continue
                why = self._excuse(msg)
                if why is None:
                    missing.append((key, msg))
                else:
                    stats.excused[why] = stats.excused.get(why, 0) + 1
            stats.checked += len(keys)
            stats.delivered += met
            if missing:
                names = ", ".join(f"{k}={m.name()}" for k, m in missing[:8])
                self.model.violate(
                    "ecq-lost",
                    f"queue {queue}: {len(missing)} key(s) never got their latest acknowledged "
                    f"value: {names}; faults around the first: "
                    f"{self.model.faults_around(missing[0][1].sent_at)}",
                    dedupe=f"ecq-lost:{queue}",
                )
