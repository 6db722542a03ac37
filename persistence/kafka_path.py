"""The persistent path's first leg: one Kafka record per persistent delivery.

Implements :class:`broker.persistent_path.PersistentPath`. Records are keyed
by the subscriber's client id, so one client's messages stay in one
partition and in order. The publisher is acknowledged only after Kafka
acknowledged every record of its PUBLISH (acks=all); a produce error or
timeout reports failure and the publisher gets no success code.

One task at a time hands records to the producer, in submission order, so
records of one client can never overtake each other in its partition even
when the producer makes a send wait (a full batch). Acknowledgements come
back through callbacks, not awaited per submission: a submission is reported
when the last of its records is acknowledged, or failed at its deadline.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.client import AIOKafkaClient
from aiokafka.cluster import ClusterMetadata
from aiokafka.errors import (
    KafkaError,
    TopicAlreadyExistsError,
    UnknownError,
    UnknownTopicOrPartitionError,
    for_code,
)
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.protocol.metadata import MetadataRequest
from aiokafka.structs import RecordMetadata

from persistence.coalescing import Retry
from persistence.delivery_codec import encode_delivery
from persistence.kafka_security import PLAINTEXT, KafkaSecurity
from persistence.producers import Aiokafka, Confluent, RecordProducer, confluent_settings

if TYPE_CHECKING:
    from broker.message import Delivery
    from broker.persistent_path import AcceptedCallback, Addressee

log = logging.getLogger("devicemq.kafka")

LOG_INTERVAL = 5.0  # seconds between two "produce failed" log lines
PARTITION_CACHE_SIZE = 100_000  # client ids whose partition is remembered
BATCH_TTL_MS = 300_000  # how long aiokafka keeps trying a batch (see make_producer)
# The push-back on publishers while the consumer is behind (push_back): looked at
# every PUSH_BACK_POLL seconds, ended by a consumer that stored nothing for
# PUSH_BACK_STALL seconds.
PUSH_BACK_POLL = 0.005
PUSH_BACK_STALL = 0.5
VOUCH_TIMEOUT = 1.0  # seconds the probe may take to say whether Kafka lists the topic
VOUCH_RETRY = 0.05  # seconds before it is asked again (doubling to VOUCH_TIMEOUT)
REPLACE_RETRY_MAX = 1.0  # seconds between two tries to make the topic at its size
RESEND_ATTEMPTS = 3  # sends of one PUBLISH's records while its topic is being made again
# What a produce answers while the topic is gone or being created again after a
# restart of a Kafka that keeps no data (Tansu answers UnknownError then).
TOPIC_GONE = (UnknownError, UnknownTopicOrPartitionError)


Records = list[tuple[bytes, bytes]]  # (key, value) of one PUBLISH's records


class _Submission:
    """One PUBLISH's records: reported once, when all are acknowledged or one failed.

    Reported failed at its round's deadline while records are still out, its
    outcome is unknown: ``on_settled`` then hears it once every record got
    Kafka's answer. A log reset sends its records again (``attempt``): they
    are named by (producer, seq), so Kafka holding one twice stores it once.
    """

    __slots__ = (
        "attempt",
        "failed",
        "handed",
        "on_accepted",
        "on_settled",
        "order",
        "outstanding",
        "records",
        "remaining",
        "round",
        "submitted",
    )

    def __init__(
        self,
        records: Records,
        on_accepted: AcceptedCallback,
        on_settled: AcceptedCallback | None,
        submitted: float = 0.0,
        order: int = 0,
    ) -> None:
        self.records = records
        self.order = order  # the path's count of submissions: records go in this order
        self.submitted = submitted  # the path's clock when submitted
        self.on_accepted: AcceptedCallback | None = on_accepted
        self.on_settled = on_settled
        self.attempt = 0
        self.remaining = len(records)  # not yet acknowledged in this attempt
        self.outstanding = 0  # handed to the producer, no answer yet (this attempt)
        self.handed = 0  # handed to the producer (this attempt)
        self.failed = False  # a record of this attempt failed
        self.round: _Round | None = None


class _Round:
    """The submissions handed to the producer together: one deadline, one latency sample."""

    __slots__ = ("open", "started", "submissions", "timer")

    def __init__(self, started: float) -> None:
        self.open = 0  # submissions not reported yet
        self.started = started
        self.submissions: list[_Submission] = []
        self.timer: asyncio.TimerHandle | None = None


class KafkaPersistentPath:
    def __init__(
        self,
        producer: RecordProducer,
        topic: str,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        timeout: float = 10.0,
        producer_id: int = 0,
        on_log_reset: Callable[[list[int]], None] | None = None,
        recreate_topic: Callable[[], Awaitable[object]] | None = None,
        latency_observer: Callable[[float], None] | None = None,
        probe: TopicProbe | None = None,
    ) -> None:
        """``probe``: a single broker's watch on a Kafka that may forget the topic
        (persistence/compaction.py); success is reported only for records it
        vouches for (:meth:`_vouch`)."""
        self._producer = producer
        self._probe = probe
        # Acknowledged after a broken connection, not vouched for yet, in order:
        # submission -> (attempt, topics made again by then)
        self._unvouched: dict[_Submission, tuple[int, int]] = {}
        self._logs_made = 0  # topics made again (release after a restore or compaction)
        self._voucher: asyncio.Task[None] | None = None
        self._topic = topic
        # Every record is named (producer_id, seq): the store skips one it has stored.
        self.producer_id = producer_id
        self._seq = 0
        self._on_log_reset = on_log_reset  # partitions whose log went backwards
        self._recreate_topic = recreate_topic
        self._topic_ready = asyncio.Event()
        self._topic_ready.set()
        self._handing = False  # a batch is being handed to the producer (_send)
        self._rounds: dict[_Round, None] = {}  # not all reported, in the order sent
        self._unsettled: dict[_Submission, None] = {}  # reported at a deadline, still out
        self._timeout = timeout  # seconds a publisher waits before it is told "failed"
        self._logged_at = -LOG_INTERVAL
        self._logged_errors = 0
        self._clock = clock
        self._wall_clock = wall_clock
        self._pending: list[_Submission] = []  # in submission order
        self._submissions = 0
        self._resends = 0  # times everything out was sent again (_send_again)
        self._batch: list[_Submission] = []  # being handed to the producer (_send)
        self._sender: asyncio.Task[None] | None = None
        self._waiting_timer: asyncio.TimerHandle | None = None  # see _watch_waiting
        self._open_rounds = 0
        self._idle: asyncio.Event | None = None  # set when nothing is pending or open
        self._partitioner = DefaultPartitioner()
        self._size_retry = VOUCH_RETRY  # seconds before _size_topic looks again (doubling)
        self._partitions: tuple[list[int], dict[bytes, int]] = ([], {})
        self.produce_errors = 0
        self.produced: dict[int, int] = {}  # partition -> highest offset acknowledged
        # Produce batches at most (each round's partitions) since the log was made: a
        # fetch from Tansu's memory store costs a look at every batch (compaction.py).
        self.batches_sent = 0
        self._held = False  # records wait while the topic is emptied (persistence/compaction.py)
        self._recreating = False
        self.recreate_retry = Retry("kafka_topic_create")
        self._latency_observer = latency_observer  # seconds per round (the metrics' histogram)
        self._unstored: Callable[[], int] | None = None
        self._max_unstored = 0
        self.backpressure_holds = 0  # batches held because the consumer was behind
        self.backpressure_seconds = 0.0

    def submit(
        self,
        deliveries: Sequence[tuple[Addressee, Delivery]],
        on_accepted: AcceptedCallback,
        on_settled: AcceptedCallback | None = None,
    ) -> None:
        """Produce one record per delivery; ``on_accepted(ok)`` once all are acknowledged,
        one failed, or the deadline passed. After ``on_accepted(False)``,
        ``on_settled(ok)`` follows once no record can be taken any more: at a
        deadline, records may still be (``ok`` True: all were)."""
        wall, now = self._wall_clock(), self._clock()
        producer, seq = self.producer_id, self._seq
        records = []
        for session, delivery in deliveries:
            seq += 1
            value = encode_delivery(
                delivery,
                wall,
                now,
                producer=producer,
                seq=seq,
                generation=session.generation,
                queue=getattr(session, "queue", False),  # a group queue's (GroupTarget)
            )
            records.append((session.client_id.encode(), value))
        self._seq = seq
        self._submissions += 1
        self._pending.append(_Submission(records, on_accepted, on_settled, now, self._submissions))
        if self._sender is None:
            self._sender = asyncio.get_running_loop().create_task(self._send_pending())
        if self._waiting_timer is None:
            self._watch_waiting()

    def _watch_waiting(self) -> None:
        """A deadline for publishes not handed to the producer yet: behind a send
        that waits for room (a frozen Kafka: the partition's next batch full, and
        aiokafka waits up to its own :data:`BATCH_TTL_MS`), a hold or a push back.
        A round's timer starts only when it is handed over; these fail at their
        own deadline, never sent (:meth:`_fail_held`)."""
        oldest = next(
            (s for s in self._pending if s.on_accepted is not None and not s.attempt), None
        )
        if oldest is None:
            self._waiting_timer = None
            return
        delay = max(0.0, oldest.submitted + self._timeout - self._clock())
        self._waiting_timer = asyncio.get_running_loop().call_later(delay, self._waited)

    def _waited(self) -> None:
        self._fail_held("kafka did not take the records within the deadline")
        self._watch_waiting()

    def push_back(self, unstored: Callable[[], int], limit: int) -> None:
        """Hold each batch while ``unstored()``, the records Kafka has that the
        consumer has not stored, is ``limit`` or more and going down.

        Kafka accepts records faster than one process can store and deliver them;
        unchecked, the gap grows for as long as publishers offer more, and every
        message waits behind it (BENCHMARKS.md, "The shape"). Held here, the wait
        is the publishers': their PUBACKs come later, their windows fill, they send
        less. A consumer that stores nothing for :data:`PUSH_BACK_STALL` seconds
        (Redis away, a partition being reassigned) ends the hold: Kafka is also the
        buffer that keeps accepting while the consumer cannot."""
        self._unstored, self._max_unstored = unstored, limit

    async def _room(self) -> None:
        """Wait while the consumer is ``limit`` or more behind and catching up."""
        unstored, limit = self._unstored, self._max_unstored
        if unstored is None or not limit:
            return
        try:
            behind = unstored()
            if behind < limit:
                return
            started = progressed = time.perf_counter()
            self.backpressure_holds += 1
            try:
                while True:
                    await asyncio.sleep(PUSH_BACK_POLL)
                    now, before, behind = time.perf_counter(), behind, unstored()
                    if behind < limit:
                        break
                    if behind < before:
                        progressed = now
                    elif now - progressed >= PUSH_BACK_STALL:
                        break
            finally:
                self.backpressure_seconds += time.perf_counter() - started
        except Exception:  # a count that cannot be read must never stop the publishers
            log.exception("counting the consumer's unstored records failed: not holding")

    async def drain(self) -> None:
        """Wait until everything submitted so far is acknowledged or failed."""
        while self._pending or self._sender is not None or self._open_rounds:
            if self._idle is None or self._idle.is_set():
                self._idle = asyncio.Event()
            await self._idle.wait()

    async def _send_pending(self) -> None:
        """Hand every pending record to the producer, oldest first, then end."""
        try:
            while self._pending:
                await self._topic_ready.wait()
                await self._room()
                await self._topic_ready.wait()  # a hold may have begun meanwhile
                partition_of = self._partitioner_for_round()
                if partition_of is None:
                    await self._size_topic()
                    continue
                self._size_retry = VOUCH_RETRY
                batch, self._pending = self._pending, []
                self._handing = True
                try:
                    await self._send(batch, partition_of)
                finally:
                    self._handing = False
        finally:
            self._sender = None
            self._check_idle()

    async def _send(
        self, batch: list[_Submission], partition_of: Callable[[bytes], int | None]
    ) -> None:
        """Hand a batch of submissions to the producer, in order, under one deadline.

        A submission sent again after a log reset whose publisher has heard
        already (at its deadline) rides along: it is not reported twice, only
        settled.
        """
        loop = asyncio.get_running_loop()
        round_ = _Round(time.perf_counter())
        round_.submissions = [s for s in batch if s.on_accepted is not None]
        round_.open = len(round_.submissions)
        if round_.open:
            self._open_rounds += 1
            self._rounds[round_] = None
            round_.timer = loop.call_at(loop.time() + self._timeout, self._expire, round_)
        for submission in batch:  # all of it: a log reset may withdraw any (_send_again)
            submission.round = round_
        send, topic = self._producer.send, self._topic
        resends, self._batch = self._resends, batch
        touched: set[int | None] = set()
        for submission in batch:
            if self._resends != resends:
                # Everything out was sent again while a send waited: the rest of the
                # batch waits its turn in order, not into the log that went back
                # (tests/model/FINDINGS.md, finding 29).
                break
            attempt = submission.attempt
            if not submission.records:
                if submission.on_accepted is not None:
                    self._report(submission, True)
                continue
            try:
                for key, value in submission.records:
                    if submission.attempt != attempt:
                        break  # a log reset: sent again from the start
                    partition = partition_of(key)
                    touched.add(partition)
                    future = await send(topic, value=value, key=key, partition=partition)
                    future.add_done_callback(partial(self._acked, submission, attempt))
                    if submission.attempt != attempt:
                        break  # sent again while this send waited: not this attempt's
                    submission.outstanding += 1
                    submission.handed += 1
            except (KafkaError, AssertionError) as error:
                if isinstance(error, AssertionError) and "Unrecognized partition" not in str(error):
                    raise
                # aiokafka's "Unrecognized partition": the chosen partition left the
                # producer's metadata during the round.
                self._failed(error)
                if submission.attempt == attempt:
                    submission.failed = True
                    if submission.on_accepted is not None:
                        self._report(submission, False)
                    else:
                        self._maybe_settle(submission)
        self.batches_sent += len(touched)

    @property
    def topic(self) -> str:
        return self._topic

    def _partitioner_for_round(self) -> Callable[[bytes], int | None] | None:
        """The default partitioner's choice per key, remembered per key.

        Before the producer has the topic's metadata, no choice: it then picks
        itself, with the same partitioner. Looked up once per round: the metadata
        call builds a new set each time.

        None on a Kafka that forgets topics while the producer knows the topic at
        another size than devicemq makes it with, or not at all (:meth:`_size_topic`).
        """
        partitions = self._producer.partitions_for_topic(self._topic)
        probe = self._probe
        if (
            probe is not None
            and probe.expected is not None
            and (
                not probe.answered
                or (probe.forgets_topics and len(partitions or ()) != probe.expected)
            )
        ):
            return None
        if not partitions:
            return lambda key: None
        known, chosen = self._partitions
        if len(partitions) != len(known):
            known = sorted(partitions)
            chosen = {}
            self._partitions = (known, chosen)
        if len(chosen) >= PARTITION_CACHE_SIZE:
            chosen.clear()  # client ids come and go: start over rather than grow
        partitioner = self._partitioner

        def partition_of(key: bytes) -> int:
            partition = chosen.get(key)
            if partition is None:
                partition = chosen[key] = partitioner(key, known, known)
            return partition

        return partition_of

    async def _size_topic(self) -> None:
        """Send nothing to a Tansu's topic while the producer knows it at another
        size than devicemq makes it with, or not at all (tests/model/FINDINGS.md,
        finding 27); asks the probe first whether this Kafka forgets topics.

        Records are stored once by (producer, seq) through a partition
        (persistence/redis_store.py), which holds while one producer's records
        reach a partition in order. A record sent with one partition count, lost
        with Tansu's own topic and sent again after another count moved its key,
        would come in behind later records of the same producer and be skipped
        as stored. So the count never changes under a key here: a topic Tansu
        lists at its own size is made again at devicemq's first (as a lost one),
        and a producer that knows another size reads the topic again.
        """
        probe = self._probe
        assert probe is not None
        self._fail_held()
        try:
            listed = await asyncio.wait_for(probe.partitions(), VOUCH_TIMEOUT)
        except Exception as error:  # Kafka away or slow: asked again, less and less often
            log.debug("asking kafka for the topic failed: %s", error)
            await self._size_later()
            return
        if not probe.forgets_topics:
            return  # any size is the operator's
        if listed is None and self._recreate_topic is not None:
            known = self._producer.partitions_for_topic(self._topic)
            log.warning(
                "kafka topic %s is listed %s, the producer knows it with %d partitions, "
                "devicemq makes it with %d: sending nothing until it is made at its size",
                self._topic,
                f"with {probe.misshapen} partitions" if probe.misshapen else "nowhere",
                len(known or ()),
                probe.expected,
            )
            self._start_recreating()
            await self._topic_ready.wait()
        try:
            await asyncio.wait_for(self._producer.refresh(self._topic), VOUCH_TIMEOUT)
        except Exception as error:
            log.debug("reading kafka topic %s's partitions failed: %s", self._topic, error)
        known = self._producer.partitions_for_topic(self._topic)
        if len(known or ()) != probe.expected:
            await self._size_later()  # Kafka is changing it: asked again

    async def _size_later(self) -> None:
        await asyncio.sleep(self._size_retry)
        self._size_retry = min(self._size_retry * 2, VOUCH_TIMEOUT)

    def _fail_held(self, reason: str = "") -> None:
        """Publishes held (by :meth:`_size_topic`, behind a waiting send) past their
        deadline are reported failed and never sent: none of their records was
        handed to the producer. One sent before (a log reset sends it again) may
        be in Kafka already, and waits to be sent again."""
        deadline = self._clock() - self._timeout
        kept: list[_Submission] = []
        held, self._pending = self._pending, []  # a callback below may submit more
        for submission in held:
            on_accepted = submission.on_accepted
            if on_accepted is None or submission.attempt or submission.submitted > deadline:
                kept.append(submission)
                continue
            submission.on_accepted = None
            self._failed(
                TimeoutError(reason or f"kafka topic {self._topic} not usable within the deadline")
            )
            on_accepted(False)
            if submission.on_settled is not None:
                submission.on_settled(False)  # nothing of it can be taken
        self._pending[:0] = kept

    def _acked(
        self, submission: _Submission, attempt: int, future: asyncio.Future[RecordMetadata]
    ) -> None:
        if future.cancelled():
            error: BaseException | None = KafkaError("produce cancelled")
        else:
            error = future.exception()  # retrieved even when ignored below
        if attempt != submission.attempt:
            return  # an answer for records sent again since
        submission.outstanding -= 1
        if error is None:
            metadata = future.result()
            highest = self.produced.get(metadata.partition, -1)
            if metadata.offset > highest:
                self.produced[metadata.partition] = metadata.offset
                probe = self._probe
                if probe is not None and submission not in self._unvouched and not probe.vouches():
                    # After a broken connection: this record may be in a log that
                    # Kafka lost. The submission waits for _vouch to say.
                    self._unvouched[submission] = (attempt, self._logs_made)
                    if self._voucher is None:
                        loop = asyncio.get_running_loop()
                        self._voucher = loop.create_task(self._vouch())
            else:
                # At or below an earlier acknowledgement: two records never share an
                # offset in one log, so the log was reset (seed 1153: the first
                # record after a restart of the embedded Kafka took offset 0 again,
                # the only offset used before, and was skipped as stored).
                self._log_went_back(metadata.partition, metadata.offset, submission)
                return
        elif isinstance(error, TOPIC_GONE) and submission.attempt < RESEND_ATTEMPTS:
            # The topic is gone or half made (a Kafka restarted empty): create it
            # again and send everything in flight once more, in order.
            self._failed(error)
            self._send_again(None)
            return
        else:
            self._failed(error)
            submission.failed = True
        if submission.on_accepted is not None:
            if error is not None:
                self._report(submission, False)
                return
            submission.remaining -= 1
            if not submission.remaining and submission not in self._unvouched:
                self._report(submission, True)
        else:
            self._maybe_settle(submission)  # waits while it is in _unvouched

    async def _vouch(self) -> None:
        """Acknowledgements that came after a connection to Kafka broke: success once
        Kafka lists the topic again (asked now), with no hold or new topic since;
        if it does not list it, they went into a log it lost, and everything out
        is sent again once the topic is back (as after a log reset). A deadline
        passing meanwhile reports failure; such a publish is settled only once
        vouched for (``on_settled``), or sent again."""
        assert self._probe is not None
        backoff = VOUCH_RETRY
        try:
            while True:
                # Sent again since (a log reset): not waited for here.
                for submission, (attempt, _) in list(self._unvouched.items()):
                    if submission.attempt != attempt:
                        del self._unvouched[submission]
                if not self._unvouched or self._probe.closed:
                    return  # closed: the broker stops, nothing will answer
                if self._held or self._recreating:
                    # A compaction or restore: its end decides (a topic made again
                    # since is listed, but without these records).
                    await self._topic_ready.wait()
                    continue
                # Only those acknowledged before the question: the answer says
                # nothing of a break after it was sent.
                asked = dict(self._unvouched)
                made = self._logs_made
                try:
                    partitions = await asyncio.wait_for(self._probe.partitions(), VOUCH_TIMEOUT)
                except Exception as error:  # Kafka away or slow: asked again shortly
                    log.debug("asking kafka for the topic failed: %s", error)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, VOUCH_TIMEOUT)
                    continue
                backoff = VOUCH_RETRY
                if self._held or self._recreating or self._logs_made != made:
                    continue  # a describe during a restore lists the lost topic: ask after it
                current = [
                    s for s, (a, m) in asked.items() if s.attempt == a and s in self._unvouched
                ]
                if partitions is not None and all(asked[s][1] == made for s in current):
                    for submission in current:
                        del self._unvouched[submission]
                        if submission.on_accepted is None:
                            self._maybe_settle(submission)  # failed at its deadline, yet taken
                        elif not submission.remaining:
                            self._report(submission, True)
                        # else: its other records are still out; each is looked at as
                        # it is acknowledged
                elif current:
                    log.warning(
                        "kafka acknowledged %d publishes into topic %s after a broken "
                        "connection, and no longer lists it (or it was made anew): "
                        "sending them again",
                        len(current),
                        self._topic,
                    )
                    self._send_again(None)
        finally:
            self._voucher = None
            self._check_idle()

    def _maybe_settle(self, submission: _Submission) -> None:
        """A submission reported failed: once no record of it can still be taken,
        ``on_settled`` hears whether all were (after a deadline they may have been);
        not while its acknowledgements wait to be vouched for."""
        if submission not in self._unsettled or submission.outstanding:
            return
        if submission in self._unvouched:
            return
        if submission.handed < len(submission.records) and not submission.failed:
            return  # still being handed to the producer
        del self._unsettled[submission]
        if submission.on_settled is not None:
            submission.on_settled(not submission.failed)

    def _log_went_back(self, partition: int, offset: int, submission: _Submission) -> None:
        """An acknowledgement at or below an earlier one: the partition's log was reset.

        A Kafka that keeps records in memory restarted, or the topic was
        recreated. The embedded Kafka (Tansu, memory storage) even acknowledges
        records sent to a topic it no longer has and then loses them. So every
        record still out is sent again, in order and ahead of anything newer,
        once the topic is created again (its publishers wait for that, within
        their deadline); and every consumer past the log's new start is told
        to rewind. Records are named (producer, seq): one Kafka holds twice is
        stored once. ``submission``'s record is in that log: sent again too, even
        one whose publisher heard at its deadline, with no other record out.
        """
        self.produced[partition] = offset
        self._send_again(partition, submission)

    def _send_again(self, partition: int | None, went_back: _Submission | None = None) -> None:
        """Send every record still out again, in submission order with what waits,
        once the topic exists again; a reset ``partition``'s consumers are told to
        rewind."""
        again: dict[_Submission, None] = {}
        if went_back is not None and went_back in self._unsettled:
            again[went_back] = None
        for round_ in list(self._rounds):
            for submission in round_.submissions:
                if submission.on_accepted is not None:
                    self._withdraw(submission)
                    again[submission] = None
        again.update((s, None) for s in self._unsettled if s.outstanding or s in self._unvouched)
        if self._handing:  # one riding along, not handed whole yet
            again.update(
                (s, None)
                for s in self._batch
                if s.on_accepted is None and not s.failed and s.handed < len(s.records)
            )
        self._resends += 1
        for submission in again:
            submission.attempt += 1
            submission.remaining = len(submission.records)
            submission.outstanding = 0
            submission.handed = 0
            submission.failed = False
        # In submission order, with what waits already: one producer's records reach
        # a partition in the order of their seqs (persistence/redis_store.py), or a
        # later one stored first makes an earlier one look stored.
        again.update(dict.fromkeys(self._pending))
        self._pending = sorted(again, key=lambda s: s.order)
        if self._sender is None and self._pending:
            self._sender = asyncio.get_running_loop().create_task(self._send_pending())
        if partition is not None and self._on_log_reset is not None:
            self._on_log_reset([partition])
        self._start_recreating()

    def _start_recreating(self) -> None:
        """Hold new records until the topic is made again (or found made)."""
        if self._recreate_topic is not None and not self._recreating:
            self._recreating = True
            self._topic_ready.clear()
            asyncio.get_running_loop().create_task(self._recreate())

    def _withdraw(self, submission: _Submission) -> None:
        """Take a submission out of its round unreported: it is sent again."""
        round_ = submission.round
        assert round_ is not None
        round_.submissions = [s for s in round_.submissions if s is not submission]
        self._close_one(round_)

    async def _recreate(self) -> None:
        assert self._recreate_topic is not None
        try:
            while True:
                try:
                    await self._recreate_topic()
                    self.recreate_retry.succeeded()
                    return
                except Exception as error:
                    log.warning("creating kafka topic %s again failed: %s", self._topic, error)
                    await self.recreate_retry.wait()
        finally:
            self._recreating = False
            if not self._held:
                self._topic_ready.set()

    # -- emptying the topic (persistence/compaction.py) --------------------------------------

    def hold(self) -> None:
        """Records submitted from now on wait (their publishers' deadlines run) until
        :meth:`release`; what was handed to the producer already goes on."""
        self._held = True
        self._topic_ready.clear()

    def nothing_out(self) -> bool:
        """No record is being handed to the producer, and every one handed has
        Kafka's answer (a hold stops the sender between batches only)."""
        return (
            not self._handing
            and not any(s.outstanding for round_ in self._rounds for s in round_.submissions)
            and not any(s.outstanding for s in self._unsettled)
        )

    def release(self, new_log: bool) -> None:
        """Send again; ``new_log``: the topic was emptied, its offsets start at 0."""
        self._held = False
        if new_log:
            self.produced.clear()
            self.batches_sent = 0
            self._logs_made += 1
        if not self._recreating:
            self._topic_ready.set()

    def _expire(self, round_: _Round) -> None:
        """Deadline of a round: whatever is still unacknowledged is reported failed.

        Kafka may still take those records later: the publisher got no success
        code for them, and a late record is stored and delivered like any other
        (at least once, never a false success).
        """
        round_.timer = None
        error = TimeoutError(f"kafka did not acknowledge within {self._timeout:g} s")
        for submission in list(round_.submissions):
            if submission.on_accepted is not None:
                self._failed(error)
                self._report(submission, False)

    def _report(self, submission: _Submission, ok: bool) -> None:
        on_accepted, submission.on_accepted = submission.on_accepted, None
        assert on_accepted is not None
        on_accepted(ok)
        round_ = submission.round
        assert round_ is not None
        self._close_one(round_)
        if not ok:
            self._unsettled[submission] = None  # its outcome may still come
            self._maybe_settle(submission)

    def _close_one(self, round_: _Round) -> None:
        round_.open -= 1
        if round_.open:
            return
        if round_.timer is not None:
            round_.timer.cancel()
            round_.timer = None
        # A round and its submissions point at each other: let go of both now, or
        # every PUBLISH leaves a cycle only the garbage collector frees (at 2,000
        # msg/s, a young collection of ~50,000 objects every few seconds, 40-150 ms
        # with the event loop held: BENCHMARKS.md, "The fleet shape, third round").
        for submission in round_.submissions:
            if submission.round is round_:
                submission.round = None
        round_.submissions = []
        if self._latency_observer is not None:
            self._latency_observer(time.perf_counter() - round_.started)
        self._open_rounds -= 1
        self._rounds.pop(round_, None)
        self._check_idle()

    def _check_idle(self) -> None:
        if self._idle is not None and not (self._pending or self._sender or self._open_rounds):
            self._idle.set()

    def _failed(self, error: BaseException) -> None:
        """Count every failure; log at most one line per interval (outages flood)."""
        self.produce_errors += 1
        now = time.monotonic()
        if now - self._logged_at >= LOG_INTERVAL:
            suppressed = self.produce_errors - self._logged_errors - 1
            more = f" ({suppressed} more since the last report)" if suppressed > 0 else ""
            log.warning("kafka produce failed: %r%s", error, more)
            self._logged_at, self._logged_errors = now, self.produce_errors


def make_producer(
    bootstrap: str,
    request_timeout_ms: int,
    linger_ms: int,
    client: str = "aiokafka",
    *,
    security: KafkaSecurity = PLAINTEXT,
) -> RecordProducer:
    """A producer that waits for every in-sync replica (acks=all), of ``client``
    (``persistence.kafka_client``: aiokafka or confluent, persistence/producers.py).

    Idempotence stays off: Tansu, the embedded broker, does not support it;
    ordering per partition holds because aiokafka keeps one batch in flight
    per partition (librdkafka: one request per connection), and because a
    batch does not give up early: aiokafka drops a batch older than its
    request timeout at the next retry and sends the ones queued behind it, so
    a stall longer than the timeout would put an earlier record after later
    ones. The publisher's own deadline is the Kafka path's
    (``request_timeout_ms``, see :class:`KafkaPersistentPath`); the producer
    keeps trying for :data:`BATCH_TTL_MS` at least, so whatever it was handed
    is appended in order or, past that, not at all.
    """
    if client == "confluent":
        return Confluent(
            confluent_settings(
                bootstrap, request_timeout_ms, linger_ms, max(request_timeout_ms, BATCH_TTL_MS)
            )
            | security.librdkafka(),
            start_timeout=request_timeout_ms / 1000,
        )
    return Aiokafka(
        AIOKafkaProducer(
            bootstrap_servers=bootstrap,
            acks="all",
            enable_idempotence=False,
            linger_ms=linger_ms,
            request_timeout_ms=max(request_timeout_ms, BATCH_TTL_MS),
            max_batch_size=512 * 1024,
            **security.aiokafka(),
        )
    )


async def ensure_topic(
    bootstrap: str, topic: str, partitions: int, *, security: KafkaSecurity = PLAINTEXT
) -> bool:
    """Create the topic with its final partition count; True if it was new."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **security.aiokafka())
    await admin.start()
    try:
        return await _create(admin, topic, partitions)
    finally:
        await admin.close()


async def _create(admin: AIOKafkaAdminClient, topic: str, partitions: int) -> bool:
    """Create the topic; True if it was new, False if it exists already."""
    try:
        response = await admin.create_topics([NewTopic(topic, partitions, 1)])
    except TopicAlreadyExistsError:
        return False
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


class TopicProbe:
    """What Kafka lists for the topic, and whether that Kafka forgets topics.

    Asked with a metadata request for all topics, on a client of its own: one
    naming the topic would make Tansu create it, with its default partition
    count, and the producer's own client must keep the metadata it has. Only a
    Tansu (its cluster id says so) loses a topic under a running broker (memory
    storage, restarted empty); an Apache Kafka's topic goes only when deleted
    by hand, and is deleted asynchronously: replacing it there would fight the
    operator.

    On a Tansu, a topic listed with another count than ``partitions`` (the count
    devicemq makes it with) is not devicemq's: any client that names a topic
    Tansu does not have (a reader, a consumer whose fetch failed) makes it at
    Tansu's default size, and a producer that knew the topic's old size goes on
    writing to partitions the new one does not list, which Tansu acknowledges
    and no consumer reads (tests/model/FINDINGS.md, finding 26). Such a topic is
    reported as not listed (:attr:`misshapen` says what it has): it is made again
    at its size, as a lost one.
    """

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        security: KafkaSecurity = PLAINTEXT,
        partitions: int | None = None,
    ) -> None:
        self._client = _WatchedClient(bootstrap_servers=bootstrap, **security.aiokafka())
        self._topic = topic
        self.expected = partitions  # None: any count is devicemq's
        self._started = False
        self.forgets_topics = False  # learnt from the last answer
        self.answered = False  # forgets_topics is known
        self.closed = False
        self._listed_at_break: int | None = None  # breaks seen when last listed
        self.misshapen: int | None = None  # partitions of a topic Tansu made itself

    async def partitions(self) -> int | None:
        """Partitions listed for the topic, None if none (or a Tansu's own topic, not
        devicemq's: :attr:`misshapen`); raises if Kafka is away."""
        if not self._started:
            await self._client.bootstrap()
            self._started = True
        breaks = self._client.breaks
        node = next(iter(self._client.cluster.brokers())).nodeId
        response = await self._client.send(node, MetadataRequest(None))
        self.forgets_topics = str(getattr(response, "cluster_id", "")).startswith("tansu")
        self.answered = True
        cluster = ClusterMetadata()
        cluster.update_metadata(response)
        listed = len(cluster.partitions_for_topic(self._topic) or ())
        self.misshapen = None
        if listed and self.forgets_topics and self.expected not in (None, listed):
            self.misshapen = listed
            listed = 0
        self._listed_at_break = breaks if listed else None
        return listed or None

    @property
    def breaks(self) -> int:
        """Connections of the probe's own client that closed so far."""
        return int(self._client.breaks)

    def vouches(self) -> bool:
        """Still listed, as far as anyone can tell without asking: Kafka listed the
        topic, and no connection to it broke since. A Tansu restarted empty no
        longer lists it, yet acknowledges records sent to it and loses them
        (tests/model/FINDINGS.md, finding 19); its restart breaks every
        connection, this probe's too, before a producer can reconnect and be
        acknowledged. A Kafka that keeps its topics is always vouched for; one not
        heard from yet, never."""
        if not self.answered:
            return False
        if not self.forgets_topics:
            return True
        return self._listed_at_break is not None and self._listed_at_break == self._client.breaks

    async def close(self) -> None:
        self.closed = True
        await self._client.close()


class _WatchedClient(AIOKafkaClient):  # type: ignore[misc]  # aiokafka is untyped
    """A client that counts its connections that closed (a Kafka restart closes all)."""

    breaks = 0

    def _on_connection_closed(self, conn: Any, reason: Any) -> None:
        self.breaks += 1
        super()._on_connection_closed(conn, reason)


async def lost_by_tansu(bootstrap: str, topic: str, security: KafkaSecurity = PLAINTEXT) -> bool:
    """A Tansu (memory storage) no longer lists ``topic``. One listed at another size
    is not lost here: what it holds may be unstored (a broker restarted with another
    ``persistence.partitions``); the compactor's restore reads it all before it
    makes it again (:class:`TopicProbe`)."""
    probe = TopicProbe(bootstrap, topic, security)
    try:
        return await probe.partitions() is None and probe.forgets_topics
    finally:
        await probe.close()


async def replace_topic(
    bootstrap: str, topic: str, partitions: int, *, security: KafkaSecurity = PLAINTEXT
) -> None:
    """Delete the topic and create it again, empty, with ``partitions``
    (persistence/compaction.py).

    Described first: a Tansu that lost the topic still keeps the records sent to
    it since, and deletes them only with a topic it lists (a describe makes it
    list the topic); created over them, its new records would find their offsets
    taken (AlreadyExists in its log) and be lost.

    Between the delete and the create, any client that names the topic (the
    broker's own consumer, whose fetch just failed, or a reader) makes Tansu
    create it at its default size (finding 26). The create then finds it made:
    one of another size is deleted and made again, until devicemq's is the one
    Kafka lists. The caller holds every producer meanwhile, so that topic is
    empty. Both requests go on one client: the window is one round trip."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **security.aiokafka())
    await admin.start()
    try:
        await admin.describe_topics([topic])
        for attempt in itertools.count(1):
            response = await admin.delete_topics([topic])
            for _name, code, *_ in response.topic_error_codes:
                if code and for_code(code) is not UnknownTopicOrPartitionError:
                    raise for_code(code)(f"cannot delete kafka topic {topic}")
            if await _create(admin, topic, partitions):
                return
            made = await _described_partitions(admin, topic)
            if made == partitions:
                return  # made by another client, at the same size: as good
            if attempt == 1 or attempt % 10 == 0:
                log.warning(
                    "kafka topic %s was made by another client between its delete and "
                    "create, with %s partitions instead of %d: deleting it again "
                    "(%d times so far)",
                    topic,
                    made,
                    partitions,
                    attempt,
                )
            await asyncio.sleep(min(0.01 * attempt, REPLACE_RETRY_MAX))
    finally:
        await admin.close()


async def _described_partitions(admin: AIOKafkaAdminClient, topic: str) -> int | None:
    """The partition count a describe lists for the topic (None: an error)."""
    for described in await admin.describe_topics([topic]):
        if described.get("topic") == topic and not described.get("error_code"):
            return len(described.get("partitions") or ())
    return None
