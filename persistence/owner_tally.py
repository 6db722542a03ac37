"""The tally of ``auth.max_bytes_per_owner`` (broker/budget.py): every
``auth.owner_tally_interval`` seconds, how many bytes of stored messages each
owner holds, read from the byte counters the store's scripts keep.

What an owner holds: its durable sessions (``{cid}_bytes``, persistence/lua/
save_batch.lua), the $ECQ queues it claimed and the group queues its sessions are
members of (``{id}_ecq_bytes``, queue_save.lua), each group once. Which owners
hold what comes from the broker (its sessions, other replicas' too) and from the
owners' queue index in Redis (persistence/owner_store.py).

Bounded in cost: only owners whose stores, each at its own byte limit, could pass
the budget are read (:func:`broker.budget.could_pass`); the queue counts of the
owners with sessions are one ZMSCORE per :data:`CHUNK` owners, and the owners
holding queues only are found by score (ZRANGEBYSCORE); the counters are read
:data:`CHUNK` at a time, one pipeline (on a Redis Cluster, one per node).
Nothing of it runs on a message's way. Each replica runs its own tally and
reaches the same answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from typing import TYPE_CHECKING, cast

from broker.budget import Usage, could_pass
from persistence.format import (
    BYTES_FIELD,
    QUEUE_OWNERS_KEY,
    client_keys,
    owner_queues_key,
    queue_keys,
)
from persistence.redis_store import RedisMessageStore

if TYPE_CHECKING:
    from broker.budget import OwnerBudget
    from broker.config import Settings

# Each owner's stores as the broker knows them: owner -> (client ids of its durable
# sessions, the group queues they are members of); Broker.stores_by_owner.
StoresByOwner = Callable[[], dict[str, tuple[list[str], set[str]]]]

CLOSE_TIMEOUT = 2.0  # seconds a shutdown waits for a tally under way to end

log = logging.getLogger("devicemq.budget")

CHUNK = 1000  # commands per pipeline round trip


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class OwnerTally:
    def __init__(
        self,
        store: RedisMessageStore,
        settings: Settings,
        budget: OwnerBudget,
        stores_by_owner: StoresByOwner,
    ) -> None:
        self._redis = store.redis
        self.budget = budget  # what the tally settles: the broker's
        self._stores_by_owner = stores_by_owner
        self.interval = settings.auth.owner_tally_interval
        # Each store's own byte limit: sessions, $ECQ queues, group queues (0: none)
        self.limits = (
            settings.persistence.max_bytes_per_client,
            settings.ecq.max_bytes,
            settings.group_queues.max_bytes,
        )
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Tally every ``auth.owner_tally_interval`` seconds, the first one now."""
        if self.budget.limit and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Stop tallying; a tally under way gets ``timeout`` seconds to end after its
        cancel (one waiting on a Redis that does not answer held a worker's drain
        for its whole 60 s under load: tests/cluster/test_workers.py)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task}, timeout=timeout)

    async def _run(self) -> None:
        while True:
            try:
                await self.once()
            except Exception as error:  # Redis away: who was over stays over
                log.warning("tallying the bytes owners hold failed: %s", error)
            await asyncio.sleep(self.interval)

    async def once(self) -> None:
        """One tally: the owners whose stores could pass the budget, read and settled."""
        started = time.perf_counter()
        budget = self.budget
        held = self._stores_by_owner()
        counts = await self._queue_counts(held)
        candidates = [
            owner
            for owner in held.keys() | counts.keys()
            if could_pass(
                budget.limit,
                (
                    len(held[owner][0]) if owner in held else 0,
                    counts.get(owner, 0),
                    len(held[owner][1]) if owner in held else 0,
                ),
                self.limits,
            )
        ]
        queues = await self._queues([o for o in candidates if counts.get(o, 0)])
        usage = await self._measure(candidates, held, queues)
        budget.settle(usage, queues)
        budget.seconds = time.perf_counter() - started

    async def _queue_counts(self, held: Iterable[str]) -> dict[str, int]:
        """How many $ECQ queues each owner holds: those with sessions asked by name,
        the others found if they hold enough to pass the budget on queues alone."""
        per_queue = self.limits[1]
        alone = self.budget.limit // per_queue + 1 if per_queue else 1
        counts: dict[str, int] = {}
        found = cast(
            list[tuple[bytes, float]],
            await self._redis.zrangebyscore(QUEUE_OWNERS_KEY, alone, "+inf", withscores=True),
        )
        for name, count in found:
            counts[_text(name)] = int(count)
        names = [o for o in held if o not in counts]
        for start in range(0, len(names), CHUNK):
            chunk = names[start : start + CHUNK]
            scores = await self._redis.zmscore(QUEUE_OWNERS_KEY, chunk)
            for owner, score in zip(chunk, scores, strict=True):
                if score:
                    counts[owner] = int(score)
        return counts

    async def _queues(self, owners: Sequence[str]) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for start in range(0, len(owners), CHUNK):
            chunk = owners[start : start + CHUNK]
            pipe = self._redis.pipeline(transaction=False)
            for owner in chunk:
                pipe.smembers(owner_queues_key(owner))
            for owner, members in zip(chunk, await pipe.execute(), strict=True):
                out[owner] = {_text(m) for m in members}
        return out

    async def _measure(
        self,
        owners: Sequence[str],
        held: dict[str, tuple[list[str], set[str]]],
        queues: dict[str, set[str]],
    ) -> dict[str, Usage]:
        """Read the byte counters of ``owners``' stores, :data:`CHUNK` per round trip
        (the keys made a chunk at a time: the event loop is held for one chunk's)."""
        sums = {owner: [0, 0, 0] for owner in owners}
        reads = iter(_counters(owners, held, queues))
        redis = self._redis
        while chunk := list(islice(reads, CHUNK)):
            # A session's count is a field of its values hash, a queue's a key of its
            # own: one pipeline of HGETs and GETs (on a cluster, one per node).
            pipe = redis.pipeline(transaction=False)
            for _owner, kind, key in chunk:
                if kind == 0:
                    pipe.hget(key, BYTES_FIELD)
                else:
                    pipe.get(key)
            values = await pipe.execute()
            for (owner, kind, _), value in zip(chunk, values, strict=True):
                if value:
                    sums[owner][kind] += int(value)
        usage: dict[str, Usage] = {}
        for owner, (s_bytes, q_bytes, g_bytes) in sums.items():
            sessions, groups = held.get(owner, ([], set()))
            n_queues = len(queues.get(owner, ()))
            usage[owner] = Usage(s_bytes, q_bytes, g_bytes, len(sessions), n_queues, len(groups))
        return usage


def _counters(
    owners: Sequence[str],
    held: dict[str, tuple[list[str], set[str]]],
    queues: dict[str, set[str]],
) -> Iterator[tuple[str, int, str]]:
    """(owner, 0 session / 1 queue / 2 group, its byte counter's key) of every store
    (a session's: the hash whose field :data:`BYTES_FIELD` it is)."""
    for owner in owners:
        sessions, groups = held.get(owner, ([], set()))
        for client_id in sessions:
            yield owner, 0, client_keys(client_id).values
        for queue in queues.get(owner, ()):
            yield owner, 1, queue_keys(queue).bytes
        for group in groups:
            yield owner, 2, queue_keys(group).bytes
