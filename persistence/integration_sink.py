"""The integration rules' Kafka producer: device data into the user's own topics.

Implements :class:`broker.integrations.IntegrationSink`. The publisher's
PUBACK/PUBREC waits for it as for the persistent path
(broker/handlers/publish.py): success once Kafka acknowledged every record of
the PUBLISH (acks=all), failure when one was refused, its topic does not exist,
or ``persistence.kafka_request_timeout_ms`` passed. The producer is its own
(not the persistent path's): a rule whose topic is gone or slow never holds up
persistent deliveries.

A rule's topic is the user's: devicemq does not create it on a Kafka of the
user's (it creates it on the embedded one), and never names a missing topic to
Kafka (a metadata request naming it would make a Kafka with
``auto.create.topics.enable``, or Tansu, create it with defaults). It asks for
the list of all topics instead, at start, every :data:`TOPICS_REFRESH` seconds,
and when a record finds its topic missing (at most every :data:`MISS_REFRESH`
seconds): a record for a topic not listed fails at once, with a log line
naming the rule.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaProducer
from aiokafka.client import AIOKafkaClient
from aiokafka.cluster import ClusterMetadata
from aiokafka.errors import KafkaError
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.protocol.metadata import MetadataRequest

from broker.integrations import Refusal
from persistence import kafka_security
from persistence.kafka_path import BATCH_TTL_MS, PARTITION_CACHE_SIZE, ensure_topic
from persistence.kafka_security import KafkaSecurity
from persistence.producers import Aiokafka, RecordProducer

if TYPE_CHECKING:
    from broker.config import IntegrationRule, Settings
    from broker.integrations import AcceptedCallback, IntegrationRecord

log = logging.getLogger("devicemq.integrations")

TOPICS_REFRESH = 5.0  # seconds between two listings of Kafka's topics
MISS_REFRESH = 1.0  # at most one listing this often while records find a topic missing
LOG_INTERVAL = 5.0  # seconds between two failure lines of one rule
# PUBLISHes whose records wait for Kafka (not handed to the producer yet, or handed
# and not acknowledged): past this, or past persistence.integrations_max_waiting_bytes
# of their keys and values, a new one fails at once. QoS 1/2 publishers are bounded
# by their Receive Maximum too; QoS 0 ones by nothing else.
MAX_WAITING = 100_000
MAX_WAITING_BYTES = 64 * 1024 * 1024
EMBEDDED_PARTITIONS = 1  # a rule's topic devicemq creates on the embedded Kafka


def kafka_client_options(settings: Settings, bootstrap: str) -> dict[str, Any]:
    """aiokafka's connection options for a Kafka client of devicemq's (the integration
    producer and its topic listing): the one place where the ``persistence.kafka_*``
    connection settings, the security ones among them, become client options. The
    embedded Kafka (no ``persistence.kafka_bootstrap``) is plaintext on loopback."""
    return {"bootstrap_servers": bootstrap, **_security(settings).aiokafka()}


def _security(settings: Settings) -> KafkaSecurity:
    """As the persistent path's clients reach Kafka (persistence/kafka_security.py);
    ConfigError naming the setting if wrong."""
    config = settings.persistence
    if config.kafka_bootstrap:
        return kafka_security.from_settings(config)
    return kafka_security.for_embedded(config)


def make_integration_producer(settings: Settings, bootstrap: str) -> RecordProducer:
    """acks=all, no idempotence (Tansu has none), and a batch kept for
    :data:`~persistence.kafka_path.BATCH_TTL_MS` as the persistent path's producer
    (persistence/kafka_path.py ``make_producer``): appended in order or not at all."""
    config = settings.persistence
    return Aiokafka(
        AIOKafkaProducer(
            **kafka_client_options(settings, bootstrap),
            acks="all",
            enable_idempotence=False,
            linger_ms=config.producer_linger_ms,
            request_timeout_ms=max(config.kafka_request_timeout_ms, BATCH_TTL_MS),
            max_batch_size=512 * 1024,
        )
    )


class IntegrationUnavailable(Exception):
    """The integrations' Kafka could not be reached at start-up (one readable line)."""


class _Submission:
    """One PUBLISH's records: reported once, when all are acknowledged or one failed."""

    __slots__ = (
        "deadline",
        "failed",
        "on_accepted",
        "on_settled",
        "outstanding",
        "records",
        "size",
        "told",
    )

    def __init__(
        self,
        records: Sequence[IntegrationRecord],
        on_accepted: AcceptedCallback,
        on_settled: AcceptedCallback | None,
    ) -> None:
        self.records = records
        self.on_accepted: AcceptedCallback | None = on_accepted
        self.on_settled = on_settled
        self.outstanding = len(records)  # no answer yet (not handed counts too)
        self.failed = False
        self.deadline = 0.0  # loop time
        self.told: bool | None = None  # what on_accepted said
        self.size = sum(len(r.value) + len(r.key or b"") for r in records)


