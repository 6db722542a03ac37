"""The persistent path's second leg: Kafka records into Redis, then to the client.

One consumer group inside the broker reads ``devicemq.device.persisted`` in
batches (``getmany``), groups each batch by subscriber (the record key), and
stores each client's part with one script call, all of a batch in one round
trip. Offsets are committed only after Redis stored the batch, so a crash
re-reads it; the store names every record by (producer, seq) and skips one it
has stored, so re-reading never stores twice. The commit runs beside
delivery, not before it: the messages are in Redis already, and a commit that
is lost only means a re-read. A batch Redis cannot take is retried until it
can: the consumer stalls, it never skips (tbmq#320).

A partition's log can go backwards: the embedded Kafka keeps records in
memory only and starts from offset 0 after a restart, and an operator may
recreate the topic. Nothing in the store depends on offsets, so the records
of the new log are stored like any other; what must not happen is a fetch
position left beyond the new log's start. A reset is noticed where it shows:
a producer acknowledgement at a lower offset than before
(:meth:`LogResets.announce`, called by the Kafka path), or a fetched record
below the position this consumer had reached. It is announced in Redis, and
every consumer rewinds the partitions named there to their beginning
(:meth:`PersistenceConsumer.check_resets`).

The consumer task is supervised: an unexpected error rewinds the partitions
of the batch it was storing to that batch's first record, is logged and
counted, and reading goes on after a wait (persistence/coalescing.py); meanwhile
:attr:`PersistenceConsumer.failure` says why (``/ready`` answers 503).

A partition's offsets can also show a hole for a moment: the embedded Kafka
(Tansu) gives a produce request its offsets before it has written the batch,
and a fetch meanwhile returns the later batch of another producer (another
replica's) without the earlier one. A record stored past such a hole would
make the earlier one, fetched later, look stored already (its (producer, seq)
is below the last stored), and it would be lost though acknowledged (issue 16,
finding 4). Our producers write no transactions and the topic is not
compacted, so a partition's offsets are contiguous: the consumer stores up to
a hole, reads again from it, and passes a hole only after :data:`HOLE_WAIT`
(counted and logged: a Kafka whose log has real gaps).

A Kafka that restarted empty (the embedded Tansu) keeps no log, yet a consumer
that has not rejoined yet still fetches at its old positions, and the new log
reuses those offsets: a fetch there returns a producer's later records while its
earlier ones sit below, and stored first, the later ones make the earlier ones
look stored (tests/model/FINDINGS.md, finding 29). So on a single broker, whose
topic probe (persistence/kafka_path.py, ``TopicProbe``) counts the closed
connections of its own client (a Kafka restart closes the one it holds), a
partition's position that was set before such a break is not read from until
the probe vouches for the topic again (listed at devicemq's size, no break
since: the same log) or the partition is read from its start (a restore, a
reset, a new assignment); its fetches meanwhile are put back and it is paused.

A group join can get stuck: a replica restarted against a Kafka (the embedded
Tansu) whose old members were still leaving rejoined every 3 s at the same
generation and never got an assignment (BENCHMARKS.md, "Two replicas on one
host"). A join that has not completed (the rebalance listener was not told of
an assignment, even an empty one) within :data:`STUCK_JOIN_AFTER` is given up:
the consumer forgets its member id and generation and joins as a new member,
and stays not ready until a join completes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError

from persistence.coalescing import CoalescingWriter, Retry
from persistence.events import NO_EVENTS, EventSink
from persistence.format import (
    Stage,
    StoredRecord,
    decode_record,
    epoch_key,
    is_queue_record,
    resets_key,
    well_formed,
)
from persistence.kafka_security import PLAINTEXT, KafkaSecurity
from persistence.queue_store import (
    RETENTION,
    QueueBatch,
    QueueEntry,
    QueueSaveResult,
    QueueStore,
)
from persistence.redis_store import (
    DURABLE,
    LOST,
    ClientBatch,
    LostWrites,
    PersistedMessageStore,
    SaveResult,
)

log = logging.getLogger("devicemq.consumer")

RESET_CHECK_INTERVAL = 1.0  # seconds between two looks at the announced log resets
# Seconds a group join may take before it counts as stuck: several of aiokafka's
# rejoin rounds (a session timeout of 2 s, a rejoin every ~3 s when stuck).
STUCK_JOIN_AFTER = 15.0
# Seconds a hole in a partition's offsets is read again before it is passed.
HOLE_WAIT = 5.0
COMMITTED_TIMEOUT = 2.0  # seconds to ask a new assignment's committed offset
COMMITS_DONE_TIMEOUT = 5.0  # seconds a shutdown waits for offset commits still held back
READ_PARTITIONS_RETRY = 0.05  # seconds between two metadata requests while the topic changes size

StoredHandler = Callable[[str, Callable[[], list[StoredRecord]]], None]
QueueStoredHandler = Callable[[str, list[QueueEntry]], None]  # queue's consumer, entries
RoomFor = Callable[[str], int]  # client id -> messages it can be sent right now


@dataclass(slots=True)
class ConsumerStats:
    records_consumed: int = 0
    messages_stored: int = 0
    duplicates_skipped: int = 0
    messages_trimmed: int = 0
    expired_on_arrival: int = 0
    discarded_ended_session: int = 0  # records of a session that had ended
    malformed_records: int = 0
    queue_refused: int = 0  # $ECQ writes not stored: ecq.max_bytes or ecq.max_queues
    queue_trimmed: int = 0  # unacknowledged queue entries removed by a limit (keys, bytes)
    save_errors: int = 0
    commit_errors: int = 0
    failures: int = 0  # unexpected errors of the consumer task (it went on)
    log_resets: int = 0  # partitions rewound after their log went backwards
    stuck_joins: int = 0  # group joins given up and started again as a new member
    not_durable: int = 0  # commits held back: persistence.redis_wait not met in time
    rewinds: int = 0  # partitions read again: Redis lost saves it had acknowledged
    offset_holes: int = 0  # fetches that skipped an offset: read again from the hole
    offset_holes_passed: int = 0  # holes still there after HOLE_WAIT: passed
    fetches_held: int = 0  # fetches at a position carried across a broken connection
    committed: dict[int, int] = field(default_factory=dict)  # partition -> next offset


async def stop_consumer(consumer: AIOKafkaConsumer) -> None:
    """Stop a Kafka consumer; a Kafka that is away is no error here.

    aiokafka's fetcher, closing, cancels a fetch still in flight and awaits it,
    which re-raises that cancel into the caller: it came out of ``stop()`` when
    Kafka had just restarted under the consumer (CI, a test of finding 29), and
    would have ended a broker's shutdown early. Only a cancel of the caller
    itself is raised on (``Task.cancelling``)."""
    try:
        await consumer.stop()
    except KafkaError as error:
        log.debug("stopping the kafka consumer: %s", error)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        log.debug("stopping the kafka consumer: a fetch in flight was cancelled")


class TopicWatch(Protocol):
    """What the consumer needs of the topic probe (persistence/kafka_path.py)."""

    @property
    def breaks(self) -> int:
        """Connections of its own client to Kafka that closed so far (a Kafka restart
        closes the one it holds; it asks every second, so it normally holds one)."""

    def vouches(self) -> bool:
        """Kafka listed the topic at devicemq's size and no connection broke since."""


