"""Capacity benchmark: many idle persistent sessions, a stored backlog, one replay.

Against a running devicemq (``--pid`` names its process for RSS):

1. ``--sessions`` persistent 3.1.1 clients connect, subscribe to their own
   topic and disconnect (idle persistent sessions);
2. ``--messages`` QoS 1 messages are published, spread over the sessions,
   with ``--backlog`` of them to one session, ``replay-0``;
3. the broker's RSS is read, and with ``--redis-url`` Redis's memory per
   stored message (``used_memory`` grown since before step 1, divided by
   ``--messages``: the sessions' own keys are in it);
4. ``replay-0`` reconnects and the time until it has received (and acked)
   its whole backlog is measured.

Not a test: ``python -m benchmarks.sessions_bench --port 1883 --pid PID``
(``devicemq run`` keeps its Redis's port in ``DATA/services/ports.json``, its
password in ``DATA/services/redis.password``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path
from typing import TypeVar

from broker.codec import PacketDecoder, encode
from broker.packets import (
    ConnAck,
    Connect,
    Disconnect,
    PubAck,
    Publish,
    SubAck,
    Subscribe,
    Subscription,
)

LEVEL = 4
T = TypeVar("T")


class Client:
    """A minimal MQTT 3.1.1 client on asyncio streams (setup traffic, not the hot path)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = PacketDecoder(protocol_level=LEVEL)
        self.pending: list[object] = []

    @classmethod
    async def connect(cls, host: str, port: int, client_id: str, clean: bool) -> Client:
        reader, writer = await asyncio.open_connection(host, port)
        client = cls(reader, writer)
        client.send(Connect(client_id, protocol_level=LEVEL, clean_start=clean, keep_alive=600))
        ack = await client.expect(ConnAck)
        assert ack.reason_code == 0, ack
        return client

    def send(self, packet: object) -> None:
        self.writer.write(encode(packet, LEVEL))  # type: ignore[arg-type]

    async def read(self) -> list[object]:
        while not self.pending:
            data = await self.reader.read(65536)
            if not data:
                raise ConnectionError("broker closed the connection")
            self.pending.extend(self.decoder.feed(data))
        packets, self.pending = self.pending, []
        return packets

    async def expect(self, kind: type[T]) -> T:
        while True:
            for i, packet in enumerate(self.pending):
                if isinstance(packet, kind):
                    del self.pending[i]
                    return packet
            self.pending.extend(self.decoder.feed(await self.reader.read(65536)))

    async def close(self) -> None:
        self.send(Disconnect())
        await self.writer.drain()
        self.writer.close()


async def make_sessions(host: str, port: int, count: int, parallel: int = 200) -> None:
    gate = asyncio.Semaphore(parallel)

    async def one(n: int) -> None:
        async with gate:
            client = await Client.connect(host, port, f"replay-{n}", clean=False)
            client.send(Subscribe(1, [Subscription(f"bench/{n}", qos=1)]))
            await client.expect(SubAck)
            await client.close()

    await asyncio.gather(*(one(n) for n in range(count)))


async def publish(host: str, port: int, sessions: int, messages: int, backlog: int) -> None:
    client = await Client.connect(host, port, "bench-publisher", clean=True)
    targets = [0] * backlog + [1 + i % max(1, sessions - 1) for i in range(messages - backlog)]
    window, unacked, packet_id = 500, 0, 0
    for n, target in enumerate(targets):
        packet_id = packet_id % 65535 + 1
        client.send(Publish(f"bench/{target}", b"x" * 64, qos=1, packet_id=packet_id))
        unacked += 1
        while unacked >= window or (n == len(targets) - 1 and unacked):
            await client.writer.drain()
            unacked -= sum(isinstance(p, PubAck) for p in await client.read())
    await client.close()


async def replay(host: str, port: int, backlog: int) -> float:
    started = time.monotonic()
    client = await Client.connect(host, port, "replay-0", clean=False)
    received: set[bytes] = set()
    while len(received) < backlog:
        acks = []
        for packet in await client.read():
            if isinstance(packet, Publish):
                assert packet.packet_id is not None
                received.add(packet.packet_id.to_bytes(2, "big"))
                acks.append(encode(PubAck(packet.packet_id), LEVEL))
        # One write per read, as a client library that batches its socket writes:
        # the replay's time is the broker's, not this client's system calls.
        client.writer.write(b"".join(acks))
    elapsed = time.monotonic() - started
    await client.close()
    return elapsed


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` so far (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def used_memory(url: str) -> int:
    from redis.asyncio import Redis

    client = Redis.from_url(url)
    try:
        return int((await client.info("memory"))["used_memory"])
    finally:
        await client.aclose()


async def main_async(args: argparse.Namespace) -> None:
    before = await used_memory(args.redis_url) if args.redis_url else 0
    t0 = time.monotonic()
    await make_sessions(args.host, args.port, args.sessions)
    print(f"{args.sessions} idle persistent sessions in {time.monotonic() - t0:.1f} s")
    t0 = time.monotonic()
    await publish(args.host, args.port, args.sessions, args.messages, args.backlog)
    print(f"{args.messages} messages published (acked) in {time.monotonic() - t0:.1f} s")
    await asyncio.sleep(args.settle)
    if args.pid:
        print(f"broker RSS: {rss_mib(args.pid):.0f} MiB")
    if args.redis_url:
        grown = await used_memory(args.redis_url) - before
        print(f"Redis memory per stored message: {grown / max(1, args.messages):.0f} B")
    cpu = cpu_seconds(args.pid) if args.pid else 0.0
    elapsed = await replay(args.host, args.port, args.backlog)
    busy = f", broker CPU {cpu_seconds(args.pid) - cpu:.2f} s" if args.pid else ""
    print(
        f"replay of {args.backlog} stored messages to a reconnecting client: {elapsed:.2f} s{busy}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=1883)
    parser.add_argument("--pid", type=int, default=0, help="broker process, for RSS")
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--backlog", type=int, default=10_000)
    parser.add_argument("--redis-url", default="", help="the broker's Redis, for its memory")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds to let storing finish")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
