"""The persistent path's two Kafka producers against Tansu (not a test).

    python -m benchmarks.kafka_producer_bench                  # both, 200,000 records each
    python -m benchmarks.kafka_producer_bench --client confluent --records 500000

It starts its own Tansu on a free 127.0.0.1 port (stopped by PID at the end),
makes a topic of 4 partitions and hands it records of 140 bytes from 100 keys
through :func:`persistence.kafka_path.make_producer`, as the path does: one
``send`` per record, partition given, a callback per answer. It prints the
records per second and the CPU time this process spent per record, librdkafka's
threads included: on a broker whose event loop is the limit, that CPU is what
a producer costs the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

from persistence.kafka_path import ensure_topic, make_producer
from tests.kafka_fixtures import bootstrap_of, start_tansu, stop_tansu

VALUE = b"x" * 140
KEYS = [b"client-%d" % i for i in range(100)]


async def _produce(bootstrap: str, client: str, records: int) -> tuple[float, float]:
    topic = f"bench-{client}-{uuid.uuid4().hex[:8]}"
    await ensure_topic(bootstrap, topic, 4)
    producer = make_producer(bootstrap, 10_000, 1, client)
    await producer.start()
    answered = 0
    failed = 0
    done = asyncio.Event()

    def on_answer(future: asyncio.Future[Any]) -> None:
        nonlocal answered, failed
        answered += 1
        if future.exception() is not None:
            failed += 1
        if answered == records:
            done.set()

    try:
        started, cpu = time.perf_counter(), time.process_time()
        for i in range(records):
            future = await producer.send(topic, VALUE, KEYS[i % 100], i % 4)
            future.add_done_callback(on_answer)
            if i % 1000 == 999:
                await asyncio.sleep(0)  # publishes arrive over many loop iterations
        await done.wait()
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    finally:
        await producer.stop()
    if failed:
        raise SystemExit(f"{client}: {failed} of {records} records failed")
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kafka_producer_bench")
    parser.add_argument("--client", choices=("aiokafka", "confluent", "both"), default="both")
    parser.add_argument("--records", type=int, default=200_000)
    args = parser.parse_args()
    clients = ["aiokafka", "confluent"] if args.client == "both" else [args.client]
    tansu = start_tansu(log=Path(f"/tmp/kafka-producer-bench-{uuid.uuid4().hex[:8]}.log"))
    try:
        bootstrap = bootstrap_of(tansu)
        for client in clients:
            wall, cpu = asyncio.run(_produce(bootstrap, client, args.records))
            print(
                f"{client:>9}: {args.records:,} records, {args.records / wall:,.0f} records/s, "
                f"{cpu / args.records * 1e6:.1f} us CPU per record ({cpu:.2f} s over {wall:.2f} s)"
            )
    finally:
        stop_tansu(tansu)


if __name__ == "__main__":
    main()
