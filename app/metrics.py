"""Prometheus metrics, liveness and readiness over HTTP, inside the broker's event loop.

:class:`MetricsServer` is a small HTTP/1.1 server on ``asyncio.start_server``
(one request per connection, no thread, no framework) answering:

- ``GET /metrics``: every ``devicemq_*`` series in the Prometheus text format;
- ``GET /health``: 200 while the process runs (the Docker HEALTHCHECK);
- ``GET /ready``: 200 when MQTT is served and, with persistence enabled,
  Redis answers PING, Kafka answers a metadata request and the persistence
  consumer has partitions assigned; otherwise 503 with a one-line JSON reason.

Nothing here sits on the message path. :class:`BrokerCollector` reads the
counters the broker already keeps (:class:`broker.stats.BrokerStats`, the
consumer's ``ConsumerStats``, the Redis store's per-script histograms) when
Prometheus scrapes; histograms observed on hot paths are
:class:`broker.stats.Histogram` (a bisect and two additions, no lock). The
few values that need I/O (Redis backlog, committed offsets the consumer has
not committed itself yet) are refreshed asynchronously before a scrape, at
most every :data:`REFRESH_INTERVAL` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.resources
import logging
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError as RedisResponseError

from app.http import ConnectionGate
from app.loop_watch import GENERATIONS, LoopWatch
from broker import __version__
from broker.budget import BYTES_LIMIT, GROUP, QUEUE, QUEUES_LIMIT, SESSION
from broker.cluster import RemoteSession
from broker.stats import LATENCY_BUCKETS, Histogram
from persistence.format import client_keys
from persistence.kafka_security import diagnose
from persistence.redis_security import explain
from persistence.redis_store import lua_script

if TYPE_CHECKING:
    from broker.config import MetricsSettings
    from broker.core import Broker
    from persistence.coalescing import Retry
    from persistence.device_persistence import DevicePersistence
    from persistence.redis_store import RedisMessageStore

__all__ = ["BrokerCollector", "MetricsServer", "MetricsUnavailable"]

log = logging.getLogger("devicemq.metrics")

PREFIX = "devicemq"
REFRESH_INTERVAL = 5.0  # seconds a Redis backlog count / committed offset read is reused
PROBE_TIMEOUT = 2.0  # seconds a readiness probe or a refresh may take
MIN_DIAGNOSIS = 0.2  # s left of a Kafka probe worth a connection that explains its failure
REQUEST_TIMEOUT = 5.0  # seconds a client has to send its request head
MAX_REQUEST_HEAD = 16 * 1024
MAX_CONNECTIONS = 64  # at once (descriptors are the broker's); see app/http.py ConnectionGate
MAX_CONNECTIONS_PER_SOURCE = 8  # from one address (IPv6: one /64)
INFLIGHT_BUCKETS = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 1024.0, 65535.0)
BACKLOG_PIPELINE = 1000  # sessions per Redis round trip when counting the backlog
_BACKLOG = lua_script("backlog")


# The labels the failure counters have from the start, at 0 (issue 40): a series
# that appears with its first event is missed by rate() and increase(), and its
# panel reads "No data" on a healthy broker. Reasons not listed still count, from
# their first event. tests/deploy/test_metrics_server.py scans broker/ for the
# names counted and fails on one missing here.
KNOWN_REJECTIONS = (
    # every refusal a CONNACK can carry (MQTT 5 table 3-1; 3.1.1 clients get its
    # nearest code, counted under this name)
    "unspecified_error",
    "malformed_packet",
    "protocol_error",
    "implementation_specific_error",
    "unsupported_protocol_version",
    "client_identifier_not_valid",
    "bad_user_name_or_password",
    "not_authorized",
    "server_unavailable",
    "server_busy",
    "banned",
    "bad_authentication_method",
    "topic_name_invalid",
    "packet_too_large",
    "quota_exceeded",
    "payload_format_invalid",
    "retain_not_supported",
    "qos_not_supported",
    "use_another_server",
    "server_moved",
    "connection_rate_exceeded",
    # protocol errors that close a connection after CONNECT (broker/errors.py)
    "receive_maximum_exceeded",
    "topic_alias_invalid",
    "message_rate_too_high",
    "subscription_identifiers_not_supported",
    # closes counted by name (broker/connection.py, edge/server.py, broker/external_auth.py)
    "flood_before_connack",
    "connect_timeout",
    "inflight_timeout",
    "max_connections",
    "slow_consumer",
    "websocket_frame_rate",
    "websocket_protocol_error",
    "websocket_handshake",
    "origin",  # a WebSocket handshake from a web page not in websocket.allowed_origins
    "auth_rate_exceeded_per_source",
    "auth_service_busy",
    "auth_chain_failed",
    "auth_service_unavailable",
    "max_bytes_per_owner",  # a new persistent session of an owner over its budget
)
KNOWN_DROPS = (
    "queue_full",
    "ecq_full",
    "group_membership_quota",
    "owner_budget",  # a message for an owner over auth.max_bytes_per_owner, not stored
    "queue_bytes_full",
    "qos0_congested",
    "expired",
    "too_large_for_client",
    "not_authorized",
    "not_authorized_receive",
    "will_not_authorized",
    "subscribe_not_authorized",
    "subscription_quota",
    "subscribe_topic_limit",
    "topic_limit",
    "retained_limit",
    "retained_client_limit",
    "message_rate_too_high",
    "payload_format_invalid",
    "cluster_forward_no_session",
    "ecq_unavailable",
    "ecq_subscribe_refused",
    "ecq_topic",
    "ecq_rewind",
)


STORE_KINDS = (SESSION, QUEUE, GROUP)  # owner_limit_refusals' labels
OWNER_LIMITS = (BYTES_LIMIT, QUEUES_LIMIT)


@functools.cache
def redis_scripts() -> tuple[str, ...]:
    """The Lua scripts of persistence/lua/ by the name the store counts them under."""
    lua = importlib.resources.files("persistence").joinpath("lua")
    return tuple(
        sorted(
            f.name.removesuffix(".lua")
            for f in lua.iterdir()
            if f.name.endswith(".lua") and f.name != "lib.lua"
        )
    )


def _from_zero(known: Iterable[str], counts: dict[str, int]) -> list[tuple[tuple[str], int]]:
    """``counts`` with every ``known`` label at 0 when it has not happened yet."""
    merged = dict.fromkeys(known, 0)
    merged.update(counts)
    return [((label,), n) for label, n in sorted(merged.items())]


class MetricsUnavailable(Exception):
    """The metrics port cannot be bound (one readable line)."""


# --------------------------------------------------------------------------
# Building metric families
# --------------------------------------------------------------------------


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def _labelled(
    family: CounterMetricFamily | GaugeMetricFamily, rows: Iterable[tuple[Sequence[str], float]]
) -> CounterMetricFamily | GaugeMetricFamily:
    for labels, value in rows:
        family.add_metric(list(labels), value)
    return family


def _buckets(histogram: Histogram) -> tuple[list[tuple[str, float]], float]:
    """Cumulative (le, count) pairs ending with +Inf, and the total count."""
    out: list[tuple[str, float]] = []
    total = 0
    for bound, n in zip(histogram.buckets, histogram.counts, strict=False):
        total += n
        out.append((repr(float(bound)), total))
    total += histogram.counts[-1]
    out.append(("+Inf", total))
    return out, total


def _histogram(
    name: str,
    doc: str,
    rows: Iterable[tuple[Sequence[str], Histogram]],
    labels: Sequence[str] = (),
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(f"{PREFIX}_{name}", doc, labels=list(labels))
    for values, histogram in rows:
        buckets, _ = _buckets(histogram)
        family.add_metric(list(values), buckets, histogram.sum)
    return family


# --------------------------------------------------------------------------
# The collector
# --------------------------------------------------------------------------


class BrokerCollector(Collector):
    """Every ``devicemq_*`` series, read from the broker's own counters at scrape time."""

    def __init__(self, loop_watch: LoopWatch | None = None) -> None:
        self.loop_watch = loop_watch
        self.broker: Broker | None = None
        self.persistence: DevicePersistence | None = None
        self.retries: list[Retry] = []
        self.kafka_produce = Histogram(LATENCY_BUCKETS)
        # Refreshed by MetricsServer before a scrape (they need I/O).
        self.backlog: int | None = None
        self.backlog_client_max = 0  # the largest backlog of one of those sessions
        # partition -> committed offset read from Kafka (0: none yet) for partitions
        # this process has not committed itself
        self.committed: dict[int, int] = {}
        # client ID -> (messages after its committed offsets, age of the oldest, s) of
        # each APPLICATION session (persistence/application_feed.py)
        self.application_lag: dict[str, tuple[int, float | None]] = {}
        self._refreshed = 0.0
        self._refresh_lock = asyncio.Lock()
        # What /ready last answered (MetricsServer probes it before each scrape):
        # None when ready, else one of READINESS_CAUSES.
        self.unready_cause: str | None = "starting"

    def attach(
        self,
        broker: Broker,
        persistence: DevicePersistence | None,
        retries: Sequence[Retry] = (),
    ) -> None:
        self.broker = broker
        self.persistence = persistence
        self.retries = list(retries)

    def collect(self) -> Iterator[Metric]:
        yield from self._info()
        if self.loop_watch is not None:
            yield from self._loop(self.loop_watch)
        if self.broker is not None:
            yield from self._broker(self.broker)
        if self.persistence is not None:
            yield from self._persistence(self.persistence)
            yield from self._retries(self.retries)

    def _info(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            f"{PREFIX}_build_info", "devicemq version (value is always 1)", labels=["version"]
        )
        info.add_metric([__version__], 1)
        yield info
        yield _gauge(
            "serving", "1 once the MQTT listener serves, 0 while starting", self.broker is not None
        )
        yield from self._readiness()

    def _loop(self, watch: LoopWatch) -> Iterator[Metric]:
        yield _histogram(
            "event_loop_lag_seconds",
            f"How late a timer asked every {watch.interval:g} s fired: the wait every "
            "client's next step had (app/loop_watch.py)",
            [((), watch.lag)],
        )
        yield _histogram(
            "gc_pause_seconds",
            "Collections of Python's cyclic garbage collector, by generation, by how "
            "long each stopped the event loop",
            [((str(generation),), watch.gc_pauses[generation]) for generation in GENERATIONS],
            labels=["generation"],
        )

    def _readiness(self) -> Iterator[Metric]:
        """/ready as series: 1/0, and why not as a label (every cause has a series)."""
        cause = self.unready_cause
        yield _gauge("ready", "1 while /ready answers 200, 0 while it answers 503", cause is None)
        yield _labelled(
            GaugeMetricFamily(
                f"{PREFIX}_unready_reason",
                "1 for the reason /ready answers 503 (0 for the others, all 0 when ready)",
                labels=["reason"],
            ),
            (((name,), name == cause) for name in READINESS_CAUSES),
        )

    def _broker(self, broker: Broker) -> Iterator[Metric]:
        stats = broker.stats
        sink = broker.integration_sink  # with no rules: the families, with no series
        yield from self._integrations(sink.counts() if sink is not None else {})
        yield _gauge(
            "connections_current",
            "Open MQTT network connections (including those that have not sent CONNECT yet)",
            len(broker.connections),
        )
        yield _counter(
            "connections",
            "Accepted MQTT CONNECTs (sessions opened or resumed)",
            stats.connections_total,
        )
        yield _labelled(
            CounterMetricFamily(
                f"{PREFIX}_connections_rejected",
                "Connections refused or closed for a protocol error, by reason",
                labels=["reason"],
            ),
            _from_zero(KNOWN_REJECTIONS, stats.connections_rejected),
        )
        persistent = connected = inflight_total = inflight_max = 0
        inflight_hist = Histogram(INFLIGHT_BUCKETS)
        for session in broker.sessions.values():
            if session.expiry_interval > 0:
                persistent += 1
            if session.connection is None:
                continue
            connected += 1
            inflight = len(session.outflow.inflight)
            inflight_hist.observe(inflight)
            inflight_total += inflight
            inflight_max = max(inflight_max, inflight)
        yield _labelled(
            GaugeMetricFamily(
                f"{PREFIX}_sessions",
                "Sessions held by this broker, connected or not, by type",
                labels=["type"],
            ),
            [
                (("persistent",), persistent),
                (("non_persistent",), len(broker.sessions) - persistent),
            ],
        )
        yield _gauge("clients_connected", "Sessions with a client connected", connected)
        yield _gauge(
            "subscriptions",
            "Subscriptions (each shared group member counts)",
            len(broker.subscriptions),
        )
        yield _gauge("retained_messages", "Retained messages held", len(broker.retained))
        yield _gauge(
            "inflight_messages",
            "Outgoing QoS 1/2 messages awaiting an ack, all clients",
            inflight_total,
        )
        yield _gauge(
            "client_inflight_messages_max",
            "Largest outgoing in-flight count of one client",
            inflight_max,
        )
        buckets, _ = _buckets(inflight_hist)
        in_flight = GaugeHistogramMetricFamily(
            f"{PREFIX}_client_inflight_messages",
            "Connected clients by their outgoing QoS 1/2 messages in flight (now)",
        )
        in_flight.add_metric([], buckets, float(inflight_total))
        yield in_flight
        qos_rows = ("0", "1", "2")
        yield _labelled(
            CounterMetricFamily(
                f"{PREFIX}_messages_received", "PUBLISH packets received, by QoS", labels=["qos"]
            ),
            zip(((q,) for q in qos_rows), stats.messages_received, strict=True),
        )
        yield _labelled(
            CounterMetricFamily(
                f"{PREFIX}_messages_sent", "PUBLISH packets sent, by QoS", labels=["qos"]
            ),
            zip(((q,) for q in qos_rows), stats.messages_sent, strict=True),
        )
        yield _labelled(
            CounterMetricFamily(
                f"{PREFIX}_messages_received_bytes",
                "Payload bytes of PUBLISH received, by QoS",
                labels=["qos"],
            ),
            zip(((q,) for q in qos_rows), stats.payload_bytes_received, strict=True),
        )
        yield _labelled(
            CounterMetricFamily(
                f"{PREFIX}_messages_sent_bytes",
                "Payload bytes of PUBLISH sent, by QoS",
                labels=["qos"],
            ),
            zip(((q,) for q in qos_rows), stats.payload_bytes_sent, strict=True),
        )
        yield _counter(
            "network_received_bytes", "Bytes read from MQTT sockets", stats.bytes_received
        )
        yield _counter("network_sent_bytes", "Bytes queued to MQTT sockets", stats.bytes_sent)
        yield _counter(
            "flapping_blocks",
            "Client IDs blocked for connecting too often (flapping.*)",
            stats.flapping_blocks,
        )
        yield _counter(
            "input_pauses",
            "Times reading from a client stopped until the acknowledgements it is owed went out",
            stats.input_pauses,
        )
        yield _labelled(
            CounterMetricFamily(
                f"{PREFIX}_publish_dropped",
                "PUBLISH deliveries dropped, by reason",
                labels=["reason"],
            ),
            _from_zero(KNOWN_DROPS, stats.dropped),
        )
        yield from self._budget(broker)
        yield _histogram(
            "delivery_latency_seconds",
            "Persistent delivery: publisher's PUBLISH to the first send to the subscriber",
            [((), stats.delivery_latency)],
        )
        yield _counter(
            "persisted_messages_delivered",
            "Stored messages sent to subscribers (DUP re-sends included)",
            stats.persisted_delivered,
        )
        yield _counter(
            "persisted_messages_acked",
            "Stored messages removed by PUBACK or PUBCOMP",
            stats.persisted_acked,
        )
        yield _counter(
            "persisted_messages_undeliverable",
            "Stored messages dropped at send time: expired, or too large for the client",
            stats.persisted_undeliverable,
        )
        yield _histogram(
            "persisted_replay_page_messages",
            "Stored messages read per Redis page when a session catches up or replays",
            [((), stats.replay_pages)],
        )

    def _budget(self, broker: Broker) -> Iterator[Metric]:
        """The limits of one owner's stores together (broker/budget.py): no owner label
        (there may be millions of owners)."""
        budget = broker.budget
        known = [(store, limit) for store in STORE_KINDS for limit in OWNER_LIMITS]
        counts = dict.fromkeys(known, 0)
        counts.update(budget.refusals)
        yield _labelled(
            CounterMetricFamily(
                f"{PREFIX}_owner_limit_refusals",
                "New stores refused and messages not stored because their owner was at "
                "auth.max_bytes_per_owner or ecq.max_queues_per_owner, by store kind and limit",
                labels=["store", "limit"],
            ),
            sorted(counts.items()),
        )
        yield _gauge(
            "owners_over_budget",
            "Owners over auth.max_bytes_per_owner at the last tally",
            len(budget.over),
        )
        yield _gauge(
            "owner_tally_owners_read",
            "Owners whose stores the last tally of auth.max_bytes_per_owner read",
            budget.read,
        )
        yield _gauge(
            "owner_tally_seconds",
            "How long the last tally of auth.max_bytes_per_owner took",
            budget.seconds,
        )

    def _integrations(self, counts: dict[str, tuple[int, int]]) -> Iterator[Metric]:
        """The audit count per integration rule (docs/integrations.md)."""
        for index, what, doc in (
            (0, "produced", "Records an integration rule produced (Kafka acknowledged them)"),
            (1, "failed", "Records of an integration rule Kafka refused or never got"),
        ):
            yield _labelled(
                CounterMetricFamily(f"{PREFIX}_integration_records_{what}", doc, labels=["rule"]),
                (((rule,), pair[index]) for rule, pair in counts.items()),
            )

    def _retries(self, retries: list[Retry]) -> Iterator[Metric]:
        yield _labelled(
            CounterMetricFamily(
                f"{PREFIX}_write_retries",
                "Background writes to Redis or Kafka tried again after a failure, per writer",
                labels=["writer"],
            ),
            [((r.name,), r.retries) for r in retries],
        )
        yield _labelled(
            CounterMetricFamily(
                f"{PREFIX}_writes_given_up",
                "What a background writer gave up: writes abandoned after their last "
                "try, or queued items dropped over its bound, per writer",
                labels=["writer"],
            ),
            [((r.name,), r.given_up) for r in retries],
        )

    def _persistence(self, persistence: DevicePersistence) -> Iterator[Metric]:
        consumer = persistence.consumer.stats
        yield _counter(
            "persisted_messages_stored",
            "Messages stored in Redis by the consumer",
            consumer.messages_stored,
        )
        yield _counter(
            "persisted_messages_trimmed",
            "Oldest stored messages removed because a client was over its limit",
            consumer.messages_trimmed,
        )
        yield _counter(
            "persisted_messages_expired",
            "Messages whose expiry passed before the consumer could store them",
            consumer.expired_on_arrival,
        )
        yield _counter(
            "persisted_messages_duplicate",
            "Kafka records the store skipped as already stored (read again, produced twice)",
            consumer.duplicates_skipped,
        )
        yield _counter(
            "persisted_messages_discarded",
            "Kafka records of a session that had ended when they arrived (not stored)",
            consumer.discarded_ended_session,
        )
        yield _counter(
            "queue_writes_refused",
            "$ECQ writes the consumer did not store: the queue was at ecq.max_bytes, or "
            "one more queue would pass ecq.max_queues "
            "(publishes refused before Kafka count in publish_dropped, reason ecq_full)",
            consumer.queue_refused,
        )
        yield _counter(
            "queue_entries_trimmed",
            "Unacknowledged $ECQ and group queue entries removed by a limit "
            "(ecq.max_keys, group_queues.max_messages, group_queues.max_bytes)",
            consumer.queue_trimmed,
        )
        if persistence.groups is not None:
            yield _counter(
                "group_queues_expired",
                "Group queue stores deleted after group_queues.unused_expiry without members",
                persistence.groups.expired,
            )
        yield _counter(
            "kafka_malformed_records",
            "Records of the persisted topic that are not devicemq's format (skipped)",
            consumer.malformed_records,
        )
        yield _counter(
            "persistence_consumer_failures",
            "Unexpected errors of the persistence consumer (it read the batch again)",
            consumer.failures,
        )
        yield _counter(
            "redis_wait_failures",
            "Offset commits held back: persistence.redis_wait not met within its timeout",
            persistence.store.wait_failures,
        )
        yield _counter(
            "redis_lost_writes",
            "Times Redis no longer had saves it had acknowledged (persistence.redis_wait "
            "found it; the partitions were read again from their committed offsets)",
            persistence.store.lost_writes,
        )
        yield _counter(
            "kafka_log_resets",
            "Partitions re-read from their start after their log went backwards",
            consumer.log_resets,
        )
        yield _counter(
            "kafka_offset_holes",
            "Fetches that skipped an offset of a partition (a batch not yet visible): "
            "read again from the hole",
            consumer.offset_holes,
        )
        yield _counter(
            "kafka_offset_holes_passed",
            "Offset holes still there after 5 s, passed (a Kafka whose log has gaps)",
            consumer.offset_holes_passed,
        )
        yield _counter(
            "kafka_fetches_held",
            "Fetches at a position carried across a broken connection to Kafka, put back "
            "until the topic is vouched for or read from its start",
            consumer.fetches_held,
        )
        yield _counter(
            "kafka_stuck_joins",
            "Consumer group joins given up after 15 s and started again as a new member",
            consumer.stuck_joins,
        )
        # Always exported (0 without the embedded Kafka's compaction): one set of names.
        from persistence.compaction import CompactionStats

        compactor = persistence.compactor
        compaction = compactor.stats if compactor is not None else CompactionStats()
        yield _counter(
            "kafka_compactions",
            "Times the embedded Kafka's topic was emptied once everything in it was stored",
            compaction.compactions,
        )
        yield _counter(
            "kafka_compactions_deferred",
            "Compactions put off: the consumer had not stored everything within the hold",
            compaction.deferred,
        )
        yield _counter(
            "kafka_topics_restored",
            "Topics Kafka had lost under the broker (restarted empty, deleted), created again",
            compaction.topics_restored,
        )
        yield _counter(
            "kafka_topic_restores_incomplete",
            "Of those: created before every record Kafka had acknowledged was read back",
            compaction.restores_incomplete,
        )
        yield _counter(
            "kafka_compaction_hold_seconds",
            "Time publishers waited while the embedded Kafka's topic was emptied or restored",
            compaction.held_seconds,
        )
        if self.backlog is not None:
            yield _gauge(
                "persisted_backlog_messages",
                "Messages stored in Redis for the persistent sessions this broker holds",
                self.backlog,
            )
            yield _gauge(
                "persisted_backlog_client_max_messages",
                "The most messages stored in Redis for one of those sessions",
                self.backlog_client_max,
            )
        yield _gauge(
            "persisted_backlog_limit_messages",
            "Messages kept per client (persistence.max_messages_per_client): over it "
            "the oldest are trimmed",
            persistence.store.limit,
        )
        yield _histogram(
            "kafka_produce_duration_seconds",
            "One produce batch: first send to Kafka acknowledging all of it (acks=all)",
            [((), self.kafka_produce)],
        )
        yield _counter(
            "kafka_push_back_holds",
            "Produce batches held because the consumer had persistence.max_unstored_records "
            "or more records to store",
            persistence.path.backpressure_holds,
        )
        yield _counter(
            "kafka_push_back_seconds",
            "Time produce batches were held that way (publishers' PUBACKs wait meanwhile)",
            persistence.path.backpressure_seconds,
        )
        yield _counter(
            "kafka_produce_errors",
            "Submissions Kafka failed to acknowledge",
            persistence.path.produce_errors,
        )
        yield _counter(
            "kafka_records_consumed",
            "Records read by the persistence consumer",
            consumer.records_consumed,
        )
        yield _counter(
            "kafka_commit_errors",
            "Offset commits that failed (lost assignment)",
            consumer.commit_errors,
        )
        yield _counter(
            "redis_save_errors",
            "Consumer batch saves Redis refused (retried until stored)",
            consumer.save_errors,
        )
        yield _counter(
            "redis_write_errors",
            "Delivery-progress writes to Redis that failed",
            persistence.writer.errors,
        )
        yield _gauge(
            "kafka_consumer_assigned_partitions",
            "Partitions assigned to this broker's consumer",
            len(persistence.kafka_consumer.assignment()),
        )
        yield _labelled(
            GaugeMetricFamily(
                f"{PREFIX}_kafka_consumer_lag_records",
                "Records of an assigned partition not yet stored: highwater - committed offset",
                labels=["partition"],
            ),
            (((str(partition),), n) for partition, n in self.consumer_lag(persistence).items()),
        )
        if persistence.apps is not None:
            yield from self._applications(persistence)
        store = persistence.store
        yield _histogram(
            "redis_script_duration_seconds",
            "One Redis Lua script call (a client batch, an ack, a page), by script",
            [((name,), h) for name, h in sorted(store.script_latency.items())],
            labels=["script"],
        )
        yield _labelled(
            CounterMetricFamily(
                f"{PREFIX}_redis_script_errors",
                "Failed Redis script calls, by script",
                labels=["script"],
            ),
            _from_zero(redis_scripts(), store.script_errors),
        )

    def _applications(self, persistence: DevicePersistence) -> Iterator[Metric]:
        apps = persistence.apps
        assert apps is not None
        held = apps.kinds if self.broker is None else held_applications(self.broker, apps.kinds)
        yield _gauge("application_sessions", "APPLICATION sessions held", len(held))
        yield _counter(
            "application_records_produced",
            "Records produced to APPLICATION sessions' topics (acknowledged by Kafka)",
            apps.produced,
        )
        yield _counter(
            "application_log_resets",
            "Partitions of APPLICATION sessions' topics found gone back (Kafka lost them): "
            "read again from their start",
            apps.log_resets,
        )
        lags = sorted(self.application_lag.items())
        yield _labelled(
            GaugeMetricFamily(
                f"{PREFIX}_application_lag_messages",
                "Messages of an APPLICATION session's topic after its committed offsets",
                labels=["client_id"],
            ),
            (((cid,), lag[0]) for cid, lag in lags),
        )
        yield _labelled(
            GaugeMetricFamily(
                f"{PREFIX}_application_lag_seconds",
                "Age of the oldest message after an APPLICATION session's committed offsets",
                labels=["client_id"],
            ),
            (((cid,), lag[1]) for cid, lag in lags if lag[1] is not None),
        )

    def consumer_lag(self, persistence: DevicePersistence) -> dict[int, int]:
        """partition -> records not yet stored (highwater - committed offset), for the
        assigned partitions whose both offsets are known; /metrics and $SYS report it."""
        kafka = persistence.kafka_consumer
        committed = persistence.consumer.stats.committed
        lag: dict[int, int] = {}
        for tp in sorted(kafka.assignment(), key=lambda tp: tp.partition):
            highwater = kafka.highwater(tp)
            done = committed.get(tp.partition, self.committed.get(tp.partition))
            if highwater is not None and done is not None:
                lag[tp.partition] = max(0, highwater - done)
        return lag

    # -- values that need I/O ---------------------------------------------------------

    async def refresh_if_stale(self) -> None:
        """:meth:`refresh`, unless it ran within :data:`REFRESH_INTERVAL` (a scrape and
        the $SYS task share its counts), bounded by :data:`PROBE_TIMEOUT`; a failure
        keeps the last values."""
        async with self._refresh_lock:
            if time.monotonic() - self._refreshed < REFRESH_INTERVAL:
                return
            try:
                await asyncio.wait_for(self.refresh(), PROBE_TIMEOUT)
            except Exception as e:
                log.debug("metrics refresh failed: %s", _short(e))
            self._refreshed = time.monotonic()

    async def refresh(self) -> None:
        """Count the Redis backlog and read committed offsets the consumer lacks."""
        persistence, broker = self.persistence, self.broker
        if persistence is None or broker is None:
            return
        kafka = persistence.kafka_consumer
        known = persistence.consumer.stats.committed
        committed: dict[int, int] = {}
        for tp in kafka.assignment():
            if tp.partition not in known:
                # Read again at each refresh until the consumer's own commits take
                # over: the consumer forgets its offsets of a reset or re-assigned
                # log, and a value read before that would report a stale lag.
                offset = await kafka.committed(tp)
                committed[tp.partition] = 0 if offset is None else offset
        self.committed = committed
        durable = [cid for cid, s in broker.sessions.items() if s.durable]
        total = largest = 0
        for start in range(0, len(durable), BACKLOG_PIPELINE):
            chunk_total, chunk_largest = await count_backlog(
                persistence.store, durable[start : start + BACKLOG_PIPELINE]
            )
            total += chunk_total
            largest = max(largest, chunk_largest)
        self.backlog, self.backlog_client_max = total, largest
        apps = persistence.apps
        if apps is not None:
            # All at once: the refresh has PROBE_TIMEOUT, the Redis backlog is set already.
            ids = held_applications(broker, apps.kinds)
            found = await asyncio.gather(*(apps.lag(cid) for cid in ids), return_exceptions=True)
            self.application_lag = {
                cid: (lag.messages, lag.oldest_age)
                for cid, lag in zip(ids, found, strict=True)
                if lag is not None and not isinstance(lag, BaseException)
            }


