"""Claims on client IDs and $ECQ queues in Redis (broker/ownership.py), shared by
every replica: one string per claim, the owner's name, in the client's Cluster
slot (persistence/format.py :func:`client_id_owner_key`, :func:`queue_owner_key`).
A client ID's claim expires ``auth.client_id_release_after`` after its last use
(Redis's clock); a queue's stays until an admin changes it. A claim is one script
(persistence/lua/owner_claim.lua), so two replicas claiming at once agree."""

from __future__ import annotations

import asyncio
import logging
from typing import cast

from broker.ownership import CLIENT_ID, Claim, ClaimDone
from persistence.format import client_id_owner_key, queue_owner_key
from persistence.redis_store import RedisMessageStore, lua_script

log = logging.getLogger("devicemq.owners")

_CLAIM = lua_script("owner_claim")
CLOSE_TIMEOUT = 5.0  # seconds a shutdown waits for claims under way


def _key(kind: str, name: str) -> str:
    return client_id_owner_key(name) if kind == CLIENT_ID else queue_owner_key(name)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisOwners:
    """:class:`broker.ownership.Owners` in Redis."""

    def __init__(self, store: RedisMessageStore) -> None:
        self._store = store
        self._tasks: set[asyncio.Task[None]] = set()

    def claim(self, kind: str, name: str, owner: str | None, ttl: float, done: ClaimDone) -> None:
        task = asyncio.get_running_loop().create_task(self._claim(kind, name, owner, ttl, done))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _claim(
        self, kind: str, name: str, owner: str | None, ttl: float, done: ClaimDone
    ) -> None:
        try:
            reply = await self._store.run_script(
                _CLAIM,
                (_key(kind, name),),
                (owner or "", int(ttl * 1000), "0" if owner is None else "1"),
            )
        except Exception as error:  # connection errors, cluster errors
            log.warning("claiming %s %r failed: %s", kind.replace("_", " "), name, error)
            done(None)
            return
        granted = bool(int(reply[0]))
        done(Claim(granted, None if granted else _text(reply[1])))

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
        return None if before is None else _text(cast(bytes, before))

    async def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Wait for the claims under way (refreshes of connections that ended), at most
        ``timeout`` seconds; the rest are cancelled (their clients claim again when
        they connect)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)
        for task in set(self._tasks):
            task.cancel()
