"""Exclusive compacted queues ($ECQ, broker/ecq.py) in Redis.

One queue per consumer client id, in that client's Cluster slot
(:func:`persistence.format.queue_keys`). The persistence consumer saves a
queue's records here (persistence/lua/queue_save.lua) before it commits their
Kafka offsets, as it does for sessions: a newer value of a key replaces the
older one atomically in the same script, every stored value gets the queue's
next sequence number, a record read twice is stored once (named by producer
and record seq, as sessions' records), and entries older than
``ecq.retention`` or beyond ``ecq.max_keys`` leave. Delivery reads the
pending entries in sequence order (persistence/queue_feed.py); an
acknowledgement removes an entry only if no newer value replaced it.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, cast

from broker.ecq import key_of
from broker.group_queue import is_group_store
from broker.outflow import MAX_PACKET_ID
from persistence.format import group_writes_key, header_fields, queue_keys, record_id
from persistence.redis_store import RedisMessageStore, is_lost, lua_script

log = logging.getLogger("devicemq.persistence")

_SAVE = lua_script("queue_save")
_LOAD = lua_script("queue_load")
_ACK = lua_script("queue_ack")
_REWIND = lua_script("queue_rewind")
_INFO = lua_script("queue_info")
_INFLIGHT = lua_script("queue_inflight")
_GROUP_WRITES = lua_script("group_writes")
_UNRECORD = lua_script("queue_unrecord")
_FORGET = lua_script("queue_forget")
_CLAIM = lua_script("group_claim")
_GROUP_ACK = lua_script("group_ack")
_RELEASE = lua_script("group_release")
_RENEW = lua_script("group_renew")
_PURGE = lua_script("queue_purge")
_ENTRY = struct.Struct(">QI")  # an in-flight record: seq, key length; then key, value
_STORE_NAME = struct.Struct(">H")  # a group write's record: its store's name length, name

DUPLICATE = -1  # QueueSaveResult.seqs: a record stored before
REFUSED = -2  # QueueSaveResult.seqs: not stored, at the byte limit or max_queues
REMEMBERED_MOST = 100_000  # stores a process remembers it registered
FULL_MS = 60_000  # how long a refusal marks a queue full (as queue_save.lua does)
RETENTION, KEY_LIMIT, BYTE_LIMIT = 1, 2, 3  # why an entry was removed
# Every queue and group store saved since this key was kept (the admin API lists them).
QUEUES_KEY = "devicemq:ecq:queues"
GROUPS_KEY = "devicemq:ecq:groups"  # group store -> ms since it has had no members (0: has)
REWIND_CHUNK = 1000  # entries made pending again per script call


@dataclass(slots=True)
class QueueBatch:
    """One queue's records from one Kafka partition, in partition order."""

    client_id: str
    values: Sequence[bytes]
    partition: int | str
    offsets: Sequence[int] = ()


class Removed(NamedTuple):
    key: str
    seq: int
    pending: bool  # not acknowledged yet: it will not be delivered
    why: int  # RETENTION or KEY_LIMIT


class LeaseLapsed(Exception):
    """A group queue member's claims lapsed: its broker did not renew them in time."""


LAPSED = b"lapsed"  # group_claim.lua's answer to a token whose lease ran out


class Purged(NamedTuple):
    """What a purge removed: entries (acknowledged ones kept for a rewind too), their
    bytes, and the (key, seq) of those still pending."""

    entries: int
    bytes: int
    pending: list[tuple[str, int]]


class QueueEntry(NamedTuple):
    key: str
    seq: int
    value: bytes


@dataclass(slots=True)
class QueueSaveResult:
    """Per record: its sequence number, or DUPLICATE, or REFUSED; and the
    unacknowledged sequence number it replaced (0: none). ``removed``: what
    retention, the key limit and the byte limit took; ``bytes``: the queue's
    values' bytes after the save."""

    seqs: list[int] = field(default_factory=list)
    replaced: list[int] = field(default_factory=list)
    removed: list[Removed] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    bytes: int = 0

    @property
    def saved(self) -> int:
        return sum(1 for s in self.seqs if s > 0)

    @property
    def duplicates(self) -> int:
        return sum(1 for s in self.seqs if s == DUPLICATE)

    @property
    def refused(self) -> int:
        return sum(1 for s in self.seqs if s == REFUSED)


@dataclass(slots=True, frozen=True)
class QueueInfo:
    pending: int  # entries not acknowledged
    keys: int  # keys kept (acknowledged or not): what a rewind can give
    last_seq: int
    acked_seq: int  # the highest sequence number acknowledged
    oldest_pending_seq: int  # 0: nothing pending
    bytes: int  # of the values kept (acknowledged ones kept for a rewind too)


