"""``devicemq loadtest ecq``: exclusive compacted queues under load ($ECQ, broker/ecq.py).

``--queues`` consumers (one per queue, MQTT 5, each subscribed to
``$ECQ/{id}/#`` before the writes start, acknowledging at once) and
``--publishers`` producers writing QoS 1 to ``$ECQ/w/{queue}/{key}`` over
``--keys`` keys per queue, ``--inflight`` unacknowledged each. Each key is
written by one producer only, so its writes reach Kafka in the order sent and
"the latest value of a key" is that producer's last acknowledged write: the
check is that every key's latest acknowledged value reaches its consumer (a
key that never does is **lost**). Fewer keys, more compaction: the report
gives the ratio of writes that were never delivered (replaced before their
turn). Payload: queue index, key index, write number, send time, padding.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from broker.codec import encode
from broker.packets import PubAck, Publish, SubAck, Subscribe, Subscription
from loadtest.queue_load import Conn, drain, latency_summary, run_reported

HEADER = struct.Struct(">IIIQ")  # queue, key, write number, send time (ns, monotonic)


@dataclass
class EcqConfig:
    host: str = "127.0.0.1"
    port: int = 1883
    queues: int = 10
    keys: int = 1000  # per queue
    publishers: int = 10
    inflight: int = 50
    payload_size: int = 1024
    duration: float = 20.0
    drain: float = 30.0
    seed: int = 1

    def check(self) -> None:
        if min(self.queues, self.keys, self.publishers, self.inflight) < 1:
            raise ValueError("--queues, --keys, --publishers and --inflight must be >= 1")
        if self.payload_size < HEADER.size:
            raise ValueError(f"--payload-size must be at least {HEADER.size}")
        if self.duration <= 0 or self.drain < 0:
            raise ValueError("--duration must be > 0, --drain >= 0")


@dataclass
class _Counts:
    writes_acked: int = 0
    reads: int = 0
    writes_refused: int = 0
    latencies: list[float] = field(default_factory=list)  # seconds, write -> read


class _Producer(Conn):
    def __init__(self, client_id: str, index: int, config: EcqConfig, run: _Run) -> None:
        super().__init__(client_id)
        self.config, self.run = config, run
        # The keys this producer owns: (queue, key) with key % publishers == index.
        self.owned = [
            (q, k)
            for q in range(config.queues)
            for k in range(index, config.keys, config.publishers)
        ]
        random.Random(config.seed * 7919 + index).shuffle(self.owned)
        self.next = 0
        self.write_no = 0
        self.out: dict[int, tuple[int, int, int]] = {}  # packet id -> queue, key, write
        self.packet_id = 0
        self.padding = bytes(config.payload_size - HEADER.size)
        self.running = False

    def fill(self) -> None:
        if not self.running or self.transport is None or not self.owned:
            return
        chunks = []
        while len(self.out) < self.config.inflight:
            q, k = self.owned[self.next % len(self.owned)]
            self.next += 1
            self.write_no += 1
            self.packet_id = self.packet_id % 65535 + 1
            payload = HEADER.pack(q, k, self.write_no, time.monotonic_ns()) + self.padding
            topic = f"$ECQ/w/{self.run.queue_ids[q]}/k{k}"
            chunks.append(encode(Publish(topic, payload, 1, packet_id=self.packet_id), 5))
            self.out[self.packet_id] = (q, k, self.write_no)
        if chunks:
            self.transport.write(b"".join(chunks))

    def packet(self, packet: object) -> None:
        if isinstance(packet, PubAck):
            q, k, write = self.out.pop(packet.packet_id)
            if packet.reason_code < 0x80:
                self.run.acked(q, k, write)
            else:
                self.run.counts.writes_refused += 1
            self.fill()
            return
        super().packet(packet)


class _Consumer(Conn):
    def __init__(self, client_id: str, index: int, run: _Run) -> None:
        super().__init__(client_id)
        self.index, self.run = index, run

    def packet(self, packet: object) -> None:
        if isinstance(packet, Publish):
            assert self.transport is not None and packet.packet_id is not None
            self.transport.write(encode(PubAck(packet.packet_id), 5))
            q, k, write, sent = HEADER.unpack_from(packet.payload)
            self.run.read(q, k, write, sent)
            return
        super().packet(packet)


class _Run:
    def __init__(self, config: EcqConfig) -> None:
        self.config = config
        tag = f"{random.Random(config.seed).getrandbits(32):08x}"
        self.queue_ids = [f"ecq-{tag}-{q}" for q in range(config.queues)]
        self.counts = _Counts()
        self.latest_acked: dict[tuple[int, int], int] = {}
        self.latest_read: dict[tuple[int, int], int] = {}
        self.measuring = False
        self.missing = 0  # keys whose latest acknowledged write has not arrived yet

    def acked(self, q: int, k: int, write: int) -> None:
        if self.measuring:
            self.counts.writes_acked += 1
        key = (q, k)
        before = self.latest_acked.get(key, 0)
        if write > before:
            read = self.latest_read.get(key, 0)
            self.missing += (write > read) - (before > read)
            self.latest_acked[key] = write

    def read(self, q: int, k: int, write: int, sent: int) -> None:
        if self.measuring:
            self.counts.reads += 1
            if len(self.counts.latencies) < 200_000:
                self.counts.latencies.append((time.monotonic_ns() - sent) / 1e9)
        key = (q, k)
        before = self.latest_read.get(key, 0)
        if write > before:
            acked = self.latest_acked.get(key, 0)
            self.missing += (acked > write) - (acked > before)
            self.latest_read[key] = write


async def run_ecq(config: EcqConfig) -> dict[str, Any]:
    config.check()
    run = _Run(config)
    consumers = [_Consumer(qid, i, run) for i, qid in enumerate(run.queue_ids)]
    for consumer in consumers:
        await consumer.open(config.host, config.port)
        suback = await consumer.request(
            Subscribe(1, [Subscription(f"$ECQ/{consumer.client_id}/#", 1)])
        )
        if not isinstance(suback, SubAck) or suback.reason_codes[0] >= 0x80:
            raise RuntimeError(f"{consumer.client_id}: SUBSCRIBE refused: {suback!r}")
    tag = run.queue_ids[0].rsplit("-", 1)[0]
    producers = [_Producer(f"{tag}-p{i}", i, config, run) for i in range(config.publishers)]
    for producer in producers:
        await producer.open(config.host, config.port)
    run.measuring = True
    started = time.monotonic()
    for producer in producers:
        producer.running = True
        producer.fill()
    await asyncio.sleep(config.duration)
    run.measuring = False
    elapsed = time.monotonic() - started
    for producer in producers:
        producer.running = False
    drained_in = await drain(lambda: any(p.out for p in producers) or run.missing > 0, config.drain)
    for conn in [*producers, *consumers]:
        conn.close()
    lost = [
        {"queue": q, "key": k, "acked": w, "read": run.latest_read.get((q, k), 0)}
        for (q, k), w in run.latest_acked.items()
        if run.latest_read.get((q, k), 0) < w
    ]
    counts = run.counts
    return {
        "config": vars(config),
        "seconds": round(elapsed, 2),
        "writes_acked": counts.writes_acked,
        "writes_per_s": round(counts.writes_acked / elapsed, 1),
        "reads": counts.reads,
        "reads_per_s": round(counts.reads / elapsed, 1),
        "compacted_ratio": round(1 - counts.reads / counts.writes_acked, 3)
        if counts.writes_acked
        else None,
        "writes_refused": counts.writes_refused,
        "keys_written": len(run.latest_acked),
        "lost": len(lost),
        "lost_examples": lost[:10],
        "drained_in_s": round(drained_in, 2),
        "latency_s": latency_summary(counts.latencies),
    }


def format_result(r: dict[str, Any]) -> str:
    c = r["config"]
    lat = r["latency_s"]
    return "\n".join(
        [
            f"ECQ load: {c['queues']} queues x {c['keys']} keys, {c['publishers']} producers "
            f"(inflight {c['inflight']}), {c['payload_size']} B, {r['seconds']} s",
            f"  writes acknowledged  {r['writes_acked']:>10,}  {r['writes_per_s']:>10,.0f}/s",
            f"  reads (delivered)    {r['reads']:>10,}  {r['reads_per_s']:>10,.0f}/s",
            f"  compacted            {r['compacted_ratio']}",
            f"  write -> read        p50 {lat['p50']} s  p99 {lat['p99']} s  max {lat['max']} s",
            f"  keys written         {r['keys_written']:,}; latest value of each delivered "
            f"within {r['drained_in_s']} s after the writes stopped",
            f"  LOST                 {r['lost']} key(s)"
            + ("" if not r["lost"] else f": {r['lost_examples']}"),
        ]
    )


def run_from_args(args: argparse.Namespace) -> int:
    """``devicemq loadtest ecq``: the options it shares with the other scenarios
    (loadtest/cli.py), with its own defaults where they differ."""
    config = EcqConfig(
        host=args.host,
        port=args.port,
        queues=args.queues if args.queues is not None else 10,
        keys=args.keys,
        publishers=args.publishers or 10,
        inflight=args.inflight,
        payload_size=args.payload_size or 1024,
        duration=args.duration,
        drain=args.drain,
        seed=args.seed if args.seed is not None else 1,
    )
    return run_reported(
        config,
        run_ecq,
        format_result,
        args.json,
        lambda r: r["lost"] == 0 and r["writes_refused"] == 0,
    )
