"""Emptying the embedded Kafka's topic once everything in it is stored.

The embedded Kafka (Tansu, memory storage) keeps every record it was ever sent
and cannot delete old ones (no DeleteRecords, no retention): its memory grows
and every fetch gets slower, until fetches come back empty and delivery stops
(BENCHMARKS.md, "Reliability": the soak that stopped delivering after
~12 minutes). Records are only a way into Redis, so once Redis holds all of
them the log can go: once the topic holds ``threshold`` records (as the
consumer's last fetches saw its partitions' ends), the compactor holds new
records back (publishers wait, within their deadline), waits until every
record handed to Kafka is answered and the consumer has stored and committed
up to the end of every partition, then deletes the topic and creates it
again. The consumer reads the new log from
its start; a reset is announced like any other (the epoch the audit uses goes
up). Nothing unstored is ever in the topic that goes, so nothing is lost.

A consumer that lags is what makes the log grow, and a log that grows is what
makes the consumer slower (the 1-hour soak, run beside the model checker on 2
cores, fell 56,000 records behind and never got to compact). So the hold
waits up to ``hold_limit`` (by default most of the publishers' own deadline)
for the consumer to catch up, and when it does not, the compactor tries again
a second later: publishers are paced to what the consumer stores, and a
publish held past its deadline gets a failure code (MQTT 5) or a closed
connection (3.1.1), never a false success.

Only for the embedded Kafka of a single broker (app/serve.py decides): a real
Kafka has retention, and other replicas' producers cannot be held from here.

The same hold keeps a topic that Kafka lost under a running broker, on any
single broker (issue 12, seed 1183). A Tansu that restarted empty, or a topic
deleted by hand, no longer lists the topic, yet still acknowledges records sent
to it and serves them, from offset 0 again; commits for it are refused, and the
next CreateTopics (a broker that starts) drops them: acknowledged, lost. So
every second the compactor asks Kafka for the topic (:class:`TopicProbe`).
Missing: the consumer reads every partition
again from 0, publishers are held until every record Kafka serves is stored,
and the topic is created again (a reset, as a compaction). If the records
cannot be read back within :data:`GIVE_UP_AFTER`, Kafka has lost them with its
log; the topic is made anyway, counted and logged as such.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from persistence.consumer import PersistenceConsumer
from persistence.kafka_path import KafkaPersistentPath, TopicProbe

log = logging.getLogger("devicemq.kafka")

CHECK_INTERVAL = 1.0  # seconds between two looks at the record count and the topic
RETRY_AFTER = 1.0  # seconds before a compaction that could not finish is tried again
GIVE_UP_AFTER = 10.0  # seconds a lost topic's records are waited for before it is made
READ_PARTITIONS_TIMEOUT = 5.0  # seconds the consumer may take to read the partitions anew
# A fetch answered this long after the last acknowledgement was asked after it too
# (fetch.max.wait is 20 ms): its end covers every acknowledged record.
FETCH_MARGIN = 0.25


@dataclass(slots=True)
class CompactionStats:
    compactions: int = 0  # topics emptied
    deferred: int = 0  # compactions given up: the consumer did not catch up in time
    records_dropped: int = 0  # stored records removed from Kafka with their topic
    held_seconds: float = 0.0  # publishers held, by every try (finished or deferred)
    topics_restored: int = 0  # topics Kafka had lost, created again
    restores_incomplete: int = 0  # of them: made before every record was read back


class KafkaCompactor:
    def __init__(
        self,
        path: KafkaPersistentPath,
        consumer: PersistenceConsumer,
        partitions: int,
        replace_topic: Callable[[], Awaitable[object]],
        threshold: int,
        hold_limit: float = 2.0,
        batch_threshold: int = 0,
        clock: Callable[[], float] = time.monotonic,
        probe: TopicProbe | None = None,
        after_compaction: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        """``threshold`` 0: never compact; ``probe``: asked every second what Kafka
        lists for the topic (a lost one is restored); None: not watched.
        ``after_compaction`` runs once the topic is emptied, publishers still held
        (the events topic's turn, persistence/device_persistence.py)."""
        self._after_compaction = after_compaction
        self._path = path
        self._consumer = consumer
        self._partitions = partitions
        self._replace_topic = replace_topic  # delete the topic, then create it again
        self.threshold = threshold
        self.batch_threshold = batch_threshold
        self._hold_limit = hold_limit
        self._clock = clock
        self._probe = probe
        self._busy = asyncio.Lock()  # one compaction or restore at a time
        self._listed = partitions  # partitions Kafka last listed for the topic
        self._lost_since: float | None = None  # when the topic was found lost
        self._next_try = 0.0
        self.stats = CompactionStats()

    async def run(self) -> None:
        """Restore a lost topic, compact once the threshold is passed, until cancelled."""
        while True:
            await asyncio.sleep(CHECK_INTERVAL)
            if self._clock() < self._next_try:
                continue
            try:
                async with self._busy:
                    if await self.topic_lost():
                        done = await self.restore()
                    elif self.due():
                        done = await self.compact()
                    else:
                        continue
            except asyncio.CancelledError:
                raise
            except Exception:  # never the end of the broker; tried again later
                log.exception("emptying or restoring the kafka topic failed")
                done = False
            if not done:
                self._next_try = self._clock() + RETRY_AFTER

    def due(self) -> bool:
        """``threshold`` records held, or ``batch_threshold`` batches sent (at most):
        a fetch from Tansu's memory store looks at every batch it holds, and at a
        message a second per client most batches hold a record or two."""
        if not self.threshold:
            return False
        if self._consumer.records_held() >= self.threshold:
            return True
        return bool(self.batch_threshold) and self._path.batches_sent >= self.batch_threshold

    async def topic_lost(self) -> bool:
        """A Kafka that forgets topics (Tansu) answers and does not list the topic, or
        lists one it made itself at another size (:class:`TopicProbe`). On any other
        Kafka a topic listed with another partition count than configured is an
        operator's (the setting applies when devicemq creates it): kept."""
        try:
            return await self._ask() is None
        except Exception as error:  # Kafka away: nothing to decide now
            log.debug("asking kafka for the topic failed: %s", error)
            return False

    async def _ask(self) -> int | None:
        """The partitions Kafka lists for the topic; None only when a Kafka that
        forgets topics lists none. Raises when Kafka does not answer."""
        if self._probe is None:
            return self._listed
        listed = await self._probe.partitions()
        if listed is None and self._probe.forgets_topics:
            if self._probe.misshapen:  # what the consumer reads until it is made again
                self._listed = self._probe.misshapen
            return None
        if listed is not None:
            self._listed = listed
        if self._lost_since is not None:  # listed again, not by us: stop restoring
            self._lost_since = None
            self._consumer.commit_again()
            log.warning("kafka lists topic %s again by itself", self._path.topic)
        return self._listed

    async def restore_when_lost(self) -> bool:
        """For the Kafka path, whose log went back or whose topic is gone (a Kafka
        that restarted): returns once Kafka lists the topic, made again if it had
        lost it. Meanwhile the path sends nothing, so no publisher is told that a
        record is accepted into a log that a broker starting after a crash would
        drop (the checker's seed 2010: 14 acknowledged in the 0.6 s between a
        Tansu restart and the probe's next look, lost to a kill -9 0.5 s later).
        False: this Kafka does not forget topics (the caller creates a missing one)."""
        while True:
            async with self._busy:
                try:
                    listed = await self._ask()
                except Exception as error:  # Kafka away: asked again shortly
                    log.debug("asking kafka for the topic failed: %s", error)
                else:
                    if self._probe is None or not self._probe.forgets_topics:
                        return False
                    if listed is not None or await self.restore():
                        return True
            await asyncio.sleep(RETRY_AFTER)

    async def restore(self) -> bool:
        """Make the lost topic again once every record Kafka still serves is stored;
        False: not yet (tried again a second later)."""
        path, consumer = self._path, self._consumer
        if self._lost_since is None:
            self._lost_since = self._clock()
            misshapen = self._probe.misshapen if self._probe is not None else None
            if misshapen:
                log.warning(
                    "kafka lists topic %s with %d partitions, not %d: a client that named "
                    "it made it (Tansu creates a topic it does not have at its default "
                    "size); storing every record in it, then making it again",
                    path.topic,
                    misshapen,
                    self._partitions,
                )
            else:
                log.warning(
                    "kafka no longer lists topic %s (restarted empty, or deleted): "
                    "storing every record it still serves, then creating it again",
                    path.topic,
                )
            consumer.read_from_start()
            if misshapen:
                await self._read_partitions(misshapen)  # to be assigned what it lists
        lost_since = self._lost_since
        path.hold()
        held_at = self._clock()
        new_log = False
        try:
            deadline = held_at + self._hold_limit
            answered_at: float | None = None  # wall clock: fetches after it see every record
            while True:
                if not path.nothing_out():
                    answered_at = None
                elif answered_at is None:
                    answered_at = time.time()
                if answered_at is not None and consumer.stored_to_end(
                    answered_at + FETCH_MARGIN, self._listed
                ):
                    try:
                        left = max(deadline - self._clock(), 0.05)
                        durable = await asyncio.wait_for(consumer.durable(), left)
                    except TimeoutError:
                        durable = False
                    if durable and path.nothing_out():
                        break
                if self._clock() >= deadline:
                    if self._clock() - lost_since < GIVE_UP_AFTER:
                        return False
                    self.stats.restores_incomplete += 1
                    log.error(
                        "kafka topic %s: its records could not all be read back within "
                        "%g s; creating it anyway (what Kafka acknowledged and no longer "
                        "serves is lost with its log)",
                        path.topic,
                        GIVE_UP_AFTER,
                    )
                    break
                await asyncio.sleep(0.02)
            await self._replace_topic()
            new_log = True
            consumer.log_recreated()
            if self._listed != self._partitions:
                await self._read_partitions(self._partitions)
                self._listed = self._partitions
            self._lost_since = None
            self.stats.topics_restored += 1
            log.warning(
                "kafka topic %s created again with %d partitions (publishers held %.0f ms)",
                path.topic,
                self._partitions,
                (self._clock() - held_at) * 1000,
            )
            return True
        finally:
            self.stats.held_seconds += self._clock() - held_at
            path.release(new_log)

    async def _read_partitions(self, partitions: int) -> None:
        """The consumer reads the topic's partitions now: its size changed."""
        try:
            await asyncio.wait_for(
                self._consumer.read_partitions(partitions), READ_PARTITIONS_TIMEOUT
            )
        except Exception as error:  # Kafka away: aiokafka refreshes by itself later
            log.warning("reading kafka topic %s's partitions failed: %r", self._path.topic, error)

    async def compact(self) -> bool:
        """Empty the topic now if everything in it is stored; False if it was not."""
        path, consumer = self._path, self._consumer
        path.hold()
        held_at = self._clock()
        new_log = False
        try:
            deadline = self._clock() + self._hold_limit
            while not (
                path.nothing_out() and await consumer.caught_up(path.produced, self._partitions)
            ):
                if self._clock() >= deadline:
                    self.stats.deferred += 1
                    if self.stats.deferred == 1 or self.stats.deferred % 60 == 0:
                        log.info(
                            "embedded kafka topic not emptied: the consumer did not store "
                            "everything within %g s (%d times so far); publishers are held "
                            "while it catches up",
                            self._hold_limit,
                            self.stats.deferred,
                        )
                    return False
                await asyncio.sleep(0.02)
            dropped, batches = consumer.records_held(), path.batches_sent
            stored_at = self._clock()
            await self._replace_topic()
            new_log = True
            consumer.log_recreated()
            self.stats.compactions += 1
            self.stats.records_dropped += dropped
            if self._after_compaction is not None:
                try:
                    await self._after_compaction()
                except Exception:  # the compaction itself is done: only logged
                    log.exception("after emptying the kafka topic")
            now = self._clock()
            log.info(
                "embedded kafka topic emptied: its %d records (%d batches at most) were "
                "all stored (publishers held %.0f ms: %.0f until everything was stored, "
                "%.0f replacing the topic)",
                dropped,
                batches,
                (now - held_at) * 1000,
                (stored_at - held_at) * 1000,
                (now - stored_at) * 1000,
            )
            return True
        finally:
            self.stats.held_seconds += self._clock() - held_at
            path.release(new_log)
