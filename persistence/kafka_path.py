"""The persistent path's first leg: one Kafka record per persistent delivery.

Implements :class:`broker.persistent_path.PersistentPath`. Records are keyed
by the subscriber's client id, so one client's messages stay in one
partition and in order. The publisher is acknowledged only after Kafka
acknowledged every record of its PUBLISH (acks=all); a produce error or
timeout reports failure and the publisher gets no success code.

Submissions made during one event-loop iteration are produced by one task,
so a burst of publishes costs one task, not one per message.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError, for_code
from aiokafka.structs import RecordMetadata

from persistence.records import encode_delivery

if TYPE_CHECKING:
    from broker.message import Delivery
    from broker.persistent_path import StoredCallback
    from broker.session import Session

log = logging.getLogger("devicemq.kafka")

LOG_INTERVAL = 5.0  # seconds between two "produce failed" log lines

_Submission = tuple[list[tuple[bytes, bytes]], "StoredCallback"]


class KafkaPersistentPath:
    def __init__(
        self,
        producer: AIOKafkaProducer,
        topic: str,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        timeout: float = 10.0,
    ) -> None:
        self._producer = producer
        self._topic = topic
        self._timeout = timeout  # seconds a publisher waits before it is told "failed"
        self._logged_at = -LOG_INTERVAL
        self._logged_errors = 0
        self._clock = clock
        self._wall_clock = wall_clock
        self._pending: list[_Submission] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.produce_errors = 0
        self.produced: dict[int, int] = {}  # partition -> highest offset acknowledged
        self.latency_observer: Callable[[float], None] | None = None

    def submit(
        self, deliveries: Sequence[tuple[Session, Delivery]], on_stored: StoredCallback
    ) -> None:
        wall, now = self._wall_clock(), self._clock()
        records = [
            (session.client_id.encode(), encode_delivery(delivery, wall, now))
            for session, delivery in deliveries
        ]
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._produce_pending)
        self._pending.append((records, on_stored))

    async def drain(self) -> None:
        """Wait until everything submitted so far is acknowledged or failed."""
        while self._pending or self._tasks:
            if self._pending:
                self._produce_pending()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _produce_pending(self) -> None:
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        task = asyncio.create_task(self._produce(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _produce(self, batch: list[_Submission]) -> None:
        """Produce, then report each submission in order.

        A submission not acknowledged within the timeout is reported failed
        even though Kafka may still take it later: the publisher gets no
        success code for it, and a late record is stored and delivered like
        any other (at least once, never a false success).
        """
        started = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + self._timeout
        sent: list[tuple[list[asyncio.Future[RecordMetadata]], StoredCallback]] = []
        for records, on_stored in batch:
            futures = []
            try:
                for key, value in records:
                    futures.append(await self._producer.send(self._topic, value=value, key=key))
            except KafkaError as error:
                self._failed(error)
                on_stored(False)
                continue
            sent.append((futures, on_stored))
        for futures, on_stored in sent:
            left = deadline - asyncio.get_running_loop().time()
            gathered = asyncio.gather(*futures)
            try:
                # Shielded: timing out must not cancel the producer's own futures.
                acknowledged = await asyncio.wait_for(asyncio.shield(gathered), max(left, 0.0))
            except (KafkaError, TimeoutError) as error:
                gathered.add_done_callback(_late_outcome)
                self._failed(error)
                on_stored(False)
                continue
            produced = self.produced
            for metadata in acknowledged:
                if metadata.offset > produced.get(metadata.partition, -1):
                    produced[metadata.partition] = metadata.offset
            on_stored(True)
        if self.latency_observer is not None:
            self.latency_observer(time.perf_counter() - started)

    def _failed(self, error: Exception) -> None:
        """Count every failure; log at most one line per interval (outages flood)."""
        self.produce_errors += 1
        now = time.monotonic()
        if now - self._logged_at >= LOG_INTERVAL:
            suppressed = self.produce_errors - self._logged_errors - 1
            more = f" ({suppressed} more since the last report)" if suppressed > 0 else ""
            log.warning("kafka produce failed: %r%s", error, more)
            self._logged_at, self._logged_errors = now, self.produce_errors


def _late_outcome(gathered: asyncio.Future[list[RecordMetadata]]) -> None:
    """A submission already reported failed finished late: nobody waits for it."""
    if not gathered.cancelled():
        gathered.exception()


def make_producer(bootstrap: str, request_timeout_ms: int, linger_ms: int) -> AIOKafkaProducer:
    """A producer that waits for every in-sync replica (acks=all).

    Idempotence stays off: Tansu, the embedded broker, does not support it;
    ordering per partition holds because aiokafka keeps one batch in flight
    per partition.
    """
    return AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        enable_idempotence=False,
        linger_ms=linger_ms,
        request_timeout_ms=request_timeout_ms,
        max_batch_size=512 * 1024,
    )


async def ensure_topic(bootstrap: str, topic: str, partitions: int) -> bool:
    """Create the topic with its final partition count; True if it was new."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        response = await admin.create_topics([NewTopic(topic, partitions, 1)])
    except TopicAlreadyExistsError:
        return False
    finally:
        await admin.close()
    # aiokafka reports per-topic outcomes in the response instead of raising:
    # an existing topic is error code 36, not success.
    for _name, code, *_ in response.topic_errors:
        error = for_code(code)
        if error is TopicAlreadyExistsError:
            return False
        if code:
            raise error(f"cannot create kafka topic {topic}")
    log.info("created kafka topic %s with %d partitions", topic, partitions)
    return True
