"""The Kafka producer behind the persistent path: aiokafka's or librdkafka's.

:class:`KafkaPersistentPath` needs little of a producer (:class:`RecordProducer`):
hand it a record for a partition and get a future of where Kafka put it. Two
clients give that (``persistence.kafka_client``):

- ``aiokafka``, pure Python, on the event loop;
- ``confluent``, confluent-kafka over librdkafka (C): its own threads batch,
  send and retry, so a record costs the event loop a few microseconds instead
  of about twenty (BENCHMARKS.md, "Optimisation log").

Both speak the path's vocabulary: a failure is one of aiokafka's errors (the
path tells a topic that is gone from other failures by them), and the answer
has ``partition`` and ``offset``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from functools import partial
from typing import Any, NamedTuple, Protocol

from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaError,
    KafkaTimeoutError,
    UnknownError,
    UnknownTopicOrPartitionError,
    for_code,
)
from confluent_kafka import KafkaError as Rd
from confluent_kafka import KafkaException, Producer

log = logging.getLogger("devicemq.kafka")

METADATA_REFRESH = 10.0  # seconds between two reads of the topics' partitions (confluent)
POLL_BUSY = 0.001  # seconds between two reads of delivery reports while records are out,
POLL_STUCK = 0.05  # ... up to this while none come back (a frozen Kafka),
POLL_IDLE = 1.0  # ... and while none are out
CHECK_TIMEOUT = 1.5  # seconds a readiness check waits for metadata (below the probe's 2 s)


class Produced(NamedTuple):
    """Where Kafka put a record."""

    partition: int
    offset: int


class RecordProducer(Protocol):
    """What the persistent path needs of a Kafka producer."""

    async def start(self) -> None:
        """Connect; raise a :class:`KafkaError` if Kafka cannot be reached."""

    async def stop(self) -> None:
        """Deliver what was handed over (or give up on it), then close."""

    async def send(
        self, topic: str, value: bytes, key: bytes | None, partition: int | None
    ) -> asyncio.Future[Any]:
        """Take a record (waiting while the producer is full); the future is Kafka's
        answer: something with ``partition`` and ``offset``, or an aiokafka error."""

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        """The topic's partitions as last seen, None before they are known."""

    async def check(self) -> None:
        """Raise unless Kafka answers a metadata request now (the readiness probe)."""

    async def refresh(self, topic: str) -> None:
        """Read ``topic``'s partitions from Kafka now (:meth:`partitions_for_topic`)."""


class Aiokafka:
    """aiokafka's producer as a :class:`RecordProducer` (its own calls, unwrapped)."""

    def __init__(self, producer: AIOKafkaProducer) -> None:
        self.producer = producer
        self.start = producer.start
        self.stop = producer.stop
        self.send = producer.send  # keyword-compatible

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        partitions: set[int] | None = self.producer.client.cluster.partitions_for_topic(topic)
        return partitions

    async def check(self) -> None:
        await self.producer.client.fetch_all_metadata()

    async def refresh(self, topic: str) -> None:
        client = self.producer.client
        await client.add_topic(topic)  # its metadata requests name the topics it has
        await client.force_metadata_update()


def aiokafka_error(error: Any) -> KafkaError:
    """A librdkafka error (``confluent_kafka.KafkaError``) as the aiokafka error
    the path knows: broker error codes are Kafka's own, librdkafka's are < 0."""
    code, text = error.code(), error.str()
    if code > 0:
        return for_code(code)(text)
    if code in (Rd._UNKNOWN_TOPIC, Rd._UNKNOWN_PARTITION):
        return UnknownTopicOrPartitionError(text)
    if code in (Rd._MSG_TIMED_OUT, Rd._TIMED_OUT):
        return KafkaTimeoutError(text)
    if code in (Rd._TRANSPORT, Rd._ALL_BROKERS_DOWN, Rd._RESOLVE, Rd._AUTHENTICATION):
        return KafkaConnectionError(text)
    if code == Rd.UNKNOWN:
        return UnknownError(text)
    return KafkaError(text)


