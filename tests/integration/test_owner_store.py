"""Claims on client IDs and $ECQ queues in Redis (persistence/owner_store.py,
owner_claim.lua) against a real redis-server, single and in cluster mode: what
broker/ownership.py's MemoryOwners does in memory, shared by every replica."""

from __future__ import annotations

import asyncio

from redis.crc import key_slot

from broker.ownership import CLIENT_ID, QUEUE, Claim
from persistence.format import client_id_owner_key, queue_keys, queue_owner_key
from persistence.owner_store import RedisOwners
from persistence.redis_store import RedisMessageStore


async def _claim(
    owners: RedisOwners, kind: str, name: str, owner: str | None, ttl: float
) -> Claim | None:
    answer: asyncio.Future[Claim | None] = asyncio.get_running_loop().create_future()
    owners.claim(kind, name, owner, ttl, answer.set_result)
    return await answer


async def test_the_first_owner_holds_a_client_id_until_it_runs_out_or_is_released(
    store: RedisMessageStore, cid: str
) -> None:
    owners = RedisOwners(store)
    assert await _claim(owners, CLIENT_ID, cid, "alice", 60) == Claim(True)
    assert await _claim(owners, CLIENT_ID, cid, "bob", 60) == Claim(False, "alice")
    assert await _claim(owners, CLIENT_ID, cid, None, 60) == Claim(False, "alice")
    assert await _claim(owners, CLIENT_ID, cid, "alice", 60) == Claim(True)  # refreshed
    held = await owners.holder(CLIENT_ID, cid)
    assert held is not None and held[0] == "alice" and 59 < (held[1] or 0) <= 60
    assert await owners.assign(CLIENT_ID, cid, None, 0) == "alice"  # released
    assert await owners.holder(CLIENT_ID, cid) is None
    assert await _claim(owners, CLIENT_ID, cid, None, 60) == Claim(True)  # asked, not kept
    assert await owners.holder(CLIENT_ID, cid) is None
    assert await _claim(owners, CLIENT_ID, cid, "bob", 0.05) == Claim(True)
    await asyncio.sleep(0.2)  # Redis's clock: unused that long, free again
    assert await _claim(owners, CLIENT_ID, cid, "carol", 60) == Claim(True)


async def test_a_queue_is_owned_without_deadline_beside_its_keys(
    store: RedisMessageStore, cid: str
) -> None:
    owners = RedisOwners(store)
    assert await _claim(owners, QUEUE, cid, "dev7", 0) == Claim(True)
    assert await _claim(owners, QUEUE, cid, "mallory", 0) == Claim(False, "dev7")
    assert await owners.holder(QUEUE, cid) == ("dev7", None)
    assert await owners.holder(CLIENT_ID, cid) is None  # the ID's claim is another key
    assert await owners.assign(QUEUE, cid, "mallory", 0) == "dev7"
    assert await _claim(owners, QUEUE, cid, "dev7", 0) == Claim(False, "mallory")
    # one Redis Cluster slot with the queue and the client's keys
    slots = {key_slot(k.encode()) for k in (queue_owner_key(cid), client_id_owner_key(cid))}
    assert slots == {key_slot(queue_keys(cid).pending.encode())}
