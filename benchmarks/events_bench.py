"""Micro-benchmark of the delivery events: ``python -m benchmarks.events_bench``.

The fleet shape (issue 39): every client has one message stored, delivered and
acknowledged per flush (4,000 devices at a message a second are 200 clients per
50 ms flush). It times what the broker pays per message, in one process with a
producer that keeps what it is given (no Kafka: a send is per partition and
flush, not per message): the three emitting calls on the delivery path, then
the flush (encoding the three events and handing the records over); and what
the audit's reader pays to decode them again (pipeline/decoding.py, when
pyarrow is installed). Best of several repeats of this process's CPU time, so
the number is what the code costs, not what the machine was busy with.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from persistence.events import EventLog
from persistence.format import Stage, StoredMessage, StoredRecord, encode_message
from persistence.redis_store import Assigned, ClientBatch, SaveResult

PARTITIONS = 12  # of the events topic (--partitions)


class KeepingProducer:
    """aiokafka's producer as EventLog uses it: it keeps the values it is given."""

    def __init__(self) -> None:
        self.values: list[bytes] = []
        self._done: asyncio.Future[None] | None = None

    partitions = PARTITIONS

    async def partitions_for(self, topic: str) -> set[int]:
        return set(range(self.partitions))

    async def send(
        self, topic: str, value: bytes, key: bytes | None = None, partition: int | None = None
    ) -> asyncio.Future[None]:
        self.values.append(value)
        if self._done is None:
            self._done = asyncio.get_running_loop().create_future()
            self._done.set_result(None)
        return self._done

    async def stop(self) -> None:
        pass


def _workload(clients: int, payload: int) -> list[tuple[str, ClientBatch, Any, StoredRecord]]:
    """Per client: its consumer batch (one raw stored value), the save's result and
    the stored record the delivery path reports."""
    out = []
    for i in range(clients):
        cid = f"fleet-sub-{i:05d}"
        message = StoredMessage(
            topic=f"fleet/dev-{i:05d}/telemetry",
            payload=bytes(payload),
            qos=1,
            publish_time=1_764_000_000.123 + i / 1000,
        )
        score = 1_000_000 + i
        batch = ClientBatch(cid, [encode_message(message)], i % PARTITIONS, [40_000 + i])
        result = SaveResult([Assigned(score & 0xFFFF or 1, score)], [], 0, 0, outcomes=[score])
        record = StoredRecord(score & 0xFFFF or 1, score, Stage.PUBLISH, False, message)
        out.append((cid, batch, result, record))
    return out


def _flush_once(log: EventLog, work: list[Any]) -> tuple[float, float]:
    """(seconds in the emitting calls, seconds in the flush) for one flush's worth."""
    t0 = time.process_time()
    for _cid, batch, result, _record in work:
        log.stored(batch, result)
    for cid, _batch, _result, record in work:
        log.delivered(cid, record)
    for cid, _batch, _result, record in work:
        log.acked(cid, record)
    t1 = time.process_time()
    asyncio.get_event_loop().run_until_complete(log.flush())
    return t1 - t0, time.process_time() - t1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=200, help="clients per flush (200)")
    parser.add_argument("--payload", type=int, default=62, help="payload bytes (62)")
    parser.add_argument("--flushes", type=int, default=50, help="flushes per repeat (50)")
    parser.add_argument("--repeat", type=int, default=7, help="repeats, the best kept (7)")
    parser.add_argument(
        "--partitions",
        type=int,
        default=PARTITIONS,
        help=f"of the events topic ({PARTITIONS}; 1: the embedded Kafka of `devicemq run`)",
    )
    args = parser.parse_args()
    work = _workload(args.clients, args.payload)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    producer = KeepingProducer()
    producer.partitions = args.partitions
    log = EventLog(producer, "devicemq.events", epoch=1)
    messages = args.clients * args.flushes
    best_emit = best_flush = float("inf")
    for _ in range(args.repeat):
        producer.values.clear()
        emit = flush = 0.0
        for _ in range(args.flushes):
            e, f = _flush_once(log, work)
            emit, flush = emit + e, flush + f
        best_emit, best_flush = min(best_emit, emit), min(best_flush, flush)
    values = list(producer.values)
    size = sum(len(v) for v in values)
    print(f"{args.clients} clients per flush, a {args.payload} B message each, 3 events each")
    print(f"{'broker: emitting calls':<34}{best_emit / messages * 1e9:>9.0f} ns per message")
    print(
        f"{'broker: flush (encode + send)':<34}{best_flush / messages * 1e9:>9.0f} ns per message"
    )
    total = (best_emit + best_flush) / messages * 1e9
    print(f"{'broker: total':<34}{total:>9.0f} ns per message")
    print(f"{'bytes in the topic':<34}{size / messages:>9.1f} B per message")
    try:
        from pipeline.decoding import event_batch, folded_batch
    except ImportError:  # the pipeline extra is not installed
        return
    parts = [0] * len(values)
    offsets = list(range(len(values)))
    for name, decode in (("events", event_batch), ("folded", folded_batch)):
        best = float("inf")
        for _ in range(max(1, args.repeat // 2)):
            t0 = time.process_time()
            rows = decode(values, parts, offsets).num_rows
            best = min(best, time.process_time() - t0)
        label = f"reader: {name} table ({rows // messages} rows/msg)"
        print(f"{label:<34}{best / messages * 1e9:>9.0f} ns per message")


if __name__ == "__main__":
    main()
