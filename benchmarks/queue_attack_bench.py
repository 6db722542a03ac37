"""What the queue attacks (a group-queue amplification, an $ECQ queue filled) still cost:
SECURITY.md's numbers.

    python -m benchmarks.queue_attack_bench amplify [--groups 1000] [--publishes 2] [--sessions 1]
    python -m benchmarks.queue_attack_bench ecq-fill [--writes 320] [--size 262144]
    python -m benchmarks.queue_attack_bench owner-fill [--sessions 10] [--publishes 200]
        [--budget 16777216]
    python -m benchmarks.queue_attack_bench owner-tally [--sessions 10000]

Each starts ``devicemq run`` with persistence on (its embedded Redis and Kafka, in
a temporary data dir, default settings otherwise) and measures the embedded
Redis's ``used_memory`` before and after:

- ``amplify``: ``--sessions`` sessions of the user mallory (a password file)
  subscribe ``$queue/g0..g{N-1}/mallory/amp`` (100 filters a SUBSCRIBE; each
  session the filters the ones before it did not get), then one publishes
  ``--publishes`` x 64 KiB to ``mallory/amp`` at QoS 1: every group queue
  keeps a copy;
- ``ecq-fill``: one client writes ``--writes`` values of ``--size`` bytes to
  ``$ECQ/w/nobody-ever/k{i}`` at QoS 1, a queue whose consumer never connects;
- ``owner-fill``: mallory leaves ``--sessions`` persistent sessions subscribed to
  ``mallory/#`` offline, then publishes ``--publishes`` x 64 KiB to ``mallory/f``
  at QoS 1 (every session keeps a copy), with ``auth.max_bytes_per_owner`` at
  ``--budget`` and a tally every second (0: neither set: the default 1 GiB, or
  nothing in a checkout without the setting).

``owner-tally`` starts a redis-server of its own and measures, in this process, one
tally of ``auth.max_bytes_per_owner`` over ``--sessions`` persistent sessions of
one owner (persistence/owner_tally.py): its duration and the longest time it held
the event loop.

It prints the SUBACK / PUBACK codes counted and the growth. Settings this
version does not have are simply absent, so the same command runs in an older
checkout (282301f) for comparison.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import time

from app.embedded_services import free_port
from benchmarks.blocking_mqtt import BlockingClient, running_broker
from broker.packets import (
    PubAck,
    Publish,
    SubAck,
    Subscribe,
    Subscription,
)

KIB = 1024
USERS = ("mallory", "alice")


def _used_memory(redis_url: str) -> int:
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        return int(client.info("memory")["used_memory"])
    finally:
        client.close()


def _settled(redis_url: str) -> int:
    """``used_memory`` once it stopped changing for a second (the consumer stored)."""
    last, still = -1, 0
    while still < 4:
        time.sleep(0.25)
        now = _used_memory(redis_url)
        still = still + 1 if abs(now - last) < 64 * KIB else 0
        last = now
    return last


def amplify(groups: int, publishes: int, sessions: int) -> None:
    with running_broker(users=USERS) as broker:
        port, redis_url = broker.port, broker.redis_url
        before = _settled(redis_url)
        codes: collections.Counter[int] = collections.Counter()
        left = [f"$queue/g{i}/mallory/amp" for i in range(groups)]
        clients = []
        for k in range(sessions):
            client = BlockingClient(port, f"mallory-amp-{k}", "mallory")
            clients.append(client)
            refused = []
            for n, start in enumerate(range(0, len(left), 100)):
                chunk = left[start : start + 100]
                subscribe = Subscribe(n + 1, [Subscription(f, 1) for f in chunk])
                client.send(subscribe)
                suback = client.until(SubAck)
                assert isinstance(suback, SubAck)
                codes.update(suback.reason_codes)
                refused += [f for f, c in zip(chunk, suback.reason_codes, strict=True) if c >= 0x80]
            left = refused
        acks: collections.Counter[int] = collections.Counter()
        for i in range(publishes):
            message = Publish("mallory/amp", b"x" * 64 * KIB, 1, packet_id=1000 + i)
            clients[0].send(message)
            puback = clients[0].until(PubAck)
            assert isinstance(puback, PubAck)
            acks[puback.reason_code] += 1
        after = _settled(redis_url)
        for client in clients:
            client.close()
    grown = after - before
    sent = publishes * 64 * KIB
    print(
        f"amplify: {sessions} session(s) of one user, SUBACK codes {dict(codes)}, "
        f"{groups - len(left)} group queues joined; PUBACK codes {dict(acks)}; "
        f"{publishes} x 64 KiB published ({sent / 1e6:.2f} MB): Redis grew by "
        f"{grown / 1e6:.1f} MB (x{grown / sent:.0f})"
    )


def ecq_fill(writes: int, size: int) -> None:
    with running_broker(users=USERS) as broker:
        port, redis_url = broker.port, broker.redis_url
        before = _settled(redis_url)
        client = BlockingClient(port, "alice-writer", "alice")
        acks: collections.Counter[int] = collections.Counter()
        started = time.monotonic()
        for i in range(writes):
            message = Publish(f"$ECQ/w/nobody-ever/k{i}", b"v" * size, 1, packet_id=i % 60000 + 1)
            client.send(message)
            puback = client.until(PubAck)
            assert isinstance(puback, PubAck)
            acks[puback.reason_code] += 1
        took = time.monotonic() - started
        after = _settled(redis_url)
        client.close()
    print(
        f"ecq-fill: {writes} x {size} bytes in {took:.1f} s, PUBACK codes {dict(acks)}: "
        f"Redis grew by {(after - before) / 1e6:.1f} MB"
    )


def owner_fill(sessions: int, publishes: int, budget: int) -> None:
    settings = {}  # --budget 0: left at its default (1 GiB); an older checkout has none
    if budget:
        settings = {
            "DEVICEMQ_AUTH_MAX_BYTES_PER_OWNER": str(budget),
            "DEVICEMQ_AUTH_OWNER_TALLY_INTERVAL": "1",
        }
    with running_broker(settings, users=USERS) as broker:
        port, redis_url = broker.port, broker.redis_url
        before = _settled(redis_url)
        for i in range(sessions):
            member = BlockingClient(port, f"mallory-{i}", "mallory", expiry=3600)
            member.send(Subscribe(1, [Subscription("mallory/#", 1)]))
            member.until(SubAck)
            member.close()
        publisher = BlockingClient(port, "mallory-pub", "mallory")
        acks: collections.Counter[int] = collections.Counter()
        started = time.perf_counter()
        for i in range(publishes):
            value = Publish("mallory/f", os.urandom(64 * KIB), 1, packet_id=i % 65535 + 1)
            publisher.send(value)
            ack = publisher.until(PubAck)
            assert isinstance(ack, PubAck)
            acks[ack.reason_code] += 1
        took = time.perf_counter() - started
        publisher.close()
        after = _settled(redis_url)
    print(
        f"owner-fill: {sessions} sessions, {publishes} x 64 KiB in {took:.1f} s, budget "
        f"{budget} bytes, PUBACK codes {dict(acks)}: Redis grew by {(after - before) / 1e6:.1f} MB"
    )


def owner_tally(sessions: int) -> None:
    import asyncio
    import dataclasses

    from broker.config import AuthSettings, Settings
    from broker.core import Broker
    from persistence.format import client_keys
    from persistence.owner_tally import OwnerTally
    from persistence.redis_store import RedisMessageStore

    binary = shutil.which("redis-server")
    assert binary, "owner-tally needs redis-server on the PATH"
    port = free_port()
    server = subprocess.Popen(
        [binary, "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )

    async def measure() -> tuple[float, float]:
        store = RedisMessageStore.from_url(f"redis://127.0.0.1:{port}/0")
        for _ in range(100):
            try:
                await store.ping()
                break
            except Exception:
                await asyncio.sleep(0.05)
        settings = dataclasses.replace(Settings(), auth=AuthSettings(max_bytes_per_owner=1))
        broker = Broker(settings)
        pipe = store.redis.pipeline(transaction=False)
        for i in range(sessions):
            session = broker.restore_session(f"fleet-{i}", 3600, [], None)
            broker.bind_owner(session, "fleet")
            pipe.set(client_keys(f"fleet-{i}").bytes, 100)
        await pipe.execute()
        longest, stop = 0.0, False

        async def ticker() -> None:
            nonlocal longest
            last = time.perf_counter()
            while not stop:
                await asyncio.sleep(0)
                now = time.perf_counter()
                longest, last = max(longest, now - last), now

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        longest = 0.0
        await OwnerTally(store, settings, broker.budget, broker.stores_by_owner).once()
        stop = True
        await tick
        await store.aclose()
        return broker.budget.seconds, longest

    try:
        took, held = asyncio.run(measure())
    finally:
        server.terminate()
        server.wait(10)
    print(
        f"owner-tally: {sessions} sessions of one owner read in {took * 1000:.0f} ms, "
        f"the event loop held at most {held * 1000:.1f} ms at once"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.queue_attack_bench", description=__doc__
    )
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("amplify")
    p.add_argument("--groups", type=int, default=1000)
    p.add_argument("--publishes", type=int, default=2)
    p.add_argument("--sessions", type=int, default=1)
    p = sub.add_parser("ecq-fill")
    p.add_argument("--writes", type=int, default=320)
    p.add_argument("--size", type=int, default=256 * KIB)
    p = sub.add_parser("owner-fill")
    p.add_argument("--sessions", type=int, default=10)
    p.add_argument("--publishes", type=int, default=200)
    p.add_argument("--budget", type=int, default=16 * KIB * KIB)
    p = sub.add_parser("owner-tally")
    p.add_argument("--sessions", type=int, default=10_000)
    args = parser.parse_args(argv)
    if args.what == "amplify":
        amplify(args.groups, args.publishes, args.sessions)
    elif args.what == "ecq-fill":
        ecq_fill(args.writes, args.size)
    elif args.what == "owner-fill":
        owner_fill(args.sessions, args.publishes, args.budget)
    else:
        owner_tally(args.sessions)


if __name__ == "__main__":
    main()
