"""The durable persistent path, assembled: Kafka producer, consumer, Redis store.

:class:`DevicePersistence` is the :class:`broker.persistent_path.PersistentPath`
of a running broker: it builds the parts and runs them; what the consumer stores
reaches the live feeds through :class:`~persistence.feed_bridge.FeedBridge`.
:func:`open_persistence` connects it to the configured Redis and Kafka, or to
embedded ones started under the data dir when neither is configured, and
:meth:`DevicePersistence.close` drains it: everything acknowledged to a
publisher is in Redis before it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from aiokafka.errors import KafkaError

from broker.config import ConfigError, Settings
from broker.ecq import QueueAddressee, consumer_filter
from broker.group_queue import GroupTarget
from broker.outflow import Outgoing
from persistence import kafka_security
from persistence.application_feed import ApplicationFeed, ApplicationSessions
from persistence.coalescing import Retry
from persistence.compaction import KafkaCompactor
from persistence.consumer import LogResets, PersistenceConsumer, make_consumer, stop_consumer
from persistence.events import NO_EVENTS, EventLog, EventSink, end_kind, open_event_log
from persistence.feed_bridge import FeedBridge
from persistence.group_feed import GroupFeed, GroupQueues
from persistence.kafka_path import (
    KafkaPersistentPath,
    TopicProbe,
    ensure_topic,
    lost_by_tansu,
    make_producer,
    replace_topic,
)
from persistence.kafka_security import PLAINTEXT, KafkaSecurity
from persistence.queue_feed import QueueAcks, QueueFeed
from persistence.queue_store import QueueStore
from persistence.redis_security import (
    Sentinels,
    connect_options,
    explain,
    for_embedded,
    sentinels,
)
from persistence.redis_store import RedisMessageStore
from persistence.session_rewind import RewindUnderWay, Rewound, rewind_session
from persistence.session_store import SessionStateStore
from persistence.store_feed import StoreFeed, StoreWriter

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer

    from broker.core import Broker
    from broker.message import Delivery
    from broker.persistent_path import (
        DoneCallback,
        OpenedCallback,
        OpenedSession,
        OpenRequest,
    )
    from broker.session import Session
    from broker.stats import BrokerStats
    from broker.topics import SubscriptionTree
    from persistence.producers import RecordProducer

log = logging.getLogger("devicemq.persistence")


def _nothing() -> None:
    """No wait to forget."""


FULL_LOOK = 1.0  # seconds a look at whether an $ECQ queue is full holds
FULL_VIEW_MOST = 10_000  # queues whose look at being full is remembered
DRAIN_TIMEOUT = 30.0  # seconds the consumer gets to store what was acknowledged
# Seconds a session taken over from another replica waits for it to say it kept the
# group writes it had in flight (ClusterState.await_kept), before reading anyway.
KEPT_WAIT = 5.0


class PersistenceUnavailable(Exception):
    """Redis or Kafka could not be reached at start-up (one readable line)."""


class DevicePersistence:
    def __init__(
        self,
        settings: Settings,
        store: RedisMessageStore,
        producer: RecordProducer,
        consumer: AIOKafkaConsumer,
        epoch: int = 0,
        clock: Callable[[], float] = time.monotonic,
        producer_id: int = 0,
        bootstrap: str = "",
        compact_after: int = 0,
        produce_latency: Callable[[float], None] | None = None,
        security: KafkaSecurity = PLAINTEXT,
    ) -> None:
        """``compact_after`` > 0: the topic is emptied after that many records, once
        all are stored (only for an embedded Kafka of a single broker);
        ``produce_latency`` hears the seconds each round of records took Kafka;
        ``security``: how every client of its own reaches Kafka (TLS, SASL)."""
        config = settings.persistence
        self.settings = settings
        self.store = store
        self._producer = producer
        self._kafka_consumer = consumer
        self._clock = clock
        self._bootstrap = bootstrap
        self.kafka_security = security  # /ready explains a failure with it (app/metrics.py)
        self.event_log: EventLog | None = None  # delivery events for the pipeline, None: off
        self.events: EventSink = NO_EVENTS
        self.resets = LogResets(store.redis, config.topic)
        # A single broker holds every producer of the topic: it can keep a topic
        # that Kafka lost (persistence/compaction.py); replicas cannot hold the others.
        self._probe: TopicProbe | None = None
        if bootstrap and not settings.cluster.enabled:
            self._probe = TopicProbe(bootstrap, config.topic, security, config.partitions)
        self.path = KafkaPersistentPath(
            producer,
            config.topic,
            clock,
            timeout=config.kafka_request_timeout_ms / 1000,
            producer_id=producer_id,
            on_log_reset=self.resets.announce,
            # A single broker's path waits for the compactor's restore (it holds every
            # producer); replicas create the topic at once (they cannot hold the others).
            recreate_topic=(
                self._restore_topic
                if bootstrap and not settings.cluster.enabled
                else lambda: ensure_topic(
                    bootstrap, config.topic, config.partitions, security=security
                )
            ),
            latency_observer=produce_latency,
            probe=self._probe,
        )
        self.writer = StoreWriter(store)
        self.sessions = SessionStateStore(store)
        # Exclusive compacted queues ($ECQ, broker/ecq.py) and group queues ($queue,
        # broker/group_queue.py) share one store: the consumer saves both.
        groups = settings.group_queues
        queue_store = None
        if settings.ecq.enabled or groups.enabled:
            queue_store = QueueStore(
                store,
                retention=settings.ecq.retention,
                max_keys=settings.ecq.max_keys,
                group_retention=groups.retention,
                group_max=groups.max_messages,
                max_bytes=settings.ecq.max_bytes,
                max_queues=settings.ecq.max_queues,
                group_max_bytes=groups.max_bytes,
            )
        # None: ecq.enabled false
        self.queues: QueueStore | None = queue_store if settings.ecq.enabled else None
        self.queue_acks = QueueAcks(self.queues) if self.queues is not None else None
        self.keeps_queues = self.queues is not None
        # What the consumer stores goes to the live feeds this path made (the bridge).
        self.feeds = FeedBridge()
        # None: group_queues.enabled false
        self.groups: GroupQueues | None = None
        if groups.enabled and queue_store is not None:
            self.groups = GroupQueues(queue_store, groups.lease, self.feeds.announce_group)
        self.feeds.groups = self.groups
        self.keeps_groups = self.groups is not None
        # $ECQ queues seen at their byte limit: queue -> (full, when last looked, monotonic)
        self._full: dict[str, tuple[bool, float]] = {}
        self._sweeper: asyncio.Task[None] | None = None  # unused group stores expire
        self._rewinding: set[str] = set()  # client IDs whose session rewind is under way
        self._background: set[asyncio.Task[None]] = set()  # fire-and-forget writes
        self.consumer = PersistenceConsumer(
            consumer,
            config.topic,
            store,
            self.feeds.stored,
            config.consumer_max_records,
            epoch,
            self.feeds.room_for,
            self.resets,
            queues=queue_store,
            on_queue_stored=self.feeds.queue_stored,
            on_queue_refused=self._queue_refused,
            watch=self._probe,
        )
        # Per process: in a cluster each replica counts its own partitions only.
        self.path.push_back(self.consumer.unstored, config.max_unstored_records)
        # The broker's, once attached: its counters (the feeds count), its subscriptions
        # (whether a group queue still has members).
        self._stats: BrokerStats | None = None
        self._subscriptions: SubscriptionTree | None = None
        self._sessions: dict[str, Session] = {}  # the broker's, once attached
        self.redis_url = ""  # where the store is (the cluster link's pub/sub uses it)
        self.redis_connect: dict[str, Any] = {}  # and how (persistence/redis_security.py)
        self.redis_sentinels: Sentinels | None = None  # who names the master, if any
        self._consumer_task: asyncio.Task[None] | None = None
        self.compactor: KafkaCompactor | None = None
        if compact_after > 0 or self._probe is not None:
            self.compactor = KafkaCompactor(
                self.path,
                self.consumer,
                config.partitions,
                lambda: replace_topic(
                    bootstrap, config.topic, config.partitions, security=security
                ),
                compact_after,
                hold_limit=0.8 * config.kafka_request_timeout_ms / 1000,
                batch_threshold=config.embedded_kafka_compact_after_batches,
                probe=self._probe,
                after_compaction=self._empty_events_if_full,
            )
        self._compactor_task: asyncio.Task[None] | None = None
        # APPLICATION sessions (persistence/application_feed.py); None: none configured.
        self.apps: ApplicationSessions | None = None
        if settings.application.client_ids:
            self.apps = ApplicationSessions(
                settings.application,
                store.redis,
                make_producer(
                    bootstrap,
                    config.kafka_request_timeout_ms,
                    config.producer_linger_ms,
                    config.kafka_client,
                    security=security,
                ),
                bootstrap,
                security,
                timeout=config.kafka_request_timeout_ms / 1000,
                clock=clock,
                producer_id=producer_id,
            )

    async def _empty_events_if_full(self) -> None:
        """The embedded Kafka keeps every record in memory, delivery events too (about
        6 KB a record at full load: 12 GB an hour at 6,000 msg/s, BENCHMARKS.md).
        Past ``events.embedded_max_bytes`` the events topic is emptied with the
        persisted one: its records are all gone then, and what the audit
        reconciles (the persisted topic's records of its current epoch) has all
        its events after this moment."""
        events, limit = self.event_log, self.settings.events.embedded_max_bytes
        if events is None or not limit or events.bytes_in_topic < limit:
            return
        held = events.bytes_in_topic
        topic, partitions = events.topic, self.settings.persistence.partitions
        await events.rotate(
            lambda: replace_topic(self._bootstrap, topic, partitions, security=self.kafka_security)
        )
        log.info("embedded kafka events topic %s emptied (%d bytes written to it)", topic, held)

    async def _restore_topic(self) -> None:
        """The path's log went back or its topic is gone: a Tansu's lost topic is
        restored (persistence/compaction.py), any other Kafka's is created."""
        assert self.compactor is not None  # made whenever the path waits for it
        if not await self.compactor.restore_when_lost():
            config = self.settings.persistence
            await ensure_topic(
                self._bootstrap, config.topic, config.partitions, security=self.kafka_security
            )

    def use_events(self, events: EventLog | None) -> None:
        """Report delivery events to ``events`` (before :meth:`attach`; None: off)."""
        self.event_log = events
        if events is not None:
            self.events = self.consumer.events = events
            events.epoch_of = lambda: self.consumer.epoch
            if self.groups is not None:
                self.groups.events = events

    @property
    def bootstrap(self) -> str:
        """The Kafka it uses (with :attr:`kafka_security`)."""
        return self._bootstrap

    @property
    def kafka_producer(self) -> RecordProducer:
        return self._producer

    @property
    def kafka_consumer(self) -> AIOKafkaConsumer:
        """The group member (assignment, highwater marks): read by app/metrics.py."""
        return self._kafka_consumer

    # -- PersistentPath -----------------------------------------------------------------

    def submit(
        self,
        deliveries: Sequence[tuple[Session | GroupTarget, Delivery]],
        on_accepted: DoneCallback,
        on_settled: DoneCallback | None = None,
    ) -> None:
        apps = self.apps
        if apps is None:
            self.path.submit(deliveries, on_accepted, on_settled)
            return
        mine: list[tuple[Session, Delivery]] = []
        others: list[tuple[Session | GroupTarget, Delivery]] = []
        for target, delivery in deliveries:
            # held here (its feed reads the topic) or by another replica, which said so
            if getattr(target, "application", False):
                mine.append((target, delivery))  # type: ignore[arg-type]
            else:
                others.append((target, delivery))
        if not mine:
            self.path.submit(others, on_accepted, on_settled)
        elif not others:
            apps.submit(mine, on_accepted, on_settled)
        else:
            join = _Join(2, on_accepted, on_settled)
            self.path.submit(others, join.accepted, join.settled)
            apps.submit(mine, join.accepted, join.settled)

    def feed_for(self, client_id: str) -> StoreFeed | ApplicationFeed:
        assert self._stats is not None
        if self.apps is not None and client_id in self.apps.kinds:
            return self.apps.feed(client_id)  # read from its topic: nothing to bridge
        feed = StoreFeed(
            client_id,
            self.store,
            self.writer,
            self.settings.persistence.replay_page_size,
            self._stats,
            self._clock,
            events=self.events,
            on_discard=self.feeds.session_ended,
        )
        self.feeds.session_feed(feed)
        return feed

    def open(self, client_id: str, request: OpenRequest, done: OpenedCallback) -> None:
        apps = self.apps
        if apps is None:
            self.sessions.open(client_id, request, done)
            return

        def opened(result: OpenedSession | None) -> None:
            if result is None or result.refused:
                done(result)
                return
            # Its kind (APPLICATION or DEVICE) and topic, before the session is made.
            apps.opening(
                client_id,
                request.username,
                result.resumed,
                lambda ok: done(result if ok else None),
            )

        self.sessions.open(client_id, request, opened)

    def enqueue(
        self,
        queue: str,
        delivery: Delivery,
        on_accepted: DoneCallback,
        on_settled: DoneCallback | None = None,
    ) -> bool:
        if self.queues is None:
            return False
        self.path.submit([(QueueAddressee(queue), delivery)], on_accepted, on_settled)
        return True

    def queue_full(self, queue: str) -> bool:
        """Is the queue full (ecq.max_bytes, ecq.max_queues)? What this process's consumer
        saw, or a read of the queue's mark at most :data:`FULL_LOOK` old (a replica's
        consumer refused a write there): a publish then hears 0x97 before Kafka."""
        if self.queues is None:
            return False
        now = time.monotonic()
        seen = self._full.get(queue)
        if seen is None or now - seen[1] >= FULL_LOOK:
            if len(self._full) >= FULL_VIEW_MOST:  # only full ones tell more than a save
                self._full = {q: v for q, v in self._full.items() if v[0]}
                if len(self._full) >= FULL_VIEW_MOST // 2:
                    self._full.clear()  # the saves refuse what does not fit meanwhile
            self._full[queue] = (seen[0] if seen else False, now)  # one read at a time
            self._spawn(self._look_full(queue))
        return seen is not None and seen[0]

    async def _look_full(self, queue: str) -> None:
        assert self.queues is not None
        try:
            full = await self.queues.is_full(queue)
        except Exception as error:  # Redis away: the save refuses what does not fit
            log.debug("reading whether queue %s is full failed: %s", queue, error)
            return
        self._full[queue] = (full, time.monotonic())

    def _queue_refused(self, queue: str) -> None:
        """This process's consumer refused a write to ``queue`` (byte limit, max_queues)."""
        self._full[queue] = (True, time.monotonic())

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def queue_feed(self, session: Session) -> QueueFeed | None:
        if self.queues is None or self.queue_acks is None:
            return None
        assert self._stats is not None

        def subscription_ids() -> tuple[int, ...]:
            entry = session.subscriptions.get(consumer_filter(session.client_id))
            return (entry.subscription_id,) if entry and entry.subscription_id else ()

        return QueueFeed(
            session.client_id,
            self.queues,
            self.queue_acks,
            self._stats,
            page_size=self.settings.persistence.replay_page_size,
            with_seq=True,  # a 3.1.1 PUBLISH carries no properties: the codec leaves it out
            clock=self._clock,
            events=self.events,
            subscription_ids=subscription_ids,
            # A persistent session's entries in flight are recorded under their ids.
            generation=session.generation if session.durable else None,
            on_live=self.feeds.queue_live,
        )

    def group_feed(self, session: Session, topic_filter: str) -> GroupFeed | None:
        """``session``'s share of the group queue ``topic_filter`` names; None: no group
        queues here."""
        if self.groups is None:
            return None
        assert self._stats is not None

        def subscription_ids() -> tuple[int, ...]:
            entry = session.subscriptions.get(topic_filter)
            return (entry.subscription_id,) if entry and entry.subscription_id else ()

        return GroupFeed(
            topic_filter,
            session.client_id,
            self.groups,
            self._stats,
            clock=self._clock,
            events=self.events,
            subscription_ids=subscription_ids,
            # A persistent session keeps its group writes in flight as it leaves.
            generation=session.generation if session.durable else None,
        )

    def restore_group_writes(self, session: Session, taken_from: str | None = None) -> None:
        if self.groups is None or not session.durable:
            return
        session.outflow.restoring_groups = True  # no identifier is given meanwhile
        kept: asyncio.Event | None = None
        forget: Callable[[], None] = _nothing
        cluster = self.feeds.elsewhere
        if taken_from is not None and cluster is not None:
            # Asked now, before anything can answer: the notice may come at once.
            kept = asyncio.Event()
            forget = cluster.await_kept(
                session.client_id, session.connected_at, taken_from, kept.set
            )
        self._spawn(self._restore_group_writes(session, taken_from, kept, forget))

    async def _kept_by(self, node: str, kept: asyncio.Event, member: str) -> None:
        """Until ``node`` says it kept ``member``'s group writes, ``KEPT_WAIT`` at most
        (or until it is known gone: ClusterState.node_gone ends the wait)."""
        try:
            await asyncio.wait_for(kept.wait(), KEPT_WAIT)
        except TimeoutError:
            log.warning(
                "replica %s did not say within %g s that it kept the group writes in "
                "flight to %s: reading what Redis holds",
                node, KEPT_WAIT, member,
            )  # fmt: skip

    def after_keeps(self, client_id: str, then: Callable[[], None]) -> None:
        if self.groups is None:
            then()
            return
        self._spawn(self._after_keeps(self.groups, client_id, then))

    async def _after_keeps(
        self, groups: GroupQueues, client_id: str, then: Callable[[], None]
    ) -> None:
        await groups.keeps_landed(client_id)
        then()

    async def _restore_group_writes(
        self,
        session: Session,
        taken_from: str | None,
        kept: asyncio.Event | None,
        forget: Callable[[], None],
    ) -> None:
        groups, outflow, member = self.groups, session.outflow, session.client_id
        assert groups is not None
        try:
            if kept is not None and taken_from is not None:
                # The replica whose connection this took over keeps what it had in
                # flight as that connection leaves: read before it lands, an id the
                # client holds would be given again (finding 37).
                try:
                    await self._kept_by(taken_from, kept, member)
                finally:
                    forget()
            # What this process itself keeps of an earlier connection of the session
            # (taken over from here and back) lands first too.
            await groups.keeps_landed(member)
            if self._sessions.get(member) is not session:
                return  # ended, or taken over again meanwhile: not this session's to restore
            while True:
                try:
                    held = await groups.store.group_writes(member, session.generation)
                    break
                except Exception as error:  # Redis away: nothing goes out meanwhile
                    log.warning("reading the group writes held by %s failed: %s", member, error)
                    await groups.retry.wait()
        finally:
            outflow.restoring_groups = False
        feeds: dict[str, GroupFeed] = {}
        items: dict[str, list[Outgoing]] = {}
        records: dict[int, bytes] = {}
        for packet_id, (store_id, entry, packed) in sorted(held.items(), key=lambda h: h[1][1].seq):
            feed = feeds.get(store_id)
            if feed is None:
                # Its feed as a member, or (it left the group since) one that only
                # completes these: whoever acknowledges first removes the entry.
                joined = outflow.groups.get(store_id)
                feed = (
                    joined if isinstance(joined, GroupFeed) else self.group_feed(session, store_id)
                )
                assert feed is not None
                feeds[store_id] = feed
            item = Outgoing(packet_id, feed.delivery_of(entry), sent=True, marked=True, ref=entry)
            items.setdefault(store_id, []).append(item)
            records[packet_id] = packed
        for store_id, restored in items.items():
            for item in outflow.restore_side(feeds[store_id], restored):
                groups.kept_again(member, {item.packet_id: records[item.packet_id]})
        if held:
            log.info("%s: %d group write(s) held before back in flight", member, len(held))
        for group in list(outflow.groups.values()):
            if isinstance(group, GroupFeed):
                group.poke()  # claims waited for these
        outflow.pump()

    def rewind_queue(self, client_id: str, from_seq: int) -> None:
        if self.queues is not None:
            asyncio.get_running_loop().create_task(self._rewind_quietly(client_id, from_seq))

    async def rewind_queue_now(self, client_id: str, from_seq: int) -> int:
        """Make the queue's kept entries from ``from_seq`` on pending again and have
        them delivered; returns how many were not pending already."""
        assert self.queues is not None
        count = await self.queues.rewind(client_id, from_seq)
        log.info("queue of %s rewound to seq %d: %d entries again", client_id, from_seq, count)
        self.feeds.queue_stored(client_id, [])  # the consumer re-reads, here or on its replica
        return count

    async def rewind_session(self, client_id: str, since: float) -> Rewound:
        """Store again, for its session, the client's messages published since
        ``since`` that the persisted topic still holds (persistence/session_rewind.py),
        and have them delivered (DUP set). One rewind of a client at a time
        (:class:`RewindUnderWay` otherwise)."""
        if client_id in self._rewinding:
            raise RewindUnderWay(client_id)
        self._rewinding.add(client_id)
        try:
            rewound = await rewind_session(
                self.store,
                self._bootstrap,
                self.settings.persistence.topic,
                client_id,
                since,
                self.kafka_security,
            )
        finally:
            self._rewinding.discard(client_id)
        log.info(
            "session of %s rewound to %.3f: %d of %d records again (%d read)",
            client_id,
            since,
            rewound.stored,
            rewound.matched,
            rewound.read,
        )
        self.feeds.stored(client_id, list)  # its feed re-reads, here or on its replica
        return rewound

    async def _rewind_quietly(self, client_id: str, from_seq: int) -> None:
        try:
            await self.rewind_queue_now(client_id, from_seq)
        except Exception as error:  # the consumer may ask again; nothing was lost
            log.warning("rewinding the queue of %s failed: %s", client_id, error)

    def save_session(self, session: Session, on_saved: DoneCallback) -> None:
        self.events.session(
            session.client_id, "disconnected" if session.connection is None else "connected"
        )
        self.sessions.save(session, on_saved)

    def session_ended(
        self, session: Session, on_ended: DoneCallback | None = None, expired: bool = False
    ) -> None:
        client_id, generation, kind = (
            session.client_id,
            session.generation,
            end_kind(session, self._clock()),
        )
        durable = session.durable

        def gone() -> None:
            self.events.session(client_id, kind)
            if self.apps is not None:
                self.apps.ended(client_id, generation)  # its topic goes
            if self.groups is not None and durable:
                self.groups.session_ended(client_id, generation)
            if self.queues is not None and durable:
                task = asyncio.get_running_loop().create_task(
                    self._forget_inflight(client_id, generation)
                )
                self._background.add(task)
                task.add_done_callback(self._background.discard)

        if expired:
            # What goes with the session goes once the store ended it: a client that
            # resumed it on another replica meanwhile keeps it (finding 40), and its
            # APPLICATION topic, group records and queue entries with it.
            self.sessions.end(client_id, generation, on_ended, session.opens, gone)
        else:
            self.sessions.end(client_id, generation, on_ended)
            gone()

    async def _forget_inflight(self, client_id: str, generation: int) -> None:
        """Its queue entries in flight are no session's any more (a later session of
        the client ID drops the record too, by its generation: this only frees it)."""
        assert self.queues is not None
        try:
            await self.queues.forget_inflight(client_id, generation)
        except Exception as error:  # the next session of the client drops it anyway
            log.info("forgetting the queue entries in flight to %s failed: %s", client_id, error)

    def problem(self) -> str | None:
        """Why the persistent path cannot keep its promise right now (not ready), or None."""
        if self._consumer_task is not None and self._consumer_task.done():
            return "persistence consumer stopped"
        return self.consumer.failure

    # -- lifecycle ------------------------------------------------------------------------

    def retries(self) -> list[Retry]:
        """Every background write's retry counts (persistence/coalescing.py)."""
        consumer = self.consumer
        return [
            consumer.store_retry,
            consumer.commit_retry,
            self.resets.retry,
            self.writer.retry,
            self.writer.replay_retry,
            self.sessions.retry,
            self.sessions.open_retry,
            self.path.recreate_retry,
            *([self.queue_acks.retry] if self.queue_acks is not None else []),
            *([self.groups.retry] if self.groups is not None else []),
        ]

    async def attach(self, broker: Broker, consume: bool = True) -> None:
        """Restore saved sessions into ``broker``, then start consuming (``consume``
        False: :meth:`start_consuming` later, once the cluster link knows which
        restored sessions are connected to other replicas)."""
        self._stats = broker.stats
        self._subscriptions = broker.subscriptions
        self._sessions = broker.sessions
        self.feeds.attach(broker.cluster)
        if self._probe is not None:
            # Learn now whether this Kafka forgets topics (the path's vouching,
            # persistence/kafka_path.py); Kafka away: the compactor asks every second.
            with contextlib.suppress(Exception):
                await self._probe.partitions()
        if self.apps is not None:
            await self.apps.load()  # before the sessions: their feeds are made with them
        restored = await self.sessions.restore(broker)
        log.info("restored %d persistent sessions from redis", restored)
        if self.apps is not None:
            await self.apps.forget_unrestored(broker.sessions)
        if consume:
            self.start_consuming()

    def start_consuming(self) -> None:
        """Store what Kafka holds: a stored message finds its session here, or its
        replica is told (``cluster.stored_elsewhere``), so the cluster comes first."""
        assert self._stats is not None, "attach first"
        if self._consumer_task is None:
            self._consumer_task = asyncio.create_task(self.consumer.run())
            if self.event_log is not None:
                self.event_log.start()
            if self.compactor is not None:
                self._compactor_task = asyncio.create_task(self.compactor.run())
            expiry = self.settings.group_queues.unused_expiry
            if self.groups is not None and expiry > 0:
                self._sweeper = asyncio.create_task(self._sweep_groups(expiry))

    async def _sweep_groups(self, expiry: float) -> None:
        """Group stores whose group has had no members for group_queues.unused_expiry
        are deleted (persistence/group_feed.py GroupQueues.sweep)."""
        assert self.groups is not None and self._subscriptions is not None
        tree = self._subscriptions
        while True:
            await asyncio.sleep(min(60.0, expiry / 4))
            try:
                await self.groups.sweep(tree.has_group, expiry)
            except Exception as error:  # Redis away: the next round looks again
                log.warning("looking for unused group queues failed: %s", error)

    async def close(self) -> None:
        """Drain: Kafka acknowledgements, then the consumer up to them, then writes."""
        if self._sweeper is not None:
            await _cancel(self._sweeper)
        if self._compactor_task is not None:
            await _cancel(self._compactor_task)  # a compaction under way releases its hold
        await self.path.drain()
        if self.apps is not None:
            await self.apps.close()
        await self._wait_consumed()
        if self._consumer_task is not None:
            await _cancel(self._consumer_task)
        await self.consumer.commits_done()
        await self.writer.flush()
        if self.queue_acks is not None:
            await self.queue_acks.flush()
        if self.groups is not None:
            await self.groups.flush()
            await self.groups.close()
        await self.sessions.flush()
        if self.event_log is not None:
            await self.event_log.close()
        await stop_consumer(self._kafka_consumer)
        with contextlib.suppress(KafkaError):
            await self._producer.stop()
        if self._probe is not None:
            with contextlib.suppress(KafkaError):
                await self._probe.close()
        await self.store.aclose()

    async def _wait_consumed(self) -> None:
        """Wait until this broker's consumer stored what this broker had acknowledged,
        in the partitions it holds. With replicas, what went to a partition another
        replica holds is that replica's to store: it is in Kafka, and waiting for
        this consumer to commit it would only wait out DRAIN_TIMEOUT (issue 16)."""
        deadline = time.monotonic() + DRAIN_TIMEOUT

        async def waiting() -> bool:  # the assignment as it is now: a rebalance may change it
            produced = self.path.produced
            for tp in self._kafka_consumer.assignment():
                if tp.partition in produced:
                    committed = await self.consumer.committed_offset(tp)
                    if committed is None or committed <= produced[tp.partition]:
                        return True
            return False

        while True:
            # Bounded by the deadline whatever Kafka does (asyncio.wait does not wait
            # for a cancelled call to end, as wait_for would).
            check = asyncio.ensure_future(waiting())
            done, _ = await asyncio.wait({check}, timeout=max(0.0, deadline - time.monotonic()))
            if done and not check.result():
                return
            if not done:
                check.cancel()
            if time.monotonic() > deadline:
                log.error("shutdown: consumer did not store everything acknowledged in time")
                return
            await asyncio.sleep(0.05)


class _Join:
    """One PUBLISH's deliveries made durable by two paths (the device path, the
    APPLICATION sessions'): accepted when both are; settled when both are."""

    def __init__(
        self, parts: int, on_accepted: DoneCallback, on_settled: DoneCallback | None
    ) -> None:
        self._accepts = parts
        self._settles = 0  # parts that failed and have yet to settle
        self._ok = True
        self._settled_ok = True
        self._on_accepted = on_accepted
        self._on_settled = on_settled

    def accepted(self, ok: bool) -> None:
        if not ok:
            self._ok = False
            self._settles += 1
        self._accepts -= 1
        if self._accepts == 0:
            self._on_accepted(self._ok)
            self._maybe_settled()

    def settled(self, ok: bool) -> None:
        self._settled_ok = self._settled_ok and ok
        self._settles -= 1
        self._maybe_settled()

    def _maybe_settled(self) -> None:
        if self._accepts or self._settles or self._ok or self._on_settled is None:
            return
        settled, self._on_settled = self._on_settled, None
        settled(self._settled_ok)


def _without_password(url: str) -> str:
    """``url`` fit for a log line: a password in it is left out."""
    scheme, sep, rest = url.partition("://")
    rest, question, query = rest.partition("?")
    if question:
        rest += "?" + "&".join(
            "password=***" if p.lower().startswith("password=") else p for p in query.split("&")
        )
    credentials, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in credentials:
        return f"{scheme}{sep}{rest}"
    return f"{scheme}://{credentials.split(':', 1)[0]}:***@{host}"


def configured_endpoints(settings: Settings) -> tuple[str, str] | None:
    """(redis_url, kafka_bootstrap) as configured; None when neither is (embedded ones)."""
    config = settings.persistence
    redis_url, bootstrap = config.redis_url, config.kafka_bootstrap
    if bool(redis_url) != bool(bootstrap):
        missing = "kafka_bootstrap" if redis_url else "redis_url"
        raise ConfigError(
            "set both redis_url and kafka_bootstrap, or neither", name=f"persistence.{missing}"
        )
    return (redis_url, bootstrap) if redis_url else None


async def open_persistence(
    settings: Settings,
    endpoints: tuple[str, str] | None = None,
    compact_after: int = 0,
    produce_latency: Callable[[float], None] | None = None,
) -> DevicePersistence:
    """Connect to Redis and Kafka: ``endpoints`` (redis_url, kafka_bootstrap), else the
    configured ones. Starting embedded services when none are configured is the
    application's part (app/serve.py): persistence does not import the edge; so are
    ``compact_after`` and ``produce_latency`` (see :class:`DevicePersistence`)."""
    config = settings.persistence
    if endpoints is None:
        endpoints = configured_endpoints(settings)
        if endpoints is None:
            raise ConfigError(
                "set both redis_url and kafka_bootstrap, or start embedded services",
                name="persistence.redis_url",
            )
    redis_url, bootstrap = endpoints
    # TLS, SASL (ConfigError if wrong); the embedded Kafka is plaintext on loopback.
    security = (
        kafka_security.from_settings(config)
        if config.kafka_bootstrap
        else kafka_security.for_embedded(config)
    )
    found_by: Sentinels | None = None
    if config.redis_url:
        connect = connect_options(config, redis_url)  # TLS, ACL user (ConfigError if wrong)
        found_by = sentinels(config, redis_url)
    else:
        for_embedded(config)  # the embedded Redis: no TLS, no users, no Sentinels
        connect = {}
    store = RedisMessageStore.from_url(
        redis_url,
        cluster=config.redis_cluster,
        connect=connect,
        sentinels=found_by,
        limit=config.max_messages_per_client,
        max_bytes=config.max_bytes_per_client,
        default_ttl=config.default_message_ttl,
        wait=config.redis_wait,
        wait_replicas=config.redis_wait_replicas,
        wait_timeout_ms=config.redis_wait_timeout_ms,
    )
    try:
        await store.load_scripts()
    except Exception as error:
        await store.aclose()
        raise PersistenceUnavailable(
            f"cannot use redis at {_without_password(redis_url)}: {explain(error, connect)}"
        ) from error
    # What this Redis must do, each told as its setting's one-line error.
    checks = (
        (store.check_version, "persistence.redis_url", f"{_without_password(redis_url)}:"),
        (store.check_wait, "persistence.redis_wait", f"redis_wait: {config.redis_wait}"),
    )
    for check, setting, told in checks:
        try:
            await check()
        except ValueError as error:
            await store.aclose()
            raise ConfigError(f"{told} {error}", name=setting) from None
    producer = make_producer(
        bootstrap,
        config.kafka_request_timeout_ms,
        config.producer_linger_ms,
        config.kafka_client,
        security=security,
    )
    consumer = make_consumer(bootstrap, config.consumer_group, security=security)
    try:
        producer_id = await store.next_producer_id()
        lost = False
        if (
            not settings.cluster.enabled
            and await store.topic_used(config.topic)
            and await lost_by_tansu(bootstrap, config.topic, security)
        ):
            # Kafka lost a topic devicemq used (a Tansu restarted empty). What a killed
            # predecessor sent to it since, Tansu keeps unlisted and unread; a topic
            # created over it would hand out those offsets again and drop the new
            # records (AlreadyExists): the old ones go with a replace (finding 17).
            lost = True
            log.warning(
                "kafka had lost topic %s: records it held and devicemq had not stored "
                "are gone; making it again",
                config.topic,
            )
            await replace_topic(bootstrap, config.topic, config.partitions, security=security)
        created = await ensure_topic(bootstrap, config.topic, config.partitions, security=security)
        epoch = await store.topic_epoch(config.topic, created or lost)
        # Subscribed (with its rebalance listener) before it starts: the group join
        # begins at once, the rest of the start-up runs meanwhile.
        persistence = DevicePersistence(
            settings,
            store,
            producer,
            consumer,
            epoch,
            producer_id=producer_id,
            bootstrap=bootstrap,
            compact_after=compact_after,
            produce_latency=produce_latency,
            security=security,
        )
        await consumer.start()
        await producer.start()
        persistence.use_events(await open_event_log(settings, bootstrap, epoch, security))
    except (KafkaError, OSError, KeyError, ValueError) as error:
        # KeyError, ValueError: aiokafka's SCRAM when Kafka refuses the login (it
        # reads an error reply as the server's signature); OSError: a TLS handshake.
        await store.aclose()
        with contextlib.suppress(KafkaError):
            await producer.stop()
        await stop_consumer(consumer)
        # aiokafka logs why it could not connect and raises "unable to bootstrap":
        # a refused login or a failed TLS handshake is named, with its settings.
        reason = await kafka_security.diagnose(bootstrap, security) or str(error)
        raise PersistenceUnavailable(f"cannot use kafka at {bootstrap}: {reason}") from error
    persistence.redis_url = redis_url
    persistence.redis_connect = connect
    persistence.redis_sentinels = found_by
    return persistence


async def _cancel(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and wait for it to end, cancelling it again while it runs
    on: a cancellation can be swallowed below our code (seen: the consumer task
    stayed "cancelling" in aiokafka's getmany for minutes, and close() with it,
    in tests/integration/test_device_persistence.py)."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
    if not task.cancelled() and task.exception() is not None:
        log.error("task %s ended with an error", task.get_name(), exc_info=task.exception())