class Confluent:
    """confluent-kafka's producer as a :class:`RecordProducer`.

    librdkafka batches, sends and retries on its own threads. Its delivery
    reports are read on the event loop (``poll(0)``: the callbacks run there
    and resolve the futures directly): every :data:`POLL_BUSY` seconds while
    records are out (backing off to :data:`POLL_STUCK` while none come back),
    and at once after a quiet spell. A poll thread of ours handing reports to
    the loop measured worse (BENCHMARKS.md, "Optimisation log").
    """

    def __init__(self, settings: dict[str, object], *, start_timeout: float = 10.0) -> None:
        self._settings = settings
        self._start_timeout = start_timeout
        self._producer: Any = None
        self._outstanding = 0  # records handed over, no delivery report yet
        self._partitions: dict[str, set[int]] = {}
        self._wake = asyncio.Event()
        self._poller: asyncio.Task[None] | None = None
        self._refresher: asyncio.Task[None] | None = None
        self._checking: asyncio.Task[Any] | None = None
        self._logged_at = 0.0

    async def start(self) -> None:
        settings = {
            **self._settings,
            "error_cb": self._error,
            "logger": logging.getLogger("devicemq.kafka.librdkafka"),
        }
        self._producer = Producer(settings)
        try:
            metadata = await asyncio.to_thread(
                self._producer.list_topics, None, self._start_timeout
            )
        except KafkaException as error:
            await self._close()
            raise KafkaConnectionError(f"{error.args[0].str()}") from None
        self._read_partitions(metadata)
        self._poller = asyncio.create_task(self._poll())
        self._refresher = asyncio.create_task(self._refresh())

    async def stop(self, timeout: float = 30.0) -> None:
        """Wait (up to ``timeout``) for what is out, as aiokafka's stop flushes; what
        is still out then is purged, its futures failed: every one is answered."""
        tasks = {t for t in (self._poller, self._refresher) if t is not None}
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)  # a cancel of stop itself still ends it
        self._poller = self._refresher = None
        if self._producer is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._outstanding and loop.time() < deadline:
            self._producer.poll(0)
            await asyncio.sleep(0.01)
        if self._outstanding:
            log.warning(
                "kafka producer stopped with %d records not acknowledged", self._outstanding
            )
            self._producer.purge()  # in flight too: their reports come at the next poll
            self._producer.poll(0)
        await self._close()

    async def _close(self) -> None:
        """End librdkafka's threads and connections."""
        producer, self._producer = self._producer, None
        if producer is not None:
            await asyncio.to_thread(producer.close)

    async def send(
        self, topic: str, value: bytes, key: bytes | None, partition: int | None
    ) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        report = partial(self._delivered, future)
        while True:
            try:
                self._producer.produce(
                    topic, value, key, -1 if partition is None else partition, on_delivery=report
                )
                break
            except BufferError:
                self._producer.poll(0)
                await asyncio.sleep(0.005)  # librdkafka's queue is full: wait for room
            except KafkaException as error:
                if error.args[0].code() == Rd._UNKNOWN_PARTITION and self._refresher is not None:
                    asyncio.get_running_loop().create_task(self._read_metadata())
                raise aiokafka_error(error.args[0]) from None
        self._outstanding += 1
        self._wake.set()
        return future

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        return self._partitions.get(topic)

    async def check(self) -> None:
        """One metadata request at a time, however often it is asked: each holds a
        thread of the default pool until it ends."""
        if self._producer is None:
            raise KafkaConnectionError("producer not started")
        if self._checking is None or self._checking.done():
            self._checking = asyncio.ensure_future(
                asyncio.to_thread(self._producer.list_topics, None, CHECK_TIMEOUT)
            )
        try:
            await asyncio.shield(self._checking)
        except KafkaException as error:
            raise aiokafka_error(error.args[0]) from None

    async def refresh(self, topic: str) -> None:
        await self._read_metadata()

    def _delivered(self, future: asyncio.Future[Any], error: Any, message: Any) -> None:
        self._outstanding -= 1
        if future.done():
            return
        if error is not None:
            future.set_exception(aiokafka_error(error))
        else:
            future.set_result(Produced(message.partition(), message.offset()))

    async def _poll(self) -> None:
        poll = self._producer.poll
        delay = POLL_BUSY
        while True:
            try:
                served = poll(0)
            except Exception:  # a callback raised: logged, and the reports go on
                log.exception("kafka producer: a delivery report failed")
                served = 1
            if self._outstanding:
                delay = POLL_BUSY if served else min(delay * 2, POLL_STUCK)
                await asyncio.sleep(delay)
            else:
                # Quiet: wait for a send, or a while (librdkafka's errors and logs
                # are served by poll too). Not wait_for: on 3.11 it can swallow
                # the cancel that ends this task, and stop() would wait forever.
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(POLL_IDLE):
                        await self._wake.wait()

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(METADATA_REFRESH)
            await self._read_metadata()

    async def _read_metadata(self) -> None:
        producer = self._producer
        # Kept as last seen if it fails: the error callback reports an unreachable Kafka.
        with contextlib.suppress(KafkaException):
            if producer is not None:
                self._read_partitions(await asyncio.to_thread(producer.list_topics, None, 5.0))

    def _read_partitions(self, metadata: Any) -> None:
        topics = metadata.topics.items()
        self._partitions = {name: set(t.partitions) for name, t in topics if not t.error}

    def _error(self, error: Any) -> None:
        """librdkafka's global errors (all brokers down, authentication): one line
        per interval, as the path logs failed produces."""
        now = time.monotonic()
        if now - self._logged_at >= 5.0:
            self._logged_at = now
            log.warning("kafka (librdkafka): %s", error.str())


def confluent_settings(
    bootstrap: str, request_timeout_ms: int, linger_ms: int, delivery_timeout_ms: int
) -> dict[str, object]:
    """librdkafka's settings for the persistent path, matching aiokafka's use.

    acks=all; idempotence off (Tansu does not support it), so order per
    partition holds by one request in flight per connection and by retrying a
    record until ``delivery_timeout_ms`` (as aiokafka's batch TTL); a key
    without a given partition goes where aiokafka's and Java's partitioner put
    it (murmur2), which the consumers' assignment assumes.
    """
    return {
        "bootstrap.servers": bootstrap,
        "acks": "all",
        "enable.idempotence": False,
        "max.in.flight.requests.per.connection": 1,
        "message.timeout.ms": delivery_timeout_ms,
        "request.timeout.ms": request_timeout_ms,
        "linger.ms": linger_ms,
        "batch.size": 512 * 1024,
        "partitioner": "murmur2_random",
    }