def make_consumer(
    bootstrap: str, group: str, *, security: KafkaSecurity = PLAINTEXT
) -> AIOKafkaConsumer:
    """A group member with settings for Tansu's slow joins and low latency.

    It subscribes when a :class:`PersistenceConsumer` takes it (with its
    rebalance listener).
    """
    return AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=2000,
        heartbeat_interval_ms=500,
        fetch_max_wait_ms=20,
        max_poll_interval_ms=3_600_000,  # a stalled Redis must not cost the assignment
        **security.aiokafka(),
    )


class LogResets:
    """Partitions whose log went backwards, announced in Redis for every replica.

    ``devicemq:resets:<topic>`` is a hash, partition -> how many resets were
    announced for it; ``devicemq:epoch:<topic>`` counts them all (delivery
    events carry it, so the audit tells the logs apart).
    """

    def __init__(self, redis: Any, topic: str) -> None:
        self._redis = redis
        self._key = resets_key(topic)
        self._epoch_key = epoch_key(topic)
        # partition -> whether this process's consumer already re-read it
        self._writer: CoalescingWriter[dict[int, bool]] = CoalescingWriter(
            self._write, _reread_by_both, dict, Retry("log_resets")
        )
        # partition -> its counts right after announcements of this process whose
        # consumer had re-read the partition already: hearing them back is no news.
        # Several may land between two looks (two compactions within a second).
        # Used once: a count is not unique over time (Redis may lose increments).
        self._mine: dict[int, set[int]] = {}
        # Partitions reassigned since this process last claimed them: a claim
        # still being written no longer holds (the consumer may not be at 0).
        self._disowned: set[int] = set()
        # Announcements not written yet: the epoch goes up by one per announcement,
        # however many one write carries (the consumer counts its own up at once).
        self._unwritten = 0
        self._writes_begun = 0  # tells a look whether a write overlapped its read

    @property
    def retry(self) -> Retry:
        return self._writer.retry

    def announce(self, partitions: Iterable[int], *, reread: bool = False) -> None:
        """From the hot path: written in the background, retried until it lands.

        ``reread``: this process's consumer already reads these partitions from
        their start (it saw the reset itself); the Kafka path's announcements
        are news to it like anyone's."""
        partitions = list(partitions)
        if not partitions:
            return  # nothing to announce: no epoch either
        if reread:
            self._disowned.difference_update(partitions)
        self._unwritten += 1
        self._writer.add(dict.fromkeys(partitions, reread))

    def disown(self, partition: int) -> None:
        """The partition was revoked or assigned again: where this consumer reads
        it says nothing about a reset it announced before."""
        self._mine.pop(partition, None)
        self._disowned.add(partition)

    async def _write(self, partitions: dict[int, bool]) -> dict[int, bool]:
        self._writes_begun += 1
        ordered = sorted(partitions)
        announcements, self._unwritten = max(self._unwritten, 1), 0
        try:
            pipe = self._redis.pipeline(transaction=False)
            for partition in ordered:
                pipe.hincrby(self._key, str(partition), 1)
            pipe.incrby(self._epoch_key, announcements)
            counts = await pipe.execute()
        except Exception as error:
            self._unwritten += announcements
            log.warning("announcing a kafka log reset failed, retrying: %s", error)
            return partitions
        for partition, count in zip(ordered, counts, strict=False):
            if partitions[partition] and partition not in self._disowned:
                self._mine.setdefault(partition, set()).add(int(count))
            else:
                self._mine.pop(partition, None)
        log.warning(
            "kafka partitions %s went backwards (log reset): announced, every "
            "consumer re-reads them from their beginning",
            ordered,
        )
        return {}

    async def read(self) -> tuple[dict[int, int], int]:
        """(partition -> resets announced, epoch)."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.hgetall(self._key)
        pipe.get(self._epoch_key)
        counts, epoch = await pipe.execute()
        return {int(k): int(v) for k, v in counts.items()}, int(epoch or 0)

    async def look(self) -> tuple[dict[int, int], int] | None:
        """:meth:`read`, for a consumer's look at what others announced; ``None`` when
        a write of this process's own overlapped it. Redis may have applied that
        write and answered the read before the write's answer came back, so its
        step is not remembered as this process's yet and would be taken for
        another's: a compaction's new log read twice (CI saw it). The next look
        reads again, and the step is known by then."""
        if self._writer.busy:
            return None
        begun = self._writes_begun
        answer = await self.read()
        if self._writer.busy or self._writes_begun != begun:
            return None
        return answer

    def announced_by_others(self, known: dict[int, int], counts: dict[int, int]) -> set[int]:
        """Partitions whose count went from ``known`` to ``counts`` by another's
        announcement. Steps that this process made itself are not news: it had
        re-read the partition before announcing (a compaction's new log would
        otherwise be read twice, a second of records stored again)."""
        news: set[int] = set()
        for partition in counts.keys() | known.keys():
            count, before = counts.get(partition, 0), known.get(partition, 0)
            if count == before:
                continue  # an own step not visible yet stays remembered
            mine = self._mine.pop(partition, set())
            later = {step for step in mine if step > count}  # landed after this read
            if later:
                self._mine[partition] = later
            steps = count - before
            own = sum(1 for step in mine if before < step <= count)
            if partition in counts and own != steps:
                news.add(partition)
        return news


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, owner: PersistenceConsumer) -> None:
        self._owner = owner

    async def on_partitions_revoked(self, revoked: Any) -> None:
        self._owner.joining()
        for tp in revoked:
            self._owner.forget_position(tp)

    async def on_partitions_assigned(self, assigned: Any) -> None:
        self._owner.joined()
        for tp in assigned:
            self._owner.placed(tp)


class PersistenceConsumer:
    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        topic: str,
        store: PersistedMessageStore,
        on_stored: StoredHandler,
        max_records: int,
        epoch: int = 0,
        room_for: RoomFor = lambda client_id: 0,
        resets: LogResets | None = None,
        events: EventSink = NO_EVENTS,
        clock: Callable[[], float] = time.monotonic,
        queues: QueueStore | None = None,
        on_queue_stored: QueueStoredHandler | None = None,
        on_queue_refused: Callable[[str], None] | None = None,
        watch: TopicWatch | None = None,
    ) -> None:
        """``queues``: where records for exclusive compacted queues go (their
        values carry FLAG_QUEUE); None: such records are skipped, counted.
        ``watch``: a single broker's topic probe (see the module docstring); None:
        positions are trusted across broken connections (replicas)."""
        self._watch = watch
        self._breaks = watch.breaks if watch is not None else 0  # breaks looked at
        # Positions carried across a broken connection, not vouched for yet, and of
        # them the partitions paused after a fetch there was put back.
        self._suspect: set[TopicPartition] = set()
        self._paused: set[TopicPartition] = set()
        self._queues = queues
        self._on_queue_stored = on_queue_stored
        self._on_queue_refused = on_queue_refused
        self._consumer = consumer
        self._clock = clock
        # Since when a group join has been under way without completing (None: joined).
        self._joining_since: float | None = clock()
        self._stuck: str | None = None  # why not ready: a stuck join, until one completes
        self._room_for = room_for
        self._epoch = epoch
        self._store = store
        self._on_stored = on_stored
        self._max_records = max_records
        self._resets = resets
        self.stats = ConsumerStats()
        self.events = events
        self.failure: str | None = None  # why storing is failing right now (not ready)
        # One commit in flight; offsets asked meanwhile go together in the next.
        self._commits = CoalescingWriter(self._commit, _newer_wins, dict, Retry("kafka_commits"))
        self.store_retry = Retry("consumer_saves")  # storing a poll, reading after a failure
        # Next offset expected per partition while it stays assigned: a fetched
        # record below it means the log went backwards.
        self._position: dict[TopicPartition, int] = {}
        # Next offset not yet stored per partition (since its last seek or
        # assignment): what a topic Kafka lost may be replaced past (compaction.py).
        self._stored: dict[TopicPartition, int] = {}
        # First offset fetched per partition since its last seek or assignment: where
        # unstored() counts from until something is stored (the push-back).
        self._fetched_from: dict[TopicPartition, int] = {}
        self._commits_off = False  # the topic is lost: nothing commits (read_from_start)
        # Bumped by every revoke and assign: a commit refused before one is not tried
        # again after it (the partition may now hold another log: a Kafka restarted).
        self._assignments = 0
        # Partitions whose committed offset stats forgot at a revoke or assign, not
        # committed since (nor forgotten for a log reset): the group's offset in
        # Kafka still tells how far they are stored (committed_offset).
        self._reassigned: set[int] = set()
        # Bumped when Redis lost acknowledged saves and the partitions are read again
        # (_rewind): the offsets of a poll stored before it are not committed.
        self._rewinds = 0
        self._known_resets: dict[int, int] | None = None
        # partition -> (offset of a hole its fetches showed, since when)
        self._holes: dict[TopicPartition, tuple[int, float]] = {}
        # Assigned since their last fetch: that fetch starts at the group's
        # committed offset, asked of Kafka to see whether it skipped offsets.
        self._unplaced: set[TopicPartition] = set()
        self._resets_checked = 0.0
        self._topic = topic
        consumer.subscribe([topic], listener=_Rebalance(self))

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def commit_retry(self) -> Retry:
        return self._commits.retry

    async def run(self) -> None:
        """Read and store until cancelled; an unexpected error never ends it."""
        while True:
            batches: dict[TopicPartition, list[ConsumerRecord]] = {}
            try:
                await self._check_resets_now_and_then()
                self._note_breaks()
                self._resume_if_vouched()
                batches = await self._consumer.getmany(
                    timeout_ms=100, max_records=self._max_records
                )
                if batches:
                    await self.process(batches)
                self.check_join()
                self.failure = self._stuck
            except asyncio.CancelledError:
                raise
            except Exception as error:
                self.stats.failures += 1
                self.failure = f"persistence consumer failed: {error!r}"
                log.exception("persistence consumer failed; reading again shortly")
                for tp, records in batches.items():
                    # Nothing of that batch may count as read: store it again (from
                    # the hole it showed, if it began past one).
                    first = records[0].offset
                    self._seek(tp, min(first, self._position.get(tp, first)))
                await self.store_retry.wait()

    def joining(self) -> None:
        """A group join starts (the rebalance listener's revoke comes first)."""
        if self._joining_since is None:
            self._joining_since = self._clock()

    def joined(self) -> None:
        """A join completed with an assignment (possibly empty: more members than
        partitions is no fault)."""
        self._joining_since = None
        self._stuck = None

    def check_join(self) -> bool:
        """True when the join under way is older than :data:`STUCK_JOIN_AFTER`: it is
        given up, and the consumer joins again as a new member (not ready meanwhile)."""
        since = self._joining_since
        if since is None or self._clock() - since < STUCK_JOIN_AFTER:
            return False
        self.stats.stuck_joins += 1
        self._stuck = f"consumer group join stuck for {STUCK_JOIN_AFTER:g} s: rejoining"
        self.failure = self._stuck
        log.warning("%s as a new member", self._stuck)
        self._joining_since = self._clock()  # the new join gets its own time
        self._join_as_new_member()
        return True

    def _join_as_new_member(self) -> None:
        coordinator = getattr(self._consumer, "_coordinator", None)  # None before start()
        if coordinator is not None:
            # aiokafka keeps no public call for it: forgetting the member id and
            # generation makes the next JoinGroup that of a new member.
            coordinator.reset_generation()
            coordinator.request_rejoin()

    def forget_position(self, tp: TopicPartition) -> None:
        """The partition was (re)assigned or revoked: its next fetch may start anywhere,
        and what this consumer committed for it before says nothing now."""
        self._position.pop(tp, None)
        self._stored.pop(tp, None)
        self._fetched_from.pop(tp, None)
        self._holes.pop(tp, None)
        self._unplaced.add(tp)
        self._trusted(tp)  # placed anew: its position is the current Kafka's
        self._assignments += 1
        self._forget_committed(tp.partition)
        self._reassigned.add(tp.partition)
        if self._resets is not None:
            self._resets.disown(tp.partition)

    def placed(self, tp: TopicPartition) -> None:
        """The partition was assigned. While the topic is lost (:meth:`read_from_start`
        until the restore ends) it is read from 0 again: aiokafka would start at the
        group's committed offset, which may be the lost log's, and skip what lies
        below it in the log Kafka serves now (a rejoin during the restore did:
        tests/model/FINDINGS.md, finding 27)."""
        self.forget_position(tp)
        if self._commits_off:
            self._seek(tp, 0)

    def _forget_committed(self, partition: int) -> None:
        """Offsets of a log that is gone (or of an assignment that ended): neither
        reported nor committed (a retried commit would skip the new log's start)."""
        self.stats.committed.pop(partition, None)
        self._reassigned.discard(partition)
        pending = self._commits.pending
        for tp in [tp for tp in pending if tp.partition == partition]:
            del pending[tp]

    async def process(self, batches: dict[TopicPartition, list[ConsumerRecord]]) -> None:
        rewinds = self._rewinds
        client_batches: list[ClientBatch] = []
        queue_batches: list[QueueBatch] = []
        commit: dict[TopicPartition, int] = {}
        went_back: list[int] = []
        self._note_breaks()
        for tp, records in batches.items():
            self._fetched_from.setdefault(tp, records[0].offset)
            expected = self._position.get(tp)
            if expected is None and tp in self._unplaced:
                # Forward only: a committed offset above the fetch (a late commit of
                # the previous owner) is no log reset.
                committed = await self._committed(tp)
                if committed is not None and records[0].offset > committed:
                    expected = committed
            self._unplaced.discard(tp)
            if expected is not None and records[0].offset < expected:
                went_back.append(tp.partition)
                expected = None  # a new log: only holes inside the fetch count
                self._trusted(tp)  # read from the log's start
            elif tp in self._suspect and not self._vouched():
                self._hold(tp, records[0].offset)
                continue
            records = self._up_to_hole(tp, expected, records)
            if not records:
                continue
            self._position[tp] = records[-1].offset + 1
            by_client: dict[str, tuple[list[bytes], list[int]]] = {}
            by_queue: dict[str, tuple[list[bytes], list[int]]] = {}
            for record in records:
                value, client_id = record.value, _client_id(record.key)
                if client_id is None or not well_formed(value):
                    self.stats.malformed_records += 1
                    log.warning("skipping a malformed record at %s offset %d", tp, record.offset)
                    continue
                if is_queue_record(value):
                    if self._queues is None:
                        self.stats.malformed_records += 1
                        continue
                    values, offsets = by_queue.setdefault(client_id, ([], []))
                    values.append(value)
                    offsets.append(record.offset)
                    continue
                values, offsets = by_client.setdefault(client_id, ([], []))
                values.append(value)
                offsets.append(record.offset)
            room_for = self._room_for
            client_batches.extend(
                # Stored marked sent, as many as go out at once: no mark write for them.
                ClientBatch(client_id, values, tp.partition, offsets, room_for(client_id))
                for client_id, (values, offsets) in by_client.items()
            )
            queue_batches.extend(
                QueueBatch(client_id, values, tp.partition, offsets)
                for client_id, (values, offsets) in by_queue.items()
            )
            commit[tp] = records[-1].offset + 1
            self.stats.records_consumed += len(records)
        for partition in went_back:
            self.stats.log_resets += 1
            self._forget_committed(partition)
        if went_back and self._resets is not None:
            # Below the position this consumer had reached: the log was reset. Its
            # new records are read from its start now (aiokafka resets to the
            # earliest); other replicas' consumers may be past it: tell them.
            self._resets.announce(went_back, reread=True)
        results = await self._save(client_batches)
        if results is None:  # Redis had lost saves: all of this is read again
            return
        queue_results = await self._save_queues(queue_batches) if queue_batches else []
        if queue_results is None:  # as above; the clients' saves were fine to make
            return
        if rewinds == self._rewinds:  # else these records are being read again
            self._commit_soon(commit)
            for tp, offset in commit.items():
                if self._position.get(tp) == offset:  # not sought elsewhere meanwhile
                    self._stored[tp] = offset
        for batch, result in zip(client_batches, results, strict=True):
            saved = self._account(result)
            self.events.stored(batch, result)
            if saved or result.duplicates:
                # Duplicates too: a save whose reply was lost stored them, unseen.
                self._on_stored(batch.client_id, _records_of(batch, result))
        for queue_batch, queue_result in zip(queue_batches, queue_results, strict=True):
            self.stats.messages_stored += queue_result.saved
            self.stats.duplicates_skipped += queue_result.duplicates
            self.stats.queue_refused += queue_result.refused
            self.stats.queue_trimmed += sum(
                1 for r in queue_result.removed if r.pending and r.why != RETENTION
            )
            if queue_result.refused:
                log.info(
                    "queue %s: %d writes refused (ecq.max_bytes or ecq.max_queues; %d bytes "
                    "kept)",
                    queue_batch.client_id, queue_result.refused, queue_result.bytes,
                )  # fmt: skip
                if self._on_queue_refused is not None:
                    self._on_queue_refused(queue_batch.client_id)
            self.events.queue_stored(queue_batch, queue_result)
            if self._on_queue_stored is not None and (
                queue_result.saved or queue_result.duplicates
            ):
                entries = [
                    QueueEntry(key, seq, value)
                    for key, seq, value in zip(
                        queue_result.keys, queue_result.seqs, queue_batch.values, strict=True
                    )
                    if seq > 0
                ]
                self._on_queue_stored(queue_batch.client_id, entries)

    async def committed_offset(self, tp: TopicPartition) -> int | None:
        """How far ``tp`` is stored and committed, None if not known: this consumer's
        last commit of it, or, for a partition revoked and assigned again since
        (a rebalance) and not committed since, the group's offset in Kafka. With no
        record since, this consumer would never commit it again (the drain waited
        out its DRAIN_TIMEOUT for that)."""
        committed = self.stats.committed.get(tp.partition)
        if committed is None and tp.partition in self._reassigned:
            committed = await self._committed(tp)
        return committed

    async def _committed(self, tp: TopicPartition) -> int | None:
        """The group's committed offset of ``tp`` (where a new assignment's first
        fetch starts), None if there is none or Kafka does not answer in time."""
        # asyncio.wait, not wait_for: during a rebalance aiokafka's answer does not end
        # at a cancel, and wait_for would wait for it (a shutdown drain hung 60 s with
        # two workers stopping together); the call is left to end on its own.
        ask = asyncio.ensure_future(self._consumer.committed(tp))
        ask.add_done_callback(_quiet)
        done, _ = await asyncio.wait({ask}, timeout=COMMITTED_TIMEOUT)
        if not done:
            ask.cancel()
            log.debug("kafka did not tell the committed offset of %s in time", tp)
            return None
        if ask.exception() is not None:  # a Kafka away: the fetch is taken as is
            log.debug("asking kafka for the committed offset of %s failed: %s", tp, ask.exception())
            return None
        committed = ask.result()
        return committed if isinstance(committed, int) and committed >= 0 else None

    def _up_to_hole(
        self, tp: TopicPartition, expected: int | None, records: list[ConsumerRecord]
    ) -> list[ConsumerRecord]:
        """The records of a fetch before the first offset it skipped; the partition
        is then read again from that offset (see the module docstring). A hole
        still there after :data:`HOLE_WAIT` is passed, and the rest of the fetch
        is looked at the same way."""
        hole = None
        first = records[0].offset
        if expected is not None and first > expected:
            hole, keep = expected, 0
        elif records[-1].offset - first != len(records) - 1:  # offsets only rise
            for i in range(1, len(records)):
                if records[i].offset != records[i - 1].offset + 1:
                    hole, keep = records[i - 1].offset + 1, i
                    break
        if hole is None:
            self._holes.pop(tp, None)
            return records
        now = self._clock()
        seen = self._holes.get(tp)
        if seen is None or seen[0] != hole:
            seen = self._holes[tp] = (hole, now)
            self.stats.offset_holes += 1
        if now - seen[1] >= HOLE_WAIT:
            del self._holes[tp]
            self.stats.offset_holes_passed += 1
            log.warning(
                "kafka partition %d: offset %d was still missing after %g s; passed",
                tp.partition,
                hole,
                HOLE_WAIT,
            )
            # That hole only: one further on in the fetch may still be filling.
            return records[:keep] + self._up_to_hole(tp, None, records[keep:])
        try:
            self._consumer.seek(tp, hole)
        except Exception as error:  # no longer assigned: its next owner reads it
            log.debug("seek of %s failed: %s", tp, error)
        self._position[tp] = hole
        return records[:keep]

    async def check_resets(self) -> None:
        """Rewind the assigned partitions whose log reset was announced since last time."""
        if self._resets is None:
            return
        answer = await self._resets.look()
        if answer is None:
            return  # an own announcement was being written: the next look tells
        counts, epoch = answer
        known, self._known_resets = self._known_resets, counts
        self._epoch = max(self._epoch, epoch)
        if known is None:
            return  # the first look: what was announced before us is history
        changed = self._resets.announced_by_others(known, counts)
        for tp in self._consumer.assignment():
            if tp.partition in changed:
                self.stats.log_resets += 1
                self._forget_committed(tp.partition)
                log.warning("kafka partition %d was reset: reading it from its start", tp.partition)
                self._seek(tp, 0)

    def unstored(self) -> int:
        """Records of the assigned partitions not stored yet: from where each is stored
        (or, before anything is, from its first fetch since its assignment or last
        seek) up to its end as its last fetch saw it: one poll behind at most. A
        partition not fetched yet is left out: unknown, it holds no one back."""
        consumer, stored, fetched_from = self._consumer, self._stored, self._fetched_from
        total = 0
        for tp in consumer.assignment():
            start = stored.get(tp)
            if start is None:
                start = fetched_from.get(tp)
                if start is None:
                    continue
            end = consumer.highwater(tp)
            if end is not None and end > start:
                total += end - start
        return total

    def records_held(self) -> int:
        """Records the assigned partitions hold, as their last fetches said (a log's
        offsets start at 0: the embedded Kafka cannot delete records)."""
        ends = (self._consumer.highwater(tp) for tp in self._consumer.assignment())
        return sum(end for end in ends if end)

    async def caught_up(self, produced: dict[int, int], partitions: int) -> bool:
        """This consumer holds all ``partitions`` and has stored and committed each to
        its end, which is at least past what ``produced`` says was acknowledged.
        A partition this consumer has committed nothing for since it was assigned
        is asked of Kafka."""
        assigned = self._consumer.assignment()
        if len(assigned) != partitions or self._commits.busy or len(self._commits.pending):
            return False
        for tp in assigned:
            end = self._consumer.highwater(tp)
            if end is None or end <= produced.get(tp.partition, -1):
                return False
            if not end:
                continue
            committed = self.stats.committed.get(tp.partition)
            if committed is None:
                committed = await self._consumer.committed(tp)
            if committed is None or committed < end:
                return False
        return True

    def read_from_start(self) -> None:
        """Read every assigned partition again from offset 0, offsets of the log it
        had forgotten: Kafka lost the topic (a Tansu restarted empty acknowledges
        and serves records of a topic it no longer lists, from offset 0 again, and
        a consumer past that offset would never fetch them). Read twice, stored once.

        Nothing is committed until :meth:`log_recreated` or :meth:`commit_again`:
        Kafka refuses commits for a topic it lost, and aiokafka retries them until
        a topic of that name exists again, where an offset of the lost log would
        skip the new log's first records."""
        self._commits_off = True
        self._commits.abandon()
        for tp in self._consumer.assignment():
            self._forget_committed(tp.partition)
            self._seek(tp, 0)

    async def read_partitions(self, partitions: int) -> None:
        """Read the topic's partitions from Kafka until it lists ``partitions``, then
        join the group anew to be assigned them.

        A topic made again at another size (persistence/compaction.py) keeps its
        name: aiokafka would learn the new count only at its next metadata refresh
        (5 minutes). A refresh already under way may have been asked before the
        topic was made: asked again until it lists them. The join is a new
        member's: Tansu (0.6) answers the rejoin a metadata change starts with the
        assignment its member had before (its generation stays 0), and the
        partitions the topic gained would never be read (tests/model/FINDINGS.md,
        finding 27); any Kafka assigns a new member afresh."""
        while True:
            await self._consumer._client.force_metadata_update()
            if len(self._consumer.partitions_for_topic(self._topic) or ()) == partitions:
                break
            await asyncio.sleep(READ_PARTITIONS_RETRY)
        self._join_as_new_member()

    def commit_again(self) -> None:
        """Kafka lists the topic again by itself (not made again): commits resume."""
        self._commits_off = False

    def stored_to_end(self, since: float, partitions: int) -> bool:
        """This consumer holds all ``partitions``, fetched each after ``since`` (wall
        clock seconds) and stored each up to the end that fetch reported: the test
        that needs no commit (Kafka refuses commits for a topic it lost)."""
        assigned = self._consumer.assignment()
        if len(assigned) != partitions:
            return False
        for tp in assigned:
            fetched = self._consumer.last_poll_timestamp(tp)  # ms, 0: never
            end = self._consumer.highwater(tp)
            if not fetched or fetched / 1000 < since or end is None:
                return False
            if end and self._stored.get(tp, 0) < end:
                return False
        return True

    async def durable(self) -> bool:
        """What is stored is as durable as ``persistence.redis_wait`` asks. Redis lost
        saves (LOST): the partitions are read from 0 again, not yet durable."""
        verdict = await self._store.wait_durable()
        if verdict == LOST:
            self.stats.rewinds += 1
            self.read_from_start()
        return verdict == DURABLE

    def log_recreated(self) -> None:
        """The topic was emptied (deleted and created again, persistence/compaction.py):
        every partition is read from its start and nothing committed before counts.
        Announced like any reset (the epoch goes up); hearing its own announcement
        back is no news (:meth:`LogResets.announced_by_others`)."""
        assigned = list(self._consumer.assignment())
        for tp in assigned:
            self.stats.log_resets += 1
            self._forget_committed(tp.partition)
            self._seek(tp, 0)
        self._commits.abandon()  # an old log's offset must not land in the new one
        self._commits_off = False
        if self._resets is not None and assigned:
            self._resets.announce((tp.partition for tp in assigned), reread=True)
            # The announcement counts the epoch up by one in Redis (LogResets._write);
            # the new log's first records' events carry it already, not once the next
            # look has read it back (the audit took them for another log's: lost).
            # A look reading more (another's announcement) still raises it.
            self._epoch += 1

    async def _check_resets_now_and_then(self) -> None:
        now = time.monotonic()
        if now - self._resets_checked >= RESET_CHECK_INTERVAL:
            self._resets_checked = now
            try:
                await self.check_resets()
            except Exception as error:  # Redis down: the next look will do
                log.debug("reading announced kafka log resets failed: %s", error)

    def _seek(self, tp: TopicPartition, offset: int) -> None:
        try:
            self._consumer.seek(tp, offset)
        except Exception as error:  # no longer assigned: its next owner reads it
            log.debug("seek of %s failed: %s", tp, error)
        if offset == 0:
            self._trusted(tp)  # read from the start: whichever log it is
        # The next fetch starts here: one that starts further on skipped offsets.
        self._position[tp] = offset
        self._stored.pop(tp, None)
        self._fetched_from.pop(tp, None)
        self._holes.pop(tp, None)

    def _note_breaks(self) -> None:
        """A connection to Kafka broke since the last look: every assigned position
        may be a lost log's (see the module docstring)."""
        watch = self._watch
        if watch is None or watch.breaks == self._breaks:
            return
        self._breaks = watch.breaks
        self._suspect.update(self._consumer.assignment())
        self._suspect.update(self._position)  # fetched here before: assigned still

    def _vouched(self) -> bool:
        """The probe vouches for the topic: every position is the log's again."""
        assert self._watch is not None
        self._note_breaks()
        if not self._watch.vouches():
            return False
        for tp in list(self._suspect):
            self._trusted(tp)
        return True

    def _hold(self, tp: TopicPartition, first: int) -> None:
        """Put a fetch back unstored and pause its partition until it is trusted."""
        self.stats.fetches_held += 1
        try:
            self._consumer.seek(tp, first)
            self._consumer.pause(tp)
        except Exception as error:  # no longer assigned: its next owner reads it
            log.debug("holding %s failed: %s", tp, error)
            return
        if tp not in self._paused:
            self._paused.add(tp)
            log.warning(
                "kafka partition %d: a connection to kafka broke; not storing from "
                "offset %d until the topic is known to be the same log",
                tp.partition,
                first,
            )

    def _trusted(self, tp: TopicPartition) -> None:
        """``tp``'s position was set anew (or vouched for): a break before now is
        noted first, so that it makes only older positions suspect."""
        self._note_breaks()
        self._suspect.discard(tp)
        if tp in self._paused:
            self._paused.discard(tp)
            try:
                self._consumer.resume(tp)
            except Exception as error:  # no longer assigned: nothing to resume
                log.debug("resuming %s failed: %s", tp, error)

    def _resume_if_vouched(self) -> None:
        if self._paused and self._vouched():
            log.warning("kafka topic %s vouched for again: reading on", self._topic)

    async def _save(self, batches: list[ClientBatch]) -> list[SaveResult] | None:
        """Store, retrying what failed. Should Redis have lost saves it acknowledged,
        nothing is stored and None is answered: every partition is read again from
        its committed offset first (these records with it), so no later record
        lands before a lost one."""
        while True:
            try:
                saved = await self._store.save_many(batches)
                self.store_retry.succeeded()
                return saved
            except LostWrites:
                await self._rewind()
                return None
            except Exception as error:  # BatchSaveError, connection errors, cluster errors
                self.stats.save_errors += 1
                log.warning("storing %d client batches failed, retrying: %s", len(batches), error)
                await self.store_retry.wait()

    async def _save_queues(self, batches: list[QueueBatch]) -> list[QueueSaveResult] | None:
        """Store queue batches; what failed is tried again (only that: a result lost
        to a retry would report its records as duplicates). None: Redis had lost
        saves, Kafka is read again (see :meth:`_save`)."""
        assert self._queues is not None
        results: list[QueueSaveResult | None] = [None] * len(batches)
        while True:
            todo = [i for i, r in enumerate(results) if r is None]
            if not todo:
                return [r for r in results if r is not None]
            saved, error = await self._queues.save_many([batches[i] for i in todo])
            if isinstance(error, LostWrites):
                await self._rewind()
                return None
            for i, result in zip(todo, saved, strict=True):
                results[i] = result
            if error is None:
                self.store_retry.succeeded()
                continue
            self.stats.save_errors += 1
            log.warning("storing %d queue batches failed, retrying: %s", len(todo), error)
            await self.store_retry.wait()

    async def commits_done(self, timeout: float = COMMITS_DONE_TIMEOUT) -> None:
        """Wait until every offset handed to Kafka so far is committed (or failed),
        at most ``timeout``: a commit held back by ``persistence.redis_wait`` may
        never be allowed (a replica gone). What is not committed is read again at
        the next start, and stored once."""
        try:
            await asyncio.wait_for(asyncio.shield(self._commits.drain()), timeout)
        except TimeoutError:
            log.warning(
                "offsets not committed within %g s (persistence.redis_wait not met?); "
                "their records are read again at the next start, stored once",
                timeout,
            )

    def _commit_soon(self, offsets: dict[TopicPartition, int]) -> None:
        if not self._commits_off:  # see read_from_start
            self._commits.add(offsets)

    async def _commit(self, offsets: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
        """Commit; answers the offsets to commit again (see below).

        With ``persistence.redis_wait``, only once Redis says the saves are as
        durable as asked: the stored messages were delivered already (a failover
        that lost them makes them read from Kafka and delivered again, never lost),
        but an offset committed too early would skip them. The wait runs here,
        beside storing, so the consumer never waits for it; commits held back
        meanwhile merge, and one wait covers them all."""
        assignments, rewinds = self._assignments, self._rewinds
        verdict = await self._store.wait_durable()
        if verdict == LOST:
            await self._rewind()
            return {}
        if verdict != DURABLE:
            self.stats.not_durable += 1
            return self._still_mine(offsets, assignments)
        if self._assignments != assignments or self._rewinds != rewinds:
            return {}  # a rebalance or a rewind during the wait: see below
        try:
            await self._consumer.commit(offsets)
        except KafkaError as error:
            # Lost the assignment (rebalance): the next owner re-reads these
            # records and the store skips them as already saved. Still assigned
            # (Kafka slow or away): tried again, unless a later commit covers them,
            # or the group's offset would lag until the next record arrives. Not
            # after a rebalance, even one that gave the partition back: a Kafka
            # that restarted empty makes every member rejoin, and an old log's
            # offset committed into the new one would skip its first records.
            # Whoever holds it now re-reads and commits.
            self.stats.commit_errors += 1
            log.warning("offset commit failed: %s", error)
            return self._still_mine(offsets, assignments)
        for tp, offset in offsets.items():
            self.stats.committed[tp.partition] = offset
            self._reassigned.discard(tp.partition)
        return {}

    async def _rewind(self) -> None:
        """Redis no longer has saves it acknowledged (a restart from a file without
        them, a replica without them taking over): read every assigned partition
        again from its committed offset. What Redis still has is skipped as
        stored; what it lost is saved again. Nothing stored before now commits.

        The committed offsets are read first; the rewind itself (the count that
        stops earlier polls committing, the pending commits dropped, the seeks)
        then happens at once, so no poll can start in between and commit past
        the lost records."""
        assigned = list(self._consumer.assignment())
        log.warning(
            "redis lost saves it had acknowledged (restart or failover): reading %d "
            "partitions again from their committed offsets",
            len(assigned),
        )
        committed: dict[TopicPartition, int] = {}
        for tp in assigned:
            try:
                committed[tp] = await self._consumer.committed(tp) or 0
            except KafkaError as error:
                log.warning("reading the committed offset of %s failed: %s", tp, error)
                committed[tp] = 0  # from the start: read again, stored once
        self._rewinds += 1
        self.stats.rewinds += 1
        self._commits.pending.clear()
        for tp, offset in committed.items():
            self._seek(tp, offset)

    def _still_mine(
        self, offsets: dict[TopicPartition, int], assignments: int
    ) -> dict[TopicPartition, int]:
        """The offsets to try committing again: none after a rebalance (see
        :meth:`_commit`), else those of partitions still assigned."""
        if self._assignments != assignments:
            return {}
        assigned = self._consumer.assignment()
        return {tp: offset for tp, offset in offsets.items() if tp in assigned}

    def _account(self, result: SaveResult) -> int:
        """Count what a client batch's save did; answers how many it stored."""
        stats, saved = self.stats, result.saved
        stats.messages_stored += saved
        stats.duplicates_skipped += result.duplicates
        stats.messages_trimmed += result.trimmed
        stats.expired_on_arrival += result.expired
        stats.discarded_ended_session += len(result.discarded)
        return saved


def _client_id(key: bytes | None) -> str | None:
    if key is None:
        return None
    try:
        return key.decode()
    except UnicodeDecodeError:
        return None


def _records_of(batch: ClientBatch, result: SaveResult) -> Callable[[], list[StoredRecord]]:
    """The stored records, decoded only if someone wants them (the client is here)."""

    def decode() -> list[StoredRecord]:
        records: list[StoredRecord] = []
        premarked = batch.premark
        for value, assigned in zip(batch.messages, result.assigned, strict=True):
            if assigned is not None:
                assert isinstance(value, bytes)
                record = decode_record(
                    assigned.packet_id, assigned.score, value, marked=len(records) < premarked
                )
                assert record.stage is Stage.PUBLISH
                records.append(record)
        return records

    return decode


def _newer_wins(
    older: dict[TopicPartition, int], newer: dict[TopicPartition, int]
) -> dict[TopicPartition, int]:
    return {**older, **newer}


def _reread_by_both(older: dict[int, bool], newer: dict[int, bool]) -> dict[int, bool]:
    """Announcements merged: a partition is known re-read only if both said so."""
    return {p: older.get(p, True) and newer.get(p, True) for p in older.keys() | newer.keys()}


def _quiet(task: asyncio.Future[Any]) -> None:
    """A call left to end on its own: its outcome is not wanted (no "never retrieved")."""
    if not task.cancelled():
        task.exception()
