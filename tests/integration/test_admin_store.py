"""The admin API's Redis side on a real Redis and Redis Cluster: the backlog purge
(persistence/lua/purge.lua) and the shared block list (persistence/blocklist_store.py)."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from broker.blocklist import make_entry
from broker.config import Settings
from broker.core import Broker
from persistence.blocklist_store import BlockListStore
from persistence.format import BLOCKED_KEY, client_keys
from persistence.redis_store import RedisMessageStore
from tests.integration.test_redis_store import all_records, msgs


async def test_a_purge_deletes_what_was_never_sent_and_keeps_what_is_in_flight(
    store: RedisMessageStore, cid: str
) -> None:
    await store.save_batch(cid, msgs(0, 5), partition=0)
    await store.mark_sent(cid, [1, 2], [1, 2])  # in flight: their ids are taken
    values = client_keys(cid).values
    entry = await store.redis.hget(values, 5)
    await store.redis.hset(values, 5, struct.pack(">d", 1) + entry[8:])  # its deadline passed
    assert await store.purge(cid) == [(3, 3), (4, 4)]  # not 5: it expired
    assert [(r.packet_id, r.sent) for r in await all_records(store, cid)] == [
        (1, True),
        (2, True),
    ]
    assert await store.pending_count(cid) == 2
    # the byte count follows, and a new message takes the next score, never a held id
    res = await store.save_batch(cid, msgs(5, 1), partition=0)
    assert res.assigned[0] is not None and res.assigned[0].score == 6
    assert await store.purge(cid) == [(6, 6)]
    assert await store.purge(cid) == []


async def test_backlog_range_and_counts(store: RedisMessageStore, cid: str) -> None:
    assert await store.backlog_range(cid) == (0, None)
    await store.save_batch(cid, msgs(0, 3), partition=0)
    assert await store.backlog_range(cid) == (3, ((1, 1), (3, 3)))
    assert await store.pending_counts([cid, cid + "-none"]) == [3, 0]


@pytest.fixture
async def blocks(store: RedisMessageStore) -> AsyncIterator[BlockListStore]:
    await store.redis.delete(BLOCKED_KEY)
    yield BlockListStore(store.redis)
    await store.redis.delete(BLOCKED_KEY)


async def test_entries_round_trip_and_ended_ones_are_deleted(
    blocks: BlockListStore, store: RedisMessageStore
) -> None:
    now = blocks._wall_clock()
    await blocks.add(make_entry("client_id", "a", reason="r", created=now))
    await blocks.add(make_entry("address", "10.0.0.0/8", until=now - 1))
    assert [e.key for e in await blocks.load()] == ["client_id:a"]
    assert await store.redis.hkeys(BLOCKED_KEY) == [b"client_id:a"]
    assert await blocks.remove("client_id:a")
    assert not await blocks.remove("client_id:a")


class _HeldRedis:
    """The real client, with HGETALL's answer held until the test lets it go: a
    refresh that read Redis before a change lands after it."""

    def __init__(self, redis: Any) -> None:
        self._redis = redis
        self.reading = asyncio.Event()
        self.release = asyncio.Event()

    async def hgetall(self, key: str) -> Any:
        answer = await self._redis.hgetall(key)
        self.reading.set()
        await self.release.wait()
        return answer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._redis, name)


async def test_a_refresh_does_not_undo_a_change_made_while_it_read(
    store: RedisMessageStore,
) -> None:
    await store.redis.delete(BLOCKED_KEY)
    broker = Broker(Settings())
    entry = make_entry("client_id", "dev-1")
    await BlockListStore(store.redis).add(entry)
    broker.add_block(entry, share=False)
    held = _HeldRedis(store.redis)
    refreshing = asyncio.create_task(BlockListStore(held).refresh(broker))
    await held.reading.wait()  # Redis answered: dev-1 blocked
    # another replica removed it meanwhile (Redis, then its "unblock" message here)
    await store.redis.hdel(BLOCKED_KEY, entry.key)
    broker.remove_block(entry.key, share=False)
    # and blocked another one, whose message came before this replica read Redis
    other = make_entry("client_id", "dev-2")
    broker.add_block(other, share=False)
    held.release.set()
    await refreshing
    assert broker.blocked("dev-1", None, "") is None
    assert broker.blocked("dev-2", None, "") is not None  # kept until the next read
    await BlockListStore(store.redis).refresh(broker)  # the next one: Redis has no dev-2
    assert len(broker.blocklist) == 0
    await store.redis.delete(BLOCKED_KEY)


async def test_an_ended_entry_written_again_is_not_deleted(store: RedisMessageStore) -> None:
    """load() deletes ended entries only if they are still the value it read."""
    await store.redis.delete(BLOCKED_KEY)
    ended = make_entry("client_id", "x", until=1.0)
    await store.redis.hset(BLOCKED_KEY, ended.key, orjson.dumps(ended.to_json()))
    held = _HeldRedis(store.redis)
    loading = asyncio.create_task(BlockListStore(held).load())
    await held.reading.wait()
    again = make_entry("client_id", "x", reason="banned again")
    await BlockListStore(store.redis).add(again)
    held.release.set()
    assert await loading == []  # what it read had ended
    assert [e.reason for e in await BlockListStore(store.redis).load()] == ["banned again"]
    await store.redis.delete(BLOCKED_KEY)
