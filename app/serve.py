"""The composition root: ``serve()`` builds every part and runs it until stopped.

Here, not in ``broker/``: the protocol package must not import the
persistent path, the metrics server or the tools on top
(tests/unit/test_import_direction.py). The parts are imported where they are
used, as before: a broker without persistence or metrics does not load them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.authentication import open_authentication
from broker.config import ConfigError, Settings
from broker.core import Broker
from edge.server import BrokerServer

if TYPE_CHECKING:
    from app.admin import AdminServer
    from app.embedded_services import EmbeddedServices
    from app.metrics import MetricsServer
    from broker.sys_topics import SysTopics
    from persistence.blocklist_store import BlockListStore
    from persistence.device_persistence import DevicePersistence
    from persistence.integration_sink import KafkaIntegrationSink
    from persistence.owner_store import RedisOwners

log = logging.getLogger("devicemq.server")

# The drain after SIGTERM ends within this, or the process exits as if killed.
SHUTDOWN_TIMEOUT = 60.0
# The cyclic garbage collector's thresholds while serving (see tune_gc).
GC_THRESHOLDS = (50_000, 10, 10)


def tune_gc() -> None:
    """Collect the youngest objects every 50,000 allocations instead of 700.

    A broker holds a few hundred tracked objects per connected client for as long
    as it stays, and a message waiting for Kafka or Redis lives long enough to
    survive two default young collections: it is promoted, and every quarter of
    the heap promoted so far buys a full collection, which walks every client's
    objects. With 2,000 persistent devices at a message a second each, those full
    collections took 0.3-2 s each, one every few seconds: the fleet's tail
    (BENCHMARKS.md, "The fleet shape"). Collected this rarely, a message is
    long gone by the time its generation is looked at, and a full collection
    comes when the fleet itself grows, not with its traffic.
    """
    gc.set_threshold(*GC_THRESHOLDS)


async def serve(
    settings: Settings,
    stop: asyncio.Event,
    on_listening: Callable[[], None] | None = None,
    *,
    embedded_kafka: bool = False,
) -> None:
    """Run a broker until ``stop`` is set, then drain and close.

    With persistence enabled, Redis and Kafka (embedded if not configured)
    are connected and saved sessions restored before the listener opens; on
    the way out, clients are disconnected first so nothing new arrives, then
    the persistent path drains into Redis. With ``metrics.enabled`` the
    metrics server answers from the start (/health 200, /ready 503 until the
    listener opens) to the end. ``on_listening`` is called once the listeners
    are open (app/workers.py tells its supervisor). ``embedded_kafka``: the
    ``persistence.kafka_bootstrap`` given is the embedded Kafka that a supervisor
    started (app/workers.py), not one of the user's: the integration rules' topics are
    created on it, as when this process starts the embedded Kafka itself.
    """
    Path(settings.data_dir).mkdir(parents=True, exist_ok=True)
    metrics: MetricsServer | None = None
    if settings.metrics.enabled:
        from app.metrics import MetricsServer

        metrics = MetricsServer(settings.metrics)
        await metrics.start()
    try:
        await _serve(settings, stop, metrics, on_listening, embedded_kafka)
    finally:
        if metrics is not None:
            await metrics.stop()


async def _serve(
    settings: Settings,
    stop: asyncio.Event,
    metrics: MetricsServer | None,
    on_listening: Callable[[], None] | None,
    embedded_kafka: bool,
) -> None:
    persistence = None
    if settings.cluster.enabled and not settings.persistence.enabled:
        raise ConfigError("the cluster shares Redis: enable persistence", name="cluster.enabled")
    if settings.cluster.share_ports and not settings.cluster.enabled:
        raise ConfigError(
            "brokers sharing a port must form a cluster: enable cluster",
            name="cluster.share_ports",
        )
    token = None
    if settings.admin.enabled:
        from app.admin import admin_token

        token = admin_token(settings)  # a bad token file stops the start here
    blocks: BlockListStore | None = None
    owners: RedisOwners | None = None  # None: claims kept in memory (broker/ownership.py)
    integrations = None
    if settings.integrations:
        integrations = await _open_integrations(settings, embedded_kafka)
    if settings.persistence.enabled:
        produce_latency = metrics.collector.kafka_produce.observe if metrics is not None else None
        try:
            persistence = await _open_persistence(settings, produce_latency)
        except BaseException:
            if integrations is not None:
                await integrations.close()
            raise
        from persistence.blocklist_store import BlockListStore

        blocks = BlockListStore(persistence.store.redis)
        from persistence.owner_store import RedisOwners

        owners = RedisOwners(persistence.store)
    authenticator, authorizer = open_authentication(settings)
    broker = Broker(
        settings,
        persistent_path=persistence,
        keep_block=blocks.keep if blocks is not None else None,
        integration_sink=integrations,
        owners=owners,
        authenticator=authenticator,
        authorizer=authorizer,
    )
    link = None
    retained = None
    tally = None  # auth.max_bytes_per_owner, measured (persistence/owner_tally.py)
    admin: AdminServer | None = None
    readiness: MetricsServer | None = None
    try:
        if persistence is not None:
            # The consumer starts after the cluster link: sessions restored here may be
            # connected to another replica, and their stored messages must tell it.
            await persistence.attach(broker, consume=not settings.cluster.enabled)
            from persistence.retained_persistence import RetainedPersistence

            retained = RetainedPersistence(
                persistence.store.redis,
                broker.retained,
                broker.clock,
                timeout=settings.persistence.kafka_request_timeout_ms / 1000,
            )
            log.info("%d retained messages loaded", await retained.load())
            if settings.cluster.enabled:
                from persistence.cluster_link import open_cluster_link

                link = await open_cluster_link(settings, persistence, broker, retained)
                persistence.start_consuming()
        if persistence is not None:
            from persistence.owner_tally import OwnerTally

            tally = OwnerTally(persistence.store, settings, broker.budget, broker.stores_by_owner)
            tally.start()
        if blocks is not None:
            await blocks.refresh(broker)  # the shared block list, before the first CONNECT
            blocks.start(broker)
        server = BrokerServer(settings, broker)
        await server.start()
        if settings.admin.enabled:
            admin = await _open_admin(settings, broker, token, persistence, blocks)
        if metrics is not None:
            retries = persistence.retries() if persistence is not None else []
            if retained is not None:
                retries.append(retained.retry)
            if link is not None:
                retries += link.retries()
            metrics.attach(broker, persistence, retries)
        if admin is not None:
            readiness = metrics
            if readiness is None:
                from app.metrics import MetricsServer

                readiness = MetricsServer(settings.metrics)  # never started: /ready's logic
                readiness.attach(broker, persistence)
            admin.api.health = _admin_health(readiness, persistence, readiness is metrics)
        sys_task = None
        if broker.sys_topics is not None:
            persisted = _persisted_numbers(broker, persistence, metrics)
            sys_task = asyncio.create_task(
                _publish_sys(broker.sys_topics, settings.sys_interval, persisted)
            )
        if on_listening is not None:
            on_listening()
        try:
            await stop.wait()
            log.info("stop requested: disconnecting clients, then draining")
        finally:
            if sys_task is not None:
                sys_task.cancel()
            if metrics is not None:
                metrics.stopping = True  # /ready: 503 while draining
            if readiness is not None:
                readiness.stopping = True  # the admin stats' health too
            await server.stop()
    finally:
        if admin is not None:
            await admin.stop()
        if blocks is not None:
            await blocks.close()
        if tally is not None:
            await tally.close()
        if owners is not None:
            await owners.close()
        if retained is not None:
            await retained.close()
        if link is not None:
            await link.close()
        if integrations is not None:
            await integrations.close()  # the clients are gone: nothing new comes
        if persistence is not None:
            await persistence.close()


async def _open_integrations(settings: Settings, embedded_kafka: bool) -> KafkaIntegrationSink:
    """The integration rules' producer, on the configured Kafka
    (``persistence.kafka_bootstrap``, whether persistence is enabled or not), or
    on the embedded one when none is configured, or when ``embedded_kafka`` says the
    configured one is the embedded Kafka a supervisor started (a worker's)."""
    from persistence.integration_sink import open_integrations

    bootstrap = settings.persistence.kafka_bootstrap
    if bootstrap:
        return await open_integrations(settings, bootstrap, embedded=embedded_kafka)
    running = await asyncio.to_thread(embedded_services(settings).ensure_running)
    return await open_integrations(settings, running.kafka_bootstrap, embedded=True)


async def _open_admin(
    settings: Settings,
    broker: Broker,
    token: str | None,
    persistence: DevicePersistence | None,
    blocks: BlockListStore | None,
) -> AdminServer:
    from app.admin import AdminApi, AdminServer
    from broker.sys_topics import node_name

    api = AdminApi(
        settings,
        broker,
        node_name(settings),
        token=token,
        store=persistence.store if persistence is not None else None,
        blocks=blocks,
        events=persistence.events if persistence is not None else None,
        queues=persistence.queues if persistence is not None else None,
        rewind=persistence.rewind_queue_now if persistence is not None else None,
        rewind_session=persistence.rewind_session if persistence is not None else None,
        group_store=(
            persistence.groups.store
            if persistence is not None and persistence.groups is not None
            else None
        ),
        applications=persistence.apps if persistence is not None else None,
    )
    admin = AdminServer(settings, api)
    await admin.start()
    return admin


AppLag = dict[str, tuple[int, float | None]]
PersistedNumbers = Callable[[], Awaitable[tuple[int | None, int | None, AppLag | None]]]


def _admin_health(
    readiness: MetricsServer, persistence: DevicePersistence | None, count_backlog: bool
) -> Callable[[], Awaitable[dict[str, Any]]]:
    """The admin stats' ``health`` (the console shows it): what ``/ready`` answers,
    the Kafka consumer's lag and the Redis backlog (``count_backlog``: counted, at
    most every 5 s, only when /metrics is served, as for $SYS; else None)."""

    async def health() -> dict[str, Any]:
        ready, detail = await readiness.readiness()
        lag = None
        if persistence is not None:
            lag = sum(readiness.collector.consumer_lag(persistence).values())
            if count_backlog:
                await readiness.collector.refresh_if_stale()
        return {
            "ready": ready,
            "reason": detail.get("reason"),
            "kafka_lag": lag,
            "backlog": readiness.collector.backlog,
        }

    return health


def _persisted_numbers(
    broker: Broker, persistence: DevicePersistence | None, metrics: MetricsServer | None
) -> PersistedNumbers | None:
    """$SYS's backlog, consumer lag and APPLICATION sessions' lag (None without
    persistence), from the metrics collector. The backlog is counted in Redis (a
    round trip per 1,000 persistent sessions, seconds of the loop for a few hundred
    thousand) and the APPLICATION lag read from Kafka (a connection per session):
    only when /metrics is served, whose counts $SYS shares; without it $SYS has the
    consumer lag alone."""
    if persistence is None:
        return None
    from app.metrics import BrokerCollector

    if metrics is not None:
        collector = metrics.collector
    else:
        collector = BrokerCollector()
        collector.attach(broker, persistence)

    async def numbers() -> tuple[int | None, int | None, AppLag | None]:
        lag = sum(collector.consumer_lag(persistence).values())
        if metrics is None:
            return None, lag, None
        await collector.refresh_if_stale()
        apps = dict(collector.application_lag) if persistence.apps is not None else None
        return collector.backlog, lag, apps

    return numbers


async def _publish_sys(
    sys_topics: SysTopics, interval: float, persisted: PersistedNumbers | None
) -> None:
    """Publish $SYS/broker/... now and every ``interval`` seconds, until cancelled."""
    while True:
        try:
            backlog, lag, apps = await persisted() if persisted is not None else (None,) * 3
            sys_topics.publish_numbers(backlog, lag, apps)
        except Exception:  # a bug must not end $SYS for good; one line in the log
            log.exception("$SYS topics not published")
        await asyncio.sleep(interval)


async def _open_persistence(
    settings: Settings, produce_latency: Callable[[float], None] | None
) -> DevicePersistence:
    """The configured Redis and Kafka, or embedded ones started under ``data_dir``."""
    from persistence.device_persistence import configured_endpoints, open_persistence

    endpoints = configured_endpoints(settings)
    compact_after = 0
    if endpoints is None:
        if not settings.cluster.enabled:  # other replicas' producers cannot be held
            config = settings.persistence
            compact_after = config.embedded_kafka_compact_after
            partitions = config.embedded_kafka_partitions
            settings = replace(settings, persistence=replace(config, partitions=partitions))
        running = await asyncio.to_thread(embedded_services(settings).ensure_running)
        endpoints = (running.redis_url, running.kafka_bootstrap)
        # Logged under the persistence logger, where this line always was.
        logging.getLogger("devicemq.persistence").info(
            "embedded services: redis %s, kafka %s",
            running.redis_url_shown,
            running.kafka_bootstrap,
        )
    return await open_persistence(settings, endpoints, compact_after, produce_latency)


def embedded_services(settings: Settings) -> EmbeddedServices:
    """The embedded services of ``data_dir``, Tansu on the configured storage, kept
    off the ports this broker listens on (own_ports)."""
    from app.embedded_services import EmbeddedServices

    return EmbeddedServices(
        Path(settings.data_dir),
        kafka_storage=settings.persistence.embedded_kafka_storage,
        avoid=own_ports(settings),
    )


def own_ports(settings: Settings) -> frozenset[int]:
    """The ports the broker binds once its services answer: its MQTT listeners, the
    metrics servers (worker i of ``--workers N`` on ``metrics.port + i``,
    app/workers.py) and the admin listener, as far as enabled."""
    from app.workers import worker_count

    listeners = (settings.listener, settings.tls, settings.websocket, settings.websocket_tls)
    ports = {listener.port for listener in listeners if listener.enabled}
    if settings.metrics.enabled:
        first = settings.metrics.port
        ports.update(range(first, first + worker_count(settings)))
    if settings.admin.enabled:
        ports.add(settings.admin.port)
    return frozenset(ports)


# A supervisor's hold on a worker (app/workers.py): given the loop, a "drain" that
# starts the drain once (more calls change nothing) and an "exit now".
Controls = Callable[[asyncio.AbstractEventLoop, Callable[[], None], Callable[[str], None]], None]


def run(
    settings: Settings,
    *,
    on_listening: Callable[[], None] | None = None,
    controls: Controls | None = None,
    embedded_kafka: bool = False,
) -> None:
    """Blocking entry point of ``devicemq run``: serve until SIGTERM or SIGINT, or
    until ``controls`` (a worker's supervisor) asks for the drain; ``embedded_kafka``
    as for :func:`serve`."""
    tune_gc()
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every platform we ship
        runner = asyncio.run
    else:
        runner = uvloop.run

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def drain() -> None:
            """Start the drain, bounded by SHUTDOWN_TIMEOUT; once."""
            if stop.is_set():
                return
            stop.set()
            loop.call_later(
                SHUTDOWN_TIMEOUT, _exit_now, f"the drain took more than {SHUTDOWN_TIMEOUT:g} s"
            )

        def signalled() -> None:
            """The first SIGTERM/SIGINT drains; a second one exits at once (a backend
            that stopped answering can hold a drain)."""
            if stop.is_set():
                _exit_now("a second signal during the drain")
            drain()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, signalled)
        if controls is not None:
            controls(loop, drain, _exit_now)
        await serve(settings, stop, on_listening, embedded_kafka=embedded_kafka)

    with contextlib.suppress(KeyboardInterrupt):
        runner(main())


def _exit_now(why: str) -> None:
    """Leave without finishing the drain: as after a crash, nothing acknowledged is
    lost (what is not stored yet is read again from Kafka at the next start)."""
    log.error("%s: exiting without finishing the drain (exit status 1)", why)
    logging.shutdown()
    os._exit(1)
