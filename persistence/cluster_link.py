"""The Redis pub/sub edge of clustering (``cluster.enabled``): bytes in and out
of :class:`broker.cluster.ClusterState`.

Channels, all under ``cluster.channel_prefix``:

- ``<prefix>:subscriptions``: control messages (connect/takeover, subscribe,
  unsubscribe, offline, end, sync), orjson, broadcast to every replica;
- ``<prefix>:stored``: client ids whose messages a replica just stored in
  Redis for a client connected elsewhere: its replica re-reads the store;
- ``<prefix>:deliver:<node>``: deliveries forwarded to clients connected on
  ``node``, framed ``[u16 len][client id][u32 len][stored-message encoding]``.

Classic PUBLISH/SUBSCRIBE is broadcast cluster-wide on Redis Cluster too, so
one plain connection to the store's Redis (any node of a cluster) is enough.
Everything a replica publishes goes out in call order on one connection,
batched per event-loop iteration in one pipeline. Pub/sub is at most once: a
replica whose subscriber connection drops misses what was said meanwhile
(redis-py re-subscribes when it reconnects).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import time
from collections import deque
from typing import TYPE_CHECKING

from redis.asyncio import Redis

from broker.cluster import DELIVER, STORED, SUBSCRIPTIONS, ClusterState
from broker.message import Delivery
from persistence.records import encode_delivery, stored_delivery
from persistence.redis_store import decode_record

if TYPE_CHECKING:
    from redis.asyncio.client import PubSub

    from broker.config import Settings
    from broker.core import Broker
    from persistence.runtime import DevicePersistence

log = logging.getLogger("devicemq.cluster")

_CID = struct.Struct(">H")
_VALUE = struct.Struct(">I")
RETRY_DELAY = 0.5


def node_id_of(settings: Settings) -> str:
    return settings.cluster.node_id or f"{socket.gethostname()}-{os.getpid()}"


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
        node_id: str,
        broker: Broker,
        persistence: DevicePersistence,
    ) -> None:
        self._redis = redis
        self._prefix = prefix
        self._broker = broker
        self._persistence = persistence
        self.state = ClusterState(broker, node_id, self._wake)
        self._mine = f"{prefix}:{DELIVER}{node_id}"
        self._pubsub: PubSub | None = None
        self._reader: asyncio.Task[None] | None = None
        self._sender: asyncio.Task[None] | None = None
        self._queue: deque[tuple[str, bytes]] = deque()
        self._scheduled = False

    async def start(self) -> None:
        """Subscribe, join the broker, ask the other replicas for their live sessions."""
        pubsub = self._redis.pubsub()
        await pubsub.subscribe(
            f"{self._prefix}:{SUBSCRIPTIONS}", f"{self._prefix}:{STORED}", self._mine
        )
        self._pubsub = pubsub
        self._broker.cluster = self.state
        self._reader = asyncio.create_task(self._read())
        self.state.request_sync()
        log.info("cluster: replica %s joined on %s:*", self.state.node_id, self._prefix)

    async def close(self) -> None:
        """Send what is queued (session ends of the shutdown), then leave."""
        self._flush()
        if self._sender is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._sender), 5.0)
        self._broker.cluster = None
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                await self._pubsub.aclose()  # type: ignore[no-untyped-call]
        await self._redis.aclose()

    # -- out ---------------------------------------------------------------------------

    def _wake(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        control, deliveries = self.state.data_to_send()
        prefix = self._prefix
        self._queue.extend((f"{prefix}:{channel}", payload) for channel, payload in control)
        if deliveries:
            wall, now = time.time(), self._broker.clock()
            for node, items in deliveries.items():
                channel = f"{prefix}:{DELIVER}{node}"
                self._queue.append((channel, encode_deliveries(items, wall, now)))
        if self._queue and self._sender is None:
            self._sender = asyncio.create_task(self._send())

    async def _send(self) -> None:
        try:
            while self._queue:
                batch = list(self._queue)
                self._queue.clear()
                try:
                    async with self._redis.pipeline(transaction=False) as pipe:
                        for channel, payload in batch:
                            pipe.publish(channel, payload)
                        listeners = await pipe.execute()
                except Exception as error:  # at most once: what failed is lost
                    log.warning("cluster: publishing %d messages failed: %s", len(batch), error)
                    await asyncio.sleep(RETRY_DELAY)
                    continue
                deliver = f"{self._prefix}:{DELIVER}"
                for (channel, _), count in zip(batch, listeners, strict=True):
                    if count == 0 and channel.startswith(deliver):
                        node = channel[len(deliver) :]
                        log.info("cluster: replica %s is gone, dropping its clean sessions", node)
                        self.state.node_gone(node)
        finally:
            self._sender = None

    # -- in ----------------------------------------------------------------------------

    async def _read(self) -> None:
        assert self._pubsub is not None
        subscriptions = f"{self._prefix}:{SUBSCRIPTIONS}"
        stored = f"{self._prefix}:{STORED}"
        while True:
            try:
                message = await self._pubsub.get_message(
                    ignore_subscribe_messages=True, timeout=1.0
                )
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning("cluster: reading pub/sub failed: %s", error)
                await asyncio.sleep(RETRY_DELAY)
                continue
            if message is None or message.get("type") != "message":
                continue
            channel = message["channel"].decode()
            data: bytes = message["data"]
            try:
                if channel == self._mine:
                    wall, now = time.time(), self._broker.clock()
                    for client_id, delivery in decode_deliveries(data, wall, now):
                        self.state.delivered(client_id, delivery)
                elif channel == subscriptions:
                    self.state.receive(SUBSCRIPTIONS, data)
                elif channel == stored:
                    self._persistence.reread(self.state.receive(STORED, data))
            except Exception:  # one bad message must not stop the replica listening
                log.exception("cluster: applying a message on %s failed", channel)


async def open_cluster_link(
    settings: Settings, persistence: DevicePersistence, broker: Broker
) -> ClusterLink:
    redis = Redis.from_url(persistence.redis_url, decode_responses=False)
    link = ClusterLink(
        redis, settings.cluster.channel_prefix, node_id_of(settings), broker, persistence
    )
    await link.start()
    return link