class QueueStore:
    def __init__(
        self,
        store: RedisMessageStore,
        *,
        retention: float,
        max_keys: int,
        clock: Callable[[], float] = time.time,
        group_retention: float = 0.0,
        group_max: int = 0,
        max_bytes: int = 0,
        group_max_bytes: int = 0,
        max_queues: int = 0,
    ) -> None:
        self._store = store
        self.retention = retention  # seconds; 0: kept until acknowledged and replaced
        self.max_keys = max_keys  # per queue; 0: no limit
        self.max_bytes = max_bytes  # per queue, of the values kept; 0: no limit
        self.max_queues = max_queues  # $ECQ queues holding entries, in all; 0: no limit
        # Group queues (broker/group_queue.py): the same store, their own limits.
        self.group_retention = group_retention
        self.group_max = group_max
        self.group_max_bytes = group_max_bytes
        self._clock = clock
        self._registered: set[str] = set()  # stores this process put in the registry
        self._starting = asyncio.Lock()  # new $ECQ queues are counted one at a time

    def _limits(self, store_id: str) -> tuple[float, int, int]:
        if is_group_store(store_id):
            return self.group_retention, self.group_max, self.group_max_bytes
        return self.retention, self.max_keys, self.max_bytes

    async def save(self, batch: QueueBatch) -> QueueSaveResult:
        queue = batch.client_id
        if not self.max_queues or is_group_store(queue) or queue in self._registered:
            return await self._save(batch)
        if await self._store.redis.sismember(QUEUES_KEY, queue):  # another process's
            self._remember(queue)
            return await self._save(batch)
        # A queue this process has not stored into: counted and started one at a time
        # here (replicas starting new queues at the same moment may pass max_queues).
        async with self._starting:
            if await self._over_queue_count(queue):
                n = len(batch.values)
                await self._store.redis.set(queue_keys(queue).full, 1, px=FULL_MS)
                return QueueSaveResult([REFUSED] * n, [0] * n, keys=[""] * n)
            return await self._save(batch)

    async def _save(self, batch: QueueBatch) -> QueueSaveResult:
        keys = queue_keys(batch.client_id)
        group = is_group_store(batch.client_id)
        retention, max_keys, max_bytes = self._limits(batch.client_id)
        # Over the byte limit an $ECQ write is refused (its producer hears 0x97 next time,
        # broker/handlers/publish.py), a group queue's oldest entries leave (its
        # publisher's other subscribers are not refused for one group's backlog).
        args: list[str | int | bytes] = [
            int(self._clock() * 1000),
            int(retention * 1000),
            max_keys,
            max_bytes,
            "oldest" if group else "refuse",
        ]
        entry_keys: list[str] = []
        for value in batch.values:
            topic, _size, published, _expiry = header_fields(value)
            rid = record_id(value)
            key = "" if group else key_of(batch.client_id, topic)  # a group's: its seq
            entry_keys.append(key)
            name = f"{rid.producer}:{batch.partition}"
            args += [name, rid.seq if rid.producer else 0, key, value, int(published * 1000)]
        script_keys: tuple[str, ...] = tuple(keys)
        guard = self._store.loss_guard()
        if guard:  # the store's durability counter first (queue_save.lua)
            script_keys, args = (*script_keys, guard[0]), [*args, guard[1]]
        reply = await self._store.run_script(_SAVE, script_keys, args)
        if is_lost(reply):
            raise self._store.lost(int(reply[1]))
        if len(reply) == 4:  # guarded: the counter, counted up after the save
            self._store.counted(int(reply[3]))
        results, removed = reply[0], reply[1]
        out = QueueSaveResult(keys=entry_keys, bytes=int(reply[2]))
        for i, (seq, replaced) in enumerate(results):
            out.seqs.append(int(seq))
            out.replaced.append(int(replaced))
            if group:
                entry_keys[i] = str(seq)
        for i in range(0, len(removed), 4):
            key, seq, pending, why = removed[i : i + 4]
            out.removed.append(Removed(_text(key), int(seq), bool(pending), int(why)))
        if out.saved:
            await self._register(batch.client_id)
        return out

    async def _over_queue_count(self, queue: str) -> bool:
        """Would storing into ``queue`` make more $ECQ queues than ``max_queues``?"""
        redis = self._store.redis
        if await redis.sismember(QUEUES_KEY, queue):
            return False
        return int(await redis.scard(QUEUES_KEY)) >= self.max_queues

    async def _register(self, store_id: str) -> None:
        """Name a queue or group store in its registry once per process (the admin API
        lists them; a group store with no members is found there and expires)."""
        if store_id in self._registered:
            return
        redis = self._store.redis
        if is_group_store(store_id):
            await redis.hsetnx(GROUPS_KEY, store_id, 0)
        else:
            await redis.sadd(QUEUES_KEY, store_id)
        self._remember(store_id)

    def _remember(self, store_id: str) -> None:
        if len(self._registered) >= REMEMBERED_MOST:
            self._registered.clear()  # looked up again in Redis: bounded memory
        self._registered.add(store_id)

    async def save_many(
        self, batches: Sequence[QueueBatch]
    ) -> tuple[list[QueueSaveResult | None], BaseException | None]:
        """Each queue's batches one after another, in order; queues side by side.

        A queue whose batch failed has that one and its later ones None (saving a
        later one first would make the failed one look like a record read twice);
        the first error is returned with them, for the caller to retry the Nones.
        """
        by_queue: dict[str, list[int]] = {}
        for i, batch in enumerate(batches):
            by_queue.setdefault(batch.client_id, []).append(i)
        results: list[QueueSaveResult | None] = [None] * len(batches)
        errors: list[BaseException] = []

        async def one_queue(indexes: list[int]) -> None:
            for i in indexes:
                try:
                    results[i] = await self.save(batches[i])
                except Exception as error:  # connection errors, cluster errors
                    errors.append(error)
                    return

        await asyncio.gather(*(one_queue(ix) for ix in by_queue.values()))
        return results, errors[0] if errors else None

    async def load(
        self, client_id: str, after_seq: int, limit: int
    ) -> tuple[list[QueueEntry], int]:
        """Up to ``limit`` pending entries after ``after_seq``, in order, and the last
        sequence number handed out."""
        keys = queue_keys(client_id)
        retention = self._limits(client_id)[0]
        oldest = int((self._clock() - retention) * 1000) if retention else 0
        last, flat = await self._store.run_script(
            _LOAD, (keys.pending, keys.values, keys.seq, keys.times), (after_seq, limit, oldest)
        )
        entries = [
            QueueEntry(_text(flat[i]), int(flat[i + 1]), bytes(flat[i + 2]))
            for i in range(0, len(flat), 3)
        ]
        return entries, int(last)

    async def ack(self, client_id: str, acked: Iterable[tuple[str, int, int]]) -> int:
        """(key, seq, packet id it was in flight under, 0: none recorded) triples."""
        args: list[str | int] = []
        for key, seq, packet_id in acked:
            args += [key, seq, packet_id]
        if not args:
            return 0
        keys = queue_keys(client_id)
        return int(
            await self._store.run_script(
                _ACK, (keys.pending, keys.acked, keys.inflight, keys.full), args
            )
        )

    async def record_inflight(
        self, client_id: str, generation: int, sent: Iterable[tuple[int, QueueEntry]]
    ) -> None:
        """(packet id, entry) about to go to the session of ``generation``."""
        args: list[int | bytes] = [generation]
        for packet_id, entry in sent:
            args += [packet_id, _packed(entry)]
        await self._store.run_script(_INFLIGHT, (queue_keys(client_id).inflight,), args)

    async def unrecord_inflight(
        self, client_id: str, never_sent: Iterable[tuple[int, QueueEntry]]
    ) -> None:
        """Forget (packet id, entry) records of entries that never went out, unless the
        packet id was recorded again for another since."""
        args: list[int | bytes] = []
        for packet_id, entry in never_sent:
            args += [packet_id, _packed(entry)]
        if args:
            await self._store.run_script(_UNRECORD, (queue_keys(client_id).inflight,), args)

    async def forget_inflight(self, client_id: str, ended_generation: int) -> None:
        """The session of ``ended_generation`` ended: its record of entries in flight
        goes (a later session's is left alone)."""
        keys = (queue_keys(client_id).inflight,)
        await self._store.run_script(_FORGET, keys, [ended_generation])

    async def inflight(self, client_id: str, generation: int) -> dict[int, QueueEntry]:
        """What was in flight to the session of ``generation`` (nothing if the record
        is an ended session's: it is deleted then)."""
        key = queue_keys(client_id).inflight
        raw = cast(dict[bytes, bytes], await self._store.redis.hgetall(key))
        if raw.get(b"gen") != str(generation).encode():
            if raw:
                await self._store.redis.delete(key)
            return {}
        out: dict[int, QueueEntry] = {}
        for field_name, packed in raw.items():
            if field_name == b"gen":
                continue
            out[int(field_name)] = _unpacked(packed)
        return out

    async def write_group_writes(
        self, client_id: str, generation: int | None, ops: Sequence[bytes | int]
    ) -> None:
        """Records and forgets of a member's group writes in flight, in order: triples
        of ``b"+"`` (record) or ``b"-"`` (forget), packet id, the record
        (:func:`group_write_packed`); ``generation``: the session's, for the records
        (None: forgets only; persistence/lua/group_writes.lua; tests/model/FINDINGS.md,
        findings 35 and 43)."""
        if ops:
            mark: bytes | int = b"-" if generation is None else generation
            await self._store.run_script(
                _GROUP_WRITES, (group_writes_key(client_id),), [mark, *ops]
            )

    async def end_group_writes(self, client_id: str, ended_generation: int) -> None:
        """The session of ``ended_generation`` ended: its group writes' record goes."""
        await self._store.run_script(_FORGET, (group_writes_key(client_id),), [ended_generation])

    async def group_writes(
        self, client_id: str, generation: int
    ) -> dict[int, tuple[str, QueueEntry, bytes]]:
        """The group writes the session of ``generation`` was left holding: packet id ->
        (group store, entry, the record as kept); an ended session's record is deleted."""
        key = group_writes_key(client_id)
        raw = cast(dict[bytes, bytes], await self._store.redis.hgetall(key))
        if raw.get(b"gen") != str(generation).encode():
            if raw:
                # An ended session's goes; a later session's stays (a stale copy of
                # this one resumed here must not delete what the later one kept).
                await self._store.run_script(_FORGET, (key,), [generation - 1])
            return {}
        out: dict[int, tuple[str, QueueEntry, bytes]] = {}
        for field_name, packed in raw.items():
            if field_name == b"gen":
                continue
            try:
                packet_id = int(field_name)
                store_id, entry = _group_write(packed)
            except (ValueError, struct.error) as error:
                # Not one this version wrote: said once, and the rest is read all the
                # same (raised, the caller would read it again forever, and the
                # session's outflow would give nothing meanwhile).
                log.error("a group write kept for %s cannot be read: %s", client_id, error)
                continue
            if 0 < packet_id <= MAX_PACKET_ID:
                out[packet_id] = (store_id, entry, packed)
        return out

    async def rewind(self, client_id: str, from_seq: int) -> int:
        """Make the latest value of every kept key with seq >= ``from_seq`` pending
        again; returns how many were not pending already."""
        keys, total, start = queue_keys(client_id), 0, from_seq
        while True:
            count, last = await self._store.run_script(
                _REWIND, (keys.pending, keys.log), (start, REWIND_CHUNK)
            )
            total += int(count)
            if not int(last):
                return total
            start = int(last) + 1

    # -- group queues (broker/group_queue.py, persistence/group_feed.py) ------------------

    async def claim(
        self,
        store_id: str,
        token: str,
        n: int,
        lease: float,
        skip: Iterable[str] = (),
        *,
        fresh: bool = True,
    ) -> list[tuple[QueueEntry, bool]]:
        """Up to ``n`` entries of the group queue no live claim holds, in sequence order,
        claimed for ``token`` (whose lease starts again), leaving out the ``skip`` keys;
        True: it may have been seen. Leases run on Redis's clock. ``fresh`` False: the
        token claimed before, and if its lease lapsed meanwhile, :class:`LeaseLapsed`
        (its claims may be other members' now)."""
        keys = queue_keys(store_id)
        retention = self.group_retention
        oldest = int((self._clock() - retention) * 1000) if retention else 0
        flat = await self._store.run_script(
            _CLAIM,
            (keys.pending, keys.values, keys.times, keys.claims, keys.tokens),
            (int(lease * 1000), token, n, oldest, 1 if fresh else 0, *skip),
        )
        if flat and flat[0] in (LAPSED, LAPSED.decode()):
            raise LeaseLapsed(token)
        return [
            (QueueEntry(_text(flat[i]), int(flat[i + 1]), bytes(flat[i + 2])), bool(flat[i + 3]))
            for i in range(0, len(flat), 4)
        ]

    async def group_ack(self, store_id: str, acked: Iterable[tuple[str, int]]) -> int:
        """(key, seq) pairs some member acknowledged: they leave the group queue."""
        args: list[str | int] = []
        for key, seq in acked:
            args += [key, seq]
        if not args:
            return 0
        k = queue_keys(store_id)
        return int(
            await self._store.run_script(
                _GROUP_ACK, (k.pending, k.log, k.values, k.times, k.claims, k.bytes), args
            )
        )

    async def release(
        self, store_id: str, token: str, dup: Mapping[str, bool], *, everything: bool = True
    ) -> int:
        """Give back the claims of ``token``: all of them (``everything``; the token is
        done with), or only those on the keys of ``dup``. ``dup[key]``: the next member
        gets it with DUP (it was sent, or claimed with DUP)."""
        keys = queue_keys(store_id)
        args: list[str | int] = [token, 1 if everything else 0]
        for key, seen in dup.items():
            args += [key, 1 if seen else 0]
        return int(await self._store.run_script(_RELEASE, (keys.claims, keys.tokens), args))

    async def renew(self, store_id: str, tokens: Iterable[str], lease: float) -> int:
        """The claims of ``tokens`` are still held: their leases start again (a token
        whose lease ran out stays gone, its claims may be another member's now)."""
        args: list[str | int] = [int(lease * 1000), *tokens]
        if len(args) == 1:
            return 0
        return int(await self._store.run_script(_RENEW, (queue_keys(store_id).tokens,), args))

    async def info(self, client_id: str) -> QueueInfo:
        keys = queue_keys(client_id)
        reply = await self._store.run_script(
            _INFO, (keys.pending, keys.log, keys.seq, keys.acked, keys.bytes), ()
        )
        return QueueInfo(*(int(v) for v in reply))

    async def purge(self, store_id: str, *, everything: bool = False) -> Purged:
        """Remove every entry of a queue or group store (its sequence goes on, unless
        ``everything``: nothing of it is left). It leaves the registry."""
        k = queue_keys(store_id)
        keys = (k.pending, k.log, k.values, k.times, k.inflight, k.claims, k.bytes, k.full)
        keys_too = (k.seq, k.seen, k.acked, k.tokens)
        args = ("all" if everything else "entries",)
        entries, freed, flat = await self._store.run_script(_PURGE, keys + keys_too, args)
        redis = self._store.redis
        if is_group_store(store_id):
            await redis.hdel(GROUPS_KEY, store_id)
        else:
            await redis.srem(QUEUES_KEY, store_id)
        self._registered.discard(store_id)
        pending = [(_text(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2)]
        return Purged(int(entries), int(freed), pending)

    async def is_full(self, client_id: str) -> bool:
        """Was a write to the queue refused (its byte limit, or ``max_queues``) lately?"""
        return bool(await self._store.redis.exists(queue_keys(client_id).full))

    async def mark_group(self, store_id: str, unused_since: float) -> None:
        """Note since when the group store has had no members (0: it has)."""
        await self._store.redis.hset(GROUPS_KEY, store_id, int(unused_since * 1000))

    async def queue_ids(self, most: int) -> list[str]:
        """Up to ``most`` $ECQ queues of the registry (SSCAN: in no particular order, a
        Redis call of its own per few hundred), sorted."""
        found: list[str] = []
        async for member in self._store.redis.sscan_iter(QUEUES_KEY, count=500):
            found.append(_text(member))
            if len(found) >= most:
                break
        return sorted(found)

    async def group_store_ids(self) -> dict[str, float]:
        """The group stores saved to: store id -> since when it has had no members
        (seconds since the epoch; 0: members when last looked), sorted."""
        raw = await self._store.redis.hgetall(GROUPS_KEY)
        return {_text(k): int(v) / 1000 for k, v in sorted(raw.items())}

    async def group_unused_since(self, store_id: str) -> float | None:
        """Since when the group store has had no members (0: it has; None: no store)."""
        since = await self._store.redis.hget(GROUPS_KEY, store_id)
        return None if since is None else int(since) / 1000


def _packed(entry: QueueEntry) -> bytes:
    key = entry.key.encode()
    return _ENTRY.pack(entry.seq, len(key)) + key + entry.value


def _unpacked(packed: bytes) -> QueueEntry:
    seq, size = _ENTRY.unpack_from(packed)
    start = _ENTRY.size
    return QueueEntry(packed[start : start + size].decode(), seq, packed[start + size :])


def group_write_packed(store_id: str, entry: QueueEntry) -> bytes:
    """A group write's record: the group store's name, then the entry as $ECQ's."""
    name = store_id.encode()
    return _STORE_NAME.pack(len(name)) + name + _packed(entry)


def _group_write(packed: bytes) -> tuple[str, QueueEntry]:
    (size,) = _STORE_NAME.unpack_from(packed)
    start = _STORE_NAME.size
    return packed[start : start + size].decode(), _unpacked(packed[start + size :])


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
