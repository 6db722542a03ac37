"""Claims on client IDs and $ECQ queues in Redis (broker/ownership.py), shared by
every replica: one string per claim, the owner's name, in the client's Cluster
slot (persistence/format.py :func:`client_id_owner_key`, :func:`queue_owner_key`).
A client ID's claim expires ``auth.client_id_release_after`` after its last use
(Redis's clock); a queue's stays until an admin changes it. A claim is one script
(persistence/lua/owner_claim.lua), so two replicas claiming at once agree.

Each owner's queues are indexed beside their claims: a set per owner
(:func:`owner_queues_key`) and one sorted set of owner -> how many
(:data:`QUEUE_OWNERS_KEY`), each key in its own slot, so they are written after
the claim, one command at a time (Redis Cluster runs no script over two slots).
``ecq.max_queues_per_owner`` is checked before a claim (the count it may reach)
and again after it: two replicas claiming new queues of one owner at once both
count theirs (ZINCRBY is atomic), and the one that took the count past the limit
takes its claim back (owner_unclaim.lua) and is refused, so the limit holds
exactly. A process that dies between the claim and the index leaves a claim
unindexed: its owner's next claim of that queue indexes it; one that dies
between SADD and ZINCRBY leaves the queue uncounted (one more may be claimed).
"""

from __future__ import annotations

import asyncio
import logging
from typing import cast

from broker.ownership import CLIENT_ID, QUEUE, Claim, ClaimDone
from persistence.format import (
    QUEUE_OWNERS_KEY,
    client_id_owner_key,
    owner_queues_key,
    queue_owner_key,
)
from persistence.redis_store import RedisMessageStore, lua_script

log = logging.getLogger("devicemq.owners")

_CLAIM = lua_script("owner_claim")
_UNCLAIM = lua_script("owner_unclaim")
CLOSE_TIMEOUT = 5.0  # seconds a shutdown waits for claims under way
FULL = 2  # owner_claim.lua: free, but the owner may make no new claim


def _key(kind: str, name: str) -> str:
    return client_id_owner_key(name) if kind == CLIENT_ID else queue_owner_key(name)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisOwners:
    """:class:`broker.ownership.Owners` in Redis."""

    def __init__(self, store: RedisMessageStore) -> None:
        self._store = store
        self._tasks: set[asyncio.Task[None]] = set()

    def claim(
        self,
        kind: str,
        name: str,
        owner: str | None,
        ttl: float,
        done: ClaimDone,
        most: int | None = None,
    ) -> None:
        task = asyncio.get_running_loop().create_task(
            self._claim(kind, name, owner, ttl, done, most)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _claim(
        self,
        kind: str,
        name: str,
        owner: str | None,
        ttl: float,
        done: ClaimDone,
        most: int | None,
    ) -> None:
        indexed = kind == QUEUE and owner is not None
        try:
            may_add = await self._may_add(owner, most) if indexed else True
            reply = await self._store.run_script(
                _CLAIM,
                (_key(kind, name),),
                (
                    owner or "",
                    int(ttl * 1000),
                    "0" if owner is None else "1",
                    "1" if may_add else "0",
                ),
            )
            status = int(reply[0])
            if status == FULL:
                done(Claim(False, quota=True))
                return
            if not status:
                done(Claim(False, _text(reply[1])))
                return
            if indexed and not await self._index(name, cast(str, owner), most, int(reply[1])):
                done(Claim(False, quota=True))
                return
        except Exception as error:  # connection errors, cluster errors
            log.warning("claiming %s %r failed: %s", kind.replace("_", " "), name, error)
            done(None)
            return
        done(Claim(True))

    async def _may_add(self, owner: str | None, most: int | None) -> bool:
        """May ``owner`` claim one more queue (``most``: None, no limit)?"""
        if most is None or owner is None:
            return True
        if most <= 0:
            return False
        held = await self._store.redis.zscore(QUEUE_OWNERS_KEY, owner)
        return int(held or 0) < most

    async def _index(self, queue: str, owner: str, most: int | None, new: int) -> bool:
        """Note ``queue`` in ``owner``'s index. False: it was a new claim that took the
        owner past ``most`` (another replica's claim came first): taken back."""
        redis = self._store.redis
        if not await redis.sadd(owner_queues_key(owner), queue):
            return True
        count = await redis.zincrby(QUEUE_OWNERS_KEY, 1, owner)
        if not new or most is None or int(count or 0) <= most:
            return True
        await redis.srem(owner_queues_key(owner), queue)
        await redis.zincrby(QUEUE_OWNERS_KEY, -1, owner)
        await self._store.run_script(_UNCLAIM, (queue_owner_key(queue),), (owner,))
        return False

    async def _reindex(self, queue: str, before: str | None, owner: str | None) -> None:
        """An admin gave ``queue`` from ``before`` to ``owner`` (None: nobody)."""
        redis = self._store.redis
        if (
            before is not None
            and before != owner
            and await redis.srem(owner_queues_key(before), queue)
        ):
            await redis.zincrby(QUEUE_OWNERS_KEY, -1, before)
        if (
            owner is not None
            and owner != before
            and await redis.sadd(owner_queues_key(owner), queue)
        ):
            await redis.zincrby(QUEUE_OWNERS_KEY, 1, owner)

    async def queues_of(self, owner: str) -> set[str]:
        members = await self._store.redis.smembers(owner_queues_key(owner))
        return {_text(m) for m in members}

    async def holder(self, kind: str, name: str) -> tuple[str, float | None] | None:
        key = _key(kind, name)
        redis = self._store.redis
        owner, left = await asyncio.gather(redis.get(key), redis.pttl(key))
        if owner is None:
            return None
        return _text(owner), None if int(left) < 0 else int(left) / 1000

    async def assign(self, kind: str, name: str, owner: str | None, ttl: float) -> str | None:
        key = _key(kind, name)
        redis = self._store.redis
        if owner is None:
            before: object = await redis.getdel(key)
        else:
            before = await redis.set(key, owner, px=int(ttl * 1000) or None, get=True)
        held = None if before is None else _text(cast(bytes, before))
        if kind == QUEUE:
            await self._reindex(name, held, owner)
        return held

    async def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Wait for the claims under way (refreshes of connections that ended), at most
        ``timeout`` seconds; the rest are cancelled (their clients claim again when
        they connect)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)
        for task in set(self._tasks):
            task.cancel()
