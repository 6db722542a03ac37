"""The Redis pub/sub edge of clustering (``cluster.enabled``): bytes in and out
of :class:`broker.cluster.ClusterState`.

Channels, all under ``cluster.channel_prefix``:

- ``<prefix>:subscriptions``: control messages (connect/takeover, subscribe,
  unsubscribe, offline, end, sync, kept), orjson, broadcast to every replica;
- ``<prefix>:stored``: client ids whose messages a replica just stored in
  Redis for a client connected elsewhere: its replica re-reads the store;
- ``<prefix>:deliver:<node>``: deliveries forwarded to clients connected on
  ``node``, framed ``[u16 len][client id][u32 len][stored-message encoding]``;
- ``<prefix>:retained``: topics whose retained message a replica just wrote to
  the hash ``devicemq:retained`` (``persistence/retained_persistence.py``): re-read them.

Liveness: each replica refreshes the key ``{<prefix>:alive}:<node>`` every
``HEARTBEAT_INTERVAL`` with a TTL of ``HEARTBEAT_TTL`` and checks the keys of
the replicas it holds records of; a missing one is a replica that died
without saying goodbye (``ClusterState.node_gone``). The hash tag puts every
liveness key in one slot, so on Redis Cluster (``persistence.redis_cluster``)
one MGET reads them all; they go through the cluster client, which follows
the slot to its node.

Classic PUBLISH/SUBSCRIBE is broadcast cluster-wide on Redis Cluster too, so
one plain connection to the store's Redis (the node ``redis_url`` names) is
enough for pub/sub. Everything a replica publishes goes out in call order on
one connection, batched per event-loop iteration in one pipeline; a batch
that fails is sent again, except forwarded deliveries (at most once: a
second attempt could deliver twice). Pub/sub is at most once: a replica
whose subscriber connection drops misses what was said meanwhile (redis-py
re-subscribes when it reconnects), and a message can be lost without a
reconnect (an output buffer limit, a failover). Both are caught up
(:meth:`ClusterLink.catch_up`): the confirmation of the re-subscription, or
a gap in a sender's sequence numbers (``broker/cluster.py``, checked at
least every ``TICK_INTERVAL`` by its ``tick``), starts a re-sync and makes
every connected persistent session's store feed re-read the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from broker.cluster import (
    DELIVER,
    RESYNC_WINDOW,
    RETAINED,
    STORED,
    SUBSCRIPTIONS,
    TICK_INTERVAL,
    ClusterState,
)
from broker.message import Delivery
from persistence.coalescing import CoalescingWriter, Retry
from persistence.delivery_codec import encode_delivery, stored_delivery
from persistence.format import decode_record
from persistence.redis_packing import packed_by_hiredis
from persistence.redis_security import redis_client

if TYPE_CHECKING:
    from redis.asyncio.client import PubSub

    from broker.config import Settings
    from broker.core import Broker
    from persistence.device_persistence import DevicePersistence
    from persistence.retained_persistence import RetainedPersistence

log = logging.getLogger("devicemq.cluster")

_CID = struct.Struct(">H")
_VALUE = struct.Struct(">I")
# Messages waiting for Redis (it is away): over this, the oldest are dropped; a
# receiver that misses numbered ones sees the gap and catches up.
MAX_QUEUED = 100_000

Queued = deque[tuple[str, bytes]]  # (channel, payload), oldest first


def _appended(older: Queued, newer: Queued) -> Queued:
    older.extend(newer)
    return older


def _newest(queued: Queued, n: int) -> Queued:
    while len(queued) > n:
        queued.popleft()
    return queued


HEARTBEAT_INTERVAL = 1.0
# Seconds QoS 1/2 publishes wait while the pub/sub link is down (tests/model/FINDINGS.md,
# finding 39): a Redis restart takes well under it, and the publishers' deadline is longer.
HOLD_LIMIT = 2.0
HEARTBEAT_TTL = 5  # seconds without a refresh before a replica counts as dead


def encode_deliveries(items: list[tuple[str, Delivery]], wall: float, now: float) -> bytes:
    parts: list[bytes] = []
    for client_id, delivery in items:
        cid = client_id.encode()
        value = encode_delivery(delivery, wall, now)
        parts += (_CID.pack(len(cid)), cid, _VALUE.pack(len(value)), value)
    return b"".join(parts)


def decode_deliveries(data: bytes, wall: float, now: float) -> list[tuple[str, Delivery]]:
    out = []
    pos = 0
    while pos < len(data):
        (n,) = _CID.unpack_from(data, pos)
        pos += 2
        cid = data[pos : pos + n].decode()
        pos += n
        (m,) = _VALUE.unpack_from(data, pos)
        pos += 4
        record = decode_record(0, 0, data[pos : pos + m])
        pos += m
        assert record.message is not None
        out.append((cid, stored_delivery(record.message, wall, now)))
    return out


class ClusterLink:
    def __init__(
        self,
        redis: Redis,
        prefix: str,
        broker: Broker,
        persistence: DevicePersistence,
        retained: RetainedPersistence | None = None,
        keys: Redis | RedisCluster | None = None,
    ) -> None:
        self._redis = redis  # pub/sub and PUBLISH: one plain connection
        self._keys = keys if keys is not None else redis  # liveness keys (cluster-aware)
        self._prefix = prefix
        self._clock = broker.clock
        self._persistence = persistence
        assert broker.cluster is not None, "the broker builds its ClusterState (cluster.enabled)"
        self.state: ClusterState = broker.cluster
        self._resync_timer: asyncio.TimerHandle | None = None
        self._hold_limit: asyncio.TimerHandle | None = None  # see _link_lost
        self._link_down = False  # since a read failed, until the link is back
        self._ticker: asyncio.Task[None] | None = None
        # A seam for tests: a notice for which this returns True is not published
        # (as if pub/sub lost it); None in production.
        self.lose: Callable[[str, bytes], bool] | None = None
        self._mine = f"{prefix}:{DELIVER}{self.state.node_id}"
        self._pubsub: PubSub | None = None
        self._reader: asyncio.Task[None] | None = None
        self._sender: CoalescingWriter[deque[tuple[str, bytes]]] = CoalescingWriter(
            self._publish,
            _appended,
            deque,
            Retry("cluster_link"),
            limit=MAX_QUEUED,
            trim=_newest,
        )
        self.read_retry = Retry("cluster_pubsub_reads")
        self._scheduled = False
        self._retained = retained
        if retained is not None:
            retained.written = self.state.retained_changed
        self._heartbeat: asyncio.Task[None] | None = None
        self._subscribed = 0  # confirmations of the control channel's subscription

    def retries(self) -> list[Retry]:
        return [self._sender.retry, self.read_retry]

    def _alive_key(self, node: str) -> str:
        return f"{{{self._prefix}:alive}}:{node}"  # one hash slot for all: MGET on a cluster

    async def start(self) -> None:
        """Subscribe, join the broker, ask the other replicas for their live sessions."""
        await self._keys.set(self._alive_key(self.state.node_id), b"1", ex=HEARTBEAT_TTL)
        pubsub = self._redis.pubsub()
        await pubsub.subscribe(
            f"{self._prefix}:{SUBSCRIPTIONS}",
            f"{self._prefix}:{STORED}",
            f"{self._prefix}:{RETAINED}",
            self._mine,
        )
        self._pubsub = pubsub
        self.state.connect_edge(self._wake, self.catch_up)
        self._reader = asyncio.create_task(self._read())
        self._heartbeat = asyncio.create_task(self._beat())
        self._ticker = asyncio.create_task(self._tick())
        self.state.request_sync()
        log.info("cluster: replica %s joined on %s:*", self.state.node_id, self._prefix)

    async def close(self) -> None:
        """Send what is queued (session ends of the shutdown), then leave."""
        self._flush()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._sender.drain(), 5.0)
        self.state.disconnect_edge()
        if self._resync_timer is not None:
            self._resync_timer.cancel()
        if self._hold_limit is not None:
            self._hold_limit.cancel()
        self.state.stop_holding()  # nothing waits for a link that is gone
        for task in (self._reader, self._heartbeat, self._ticker):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        with contextlib.suppress(Exception):
            await self._keys.delete(self._alive_key(self.state.node_id))
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                await self._pubsub.aclose()  # type: ignore[no-untyped-call]
        await self._redis.aclose()
        if self._keys is not self._redis:
            await self._keys.aclose()

    def catch_up(self) -> None:
        """Messages from other replicas may have been lost: ask for their snapshots
        again (records nobody confirms within ``RESYNC_WINDOW`` are dropped), re-read
        the retained messages, and make every connected persistent session's store
        feed re-read the store (a lost ``stored`` notice)."""
        if self._hold_limit is not None:
            self._hold_limit.cancel()  # the re-sync's own window bounds the wait now
            self._hold_limit = None
        self._link_down = False
        self.state.resync()
        if self._retained is not None:
            self._retained.resync()
        if self._resync_timer is not None:
            self._resync_timer.cancel()  # the window restarts with the latest request
        loop = asyncio.get_running_loop()
        self._resync_timer = loop.call_later(RESYNC_WINDOW, self.state.resync_done)
        feeds = self._persistence.feeds
        feeds.reread(feeds.connected())

    def _link_lost(self) -> None:
        """Publishes wait for the re-sync (``ClusterState.link_lost``), at most
        :data:`HOLD_LIMIT` while the link stays down: then they are routed with what
        this replica knows, as a replica alone would. Once per outage: the reads
        retried while Redis stays away do not hold again."""
        if self._link_down:
            return
        self._link_down = True
        self.state.link_lost()
        loop = asyncio.get_running_loop()
        self._hold_limit = loop.call_later(HOLD_LIMIT, self._stop_holding)

    def _stop_holding(self) -> None:
        self._hold_limit = None
        self.state.stop_holding()

    # -- out ---------------------------------------------------------------------------

    def _wake(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        control, deliveries = self.state.data_to_send()
        prefix = self._prefix
        queued = [(f"{prefix}:{channel}", payload) for channel, payload in control]
        if deliveries:
            wall, now = time.time(), self._clock()
            for node, items in deliveries.items():
                channel = f"{prefix}:{DELIVER}{node}"
                queued.append((channel, encode_deliveries(items, wall, now)))
        if queued:
            self._sender.add(deque(queued))

    async def _publish(self, batch: Queued) -> Queued:
        """Publish ``batch`` in order; what to send again (see below)."""
        deliver = f"{self._prefix}:{DELIVER}"
        lose = self.lose
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for channel, payload in batch:
                    if lose is not None and lose(channel, payload):
                        pipe.echo(b"lost on purpose")  # counts as 0 listeners
                    else:
                        pipe.publish(channel, payload)
                listeners = await pipe.execute()
        except Exception as error:
            # Control messages and notices are numbered: sent again, in order,
            # ahead of anything newer (a receiver ignores what it heard
            # already). Forwarded deliveries are at most once: dropped.
            kept = deque(item for item in batch if not item[0].startswith(deliver))
            log.warning(
                "cluster: publishing %d messages failed (%d to send again): %s",
                len(batch),
                len(kept),
                error,
            )
            return kept
        for (channel, _), count in zip(batch, listeners, strict=True):
            if count == 0 and channel.startswith(deliver):
                node = channel[len(deliver) :]
                log.info("cluster: replica %s is gone, dropping its clean sessions", node)
                self.state.node_gone(node)
        return deque()

    # -- in ----------------------------------------------------------------------------

    async def _read(self) -> None:
        assert self._pubsub is not None
        subscriptions = f"{self._prefix}:{SUBSCRIPTIONS}"
        stored = f"{self._prefix}:{STORED}"
        retained = f"{self._prefix}:{RETAINED}"
        while True:
            try:
                message = await self._pubsub.get_message(timeout=1.0)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning("cluster: reading pub/sub failed: %s", error)
                self._link_lost()
                await self.read_retry.wait()
                continue
            self.read_retry.succeeded()
            if message is None:
                continue
            if message.get("type") == "subscribe" and message["channel"] == subscriptions.encode():
                self._subscribed += 1
                if self._subscribed > 1:  # redis-py re-subscribed: messages were missed
                    log.warning("cluster: pub/sub reconnected, re-syncing")
                    self.catch_up()
                continue
            if message.get("type") != "message":
                continue
            channel = message["channel"].decode()
            data: bytes = message["data"]
            try:
                if channel == self._mine:
                    wall, now = time.time(), self._clock()
                    for client_id, delivery in decode_deliveries(data, wall, now):
                        self.state.delivered(client_id, delivery)
                elif channel == subscriptions:
                    self.state.receive(SUBSCRIPTIONS, data)
                elif channel == stored:
                    self._persistence.feeds.reread(self.state.receive(STORED, data))
                elif channel == retained:
                    topics = self.state.receive(RETAINED, data)
                    if topics and self._retained is not None:
                        self._retained.refresh(topics)
            except Exception:  # one bad message must not stop the replica listening
                log.exception("cluster: applying a message on %s failed", channel)

    async def _tick(self) -> None:
        """Every ``TICK_INTERVAL``: this replica's last sequence number, behind what
        is queued (so it never runs ahead of the messages it counts)."""
        while True:
            await asyncio.sleep(TICK_INTERVAL)
            self._flush()
            self._sender.add(deque([(f"{self._prefix}:{SUBSCRIPTIONS}", self.state.tick()[1])]))

    async def _beat(self) -> None:
        """Refresh this replica's liveness key; forget replicas whose key expired."""
        mine = self._alive_key(self.state.node_id)
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL)
            try:
                await self._keys.set(mine, b"1", ex=HEARTBEAT_TTL)
                nodes = sorted(self.state.remote_nodes())
                if not nodes:
                    continue
                found = await self._keys.mget([self._alive_key(n) for n in nodes])
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning("cluster: heartbeat failed: %s", error)
                continue
            for node, value in zip(nodes, found, strict=True):
                if value is None:
                    log.warning("cluster: replica %s missed its heartbeat, forgetting it", node)
                    self.state.node_gone(node)


async def open_cluster_link(
    settings: Settings,
    persistence: DevicePersistence,
    broker: Broker,
    retained: RetainedPersistence | None = None,
) -> ClusterLink:
    url = persistence.redis_url
    # The connections are named, so an operator (or a test) can find them.
    name = f"devicemq-cluster-{broker.cluster.node_id if broker.cluster else ''}"
    connect = persistence.redis_connect  # TLS, ACL user (persistence/redis_security.py)
    redis = redis_client(url, connect, persistence.redis_sentinels, client_name=name)
    keys: Redis | RedisCluster | None = None
    if settings.persistence.redis_cluster:
        keys = packed_by_hiredis(RedisCluster.from_url(url, decode_responses=False, **connect))
    link = ClusterLink(
        redis,
        settings.cluster.channel_prefix,
        broker,
        persistence,
        retained,
        keys,
    )
    await link.start()
    return link
