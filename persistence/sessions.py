"""Durable session state in Redis, so sessions survive broker restarts.

Each durable session's state (subscriptions, expiry) is the store's
``{cid}_session`` key; the index ``devicemq:sessions`` (a sorted set, score =
expiry deadline in epoch seconds, +inf while connected or never expiring)
lists them for the restore at start-up. Saves for one client run one at a
time and the latest state wins, so a slow save never overwrites a newer one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from broker.core import Broker
from broker.session import NEVER_EXPIRES, Session
from broker.topics import SubscriptionEntry
from persistence.redis_store import RedisMessageStore, SessionState, SubscriptionState

log = logging.getLogger("devicemq.sessions")

INDEX_KEY = "devicemq:sessions"
SAVE_ATTEMPTS = 20
RETRY_DELAY = 0.5
RESTORE_CONCURRENCY = 50
# Redis keeps a disconnected session's keys this much longer than the session
# lasts: the broker deletes them itself when the session expires, and that delete
# must still find the refs to remove the message strings (whose TTL is their own,
# up to default_message_ttl). Expired by Redis first, the strings were orphaned.
EXPIRY_GRACE = 60

Done = Callable[[bool], None]


@dataclass(slots=True)
class _Pending:
    state: SessionState | None  # None: delete
    deadline: float  # index score
    ttl: int | None
    callbacks: list[Done]
    delete_first: bool = False  # a delete was queued before this save (clean start)


class SessionStateStore:
    def __init__(self, store: RedisMessageStore, wall_clock: Callable[[], float] = time.time):
        self._store = store
        self._wall_clock = wall_clock
        self._pending: dict[str, _Pending] = {}
        self._busy: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._drains: dict[str, asyncio.Task[None]] = {}

    def save(self, session: Session, on_saved: Done) -> None:
        now = self._wall_clock()
        connected = session.connection is not None
        forever = connected or session.expiry_interval == NEVER_EXPIRES
        state = SessionState(
            None if session.expiry_interval == NEVER_EXPIRES else session.expiry_interval,
            now,
            {
                f: SubscriptionState(
                    e.qos, e.no_local, e.retain_as_published, e.retain_handling, e.subscription_id
                )
                for f, e in session.subscriptions.items()
            },
            session.connection.protocol_level if session.connection is not None else 5,
            tuple(sorted(pid for pid, held in session.incoming_qos2.items() if held)),
        )
        deadline = math.inf if forever else now + session.expiry_interval
        self._enqueue(
            session.client_id,
            state,
            deadline,
            None if forever else session.expiry_interval + EXPIRY_GRACE,
            on_saved,
        )

    def delete(self, client_id: str) -> None:
        self._enqueue(client_id, None, 0.0, None, lambda ok: None)

    async def flush(self) -> None:
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def settled(self, client_id: str) -> None:
        """Wait until what is queued for ``client_id`` is written (a clean start's
        delete must land before the new session reads the store)."""
        while (task := self._drains.get(client_id)) is not None:
            await asyncio.wait({task})

    async def restore(self, broker: Broker) -> int:
        """Recreate every durable session saved in Redis; expired ones are deleted."""
        redis = self._store.redis
        entries = cast(
            list[tuple[bytes, float]], await redis.zrange(INDEX_KEY, 0, -1, withscores=True)
        )
        now = self._wall_clock()
        gate = asyncio.Semaphore(RESTORE_CONCURRENCY)
        restored = 0

        async def restore_one(raw: bytes, deadline: float) -> None:
            nonlocal restored
            client_id = raw.decode()
            async with gate:
                state = await self._store.load_session(client_id)
                if state is None or deadline <= now:
                    await self._remove(client_id)
                    return
            expiry = NEVER_EXPIRES if state.expiry_interval is None else state.expiry_interval
            if math.isinf(deadline):
                # Saved while connected: the broker died under it; expiry starts now.
                expires_in = None if expiry == NEVER_EXPIRES else float(expiry)
            else:
                expires_in = deadline - now
            subscriptions = [
                SubscriptionEntry(
                    client_id,
                    f,
                    s.qos,
                    s.no_local,
                    s.retain_as_published,
                    s.retain_handling,
                    s.subscription_id,
                )
                for f, s in state.subscriptions.items()
            ]
            restored_session = broker.restore_session(client_id, expiry, subscriptions, expires_in)
            restored_session.incoming_qos2 = dict.fromkeys(state.qos2_received, True)
            restored += 1

        await asyncio.gather(*(restore_one(raw, score) for raw, score in entries))
        return restored

    def _enqueue(
        self,
        client_id: str,
        state: SessionState | None,
        deadline: float,
        ttl: int | None,
        done: Done,
    ) -> None:
        previous = self._pending.get(client_id)
        callbacks = [*previous.callbacks, done] if previous is not None else [done]
        # The latest state wins, but a delete it replaces must still happen first.
        delete_first = previous is not None and (previous.state is None or previous.delete_first)
        self._pending[client_id] = _Pending(state, deadline, ttl, callbacks, delete_first)
        if client_id not in self._busy:
            self._busy.add(client_id)
            task = asyncio.get_running_loop().create_task(self._drain(client_id))
            self._tasks.add(task)
            self._drains[client_id] = task
            task.add_done_callback(self._tasks.discard)

    async def _drain(self, client_id: str) -> None:
        try:
            while (pending := self._pending.pop(client_id, None)) is not None:
                ok = await self._write(client_id, pending)
                for done in pending.callbacks:
                    done(ok)
        finally:
            self._busy.discard(client_id)
            self._drains.pop(client_id, None)

    async def _write(self, client_id: str, pending: _Pending) -> bool:
        for _ in range(SAVE_ATTEMPTS):
            try:
                if pending.state is None or pending.delete_first:
                    await self._remove(client_id)
                    pending.delete_first = False
                if pending.state is not None:
                    await self._store.save_session(client_id, pending.state, ttl=pending.ttl)
                    await self._store.redis.zadd(INDEX_KEY, {client_id: pending.deadline})
                return True
            except Exception as error:
                log.warning("saving session %s failed: %s", client_id, error)
                await asyncio.sleep(RETRY_DELAY)
        return False

    async def _remove(self, client_id: str) -> None:
        await self._store.delete_session(client_id)
        await self._store.redis.zrem(INDEX_KEY, client_id)
