"""The persistent path's first leg, KafkaPersistentPath, against Tansu (not a test).

    python -m benchmarks.kafka_path_bench                      # 60,000 publishes
    python -m benchmarks.kafka_path_bench --client confluent --records 100000

It starts its own Tansu on a free 127.0.0.1 port (stopped by PID at the end) and
submits publishes of one 62-byte record each for ``--keys`` subscribers (the
fleet shape: one record per device, many keys), ``--round`` at a time between
two loop iterations, at most 2,000 unanswered. It prints the CPU time this
process spent per record (the path, the producer and its callbacks) and the
records per second: on a broker whose event loop is the limit, that CPU is what
the first leg costs everything else.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from types import SimpleNamespace

import uvloop

from broker.message import Delivery, Message
from persistence.kafka_path import KafkaPersistentPath, ensure_topic, make_producer
from tests.kafka_fixtures import bootstrap_of, start_tansu, stop_tansu

WARM_UP = 2_000
WINDOW = 2_000  # publishes not answered yet, at most


async def _run(bootstrap: str, args: argparse.Namespace) -> tuple[float, float]:
    topic = f"bench-path-{uuid.uuid4().hex[:8]}"
    await ensure_topic(bootstrap, topic, args.partitions)
    producer = make_producer(bootstrap, 10_000, 1, args.client)
    await producer.start()
    path = KafkaPersistentPath(producer, topic, timeout=10.0)
    devices = [SimpleNamespace(client_id=f"dev-{i}", generation=0) for i in range(args.keys)]
    delivery = Delivery(Message("devices/t", b"x" * 62, 1, False), 1, False)
    answered = failed = 0

    def on_accepted(ok: bool) -> None:
        nonlocal answered, failed
        answered += 1
        failed += not ok

    async def publish(count: int) -> None:
        sent = 0
        while sent < count:
            for _ in range(min(args.round, count - sent)):
                path.submit([(devices[sent % args.keys], delivery)], on_accepted)
                sent += 1
            await asyncio.sleep(0)
            while sent - answered > WINDOW:
                await asyncio.sleep(0.0005)
        while answered < count:
            await asyncio.sleep(0.001)

    try:
        await publish(WARM_UP)
        answered = 0
        started, cpu = time.perf_counter(), time.process_time()
        await publish(args.records)
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    finally:
        await producer.stop()
    if failed:
        raise SystemExit(f"{failed} publishes failed")
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=60_000)
    parser.add_argument("--keys", type=int, default=4_000, help="subscribers (record keys)")
    parser.add_argument("--round", type=int, default=200, help="publishes per loop iteration")
    parser.add_argument("--partitions", type=int, default=1)
    parser.add_argument("--client", choices=("aiokafka", "confluent"), default="aiokafka")
    args = parser.parse_args()
    tansu = start_tansu()
    try:
        wall, cpu = uvloop.run(_run(bootstrap_of(tansu), args))
    finally:
        stop_tansu(tansu)
    print(
        f"{args.client}: {args.records:,} publishes, {args.records / wall:,.0f} records/s, "
        f"{cpu / args.records * 1e6:.1f} us CPU per record"
    )


if __name__ == "__main__":
    main()
