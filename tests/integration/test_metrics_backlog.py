"""The metrics' count of the Redis backlog (app/metrics.py ``count_backlog``) on a
real Redis and Redis Cluster."""

from __future__ import annotations

from redis.asyncio.cluster import RedisCluster

from app.metrics import count_backlog
from persistence.redis_store import RedisMessageStore
from tests.integration.test_redis_store import msgs


async def _calls(store: RedisMessageStore, command: str) -> int:
    stats = await store.redis.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


async def test_the_backlog_of_many_sessions_is_one_script_call_on_a_single_redis(
    store: RedisMessageStore, cid: str
) -> None:
    """Totals and the largest are those of the sessions named, an empty one counting
    0; on a single Redis the sessions of one refresh chunk cost one script call and
    one reply, not a ZCARD and a reply each (a refresh parsed 1,000 replies per
    round trip on the event loop)."""
    others = [f"{cid}-b", f"{cid}-empty"]
    await store.save_batch(cid, msgs(0, 3), partition=0)
    await store.save_batch(others[0], msgs(0, 5), partition=0)
    assert await count_backlog(store, []) == (0, 0)
    assert await count_backlog(store, [cid, *others]) == (8, 5)
    assert await count_backlog(store, [others[1]]) == (0, 0)
    if isinstance(store.redis, RedisCluster):
        return  # a pipeline of ZCARDs: a script sees one slot
    before = [await _calls(store, c) for c in ("evalsha", "zcard")]
    assert await count_backlog(store, [cid, *others]) == (8, 5)
    after = [await _calls(store, c) for c in ("evalsha", "zcard")]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 3]  # inside one call
