"""Retained messages written through to a real Redis (persistence/retained_persistence.py)."""

from __future__ import annotations

import asyncio
import os
import signal

from redis.asyncio import Redis

from broker.message import Message
from broker.retained import RetainedStore
from persistence.format import RETAINED_KEY
from persistence.retained_persistence import RetainedPersistence
from tests.integration.redis_servers import RedisServer
from tests.kafka_fixtures import freeze


async def test_writes_wait_for_redis_one_per_topic_and_publishers_hear_the_outcome() -> None:
    """Finding 7 of the persistent path: the retained-write queue grew by one entry per
    PUBLISH while Redis was slow. A write not yet sent is replaced by a newer one of
    its topic; every publisher waiting on either hears once it is in Redis."""
    server = RedisServer()
    redis = Redis.from_url(server.url)
    try:
        retained = RetainedStore()
        writer = RetainedPersistence(redis, retained, clock=lambda: 0.0, timeout=30)
        await writer.load()
        freeze(server.process.pid)
        outcomes: list[bool] = []
        try:
            for i in range(1000):
                retained.store(Message(f"t/{i % 10}", b"%d" % i, 1, True), outcomes.append)
            await asyncio.sleep(0.2)
            assert len(writer._ops) <= 20  # one per topic, and what was on its way
            assert outcomes == []
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        for _ in range(200):
            if len(outcomes) == 1000:
                break
            await asyncio.sleep(0.05)
        assert outcomes == [True] * 1000
        stored = await redis.hgetall(RETAINED_KEY)
        assert sorted(k.decode() for k in stored) == [f"t/{n}" for n in range(10)]
        assert all(v.endswith(b"%d" % (990 + int(k.decode()[2:]))) for k, v in stored.items())
        await writer.close()
    finally:
        await redis.aclose()
        server.stop()
