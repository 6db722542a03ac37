"""The block list in Redis: shared by every replica, kept across restarts.

One hash, ``devicemq:blocked`` (persistence/format.py), maps an entry's key
(``kind:value``) to its JSON (broker/blocklist.py). A write goes to Redis
first, then into the broker's list (which closes matching connections and
tells the other replicas over the cluster link). Pub/sub being at most once,
every replica also re-reads the whole hash every ``REFRESH_INTERVAL`` and
applies the difference: an entry it missed is enforced then, one removed
elsewhere goes. Entries past their deadline are deleted from Redis when read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import orjson

from broker.blocklist import BadEntry, BlockEntry, entry_from_json
from broker.core import Broker
from persistence.format import BLOCKED_KEY

log = logging.getLogger("devicemq.blocklist")

REFRESH_INTERVAL = 10.0  # seconds between two reads of the whole list

# Delete ended entries only if they are still the value read: an entry written
# again meanwhile (a new ban of the same key) stays.
_DELETE_IF_UNCHANGED = """
local n = 0
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    n = n + redis.call('HDEL', KEYS[1], ARGV[i])
  end
end
return n
"""


class BlockListStore:
    """Reads and writes the shared list; :meth:`start` keeps a broker's copy current."""

    def __init__(self, redis: Any, wall_clock: Callable[[], float] = time.time) -> None:
        self.redis = redis
        self._wall_clock = wall_clock
        self._lock = asyncio.Lock()  # a refresh never applies a list older than a write
        self._task: asyncio.Task[None] | None = None
        self._writes: set[asyncio.Task[None]] = set()
        self._unwritten: set[str] = set()  # keys of our own entries on their way to Redis

    async def load(self) -> list[BlockEntry]:
        """Every entry in force (expired ones are deleted on the way)."""
        raw = await self.redis.hgetall(BLOCKED_KEY)
        now = self._wall_clock()
        entries: list[BlockEntry] = []
        stale: list[bytes] = []
        for key, value in raw.items():
            try:
                entry = entry_from_json(orjson.loads(value))
            except (BadEntry, orjson.JSONDecodeError, AttributeError, TypeError) as e:
                log.warning("block-list entry %r in Redis is unreadable: %s", key, e)
                continue
            if entry.expired(now):
                stale += [key, value]
            else:
                entries.append(entry)
        if stale:
            await self.redis.eval(_DELETE_IF_UNCHANGED, 1, BLOCKED_KEY, *stale)
        return entries

    async def add(self, entry: BlockEntry) -> None:
        async with self._lock:
            await self.redis.hset(BLOCKED_KEY, entry.key, orjson.dumps(entry.to_json()))

    async def remove(self, key: str) -> bool:
        async with self._lock:
            return bool(await self.redis.hdel(BLOCKED_KEY, key))

    def keep(self, entry: BlockEntry) -> None:
        """For the broker's own entries (flapping): written in the background."""
        self._unwritten.add(entry.key)
        task = asyncio.get_running_loop().create_task(self._keep(entry))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _keep(self, entry: BlockEntry) -> None:
        try:
            await self.add(entry)
        except Exception as e:  # in force here until the next refresh
            log.warning("block-list entry %s not written to Redis: %s", entry.key, e)
        finally:
            self._unwritten.discard(entry.key)

    # -- the broker's copy -------------------------------------------------------------

    async def refresh(self, broker: Broker) -> None:
        """Make ``broker``'s list the one in Redis, enforcing entries it lacked.

        An entry added or removed here while Redis was read (this replica's own
        write, or one another replica announced) is left as it is now: the list
        read may be older than that change."""
        blocks = broker.blocklist
        async with self._lock:
            mark = blocks.changes
            entries = await self.load()
            fresh = {e.key: e for e in entries}
            for entry in blocks.entries():
                key = entry.key
                kept = key in fresh or key in self._unwritten or blocks.changed_since(key, mark)
                if not kept:
                    broker.remove_block(key, share=False)
            for entry in entries:
                if blocks.get(entry.key) != entry and not blocks.changed_since(entry.key, mark):
                    broker.add_block(entry, share=False)
            blocks.forget_changes(mark)

    def start(self, broker: Broker, interval: float = REFRESH_INTERVAL) -> None:
        self._task = asyncio.get_running_loop().create_task(self._refreshing(broker, interval))

    async def _refreshing(self, broker: Broker, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.refresh(broker)
            except Exception as e:
                log.warning("block list not refreshed from Redis: %s", e)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
