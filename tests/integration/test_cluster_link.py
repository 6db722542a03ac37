"""persistence/cluster_link.py against a real redis-server: what fails is sent again.

Pub/sub is at most once on the receiving side, but a replica must not drop a
``stored`` notice (or a control message) because its own PUBLISH failed
(issue 16, 3): the batch stays queued, in order, until Redis takes it. The
failure is made by an ACL that refuses PUBLISH, so a listener is subscribed
throughout (a restarted Redis would race the retry against the subscription).
"""

from __future__ import annotations

import asyncio
from collections import deque
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from broker.config import ClusterSettings, Settings
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


async def test_a_notice_whose_publish_failed_is_published_once_redis_takes_it(
    tmp_path: Path,
) -> None:
    """The link's Redis user may not PUBLISH (every attempt fails, deterministically)
    while a listener is subscribed; once it may, the notice arrives, the delivery
    does not."""
    redis = RedisProcess(tmp_path / "redis", appendfsync="no")
    redis.start()
    admin = Redis.from_url(redis.url)
    await admin.acl_setuser(
        "link", enabled=True, nopass=True, channels=["*"], commands=["-@all", "+@connection"]
    )
    client = Redis.from_url(redis.url, username="link", password="x")
    listener = Redis.from_url(redis.url)
    pubsub = listener.pubsub()
    await pubsub.subscribe("p:stored", "p:deliver:m")
    # The edge publishes what its ClusterState has to say; persistence (re-reads on
    # notices received) is not involved in sending.
    broker = Broker(Settings(cluster=ClusterSettings(enabled=True, node_id="n")))
    link = ClusterLink(client, "p", broker, None)  # type: ignore[arg-type]
    try:
        sender = link._sender
        # what _flush hands over: a numbered notice, and a delivery (at most once)
        sender.add(deque([("p:stored", b"notice"), ("p:deliver:m", b"forwarded")]))
        deadline = asyncio.get_running_loop().time() + 5.0
        # The first attempt took both and failed: the notice alone waits to go again.
        while list(sender.pending) != [("p:stored", b"notice")]:
            assert asyncio.get_running_loop().time() < deadline, list(sender.pending)
            await asyncio.sleep(0.01)
        assert sender.busy
        await admin.acl_setuser("link", commands=["+publish"])
        assert await _next_message(pubsub, 5.0) == b"notice"
        assert await _next_message(pubsub, 1.0) is None  # the delivery was dropped
        await asyncio.wait_for(sender.drain(), 5.0)
        assert sender.retry.retries >= 1
    finally:
        await pubsub.aclose()  # type: ignore[no-untyped-call]
        for c in (listener, client, admin):
            await c.aclose()
        redis.stop()
