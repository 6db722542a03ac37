"""A consumer-group rebalance under load: an intruder takes partitions away and gives them back.

While paho publishers send to persistent subscribers, a second member joins
the broker's persistence consumer group: a plain aiokafka consumer in its own
process, with the group id and topic devicemq uses, that fetches records for a
while WITHOUT storing or committing them, then leaves the group (a clean
``close``) or is SIGKILLed (the group notices after its session timeout). Redis
is paused while the intruder joins, so the broker's consumer is in the middle
of storing a batch when its partitions are taken away. The broker gets them
back and must re-read from its last committed offset everything the intruder
fetched: nothing acknowledged lost, nothing repeated without DUP, order kept,
and ``/ready`` back to 200 with no help.

Whether the broker's commit after that stuck batch fails is not asserted: it
depends on whether the consumer has already rejoined under the new generation
when the store finishes (Tansu then accepts the commit), a race the test
cannot settle, and either outcome is correct: a failed commit means a re-read
(the store skips what it has), a successful one covers records it stored.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from aiokafka.partitioner import DefaultPartitioner

from tests.faults.checker import (
    V5,
    V311,
    PahoSubscriber,
    Publisher,
    assert_ok,
    check,
    start_publishers,
    wait_until,
)
from tests.faults.conftest import REPO, Stack
from tests.faults.test_readiness import metrics_settings, wait_ready
from tests.kafka_fixtures import freeze

INTRUDER = r"""
import asyncio, json, sys
from aiokafka import AIOKafkaConsumer
from tests.kafka_fixtures import freeze

async def main(bootstrap, topic, group, seconds):
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
        auto_offset_reset="earliest", session_timeout_ms=2000, heartbeat_interval_ms=500,
        fetch_max_wait_ms=20,
    )
    await consumer.start()
    print(json.dumps({"started": True}), flush=True)
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        batches = await consumer.getmany(timeout_ms=100, max_records=500)
        fetched = {str(tp.partition): len(rs) for tp, rs in batches.items() if rs}
        if fetched:
            print(json.dumps({"fetched": fetched}), flush=True)
    assigned = sorted(tp.partition for tp in consumer.assignment())
    print(json.dumps({"assigned": assigned}), flush=True)
    await consumer.stop()  # leaves the group, commits nothing
    print(json.dumps({"left": True}), flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])))
"""


class Intruder:
    """The aiokafka group member in a subprocess; counts what it fetched."""

    def __init__(self, bootstrap: str, topic: str, group: str, seconds: float) -> None:
        self.fetched: dict[str, int] = {}
        self.events: list[dict[str, object]] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-c", INTRUDER, bootstrap, topic, group, str(seconds)],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self._thread = threading.Thread(target=self._read, name="intruder", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                self.events.append({"output": line.decode(errors="replace").rstrip()})
                continue
            self.events.append(event)
            for partition, n in event.get("fetched", {}).items():
                self.fetched[partition] = self.fetched.get(partition, 0) + n

    @property
    def total(self) -> int:
        return sum(self.fetched.values())

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self._thread.join(5)

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self._thread.join(5)
        return code


def _one_per_partition(stack: Stack, partitions: int) -> list[str]:
    """Subscriber client IDs whose records land one in each partition (keyed by client ID)."""
    partitioner = DefaultPartitioner()
    ids: dict[int, str] = {}
    n = 0
    while len(ids) < partitions:
        cid = stack.client(f"sub{n}")
        ids.setdefault(partitioner(cid.encode(), list(range(partitions)), []), cid)
        n += 1
    return [ids[p] for p in range(partitions)]


def _grows(pubs: list[Publisher], by: int, timeout: float, what: str) -> None:
    before = [len(p.acked) for p in pubs]
    wait_until(
        lambda: all(len(p.acked) >= b + by for p, b in zip(pubs, before, strict=True)),
        timeout,
        what,
    )


@pytest.mark.parametrize("exit_mode", ["leave", "kill"])
def test_rebalance_during_load(stack_factory, kafka, exit_mode: str) -> None:  # type: ignore[no-untyped-def]
    settings = metrics_settings()
    stack: Stack = stack_factory(settings)
    port = int(settings["metrics.port"])  # type: ignore[call-overload]
    topic_name = str(stack.broker.settings["persistence.topic"])
    group = str(stack.broker.settings["persistence.consumer_group"])
    wait_ready(port, 200, 15)
    topic = stack.topic("t")
    # One subscriber per partition, so whichever partitions the intruder gets carry traffic.
    partitions = int(stack.broker.settings["persistence.partitions"])  # type: ignore[call-overload]
    subs = [
        PahoSubscriber(stack.broker.address, cid, version=(V5, V311)[i % 2])
        for i, cid in enumerate(_one_per_partition(stack, partitions))
    ]
    pubs: list[Publisher] = []
    intruder: Intruder | None = None
    redis_paused = False
    try:
        for sub in subs:
            sub.connect()
            sub.subscribe(topic + "/#", qos=1)
        start_publishers(pubs, stack, topic)
        _grows(pubs, 200, 15, "traffic before the intruder")
        # Long enough to outlive a kill; "leave" mode closes by itself after it.
        seconds = 6.0 if exit_mode == "leave" else 60.0
        # Redis paused while the intruder joins: the broker's consumer is stuck storing
        # a batch when its partitions are revoked.
        assert stack.redis.proc is not None
        freeze(stack.redis.proc.pid)
        redis_paused = True
        intruder = Intruder(kafka[0], topic_name, group, seconds)
        wait_until(lambda: intruder.total >= 50, 15, f"the intruder fetching: {intruder.events}")
        os.kill(stack.redis.proc.pid, signal.SIGCONT)
        redis_paused = False
        _grows(pubs, 100, 15, "traffic while the intruder holds partitions")
        if exit_mode == "leave":
            assert intruder.wait(20) == 0, intruder.events
        else:
            time.sleep(2.0)
            intruder.kill()
        wait_ready(port, 200, 20)  # the broker owns every partition again, by itself
        _grows(pubs, 200, 20, "traffic after the intruder went")
        for pub in pubs:
            pub.stop()
        for sub in subs:
            sub.wait_all(pubs, timeout=30)
            assert_ok(check(pubs, sub))
        assert intruder.total > 0, intruder.events  # it held partitions and read from them
        assert stack.broker.alive(), stack.broker.log()[-3000:]
        assert stack.broker.exit_codes == []
        print(
            f"intruder fetched {intruder.fetched}; "
            f"broker commit failures logged: {stack.broker.log().count('offset commit failed')}"
        )
    finally:
        if redis_paused and stack.redis.proc is not None:
            os.kill(stack.redis.proc.pid, signal.SIGCONT)
        if intruder is not None:
            intruder.kill()
        for sub in subs:
            sub.close()
        for pub in pubs:
            pub.close()
