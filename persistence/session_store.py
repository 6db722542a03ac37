"""Durable session state in Redis, so sessions survive broker restarts and move between replicas.

Each durable session's state (subscriptions, expiry, owner) is the store's
``{cid}_session`` key and its generation ``{cid}_generation``; the index
``devicemq:sessions`` (a sorted set, score = expiry deadline in epoch seconds,
+inf while connected or never expiring) lists them for the restore at
start-up.

Operations on one client run one at a time, in the order asked: opening a
session (resume or new, before CONNACK), saving its state, ending it.
Consecutive saves are merged (the latest state wins). Every write is fenced
by the session's generation in Redis, so a broker holding an older session
of the client can neither overwrite nor delete a newer one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

from broker.core import Broker
from broker.persistent_path import OpenedSession, OpenRequest
from broker.session import NEVER_EXPIRES, Session
from broker.topics import SubscriptionEntry
from persistence.coalescing import Retry
from persistence.format import SessionState, SubscriptionState
from persistence.redis_store import RedisMessageStore, SessionOwned

log = logging.getLogger("devicemq.sessions")

SAVE_ATTEMPTS = 20
SLOW_OPERATION = 2.0  # seconds: a session write (or open) this slow is logged
OPEN_ATTEMPTS = 6  # a CONNECT waits at most this many tries for Redis
RESTORE_CONCURRENCY = 50  # ends of expired sessions written at once
RESTORE_CHUNK = 1000  # sessions read per Redis pipeline at a restore
# Redis keeps a disconnected session's keys this much longer than the session
# lasts: the broker deletes them itself when the session expires, and that delete
# must still find the refs to remove the message strings (whose TTL is their own,
# up to default_message_ttl). Expired by Redis first, the strings were orphaned.
EXPIRY_GRACE = 60

Done = Callable[[bool], None]
Opened = Callable[[OpenedSession | None], None]


@dataclass(slots=True)
class _Save:
    state: SessionState
    deadline: float  # index score
    ttl: int | None
    callbacks: list[Done] = field(default_factory=list)


@dataclass(slots=True)
class _End:
    generation: int
    done: Done | None = None
    opens: int | None = None  # an end by expiry: the resumes it saw (end_session)
    gone: Callable[[], None] | None = None  # once the store ended it (not refused)


@dataclass(slots=True)
class _Open:
    request: OpenRequest
    done: Opened


_Op = _Save | _End | _Open


class SessionStateStore:
    def __init__(self, store: RedisMessageStore, wall_clock: Callable[[], float] = time.time):
        self._store = store
        self._wall_clock = wall_clock
        self._queues: dict[str, deque[_Op]] = {}
        self._drains: dict[str, asyncio.Task[None]] = {}
        # Shared by every client's writes, so at a steady pace: one client's failures
        # must not lengthen another's waits (a CONNACK may wait on them).
        self.retry = Retry("session_saves", most=0)
        # A CONNECT waits for its session: tries at a steady pace, no growing waits.
        self.open_retry = Retry("session_opens", most=0)

    # -- asked by the broker ----------------------------------------------------------

    def open(self, client_id: str, request: OpenRequest, done: Opened) -> None:
        self._enqueue(client_id, _Open(request, done))

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
            session.generation,
            session.owner,
            session.username,
        )
        deadline = math.inf if forever else now + session.expiry_interval
        ttl = None if forever else session.expiry_interval + EXPIRY_GRACE
        queue = self._queues.get(session.client_id)
        last = queue[-1] if queue else None
        if isinstance(last, _Save) and last.state.generation == state.generation:
            # Not yet written: the latest state wins, every caller hears the outcome.
            last.state, last.deadline, last.ttl = state, deadline, ttl
            last.callbacks.append(on_saved)
            return
        self._enqueue(session.client_id, _Save(state, deadline, ttl, [on_saved]))

    def end(
        self,
        client_id: str,
        generation: int,
        on_ended: Done | None = None,
        opens: int | None = None,
        gone: Callable[[], None] | None = None,
    ) -> None:
        """End the session of ``generation``; ``opens``: it expired, and is kept if a
        client resumed it since this broker's count (RedisMessageStore.end_session).
        ``gone`` is called once the store ended it, not if it kept it."""
        self._enqueue(client_id, _End(generation, on_ended, opens, gone))

    async def flush(self) -> None:
        while self._drains:
            await asyncio.gather(*self._drains.values(), return_exceptions=True)

    async def settled(self, client_id: str) -> None:
        """Wait until what is queued for ``client_id`` is written."""
        while (task := self._drains.get(client_id)) is not None:
            await asyncio.wait({task})

    async def restore(self, broker: Broker) -> int:
        """Recreate every durable session saved in Redis; expired ones are deleted."""
        entries = await self._store.indexed_sessions()
        now = self._wall_clock()
        restored = 0
        ended: list[tuple[str, int]] = []  # expired or missing: their keys go
        for start in range(0, len(entries), RESTORE_CHUNK):
            chunk = entries[start : start + RESTORE_CHUNK]
            client_ids = [raw.decode() for raw, _ in chunk]
            states = await self._store.load_sessions(client_ids)
            for client_id, (_, deadline), state in zip(client_ids, chunk, states, strict=True):
                if state is None or deadline <= now:
                    ended.append((client_id, 0 if state is None else state.generation))
                elif self._restore_one(broker, client_id, deadline, now, state, ended):
                    restored += 1
            await asyncio.sleep(0)  # a chunk at a time: the loop is not held for all
        gate = asyncio.Semaphore(RESTORE_CONCURRENCY)

        async def end(client_id: str, generation: int) -> None:
            async with gate:
                await self._end(client_id, generation)

        await asyncio.gather(*(end(client_id, gen) for client_id, gen in ended))
        return restored

    def _restore_one(
        self,
        broker: Broker,
        client_id: str,
        deadline: float,
        now: float,
        state: SessionState,
        ended: list[tuple[str, int]],
    ) -> bool:
        """Recreate one stored session in ``broker``; False (and in ``ended``) if its
        expiry passed while no broker held it."""
        expiry = NEVER_EXPIRES if state.expiry_interval is None else state.expiry_interval
        if math.isinf(deadline):
            # Saved while connected: the broker died under it; expiry starts now.
            expires_in = None if expiry == NEVER_EXPIRES else float(expiry)
        else:
            expires_in = deadline - now
        if expires_in is not None and expires_in <= 0:
            # Expiry 0: it ended with its connection, which the crash closed; the
            # end was not written yet. Restored, a resume would find it present.
            ended.append((client_id, state.generation))
            return False
        restored_session = broker.restore_session(
            client_id, expiry, _entries(client_id, state), expires_in
        )
        restored_session.incoming_qos2 = dict.fromkeys(state.qos2_received, True)
        restored_session.generation = state.generation
        restored_session.opens = state.opens
        broker.bind_owner(restored_session, state.owner)
        restored_session.username = state.username
        broker.acl.client_connected(client_id, state.username)
        return True

    # -- the per-client queue ---------------------------------------------------------

    def _enqueue(self, client_id: str, op: _Op) -> None:
        queue = self._queues.get(client_id)
        if queue is None:
            queue = self._queues[client_id] = deque()
        queue.append(op)
        if client_id not in self._drains:
            task = asyncio.get_running_loop().create_task(self._drain(client_id, queue))
            self._drains[client_id] = task

    async def _drain(self, client_id: str, queue: deque[_Op]) -> None:
        try:
            while queue:
                op = queue.popleft()  # from now on, saves asked go into a new write
                started = time.monotonic()
                try:
                    if isinstance(op, _Open):
                        op.done(await self._open(client_id, op.request))
                    elif isinstance(op, _Save):
                        ok = await self._save(client_id, op)
                        for done in op.callbacks:
                            done(ok)
                    else:
                        ended: list[bool] = []
                        ok = await self._retrying(
                            partial(self._end, client_id, op.generation, op.opens, ended)
                        )
                        if op.done is not None:
                            op.done(ok)
                        if ended and op.gone is not None:
                            op.gone()
                except Exception:  # a callback's bug must not stop the queue
                    log.exception("session operation for %s failed", client_id)
                took = time.monotonic() - started
                if took >= SLOW_OPERATION:
                    log.info(
                        "session %s of %s took %.1f s (%d more queued)",
                        type(op).__name__.strip("_").lower(),
                        client_id,
                        took,
                        len(queue),
                    )
        finally:
            del self._drains[client_id]
            if self._queues.get(client_id) is queue and not queue:
                del self._queues[client_id]

    async def _open(self, client_id: str, request: OpenRequest) -> OpenedSession | None:
        state = SessionState(
            request.expiry_interval,
            self._wall_clock(),
            protocol_level=request.protocol_level,
            owner=request.owner,
            username=request.username,
        )
        proposed = int(self._wall_clock() * 1000) * 1000
        for attempt in range(OPEN_ATTEMPTS):
            try:
                found = await self._store.open_session(
                    client_id,
                    resume=not request.clean_start,
                    generation=proposed,
                    state=state,
                    enforce_owner=request.enforce_owner,
                )
                break
            except SessionOwned:
                return OpenedSession(0, False, [], (), None, refused=True)
            except Exception as error:
                log.warning("opening session %s failed: %s", client_id, error)
                if attempt + 1 == OPEN_ATTEMPTS:
                    self.open_retry.gave_up()
                    return None
                await self.open_retry.wait()
        if found is None:  # a new session, written with its generation
            await self._index(client_id, math.inf)
            return OpenedSession(state.generation, False, [], (), request.owner)
        return OpenedSession(
            found.generation,
            True,
            _entries(client_id, found),
            found.qos2_received,
            found.owner,
            opens=found.opens,
        )  # the username is the one connecting now

    async def _save(self, client_id: str, op: _Save) -> bool:
        async def write() -> None:
            if await self._store.save_session(client_id, op.state, ttl=op.ttl):
                await self._index(client_id, op.deadline)

        return await self._retrying(write)

    async def _retrying(self, write: Callable[[], Awaitable[object]]) -> bool:
        for _ in range(SAVE_ATTEMPTS):
            try:
                await write()
                self.retry.succeeded()
                return True
            except Exception as error:
                log.warning("writing session state failed: %s", error)
                await self.retry.wait()
        self.retry.gave_up()
        return False

    async def _index(self, client_id: str, deadline: float) -> None:
        await self._store.index_session(client_id, deadline)

    async def _end(
        self,
        client_id: str,
        generation: int,
        opens: int | None = None,
        ended: list[bool] | None = None,
    ) -> None:
        """End it in the store; ``ended`` gets True if it did (neither a newer session
        nor a resume since ``opens`` kept it)."""
        if await self._store.end_session(client_id, generation, opens) is not None:
            if ended is not None:
                ended.append(True)
            await self._store.unindex_session(client_id)


def _entries(client_id: str, state: SessionState) -> list[SubscriptionEntry]:
    return [
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