async def count_backlog(store: RedisMessageStore, client_ids: Sequence[str]) -> tuple[int, int]:
    """(messages stored for ``client_ids`` in all, the most for one of them).

    On a single Redis one script call (persistence/lua/backlog.lua) answers for
    them all: a pipeline of a ZCARD each had redis-py parse a reply per session
    on the event loop, 55 ms of the broker's CPU for 4,000 sessions, 5.7 with the
    script (BENCHMARKS.md, "The persistent path's CPU, fifth round"). On a Redis
    Cluster, whose scripts see one hash slot, the ZCARDs stay."""
    if not client_ids:
        return 0, 0
    if isinstance(store.redis, RedisCluster):
        counts = await store.pending_counts(client_ids)
        return sum(counts), max(counts)
    keys = [client_keys(cid).messages for cid in client_ids]
    total, largest = await store.run_script(_BACKLOG, keys, ())
    return int(total), int(largest)


def held_applications(broker: Broker, kinds: Collection[str]) -> list[str]:
    """The APPLICATION sessions this broker holds, sorted: with replicas, one held by
    another replica (a remote record here) is that replica's to report."""
    return sorted(
        cid
        for cid in kinds
        if (session := broker.sessions.get(cid)) is not None
        and not isinstance(session, RemoteSession)
    )


