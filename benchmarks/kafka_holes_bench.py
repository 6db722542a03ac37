"""Does a fetch from the embedded Kafka skip offsets while producers race?

The cause of the 4 messages a two-replica run lost (BENCHMARKS.md, "Two
replicas on one host"): Tansu numbers a produce request's batch before it writes
it, so a fetch in between can return a later batch without the earlier one.
This starts a Tansu of its own (memory storage, as `devicemq run` does),
writes one partition from several producers (as replicas do; one producer
keeps one request in flight and never races itself), reads it with a plain
consumer that follows its fetches as aiokafka does, and counts the offsets it
skipped, then reads each hole again to see whether the records are there.
A race, not a test: run it a few times. ``--storage s3``: the Tansu, with
its S3 store, of a temporary data dir of the embedded services
(persistence.embedded_kafka_storage: s3, docs/embedded-kafka.md).

    python -m benchmarks.kafka_holes_bench --seconds 30 --producers 4 --busy
    python -m benchmarks.kafka_holes_bench --seconds 15 --storage s3
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import TopicPartition

from app.embedded_services import EmbeddedServices, find_tansu, free_port

TOPIC = "holes"


async def _produce(producer: AIOKafkaProducer, until: float) -> int:
    sent, futures = 0, []
    while time.monotonic() < until:
        for _ in range(20):
            futures.append(await producer.send(TOPIC, b"x" * 64, partition=0))
        await asyncio.sleep(0)
        if len(futures) > 2000:
            await asyncio.gather(*futures)
            sent, futures = sent + len(futures), []
    await asyncio.gather(*futures)
    return sent + len(futures)


async def run(
    bootstrap: str, seconds: float, producers: int
) -> tuple[int, int, list[tuple[int, int]], int]:
    """(records sent, fetched, holes as (expected, got) offsets, holes whose records are there)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(TOPIC, 1, 1)])
    finally:
        await admin.close()
    senders = [AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=1) for _ in range(producers)]
    consumer = AIOKafkaConsumer(
        TOPIC,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        fetch_max_wait_ms=5,
    )
    for sender in senders:
        await sender.start()
    await consumer.start()
    try:
        until = time.monotonic() + seconds
        tasks = [asyncio.create_task(_produce(s, until)) for s in senders]
        expected, fetched, holes = 0, 0, []
        while time.monotonic() < until + 3:
            for records in (await consumer.getmany(timeout_ms=50)).values():
                for record in records:
                    if record.offset != expected:
                        holes.append((expected, record.offset))
                    expected, fetched = record.offset + 1, fetched + 1
        sent = sum(await asyncio.gather(*tasks))
        tp, there = TopicPartition(TOPIC, 0), 0
        for start, _ in holes:
            consumer.seek(tp, start)
            again = (await consumer.getmany(tp, timeout_ms=2000, max_records=1)).get(tp, [])
            there += bool(again) and again[0].offset == start
        return sent, fetched, holes, there
    finally:
        for sender in senders:
            await sender.stop()
        await consumer.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kafka_holes_bench")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--busy", action="store_true", help="keep one core busy meanwhile")
    parser.add_argument(
        "--storage", choices=("memory", "s3"), default="memory", help="Tansu's storage"
    )
    args = parser.parse_args(argv)
    if args.storage == "s3":
        with tempfile.TemporaryDirectory(prefix="holes-s3-") as data_dir:
            services = EmbeddedServices(data_dir, kafka_storage="s3")
            try:
                bootstrap = services.ensure_running().kafka_bootstrap
                sent, fetched, holes, there = asyncio.run(
                    run(bootstrap, args.seconds, args.producers)
                )
            finally:
                services.stop()
        _report(args, sent, fetched, holes, there)
        return 0
    url = f"tcp://127.0.0.1:{free_port()}"
    tansu = subprocess.Popen(
        [
            find_tansu(),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            "memory://tansu/",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    burner = None
    if args.busy:
        burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.0)  # Tansu answers within a second here; the admin client retries
        sent, fetched, holes, there = asyncio.run(
            run(url.removeprefix("tcp://"), args.seconds, args.producers)
        )
    finally:
        for process in (burner, tansu):
            if process is not None:
                process.terminate()
                process.wait()
    _report(args, sent, fetched, holes, there)
    return 0


def _report(
    args: argparse.Namespace, sent: int, fetched: int, holes: list[tuple[int, int]], there: int
) -> None:
    print(
        f"{args.storage}, {args.producers} producers, {args.seconds:g} s: sent {sent}, "
        f"fetched {fetched}, {len(holes)} fetches skipped offsets (records there when read "
        f"again: {there}) {holes[:5]}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
