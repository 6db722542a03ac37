"""Retained messages in Redis (``persistence.enabled``): they survive restarts and,
with ``cluster.enabled``, every replica sees the same ones.

The in-memory :class:`broker.retained.RetainedStore` stays the read path. Every
change made here (a retained PUBLISH, its deletion by an empty payload, a
retained will) is written through to the hash ``devicemq:retained`` (topic ->
stored-message encoding, expiry as an absolute wall-clock time); the hash is
loaded at start-up, expired entries dropped. With a cluster, once a write is in
Redis the other replicas are told its topics (``ClusterState.retained_changed``)
and read them back from the hash, so they all converge on its last write; a
replica that may have missed notices (pub/sub reconnected) re-reads them all.

One task does the Redis I/O, in call order: a read of a topic is applied only
if no local write of that topic follows it (the local write is newer; if
another replica writes after it, its notice comes later and is read again).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from broker.message import Delivery, Message
from broker.retained import RetainedStore
from persistence.coalescing import Retry
from persistence.delivery_codec import encode_delivery, stored_delivery
from persistence.format import RETAINED_KEY, decode_record

log = logging.getLogger("devicemq.retained")


def encode_retained(message: Message, wall: float, now: float) -> bytes:
    return encode_delivery(Delivery(message, message.qos, True), wall, now)


def decode_retained(value: bytes, wall: float, now: float) -> Message | None:
    """The retained message of a hash value; None if it has expired."""
    stored = decode_record(0, 0, value).message
    if stored is None or (stored.expiry is not None and stored.expiry <= wall):
        return None
    return stored_delivery(stored, wall, now).message


class _Waiter:
    """A publisher waiting for its retained message to be written (once, either way)."""

    __slots__ = ("done", "timer")

    def __init__(self, done: Callable[[bool], None], timeout: float) -> None:
        self.done: Callable[[bool], None] | None = done
        self.timer = asyncio.get_running_loop().call_later(timeout, self.fire, False)

    def fire(self, ok: bool) -> None:
        done, self.done = self.done, None
        self.timer.cancel()
        if done is not None:
            done(ok)


_Op = tuple[str, str, Message | None, list[_Waiter]]  # ("w"|"r", topic, message, waiters)


class RetainedPersistence:
    """``timeout``: seconds a publisher waits for its retained message to be written
    before it is told the PUBLISH failed (the write goes on; a re-send is harmless)."""

    def __init__(
        self,
        redis: Any,  # redis.asyncio.Redis or RedisCluster: one key, so either works
        retained: RetainedStore,
        clock: Callable[[], float],
        timeout: float = 10.0,
    ) -> None:
        self._redis = redis
        self._retained = retained
        self._clock = clock
        self._timeout = timeout
        self._ops: list[_Op] = []
        # topic -> index in _ops of its write not yet sent: a newer one replaces it, so
        # what waits while Redis is down is one write per topic, not one per PUBLISH
        self._unsent: dict[str, int] = {}
        self._writes = Counter[str]()  # queued writes per topic
        self._task: asyncio.Task[None] | None = None
        self._resync: asyncio.Task[None] | None = None
        self.retry = Retry("retained")
        self.written: Callable[[list[str]], None] | None = None  # cluster: tell the others

    async def load(self) -> int:
        """Fill the in-memory store from the hash, dropping expired entries."""
        wall, now = time.time(), self._clock()
        entries: dict[bytes, bytes] = await self._redis.hgetall(RETAINED_KEY)
        expired = []
        for raw_topic, value in entries.items():
            message = decode_retained(value, wall, now)
            if message is None:
                expired.append(raw_topic)
            else:
                self._retained.replace(message.topic, message)
        if expired:
            await self._redis.hdel(RETAINED_KEY, *expired)
        self._retained.on_change = self.changed
        return len(entries) - len(expired)

    def changed(self, message: Message, done: Callable[[bool], None] | None = None) -> None:
        """``RetainedStore.on_change``: write ``message`` (empty payload: delete) through,
        then ``done(True)``; ``done(False)`` if it is not written within the timeout."""
        topic = message.topic
        waiters = [] if done is None else [_Waiter(done, self._timeout)]
        unsent = self._unsent.get(topic)
        if unsent is not None:  # not sent yet: the newest message of the topic wins
            _kind, _topic, _old, before = self._ops[unsent]
            self._ops[unsent] = ("w", topic, message, before + waiters)
            return
        self._writes[topic] += 1
        self._unsent[topic] = len(self._ops)
        self._push(("w", topic, message, waiters))

    def refresh(self, topics: Iterable[str]) -> None:
        """Another replica changed ``topics``: read them back from the hash."""
        for topic in topics:
            self._push(("r", topic, None, []))

    def resync(self) -> None:
        """Notices may have been missed: re-read every topic known here or in the hash."""
        if self._resync is None:
            self._resync = asyncio.get_running_loop().create_task(self._reread_all())

    async def _reread_all(self) -> None:
        try:
            keys: list[bytes] = await self._redis.hkeys(RETAINED_KEY)
        except Exception as error:
            log.warning("retained: re-reading after a re-sync failed: %s", error)
            return
        finally:
            self._resync = None
        self.refresh(dict.fromkeys([*self._retained.topics(), *(k.decode() for k in keys)]))

    async def close(self) -> None:
        """Write what is queued (bounded), then stop."""
        self._retained.on_change = None
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 5.0)
            except Exception:
                log.warning("retained: %d changes not written at shutdown", len(self._ops))
                self._task.cancel()

    def _push(self, op: _Op) -> None:
        self._ops.append(op)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            while self._ops:
                batch, self._ops, self._unsent = self._ops, [], {}
                try:
                    results = await self._execute(batch)
                except Exception as error:
                    log.warning("retained: writing to redis failed: %s", error)
                    self._ops = batch + self._ops
                    self._unsent = {
                        topic: i for i, (kind, topic, _, _) in enumerate(self._ops) if kind == "w"
                    }
                    await self.retry.wait()
                    continue
                self.retry.succeeded()
                self._applied(batch, results)
                for *_, waiters in batch:
                    for waiter in waiters:
                        waiter.fire(True)
        finally:
            self._task = None

    async def _execute(self, batch: list[_Op]) -> list[Any]:
        wall, now = time.time(), self._clock()
        async with self._redis.pipeline(transaction=False) as pipe:
            for kind, topic, message, _ in batch:
                if kind == "r":
                    pipe.hget(RETAINED_KEY, topic)
                elif message is not None and message.payload and not message.expired(now):
                    pipe.hset(RETAINED_KEY, topic, encode_retained(message, wall, now))
                else:
                    pipe.hdel(RETAINED_KEY, topic)
            return list(await pipe.execute())

    def _applied(self, batch: list[_Op], results: list[Any]) -> None:
        wall, now = time.time(), self._clock()
        last_write = {topic: i for i, (kind, topic, _, _) in enumerate(batch) if kind == "w"}
        written: list[str] = []
        for i, ((kind, topic, _, _), value) in enumerate(zip(batch, results, strict=True)):
            if kind == "w":
                written.append(topic)
                continue
            if last_write.get(topic, -1) > i or self._writes[topic] - _count(batch, topic) > 0:
                continue  # a newer local write follows
            message = None if value is None else decode_retained(value, wall, now)
            self._retained.replace(topic, message)
        for topic in written:
            self._writes[topic] -= 1
            if self._writes[topic] <= 0:
                del self._writes[topic]
        if written and self.written is not None:
            self.written(list(dict.fromkeys(written)))


def _count(batch: list[_Op], topic: str) -> int:
    return sum(1 for kind, t, _, _ in batch if kind == "w" and t == topic)
