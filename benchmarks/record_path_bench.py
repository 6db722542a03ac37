"""The persistent path's work per record, without Kafka or Redis:
``python -m benchmarks.record_path_bench``.

What the broker pays in Python for one persistent delivery of the fleet shape
(a 62-byte QoS 1 message, MQTT 3.1.1, no properties), step by step: encoding
its record value (persistence/delivery_codec.py ``encode_delivery``), handing
the record to the producer (persistence/producers.py ``Aiokafka.send``, into
aiokafka's batch in this process; no broker: the batches are dropped as they
fill), the consumer's check of the record it reads back
(persistence/consumer.py), and decoding the stored record for its subscriber
(persistence/format.py ``decode_record``). Best of ``--repeat`` runs of this
thread's CPU time: what the code costs, not what a shared machine was busy
with. Run it on two trees (``PYTHONPATH=TREE``) to compare them; a step a
tree does not have is measured as that tree does it.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.structs import PartitionMetadata

import persistence.consumer as consumer_module
from broker.message import Delivery, Message
from persistence.delivery_codec import encode_delivery
from persistence.format import decode_record
from persistence.producers import Aiokafka

TOPIC = "devicemq.device.persisted"


def _best(step: Callable[[], object], calls: int, repeat: int) -> float:
    """Nanoseconds of this thread's CPU per call, best of ``repeat`` runs."""
    best = float("inf")
    for _ in range(repeat):
        started = time.thread_time_ns()
        for _ in range(calls):
            step()
        best = min(best, (time.thread_time_ns() - started) / calls)
    return best


async def _best_async(
    step: Callable[[], Awaitable[object]], calls: int, repeat: int, between: Callable[[], None]
) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.thread_time_ns()
        for n in range(calls):
            await step()
            if n % 1000 == 999:
                between()
        best = min(best, (time.thread_time_ns() - started) / calls)
        between()
    return best


async def _send_cost(value: bytes, key: bytes, calls: int, repeat: int) -> tuple[float, float]:
    """(aiokafka's send, Aiokafka.send) per record, into an unstarted producer's batches."""
    producer = AIOKafkaProducer(
        bootstrap_servers="127.0.0.1:1", acks="all", max_batch_size=512 * 1024, linger_ms=1
    )
    wrapper = Aiokafka(producer)
    producer.client.cluster._partitions[TOPIC] = {0: PartitionMetadata(TOPIC, 0, 0, [0], [0], None)}
    accumulator: Any = producer._message_accumulator

    def drop() -> None:  # no sender: the batches filled so far are let go
        accumulator._batches.clear()

    async def long_way() -> object:
        return await producer.send(TOPIC, value=value, key=key, partition=0)

    async def wrapped() -> object:
        return await wrapper.send(TOPIC, value, key, 0)

    return (
        await _best_async(long_way, calls, repeat, drop),
        await _best_async(wrapped, calls, repeat, drop),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=50_000, help="per run and step")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    delivery = Delivery(Message("fleet/dev-01234/telemetry", b"x" * 62, 1, False), 1, False)
    value = encode_delivery(delivery, 1.7e9, 100.0, producer=3, seq=5, generation=1)
    key = b"lt-0123abcd-s1234"
    # A tree before well_formed (persistence/format.py) had its own in the consumer.
    well_formed = (
        getattr(consumer_module, "well_formed", None) or vars(consumer_module)["_well_formed"]
    )
    steps = {
        "encode the record (encode_delivery)": lambda: encode_delivery(
            delivery, 1.7e9, 100.0, producer=3, seq=5, generation=1
        ),
        "the consumer's check of a record": lambda: well_formed(value),
        "decode it for the subscriber (decode_record)": lambda: decode_record(
            5, 77, value, marked=True
        ),
    }
    for name, step in steps.items():
        print(f"{name:<48} {_best(step, args.calls, args.repeat):8.0f} ns")
    aiokafka_send, wrapped = asyncio.run(_send_cost(value, key, args.calls, args.repeat))
    print(f"{'hand it to the producer (Aiokafka.send)':<48} {wrapped:8.0f} ns")
    print(f"{'  aiokafka send itself, for comparison':<48} {aiokafka_send:8.0f} ns")


if __name__ == "__main__":
    main()