class _TopicList:
    """The names of Kafka's topics, asked without naming any (so none is created)."""

    def __init__(self, options: dict[str, Any], timeout: float | None = None) -> None:
        """``timeout``: seconds a request may take (the publishers' deadline; else
        aiokafka's default, 40 s)."""
        if timeout is not None:
            options = {**options, "request_timeout_ms": int(timeout * 1000)}
        self._client = AIOKafkaClient(**options)
        self._started = False

    async def names(self) -> set[str]:
        if not self._started:
            await self._client.bootstrap()
            self._started = True
        node = next(iter(self._client.cluster.brokers())).nodeId
        response = await self._client.send(node, MetadataRequest(None))
        cluster = ClusterMetadata()
        cluster.update_metadata(response)
        return set(cluster.topics())

    async def close(self) -> None:
        await self._client.close()


class KafkaIntegrationSink:
    def __init__(
        self,
        producer: RecordProducer,
        rules: Sequence[IntegrationRule],
        timeout: float,
        topics: _TopicList | None = None,
        create_on: str | None = None,
        max_waiting: int = MAX_WAITING,
        max_waiting_bytes: int = MAX_WAITING_BYTES,
    ) -> None:
        """``timeout``: seconds a publisher waits for Kafka before its failure code;
        ``create_on``: the bootstrap of a Kafka (the embedded one) on which missing
        topics of rules are created; None: none is."""
        self._producer = producer
        self._rules = list(rules)
        self._timeout = timeout
        self._topics_list = topics
        self._create_on = create_on
        self._max_waiting = max_waiting
        self._max_waiting_bytes = max_waiting_bytes
        self._open_bytes = 0  # of the submissions in _open
        self.listed: set[str] | None = None  # Kafka's topics when last asked
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deadlines: deque[_Submission] = deque()  # not reported yet, oldest first
        self._timer: asyncio.TimerHandle | None = None  # the oldest one's deadline
        self._partitioner = DefaultPartitioner()
        # topic -> (its partitions, key -> partition chosen)
        self._chosen: dict[str, tuple[list[int], dict[bytes, int]]] = {}
        self._listed_at = -MISS_REFRESH
        self._listing: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None
        self._pending: list[_Submission] = []
        self._sender: asyncio.Task[None] | None = None
        self._open: set[_Submission] = set()  # not every record answered yet
        self._idle = asyncio.Event()
        self._idle.set()
        self.produced = {rule.name: 0 for rule in rules}  # records Kafka acknowledged
        self.failed = {rule.name: 0 for rule in rules}  # records refused or never sent
        self._logged_at: dict[str, float] = {}

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Connect and list the topics; every rule whose topic is missing is logged
        (created on the embedded Kafka). :class:`KafkaError` if Kafka is away."""
        await self._producer.start()
        if self._topics_list is not None:
            await self._list()
            self._watch = asyncio.get_running_loop().create_task(self._watch_topics())
        for rule in self._rules:
            if self.listed is not None and rule.kafka_topic not in self.listed:
                log.warning(
                    "integration rule %r: kafka topic %r does not exist: publishes to %r get "
                    "no success code until it is created",
                    rule.name,
                    rule.kafka_topic,
                    rule.topic_filter,
                )

    async def close(self) -> None:
        """Wait for what was handed over, within the publishers' deadline, then close.
        Whatever Kafka has not acknowledged by then was never a success for its
        publisher (the clients are gone: none was told otherwise)."""
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.wait({self._watch})
        if self._listing is not None:
            # A listing waits for Kafka up to the publishers' deadline: at the stop,
            # nobody needs its answer.
            self._listing.cancel()
            await asyncio.wait({self._listing})
        try:
            async with asyncio.timeout(self._timeout):
                await self.drain()
        except TimeoutError:
            log.warning("integration records not acknowledged by kafka at the stop")
        if self._sender is not None:
            self._sender.cancel()
            await asyncio.wait({self._sender})
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self._timeout):
                await self._producer.stop()
        if self._topics_list is not None:
            await self._topics_list.close()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def counts(self) -> dict[str, tuple[int, int]]:
        """Per rule: (records produced, records failed)."""
        return {name: (n, self.failed[name]) for name, n in self.produced.items()}

    # -- records ----------------------------------------------------------------------

    def submit(
        self,
        records: Sequence[IntegrationRecord],
        on_accepted: AcceptedCallback,
        on_settled: AcceptedCallback | None = None,
        *,
        best_effort: bool = False,
    ) -> Refusal | None:
        """See :meth:`broker.integrations.IntegrationSink.submit`. A refusal is
        counted failed for the rules it concerns only: a rule whose topic is
        missing, every rule of it when too much waits."""
        listed = self.listed
        if listed is not None and any(r.topic not in listed for r in records):
            kept = []
            for record in records:
                if record.topic in listed:
                    kept.append(record)
                    continue
                self.failed[record.rule] += 1
                self._log(record.rule, f"kafka topic {record.topic!r} does not exist")
            self._refresh_soon()
            if not best_effort:
                # Nothing of it is sent (the other rules' records are not made and not
                # counted): the publisher sends again, and its re-send, once the topic
                # exists, adds no copy to the other rules' topics.
                return Refusal.MISSING_TOPIC
            if not kept:
                return None
            records = kept
        submission = _Submission(records, on_accepted, on_settled)
        open_ = self._open
        if open_ and (
            len(open_) >= self._max_waiting
            or self._open_bytes + submission.size > self._max_waiting_bytes
        ):
            for record in records:
                self.failed[record.rule] += 1
                self._log(
                    record.rule,
                    f"{len(open_)} publishes ({self._open_bytes} bytes) wait for kafka "
                    f"(at most {self._max_waiting}, "
                    f"persistence.integrations_max_waiting_bytes {self._max_waiting_bytes})",
                )
            return Refusal.FULL
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        # Deadlines come in submission order (one timeout for all): one timer, for
        # the oldest (a timer per PUBLISH measured ~6% of the broker's time).
        submission.deadline = loop.time() + self._timeout
        self._deadlines.append(submission)
        if self._timer is None:
            self._timer = loop.call_at(submission.deadline, self._expire)
        open_.add(submission)
        self._open_bytes += submission.size
        self._idle.clear()
        self._pending.append(submission)
        if self._sender is None:
            self._sender = loop.create_task(self._send_pending())
        return None

    async def _send_pending(self) -> None:
        """Hand every pending record to the producer, oldest first: one sender, so a
        client's records keep their order in their partition."""
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                await self._send(batch)
        finally:
            self._sender = None

    async def _send(self, batch: list[_Submission]) -> None:
        """Hand a batch's records over within the publishers' deadline: a send waits
        for the topic's metadata or for room in a full producer, and a topic deleted
        under a running broker would hold every rule for aiokafka's request timeout
        (minutes) otherwise. A record not handed over fails.

        The partition is chosen here, once per key and topic (aiokafka's partitioner
        hashes every record in Python: ~9% of the broker's time, measured)."""
        send, acked = self._producer.send, self._acked
        partition_of = self._partitioners()
        submissions = iter(batch)
        records: Iterator[IntegrationRecord] = iter(())
        submission: _Submission | None = None
        try:
            async with asyncio.timeout(self._timeout):
                for submission in submissions:
                    records = iter(submission.records)
                    for record in records:
                        partition = partition_of(record.topic, record.key)
                        future = await send(record.topic, record.value, record.key, partition)
                        future.add_done_callback(partial(acked, submission, record))
        except Exception as error:  # not only KafkaError: every record must be answered
            if submission is not None:
                self._answered(submission, record, error)
                for rest in records:
                    self._answered(submission, rest, error)
            for later in submissions:
                for rest in later.records:
                    self._answered(later, rest, error)

    def _partitioners(self) -> Callable[[str, bytes | None], int | None]:
        """A topic's partition for a key, as aiokafka's default partitioner picks it,
        remembered per key; None (aiokafka picks) without a key or before the
        producer knows the topic's partitions. Asked once per batch."""
        known: dict[str, tuple[list[int], dict[bytes, int]] | None] = {}
        producer, chosen_by_topic = self._producer, self._chosen
        partitioner = self._partitioner

        def partition_of(topic: str, key: bytes | None) -> int | None:
            if key is None:
                return None
            if topic not in known:
                partitions = producer.partitions_for_topic(topic)
                if not partitions:
                    known[topic] = None
                else:
                    listed, chosen = chosen_by_topic.get(topic, ([], {}))
                    if len(listed) != len(partitions) or len(chosen) >= PARTITION_CACHE_SIZE:
                        listed, chosen = sorted(partitions), {}
                        chosen_by_topic[topic] = (listed, chosen)
                    known[topic] = (listed, chosen)
            entry = known[topic]
            if entry is None:
                return None
            listed, chosen = entry
            partition = chosen.get(key)
            if partition is None:
                partition = chosen[key] = partitioner(key, listed, listed)
            return partition

        return partition_of

    def _acked(
        self, submission: _Submission, record: IntegrationRecord, future: asyncio.Future[Any]
    ) -> None:
        if future.cancelled():
            error: BaseException | None = KafkaError("produce cancelled")
        else:
            error = future.exception()
        self._answered(submission, record, error)

    def _answered(
        self, submission: _Submission, record: IntegrationRecord, error: BaseException | None
    ) -> None:
        submission.outstanding -= 1
        if error is None:
            self.produced[record.rule] += 1
        else:
            self.failed[record.rule] += 1
            submission.failed = True
            self._log(record.rule, f"kafka refused a record for {record.topic!r}: {error!r}")
        if submission.on_accepted is not None and (submission.failed or not submission.outstanding):
            self._report(submission, not submission.failed)
        elif not submission.outstanding:
            self._settle(submission)

    def _expire(self) -> None:
        """The deadline of the oldest submissions: those not reported yet are told
        "failed"; what is out may still be taken (counted produced then), and
        ``on_settled`` says so. Then the timer waits for the next one's."""
        self._timer = None
        loop, deadlines = self._loop, self._deadlines
        assert loop is not None
        now = loop.time()
        while deadlines and deadlines[0].deadline <= now:
            submission = deadlines.popleft()
            if submission.on_accepted is None:
                continue  # reported already
            rules = sorted({record.rule for record in submission.records})
            for rule in rules:
                self._log(rule, f"kafka did not acknowledge within {self._timeout:g} s")
            self._report(submission, False)
        if deadlines:
            self._timer = loop.call_at(deadlines[0].deadline, self._expire)

    def _report(self, submission: _Submission, ok: bool) -> None:
        on_accepted, submission.on_accepted = submission.on_accepted, None
        assert on_accepted is not None
        submission.told = ok
        deadlines = self._deadlines
        while deadlines and deadlines[0].on_accepted is None:
            deadlines.popleft()  # reported (mostly in order): kept no longer
        on_accepted(ok)
        if not submission.outstanding:
            self._settle(submission)

    def _settle(self, submission: _Submission) -> None:
        """Every record answered: a failed publisher hears the final outcome."""
        if submission in self._open:
            self._open.remove(submission)
            self._open_bytes -= submission.size
        if not self._open:
            self._idle.set()
        if submission.on_settled is not None and submission.told is False:
            on_settled, submission.on_settled = submission.on_settled, None
            on_settled(not submission.failed)

    async def drain(self) -> None:
        """Wait until every record submitted so far has Kafka's answer."""
        await self._idle.wait()

    # -- topics -----------------------------------------------------------------------

    async def _list(self) -> None:
        assert self._topics_list is not None
        self._listed_at = time.monotonic()
        listed = await self._topics_list.names()
        for rule in self._rules:
            if rule.kafka_topic not in listed and self._create_on is not None:
                await ensure_topic(self._create_on, rule.kafka_topic, EMBEDDED_PARTITIONS)
                log.info("integration rule %r: created kafka topic %r", rule.name, rule.kafka_topic)
                listed.add(rule.kafka_topic)
        self.listed = listed

    async def _watch_topics(self) -> None:
        while True:
            await asyncio.sleep(TOPICS_REFRESH)
            await self._list_logged()

    async def _list_logged(self) -> None:
        try:
            await self._list()
        except Exception as error:  # Kafka away: the last listing stands
            log.debug("listing kafka topics for the integration rules failed: %r", error)

    def _refresh_soon(self) -> None:
        """A record found its topic missing: ask again (it may have been created)."""
        if self._topics_list is None or self._listing is not None:
            return
        if time.monotonic() - self._listed_at < MISS_REFRESH:
            return
        log.debug("listing kafka topics: a record found its topic missing")
        task = asyncio.get_running_loop().create_task(self._list_logged())
        self._listing = task

        def done(_: asyncio.Task[None]) -> None:
            self._listing = None

        task.add_done_callback(done)

    def _log(self, rule: str, problem: str) -> None:
        """One line per rule per interval (an outage would flood)."""
        now = time.monotonic()
        if now - self._logged_at.get(rule, -LOG_INTERVAL) >= LOG_INTERVAL:
            self._logged_at[rule] = now
            log.warning(
                "integration rule %r: %s: its publishers get no success code", rule, problem
            )


async def open_integrations(
    settings: Settings, bootstrap: str, *, embedded: bool
) -> KafkaIntegrationSink:
    """The started sink of the configured rules, on ``bootstrap``; a Kafka that does
    not answer is :class:`IntegrationUnavailable`, one line."""
    timeout = settings.persistence.kafka_request_timeout_ms / 1000
    sink = KafkaIntegrationSink(
        make_integration_producer(settings, bootstrap),
        settings.integrations,
        timeout,
        _TopicList(kafka_client_options(settings, bootstrap), timeout),
        bootstrap if embedded else None,
        max_waiting_bytes=settings.persistence.integrations_max_waiting_bytes,
    )
    try:
        await sink.start()
    except Exception as error:  # Kafka away (KafkaError), or no broker in its answer
        with contextlib.suppress(Exception):
            await sink.close()
        raise IntegrationUnavailable(
            f"cannot use kafka at {bootstrap} for the integrations: "
            f"{kafka_security.explain(error, _security(settings))}"
        ) from error
    return sink