# --------------------------------------------------------------------------
# The HTTP server
# --------------------------------------------------------------------------

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    503: "Service Unavailable",
}
_JSON = "application/json"


class MetricsServer:
    """``/metrics``, ``/health`` and ``/ready`` on ``settings.host:settings.port``."""

    def __init__(self, settings: MetricsSettings) -> None:
        self.settings = settings
        self.registry = CollectorRegistry(auto_describe=False)
        self.loop_watch = LoopWatch()
        self.collector = BrokerCollector(self.loop_watch)
        self.registry.register(self.collector)
        ProcessCollector(namespace=PREFIX, registry=self.registry)
        self.stopping = False
        self._server: asyncio.Server | None = None
        # Idle sockets opened by anyone must neither starve MQTT of descriptors nor
        # lock out the scraper: a newcomer pushes out the oldest silent one.
        self.gate = ConnectionGate(MAX_CONNECTIONS, MAX_CONNECTIONS_PER_SOURCE)

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        host, port = self.settings.host, self.settings.port
        try:
            self._server = await asyncio.start_server(
                self._handle, host, port, reuse_address=True, limit=MAX_REQUEST_HEAD
            )
        except OSError as e:
            raise MetricsUnavailable(
                f"cannot serve metrics on {host}:{port}: {e.strerror or e}"
            ) from e
        self.loop_watch.start()
        log.info("metrics on http://%s:%d/metrics", host, self.port)

    def attach(
        self,
        broker: Broker,
        persistence: DevicePersistence | None,
        retries: Sequence[Retry] = (),
    ) -> None:
        """The broker serves MQTT now: export it and let /ready answer for it."""
        self.collector.attach(broker, persistence, retries)

    async def stop(self) -> None:
        self.stopping = True
        await self.loop_watch.stop()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    # -- requests ---------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        key, source = self.gate.enter(writer)
        if key is None:  # over a limit, nobody idle to push out: closed unanswered
            writer.transport.abort()
            return
        try:
            await self._exchange(reader, writer, key)
        finally:
            self.gate.leave(key, source)

    async def _exchange(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: object
    ) -> None:
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT)
            except (
                asyncio.IncompleteReadError,
                asyncio.LimitOverrunError,
                TimeoutError,
                ConnectionError,
            ):
                return
            self.gate.head_read(key)
            status, content_type, body, head_only = await self._respond(head)
            reason = _REASONS.get(status, "")
            headers = (
                f"HTTP/1.1 {status} {reason}\r\n"
                f"Content-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\n"
                "Cache-Control: no-store\r\n"
                "Connection: close\r\n\r\n"
            )
            writer.write(headers.encode("latin-1") + (b"" if head_only else body))
            await writer.drain()
        except (ConnectionError, OSError):
            pass
        except Exception:  # a bug must not kill the server; one line in the log
            log.exception("metrics request failed")
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def _respond(self, head: bytes) -> tuple[int, str, bytes, bool]:
        """(status, content type, body, omit body) for a request head."""
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            return 400, _JSON, b'{"error":"bad request"}\n', False
        method, target = parts[0], parts[1].decode("latin-1")
        path = target.split("?", 1)[0]
        head_only = method == b"HEAD"
        if path not in ("/metrics", "/health", "/ready"):
            return 404, _JSON, b'{"error":"not found"}\n', head_only
        if method not in (b"GET", b"HEAD"):
            return 405, _JSON, b'{"error":"method not allowed"}\n', False
        if path == "/health":
            return 200, _JSON, b'{"status":"up"}\n', head_only
        if path == "/ready":
            ready, detail = await self.readiness()
            body = orjson.dumps({"ready": ready, **detail}) + b"\n"
            return (200 if ready else 503), _JSON, body, head_only
        # together: with Redis and Kafka both unanswering, the scrape still ends
        # within two probe timeouts (compose scrapes every 5 s)
        _, (ready, detail) = await asyncio.gather(
            self.collector.refresh_if_stale(), self.readiness()
        )
        self.collector.unready_cause = None if ready else readiness_cause(detail)
        return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry), head_only

    async def readiness(self) -> tuple[bool, dict[str, object]]:
        """(ready, details): MQTT served, and Redis, Kafka and a partition assignment."""
        if self.stopping:
            return False, {"reason": "shutting down"}
        collector = self.collector
        if collector.broker is None:
            return False, {"reason": "starting"}
        persistence = collector.persistence
        if persistence is None:
            return True, {"persistence": "disabled"}
        try:
            await asyncio.wait_for(persistence.store.ping(), PROBE_TIMEOUT)
        except RedisResponseError as e:
            # Reachable, but refusing: e.g. MISCONF after a failed AOF write (disk full).
            return False, {"reason": f"redis refuses commands: {_short(e)}"}
        except Exception as e:
            # A refused login or a failed TLS handshake says so, naming the settings.
            reason = explain(e, persistence.redis_connect)
            return False, {"reason": f"redis unreachable: {_short_text(reason)}"}
        started = time.monotonic()
        try:
            await asyncio.wait_for(persistence.kafka_producer.check(), PROBE_TIMEOUT)
        except Exception as e:
            # The producer only says no broker answered: a refused login or a failed
            # TLS handshake is found by connecting once, and named with its settings,
            # within what is left of the probe's time (a Kafka that does not answer at
            # all used it up: /ready answers within PROBE_TIMEOUT for Kafka).
            left = PROBE_TIMEOUT - (time.monotonic() - started)
            why = None
            if left > MIN_DIAGNOSIS:
                why = await diagnose(persistence.bootstrap, persistence.kafka_security, left)
            return False, {"reason": f"kafka unreachable: {_short_text(why or _short(e))}"}
        problem = persistence.problem()
        if problem is not None:
            return False, {"reason": problem}
        assigned = len(persistence.kafka_consumer.assignment())
        if not assigned:
            return False, {"reason": "consumer has no partitions assigned"}
        return True, {"partitions": assigned}


# devicemq_unready_reason's labels: what /ready's 503 reasons start with, coarsely.
READINESS_CAUSES = (
    "starting",
    "shutting_down",
    "redis",
    "kafka",
    "no_partitions",
    "persistence_consumer",
)


def readiness_cause(detail: dict[str, object]) -> str:
    """The :data:`READINESS_CAUSES` label of a 503 from :meth:`MetricsServer.readiness`."""
    reason = str(detail.get("reason", ""))
    if reason == "starting":
        return "starting"
    if reason == "shutting down":
        return "shutting_down"
    if reason.startswith("redis "):
        return "redis"
    if reason.startswith("kafka "):
        return "kafka"
    if reason == "consumer has no partitions assigned":
        return "no_partitions"
    return "persistence_consumer"  # DevicePersistence.problem(): failed, stopped, stuck


def _short(error: BaseException) -> str:
    return _short_text(str(error) or type(error).__name__)


def _short_text(text: str) -> str:
    return text.splitlines()[0][:300]
