"""``devicemq loadtest group-queue``: durable group queues under load ($queue,
broker/group_queue.py). ``shared-queue``, its first name, still runs it.

``--queues`` groups, each with ``--members`` members (MQTT 5, persistent
sessions, subscribed to ``$queue/{group}/{topic}/#`` before the load starts,
acknowledging at once), and ``--publishers`` producers publishing QoS 1 to the
groups' topics in turn, ``--inflight`` unacknowledged each. With ``--churn S``
a member drops its connection without DISCONNECT every S seconds (one at a
time, round robin) and comes back a moment later: what it had in flight must
go to another member, with DUP. The check: every acknowledged message
reaches some member (one that never does is **lost**); a message delivered
twice must carry DUP the second time (one that does not is counted).
Payload: group index, message number, send time, padding.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from broker.codec import encode
from broker.packets import (
    ConnAck,
    Connect,
    Properties,
    PubAck,
    Publish,
    SubAck,
    Subscribe,
    Subscription,
)
from loadtest.queue_load import Conn, drain, latency_summary, run_reported

HEADER = struct.Struct(">IQQ")  # group, message number, send time (ns, monotonic)


@dataclass
class GroupQueueConfig:
    host: str = "127.0.0.1"
    port: int = 1883
    queues: int = 4  # groups
    members: int = 4  # per group
    publishers: int = 8
    inflight: int = 50
    payload_size: int = 1024
    duration: float = 20.0
    drain: float = 30.0
    churn: float = 0.0  # seconds between members dropping their connection; 0: none
    seed: int = 1

    def check(self) -> None:
        if min(self.queues, self.members, self.publishers, self.inflight) < 1:
            raise ValueError("--queues, --members, --publishers and --inflight must be >= 1")
        if self.payload_size < HEADER.size:
            raise ValueError(f"--payload-size must be at least {HEADER.size}")
        if self.duration <= 0 or self.drain < 0 or self.churn < 0:
            raise ValueError("--duration must be > 0, --drain and --churn >= 0")


@dataclass
class _Counts:
    acked: int = 0
    refused: int = 0
    reads: int = 0
    duplicates: int = 0  # deliveries of a message already delivered
    duplicates_without_dup: int = 0
    dropped_connections: int = 0
    latencies: list[float] = field(default_factory=list)


class _Run:
    def __init__(self, config: GroupQueueConfig) -> None:
        self.config = config
        tag = f"{random.Random(config.seed).getrandbits(32):08x}"
        self.tag = tag
        self.topics = [f"gq-{tag}/{g}" for g in range(config.queues)]
        self.filters = [f"$queue/g{g}/gq-{tag}/{g}/#" for g in range(config.queues)]
        self.counts = _Counts()
        self.acked: set[tuple[int, int]] = set()
        self.read_once: set[tuple[int, int]] = set()
        self.measuring = False

    def missing(self) -> int:
        return len(self.acked - self.read_once)

    def delivered(self, group: int, number: int, sent: int, dup: bool) -> None:
        key = (group, number)
        if key in self.read_once:
            self.counts.duplicates += 1
            if not dup:
                self.counts.duplicates_without_dup += 1
            return
        self.read_once.add(key)
        if self.measuring:
            self.counts.reads += 1
            if len(self.counts.latencies) < 200_000:
                self.counts.latencies.append((time.monotonic_ns() - sent) / 1e9)


class _Member(Conn):
    def __init__(self, client_id: str, group: int, run: _Run) -> None:
        super().__init__(client_id)
        self.group, self.run = group, run

    async def join(self, host: str, port: int, first: bool) -> None:
        loop = asyncio.get_running_loop()
        self.decoder = type(self.decoder)(protocol_level=5)
        self.lost = loop.create_future()
        await loop.create_connection(lambda: self, host, port)
        connack = await self.request(
            Connect(
                self.client_id,
                protocol_level=5,
                clean_start=first,
                keep_alive=600,
                properties=Properties(session_expiry_interval=600, receive_maximum=100),
            )
        )
        if not isinstance(connack, ConnAck) or connack.reason_code:
            raise RuntimeError(f"{self.client_id}: CONNECT refused: {connack!r}")
        if first:
            suback = await self.request(
                Subscribe(1, [Subscription(self.run.filters[self.group], 1)])
            )
            if not isinstance(suback, SubAck) or suback.reason_codes[0] >= 0x80:
                raise RuntimeError(f"{self.client_id}: SUBSCRIBE refused: {suback!r}")

    def drop(self) -> None:
        """Leave without DISCONNECT, as a device whose link died."""
        if self.transport is not None:
            self.transport.abort()
            self.transport = None

    def packet(self, packet: object) -> None:
        if isinstance(packet, Publish):
            assert packet.packet_id is not None
            if self.transport is not None:
                self.transport.write(encode(PubAck(packet.packet_id), 5))
            group, number, sent = HEADER.unpack_from(packet.payload)
            self.run.delivered(group, number, sent, packet.dup)
            return
        super().packet(packet)


class _Producer(Conn):
    def __init__(self, client_id: str, index: int, run: _Run) -> None:
        super().__init__(client_id)
        self.index, self.run = index, run
        config = run.config
        self.next = 0
        self.out: dict[int, tuple[int, int]] = {}
        self.packet_id = 0
        self.padding = bytes(config.payload_size - HEADER.size)
        self.running = False

    def fill(self) -> None:
        run, config = self.run, self.run.config
        if not self.running or self.transport is None:
            return
        chunks = []
        while len(self.out) < config.inflight:
            self.next += 1
            group = (self.index + self.next) % config.queues
            number = self.next * config.publishers + self.index
            self.packet_id = self.packet_id % 65535 + 1
            payload = HEADER.pack(group, number, time.monotonic_ns()) + self.padding
            topic = f"{run.topics[group]}/p{self.index}"
            chunks.append(encode(Publish(topic, payload, 1, packet_id=self.packet_id), 5))
            self.out[self.packet_id] = (group, number)
        if chunks:
            self.transport.write(b"".join(chunks))

    def packet(self, packet: object) -> None:
        if isinstance(packet, PubAck):
            group, number = self.out.pop(packet.packet_id)
            if packet.reason_code < 0x80:
                self.run.acked.add((group, number))
                if self.run.measuring:
                    self.run.counts.acked += 1
            else:
                self.run.counts.refused += 1
            self.fill()
            return
        super().packet(packet)


async def _churn(config: GroupQueueConfig, run: _Run, members: list[_Member]) -> None:
    """One member at a time drops its connection and comes back half a second later."""
    turn = 0
    while True:
        await asyncio.sleep(config.churn)
        member = members[turn % len(members)]
        turn += 1
        member.drop()
        run.counts.dropped_connections += 1
        await asyncio.sleep(0.5)
        await member.join(config.host, config.port, first=False)


async def run_group_queue(config: GroupQueueConfig) -> dict[str, Any]:
    config.check()
    run = _Run(config)
    members = [
        _Member(f"gq-{run.tag}-g{g}-m{m}", g, run)
        for g in range(config.queues)
        for m in range(config.members)
    ]
    for member in members:
        await member.join(config.host, config.port, first=True)
    producers = [_Producer(f"gq-{run.tag}-p{i}", i, run) for i in range(config.publishers)]
    for producer in producers:
        await producer.open(config.host, config.port)
    run.measuring = True
    started = time.monotonic()
    for producer in producers:
        producer.running = True
        producer.fill()
    churner = asyncio.create_task(_churn(config, run, members)) if config.churn else None
    await asyncio.sleep(config.duration)
    run.measuring = False
    elapsed = time.monotonic() - started
    for producer in producers:
        producer.running = False
    if churner is not None:
        churner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await churner
        for member in members:  # one dropped at the cancel comes back
            if member.transport is None:
                await member.join(config.host, config.port, first=False)
    drained_in = await drain(
        lambda: any(p.out for p in producers) or run.missing() > 0, config.drain
    )
    for conn in [*producers, *members]:
        conn.close()
    lost = sorted(run.acked - run.read_once)
    counts = run.counts
    return {
        "config": vars(config),
        "seconds": round(elapsed, 2),
        "acked": counts.acked,
        "acked_per_s": round(counts.acked / elapsed, 1),
        "reads": counts.reads,
        "reads_per_s": round(counts.reads / elapsed, 1),
        "refused": counts.refused,
        "duplicates": counts.duplicates,
        "duplicates_without_dup": counts.duplicates_without_dup,
        "dropped_connections": counts.dropped_connections,
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
            f"group queue load: {c['queues']} groups x {c['members']} members, "
            f"{c['publishers']} publishers (inflight {c['inflight']}), {c['payload_size']} B, "
            f"{r['seconds']} s, churn every {c['churn'] or '-'} s",
            f"  published (acked)    {r['acked']:>10,}  {r['acked_per_s']:>10,.0f}/s",
            f"  delivered (first)    {r['reads']:>10,}  {r['reads_per_s']:>10,.0f}/s",
            f"  publish -> delivery  p50 {lat['p50']} s  p99 {lat['p99']} s  max {lat['max']} s",
            f"  duplicates           {r['duplicates']:,} ({r['duplicates_without_dup']} "
            f"without DUP), {r['dropped_connections']} connections dropped",
            f"  every acknowledged message delivered within {r['drained_in_s']} s after "
            f"the load stopped",
            f"  LOST                 {r['lost']}"
            + ("" if not r["lost"] else f": {r['lost_examples']}"),
        ]
    )


def run_from_args(args: argparse.Namespace) -> int:
    """``devicemq loadtest group-queue``: the options it shares with the other
    scenarios (loadtest/cli.py), with its own defaults where they differ."""
    config = GroupQueueConfig(
        host=args.host,
        port=args.port,
        queues=args.queues if args.queues is not None else 4,
        members=args.members,
        publishers=args.publishers or 8,
        inflight=args.inflight,
        payload_size=args.payload_size or 1024,
        duration=args.duration,
        drain=args.drain,
        churn=args.churn,
        seed=args.seed if args.seed is not None else 1,
    )
    return run_reported(
        config,
        run_group_queue,
        format_result,
        args.json,
        lambda r: not r["lost"] and not r["refused"] and not r["duplicates_without_dup"],
    )
