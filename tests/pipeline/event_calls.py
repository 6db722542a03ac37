"""Every kind of delivery event through EventLog's public calls, on a fake clock.

The same calls on the code of a7dfed5 (2026-11-28) wrote the keyed records of
tests/pipeline/data/events_keyed.json: ``python -m tests.pipeline.event_calls
OUT`` on that tree wrote the file (tests/pipeline/test_events.py reads the
records of the code today beside them).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import orjson

from persistence.events import EventLog
from persistence.format import Stage, StoredMessage, StoredRecord, encode_message
from persistence.queue_store import QueueBatch, QueueSaveResult, Removed
from persistence.redis_store import Assigned, ClientBatch, SaveResult


class Producer:
    """aiokafka's producer as EventLog uses it: keeps (partition, key, value)."""

    def __init__(self, partitions: int) -> None:
        self.partitions = partitions
        self.sent: list[tuple[int | None, bytes | None, bytes]] = []

    async def partitions_for(self, topic: str) -> set[int]:
        if not self.partitions:
            raise KeyError(topic)
        return set(range(self.partitions))

    async def send(
        self, topic: str, value: bytes, key: bytes | None = None, partition: int | None = None
    ) -> asyncio.Future[None]:
        self.sent.append((partition, key, value))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    async def stop(self) -> None:
        pass


def _value(topic: str, payload: bytes, expiry: float | None = None) -> bytes:
    return encode_message(
        StoredMessage(topic=topic, payload=payload, qos=1, publish_time=100.25, expiry=expiry)
    )


def _record(pid: int, score: int, expiry: float | None = None) -> StoredRecord:
    message = StoredMessage(topic="t", payload=b"x", qos=1, expiry=expiry)
    return StoredRecord(pid, score, Stage.PUBLISH, False, message)


async def calls(partitions: int) -> list[tuple[int | None, bytes | None, bytes]]:
    """The records of one flush of every kind of event, and of a gap."""
    producer = Producer(partitions)
    log = EventLog(
        producer,  # type: ignore[arg-type]
        "devicemq.events",
        epoch=3,
        default_ttl=1000,
        max_buffer=19,
        clock=lambda: 500.0,
    )
    values = [_value(f"a/{i}", b"p" * i, expiry=900.5 if i == 1 else None) for i in range(6)]
    batch = ClientBatch("c1", values, 2, [70, 71, 72, 73, 74, 75])
    # stored, stored (expiry), duplicate, expired, discarded, unstored; ids 4, 5 trimmed
    result = SaveResult(
        [Assigned(11, 11), Assigned(12, 12), None, None, None, None],
        [4, 5], 1, 1, [5], [4], outcomes=[11, 12, -1, 0, -2, -3],
    )  # fmt: skip
    log.stored(batch, result)
    log.session("c1", "connected")
    log.delivered("c1", _record(11, 11))
    record = _record(12, 12)
    record.sent = True
    log.delivered("c1", record)
    log.acked("c1", _record(11, 11))
    log.discarded("c1", _record(12, 12, expiry=400.0))  # expired at delivery
    log.discarded("c1", _record(13, 13))  # too large
    log.purged("c1", 14, 14)
    log.session("c1", "disconnected")
    log.session("c2", "session_expired")
    log.session("c3", "session_ended")
    log.admin("c1", "purge", {"purged": 1})
    log.admin("", "block", {"kind": "address", "value": "10.0.0.0/8"})
    queue_values = [_value(f"$ECQ/q1/k{i}", b"v" * i) for i in range(3)]
    queue = QueueBatch("q1", queue_values, 1, [30, 31, 32])
    saved = QueueSaveResult(
        seqs=[5, -1, -2],
        replaced=[3, 0, 0],
        removed=[Removed("k9", 2, True, 1), Removed("k8", 1, True, 2), Removed("k7", 9, False, 1)],
        keys=["k0", "k1", "k2"],
    )
    log.queue_stored(queue, saved)
    log.queue("q1", "delivered", 5, "k0", dup=True)
    log.queue("q1", "acked", 5, "k0")
    log.queue("q1", "discarded", 6, "k1")
    log.queue("q1", "purged", 7, "k2")
    log.acked("c4", _record(1, 1))
    log.acked("c4", _record(2, 2))  # over max_buffer: dropped, a gap
    await log.flush()
    return producer.sent


def main() -> None:
    out: dict[str, Any] = {}
    for partitions in (12, 0):
        sent = asyncio.run(calls(partitions))
        out[str(partitions)] = [
            [p, k.decode() if k is not None else None, orjson.loads(v)] for p, k, v in sent
        ]
    Path(sys.argv[1]).write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
