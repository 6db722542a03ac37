"""persistence/cluster_link.py against a real redis-server: what fails is sent again.

Pub/sub is at most once on the receiving side, but a replica must not drop a
``stored`` notice (or a control message) because its own PUBLISH failed
(issue 16, 3): the batch stays queued, in order, until Redis takes it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from broker.config import Settings
from broker.core import Broker
from persistence.cluster_link import ClusterLink
from tests.faults.conftest import RedisProcess


async def _next_message(pubsub: Any, timeout: float) -> bytes | None:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
        if message is not None:
            return bytes(message["data"])
    return None


async def test_a_notice_whose_publish_failed_is_published_once_redis_is_back(
    tmp_path: Path,
) -> None:
    redis = RedisProcess(tmp_path / "redis", appendfsync="no")
    redis.start()
    client = Redis.from_url(redis.url)
    # The edge publishes what its ClusterState has to say; persistence (re-reads on
    # notices received) is not involved in sending.
    link = ClusterLink(client, "p", "n", Broker(Settings()), None)  # type: ignore[arg-type]
    try:
        redis.stop()
        link._queue.append(("p:stored", b"notice"))  # what _flush queues
        link._queue.append(("p:deliver:m", b"forwarded"))  # at most once: not again
        sender = asyncio.create_task(link._send())
        await asyncio.sleep(1.0)  # at least one attempt failed
        assert not sender.done()
        redis.start()  # same port, same data
        listener = Redis.from_url(redis.url)
        pubsub = listener.pubsub()
        await pubsub.subscribe("p:stored", "p:deliver:m")
        try:
            assert await _next_message(pubsub, 5.0) == b"notice"
            assert await _next_message(pubsub, 1.0) is None  # the delivery was dropped
            await asyncio.wait_for(sender, 5.0)
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]
            await listener.aclose()
    finally:
        await client.aclose()
        redis.stop()
