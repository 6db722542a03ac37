"""The Redis side of the persistent path: stored messages of persistent sessions.

The Kafka consumer groups what it reads by subscriber and hands each client's
batch to :meth:`PersistedMessageStore.save_batch` (or many at once to
:meth:`~PersistedMessageStore.save_many`); delivery and replay read back with
:meth:`~PersistedMessageStore.load_page` and acknowledge with
:meth:`~PersistedMessageStore.ack`. :class:`PersistedMessageStore` is the
interface; :class:`RedisMessageStore` implements it over redis-py asyncio,
on a single Redis (``redis.asyncio.Redis``) or a Redis Cluster
(``redis.asyncio.cluster.RedisCluster``). Every operation on a client is one
Lua script call (or one plain command), so a batch costs one round trip.
The key names and the value format are persistence/format.py's.

Invariants
----------
* **Packet ids** follow the score: ``packet_id = (score - 1) % 65535 + 1``
  (:func:`~persistence.format.packet_id_of`), so they wrap 65535 -> 1 and
  are never 0; the last one is the last score's. An id is never
  given out while a ref with that id is in ``{cid}_messages``: the save
  script first trims the set below the limit (``limit <= 65535``), so at
  least one id is free, then moves the score on past any score whose id is
  still stored (an old unacknowledged message can outlive 65535 newer,
  acknowledged ones; its id is skipped, never overwritten, and the scores
  show a gap there). A stored ref can only clash with a new score 65535 or
  more steps later, so the script checks ids one by one only when its oldest
  ref is that old. Acknowledged as they go, the ids run 1..65535, 1, 2, ...
  with no gap.
* **Scores** come from ``{cid}_last_score``, which only grows (strictly
  increasing per client, gaps only where an id was skipped); it is not
  derived from the set (which empties), and if the counter key were lost the
  script continues above the set's highest score.
* **Idempotent save**: a record is named by (producer, seq), and one
  producer's records reach a partition in order: a seq at or below the last
  one stored from that producer through that partition is skipped (reported
  as a duplicate). A batch read again after a crash, or a record Kafka took
  twice from a retried produce request, is stored once. Nothing depends on
  Kafka offsets, so a topic recreated from offset 0 loses nothing.
* **Generations**: every durable session has a generation that only grows
  per client (:meth:`RedisMessageStore.open_session`); records carry the one
  they were routed for, and a record of an ended session (an older
  generation) is dropped, never stored into the next session. Session saves
  and deletes are fenced the same way: a broker that still holds an old
  session cannot overwrite or delete a newer one.
* **In flight until acknowledged**: a message marked sent (it may have been
  seen) is never trimmed and never expires: its entry in ``{cid}_values``
  loses its deadline and lives as long as the session (the hash has no TTL
  while the client is connected, the session's TTL while it is not), so its
  packet id stays taken until the client acknowledges it
  (MQTT-4.4.0-1: it is re-sent on reconnect whatever its age). Sent messages
  are the oldest refs (delivery goes in score order), at most a window's
  worth.
* **Limit**: over the per-client limit (default 10000, at most 65535) the
  oldest refs never sent (lowest scores) and their entries are removed,
  reported in :attr:`SaveResult.trimmed_ids`; when every stored message is in
  flight, the new message is not stored (:attr:`SaveResult.unstored`).
* **Bounded growth**: while the session key has a TTL (client disconnected)
  every key of the client expires with it; with no session key at all the
  keys expire after the longest message TTL (at least ``default_ttl``).
  Entries never sent have a deadline of their own (message expiry, at most
  ``default_ttl``); an expired entry is dropped with its ref where a script
  meets it (:meth:`RedisMessageStore.load_page`, marks, trims), and counts
  toward the limits until then, as an expired ref did before (its size then
  leaves the byte count); its bytes stay in Redis until then too (a string
  expired on its own before), within the per-client limits, or until the
  session's keys expire.
* **Layout**: a client's messages are one sorted set and one hash
  (persistence/format.py, ``{cid}_values``): ~140 B of Redis memory per
  stored 64-byte message where a string per message cost ~240 B
  (BENCHMARKS.md, "The fleet's size"). Data of the layout before (a string
  per message) is moved into the hash the first time a script touches the
  client (persistence/lua/lib.lua, ``upgrade``).

Atomicity comes from each batch being one script: on a crash a batch is
either stored with its dedup record or not at all.
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
import struct
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, NamedTuple, Protocol, TypeVar, cast

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import NoScriptError, ResponseError

from broker.stats import Histogram
from persistence.format import (
    PRODUCERS_KEY,
    SESSIONS_INDEX,
    WAIT_FENCE_KEY,
    ClientKeys,
    SessionState,
    StoredMessage,
    StoredRecord,
    client_keys,
    decode_record,
    encode_message,
    epoch_key,
    group_writes_key,
    opens_key,
    packet_id_of,
    queue_keys,
    record_id,
    stored_value,
)
from persistence.redis_packing import packed_by_hiredis
from persistence.redis_security import Sentinels, redis_client

log = logging.getLogger("devicemq.persistence")

__all__ = [
    "DEFAULT_LIMIT",
    "DEFAULT_TTL",
    "DISCARDED",
    "DUPLICATE",
    "EXPIRED",
    "MAX_LIMIT",
    "UNSTORED",
    "Assigned",
    "BatchSaveError",
    "ClientBatch",
    "LostWrites",
    "Page",
    "PersistedMessageStore",
    "RedisMessageStore",
    "SaveResult",
    "SessionOwned",
]

DEFAULT_LIMIT = 10_000
MAX_LIMIT = 65_535
DEFAULT_TTL = 7 * 24 * 3600  # seconds

RedisClient = Redis | RedisCluster

POOL_CONNECTIONS = 64  # Redis connections of one broker (single-node mode)
# Clients in one call of the save, mark or ack script: a poll's or a flush's clients
# share a call (their cost is the call's, not one each), yet one call holds Redis
# for about 10 ms at most (~35 us a client), so other commands come between.
CALL_CLIENTS = 256
_T = TypeVar("_T")
# per message to the save script: producer, seq, generation, TTL, length
_SAVE_META = struct.Struct(">ddddd")

# ---------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------


class Page(NamedTuple):
    """One page of stored messages and the score counter as it was read."""

    records: list[StoredRecord]
    last_score: int


class Assigned(NamedTuple):
    packet_id: int
    score: int


@dataclass(slots=True)
class SaveResult:
    """What one client batch did.

    ``assigned[i]`` is message i's packet id and score (in order, strictly
    increasing scores), or None when it was not stored: it was a duplicate
    of a record stored before (counted in ``duplicates``), it had already
    expired (``expired``), its session had ended (index in ``discarded``: an
    older generation), or it did not fit (index in ``unstored``: every
    message stored was in flight, none could make room). ``trimmed_ids`` are
    packet ids removed, oldest first, to respect the limit; they may include
    messages of this very batch.
    """

    assigned: list[Assigned | None]
    trimmed_ids: list[int]
    duplicates: int
    expired: int
    unstored: list[int] = field(default_factory=list)
    discarded: list[int] = field(default_factory=list)
    # Per message, the script's answer: its score (> 0), or EXPIRED, DUPLICATE,
    # DISCARDED, UNSTORED.
    outcomes: list[int] = field(default_factory=list)

    @property
    def saved(self) -> int:
        return sum(1 for a in self.assigned if a is not None)

    @property
    def trimmed(self) -> int:
        return len(self.trimmed_ids) + len(self.unstored)


@dataclass(slots=True)
class ClientBatch:
    """One client's messages from one Kafka partition, in partition order.

    ``offsets`` are their Kafka offsets (reported in delivery events; the
    store does not need them). The first ``premark`` messages stored are
    stored marked sent (see :attr:`StoredRecord.marked`).
    """

    client_id: str
    messages: Sequence[StoredMessage | bytes]
    partition: int | str  # the Kafka partition they came from
    offsets: Sequence[int] | None = None
    premark: int = 0


EXPIRED, DUPLICATE, DISCARDED, UNSTORED = 0, -1, -2, -3  # SaveResult.outcomes


def _save_result(reply: Any) -> SaveResult:
    """The save script's reply: a score per message (>0 stored, 0 expired, -1 duplicate,
    -2 older generation, -3 no room: every stored message in flight)."""
    scores, trimmed = reply
    assigned: list[Assigned | None] = []
    duplicates = expired = 0
    unstored: list[int] = []
    discarded: list[int] = []
    for i, score in enumerate(scores):
        if score > 0:
            assigned.append(Assigned(packet_id_of(score), score))
            continue
        assigned.append(None)
        if score == -1:
            duplicates += 1
        elif score == 0:
            expired += 1
        elif score == -2:
            discarded.append(i)
        else:
            unstored.append(i)
    return SaveResult(
        assigned,
        [int(t) for t in trimmed],
        duplicates,
        expired,
        unstored,
        discarded,
        [int(x) for x in scores],
    )


class _ClientPart(NamedTuple):
    """One client's share of a save script call (save_batch.lua)."""

    keys: ClientKeys
    args: tuple[Any, ...]  # partition, n, meta, premark, values


def _save_call(
    parts: Sequence[_ClientPart], limit: int, default_ttl_ms: int, max_bytes: int
) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of one save script call for ``parts`` (save_batch.lua)."""
    keys: list[str] = []
    args: list[Any] = [len(parts), limit, default_ttl_ms, max_bytes]
    for part in parts:
        keys.extend(part.keys)
        args.extend(part.args)
    return keys, args


def _script_calls(items: list[_T], first_key: Callable[[_T], str], single: bool) -> list[list[_T]]:
    """Clients' parts grouped into script calls: on a single Redis, :data:`CALL_CLIENTS`
    at most in a call; on a cluster, one call per hash slot of their first key (a
    script sees one slot), split the same way."""
    if single:
        groups = [items] if items else []
    else:
        by_slot: dict[int, list[_T]] = {}
        for item in items:
            by_slot.setdefault(key_slot(first_key(item).encode()), []).append(item)
        groups = list(by_slot.values())
    return [g[i : i + CALL_CLIENTS] for g in groups for i in range(0, len(g), CALL_CLIENTS)]


# A client's part of a mark or ack script call: its keys (messages first), its
# (packet id, score) pairs, its client id.
_ProgressPart = tuple[tuple[str, ...], Sequence[tuple[int, int]], str]


def _progress_call(
    parts: Sequence[tuple[tuple[str, ...], Sequence[tuple[int, int]]]],
) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of one mark_sent.lua or ack.lua call for many clients: their
    keys (as many each), and each client's pair count followed by its pairs."""
    keys: list[str] = []
    args: list[Any] = [len(parts)]
    for client_keys_, pairs in parts:
        keys.extend(client_keys_)
        args.append(len(pairs))
        for packet_id, score in pairs:
            args.append(packet_id)
            args.append(score)
    return keys, args


def _client_result(reply: Any) -> SaveResult | ResponseError:
    """One client's reply of the save script: its result, or the error its save met."""
    if isinstance(reply, list) and len(reply) == 2 and reply[0] == b"error":
        message = reply[1]
        text = message.decode("utf-8", "replace") if isinstance(message, bytes) else str(message)
        return ResponseError(text)
    return _save_result(reply)


class SessionOwned(Exception):
    """The client id's stored session belongs to another owner (auth.session_owner)."""


class LostWrites(Exception):
    """Redis lost saves it had acknowledged (its durability counter went back): no
    batch of the call was stored; Kafka must be read again from the committed
    offsets before anything else is saved (see save_batch.lua)."""


def is_lost(reply: Any) -> bool:
    """A save script's answer that Redis lost acknowledged saves (see loss_guard)."""
    return isinstance(reply, list) and len(reply) == 2 and reply[0] == b"lost"


class BatchSaveError(Exception):
    """Some batches of :meth:`RedisMessageStore.save_many` failed.

    ``results[i]`` is batch i's :class:`SaveResult` or its exception. Saving is
    idempotent: retrying the whole call stores nothing twice.
    """

    def __init__(self, results: list[SaveResult | BaseException]) -> None:
        errors = [r for r in results if isinstance(r, BaseException)]
        super().__init__(f"{len(errors)} of {len(results)} client batches failed: {errors[0]!r}")
        self.results = results


# ---------------------------------------------------------------------------
# The interface
# ---------------------------------------------------------------------------


# What wait_durable answers (persistence.redis_wait).
DURABLE = "durable"
NOT_YET = "not yet"  # the wait timed out or failed: try again
LOST = "lost"  # Redis lost saves it acknowledged: save them again
COUNTER_TTL = 7 * 86400  # seconds a store's durability counter outlives its last fence


class PersistedMessageStore(Protocol):
    """Stored messages and session state of persistent sessions."""

    async def save_batch(
        self,
        client_id: str,
        messages: Sequence[StoredMessage | bytes],
        partition: int | str,
        offsets: Sequence[int] | None = None,
        *,
        limit: int | None = None,
    ) -> SaveResult: ...

    async def save_many(self, batches: Iterable[ClientBatch]) -> list[SaveResult]: ...

    async def wait_durable(self) -> str: ...

    async def load_page(self, client_id: str, after_score: int = 0, limit: int = 100) -> Page: ...

    async def ack(self, client_id: str, packet_id: int, score: int = 0) -> bool: ...

    async def ack_many(
        self, client_id: str, packet_ids: Iterable[int], scores: Iterable[int] | None = None
    ) -> int: ...

    async def mark_pubrel(self, client_id: str, packet_id: int) -> bool: ...

    async def mark_sent(
        self, client_id: str, packet_ids: Iterable[int], scores: Iterable[int] | None = None
    ) -> list[int]: ...

    async def write_progress(
        self,
        marks: Mapping[str, Sequence[tuple[int, int]]],
        pubrels: Mapping[str, Sequence[int]],
        acks: Mapping[str, Sequence[tuple[int, int]]],
    ) -> dict[str, set[tuple[int, int]]]: ...

    async def pending_count(self, client_id: str) -> int: ...

    async def open_session(
        self,
        client_id: str,
        *,
        resume: bool,
        generation: int,
        state: SessionState,
        enforce_owner: bool = False,
    ) -> SessionState | None: ...

    async def save_session(
        self, client_id: str, state: SessionState, *, ttl: int | None = None
    ) -> bool: ...

    async def load_session(self, client_id: str) -> SessionState | None: ...

    async def load_sessions(self, client_ids: Sequence[str]) -> list[SessionState | None]: ...

    async def end_session(
        self, client_id: str, generation: int = 0, opens: int | None = None
    ) -> int | None: ...

    async def expire_session(self, client_id: str, seconds: int, generation: int = 0) -> bool: ...


# ---------------------------------------------------------------------------
# Redis implementation
# ---------------------------------------------------------------------------


def _session_state(
    data: bytes | None, generation: bytes | None, opens: bytes | None = None
) -> SessionState | None:
    if data is None:
        return None
    state = SessionState.decode(data)
    state.generation = int(generation or 0)
    state.opens = int(opens or 0)
    return state


# The scripts use ZMSCORE (ack.lua, mark_sent.lua) and ZRANGE ... BYSCORE
# (load_page.lua), both new in Redis 6.2.
MIN_REDIS_VERSION = (6, 2)


def too_old_redis(info: Mapping[str, Any]) -> str | None:
    """The version of a Redis (or of any node of a cluster: ``info`` per node) older
    than :data:`MIN_REDIS_VERSION`, or None."""
    found = (
        [info] if "redis_version" in info else [v for v in info.values() if isinstance(v, Mapping)]
    )
    for node in found:
        version = str(node.get("redis_version", "0"))
        numbers = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
        if numbers < MIN_REDIS_VERSION:
            return version
    return None


class _Script(NamedTuple):
    name: str
    text: bytes
    sha: str


def _load_script(name: str) -> _Script:
    """A script of persistence/lua/, with lib.lua's shared helpers in front of it."""
    lua = resources.files("persistence").joinpath("lua")
    text = lua.joinpath("lib.lua").read_bytes() + lua.joinpath(f"{name}.lua").read_bytes()
    return _Script(name, text, hashlib.sha1(text).hexdigest())


def lua_script(name: str) -> _Script:
    """A script of persistence/lua/ for another part of the store (the queues' scripts,
    persistence/queue_store.py), run with :meth:`RedisMessageStore.run_script`."""
    return _load_script(name)


_SAVE = _load_script("save_batch")
_LOAD_PAGE = _load_script("load_page")
_ACK = _load_script("ack")
_MARK_SENT = _load_script("mark_sent")
_SESSION = _load_script("session")
_END = _load_script("end_session")
_OPEN = _load_script("open_session")
_PURGE = _load_script("purge")
_PUBREL = _load_script("mark_pubrel")
_SCRIPTS = (_SAVE, _LOAD_PAGE, _ACK, _MARK_SENT, _SESSION, _END, _OPEN, _PURGE, _PUBREL)


class RedisMessageStore:
    """:class:`PersistedMessageStore` on redis-py asyncio (single or cluster).

    ``redis`` must not decode responses. ``limit`` is the per-client stored
    limit (1..65535), ``max_bytes`` the per-client limit of bytes stored (0:
    none), ``default_ttl`` the TTL in seconds of messages without an MQTT 5
    expiry. ``clock`` gives epoch seconds (message expiry is absolute).
    """

    def __init__(
        self,
        redis: RedisClient,
        *,
        limit: int = DEFAULT_LIMIT,
        default_ttl: int = DEFAULT_TTL,
        clock: Callable[[], float] = time.time,
        max_bytes: int = 0,
        wait: str = "off",
        wait_replicas: int = 1,
        wait_timeout_ms: int = 1000,
    ) -> None:
        _check_limit(limit)
        if default_ttl <= 0:
            raise ValueError("default_ttl must be positive")
        self.redis = redis
        self.limit = limit
        self.max_bytes = max_bytes  # per client, of the values stored; 0: none
        # persistence.redis_wait: offsets are committed after WAIT / WAITAOF (wait_durable)
        self.wait = wait
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self.wait_failures = 0  # waits that did not see the writes durable in time
        self.lost_writes = 0  # fences that found acknowledged saves gone (restart, failover)
        # Every save wave (and every fence) increments this store's own counter in
        # Redis; ``_counted`` is the highest value Redis acknowledged. A fence that
        # finds it lower saw Redis lose acknowledged writes (wait_durable).
        self._counter_key = f"{WAIT_FENCE_KEY}:{secrets.token_hex(8)}"
        self._counted = 0
        self._lost_seen = False  # a save's increment came back below _counted
        self.default_ttl = default_ttl
        self._clock = clock
        self._default_ttl_ms = default_ttl * 1000
        # Exported by app/metrics.py: seconds per script call, failed calls.
        self.script_latency: dict[str, Histogram] = {}
        self.script_errors: dict[str, int] = {}

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        cluster: bool = False,
        connect: Mapping[str, Any] | None = None,
        sentinels: Sentinels | None = None,
        **kwargs: Any,
    ) -> RedisMessageStore:
        """A store on ``redis://host:port`` (``cluster``: any node of a cluster;
        ``sentinels``: the master they name); ``connect``: redis-py's connection
        options (persistence/redis_security.py).

        The single-node pool makes callers wait for a free connection instead
        of failing: redis-py's default pool raises "Too many connections"
        past 100, which a reconnect storm of replays reaches easily.
        """
        client: RedisClient
        options = dict(connect or {})
        if cluster:
            client = packed_by_hiredis(
                RedisCluster.from_url(url, decode_responses=False, **options)
            )
        else:
            client = redis_client(url, options, sentinels, max_connections=POOL_CONNECTIONS)
        return cls(client, **kwargs)

    async def aclose(self) -> None:
        await self.redis.aclose()

    # -- scripts -----------------------------------------------------------

    async def load_scripts(self) -> None:
        """SCRIPT LOAD every script (on a cluster: on every primary)."""
        for script in _SCRIPTS:
            await self.redis.execute_command("SCRIPT LOAD", script.text)

    async def _eval(self, script: _Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run a script; its latency and failures are counted per script name."""
        started = time.perf_counter()
        try:
            return await self._run_script(script, keys, args)
        except Exception:
            self.script_errors[script.name] = self.script_errors.get(script.name, 0) + 1
            raise
        finally:
            self._observe(script.name, time.perf_counter() - started)

    async def run_script(self, script: _Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """:meth:`_eval` for the store's other parts: counted with the rest."""
        return await self._eval(script, keys, args)

    def _observe(self, name: str, seconds: float) -> None:
        latency = self.script_latency.get(name)
        if latency is None:
            latency = self.script_latency[name] = Histogram()
        latency.observe(seconds)

    async def _run_script(self, script: _Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        # execute_command, not evalsha(): the cluster client routes EVALSHA by
        # its keys this way, and pipelines refuse evalsha by name.
        try:
            return await self.redis.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            pass
        # Not cached on that node (restart, failover, new primary): load
        # everywhere, then run; EVAL also caches it on the node it runs on.
        await self.load_scripts()
        try:
            return await self.redis.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await self.redis.execute_command("EVAL", script.text, len(keys), *keys, *args)

    # -- saving ------------------------------------------------------------

    def _ttl_ms(self, expiry: float | None, now: float) -> int:
        if expiry is None:
            return self._default_ttl_ms
        return math.ceil((expiry - now) * 1000)

    async def save_batch(
        self,
        client_id: str,
        messages: Sequence[StoredMessage | bytes],
        partition: int | str,
        offsets: Sequence[int] | None = None,
        *,
        limit: int | None = None,
    ) -> SaveResult:
        """Store one client's batch (one script call). See :class:`SaveResult`.

        A message may come already encoded (:func:`encode_message`), as the
        Kafka consumer passes record values through untouched.
        """
        if limit is not None:
            _check_limit(limit)
        batch = ClientBatch(client_id, messages, partition, offsets)
        part = self._client_part(batch, self._clock())
        if not messages:
            return SaveResult([], [], 0, 0)
        keys, args = _save_call([part], limit or self.limit, self._default_ttl_ms, self.max_bytes)
        (reply,) = await self._eval(_SAVE, keys, args)
        result = _client_result(reply)
        if isinstance(result, BaseException):
            self.script_errors[_SAVE.name] = self.script_errors.get(_SAVE.name, 0) + 1
            raise result
        return result

    async def save_many(self, batches: Iterable[ClientBatch]) -> list[SaveResult]:
        """Save many client batches, each wave of them in one pipelined round trip.

        Batches of one client run one after another in the order given (a
        later batch first would make the earlier one look replayed): wave k
        holds every client's k-th batch, and a client whose batch failed has
        its later ones failed too, unsaved. Returns one result per batch, in
        order. If any batch fails, the others still complete and
        :class:`BatchSaveError` carries every result; retrying the call is safe.
        """
        todo = list(batches)
        results: list[SaveResult | BaseException | None] = [None] * len(todo)
        waves: list[list[int]] = []
        seen: dict[str, int] = {}
        for i, batch in enumerate(todo):
            k = seen.get(batch.client_id, 0)
            seen[batch.client_id] = k + 1
            if k == len(waves):
                waves.append([])
            waves[k].append(i)
        failed: dict[str, BaseException] = {}
        for wave in waves:
            runnable = []
            for i in wave:
                error = failed.get(todo[i].client_id)
                if error is not None:
                    results[i] = error
                else:
                    runnable.append(i)
            saved = await self._save_wave([todo[i] for i in runnable])
            for i, result in zip(runnable, saved, strict=True):
                results[i] = result
                if isinstance(result, BaseException):
                    failed[todo[i].client_id] = result
        done: list[SaveResult] = []
        for r in results:
            if not isinstance(r, SaveResult):
                raise BatchSaveError([r if r is not None else RuntimeError() for r in results])
            done.append(r)
        return done

    async def _save_wave(self, batches: list[ClientBatch]) -> list[SaveResult | BaseException]:
        """One script call for the batches (of different clients) on a single Redis, one
        per hash slot on a cluster (a script sees one slot), pipelined.

        Calls refused with NOSCRIPT (a restarted or new Redis) ran nothing:
        they are sent again once the scripts are loaded.
        """
        now = self._clock()
        results: list[SaveResult | BaseException] = [SaveResult([], [], 0, 0)] * len(batches)
        parts: dict[int, _ClientPart] = {}
        for i, batch in enumerate(batches):
            if batch.messages:
                try:
                    parts[i] = self._client_part(batch, now)
                except ValueError as error:  # a malformed batch fails alone
                    results[i] = error
        calls = self._calls(parts)
        for attempt in range(2):
            if not calls:
                break
            started = time.perf_counter()
            pipe = self.redis.pipeline(transaction=False)
            counting = self.wait != "off"
            floor = self._counted
            guard = self.loss_guard()
            for members in calls:
                keys, args = _save_call(
                    [parts[i] for i in members], self.limit, self._default_ttl_ms, self.max_bytes
                )
                if guard:
                    keys.append(guard[0])
                    args.append(guard[1])
                pipe.execute_command("EVALSHA", _SAVE.sha, len(keys), *keys, *args)
            if counting:  # after the saves, on their connection (wait_durable)
                pipe.incr(self._counter_key)
            try:
                replies = await pipe.execute(raise_on_error=False)
            finally:
                self._observe(_SAVE.name, time.perf_counter() - started)
            counted: Any = None
            if counting:
                counted = replies.pop()
                if isinstance(counted, int):
                    if counted <= floor:  # below what Redis acknowledged before: lost
                        if guard:
                            # Every script refused (or ran nothing: NOSCRIPT on a new
                            # master); retrying would count past the loss and hide it.
                            raise self.lost(counted)
                        self._lost_seen = True
                    self._counted = max(self._counted, counted)
            lost = [r for r in replies if is_lost(r)]
            if lost:  # nothing of this wave was stored
                raise self.lost(counted if isinstance(counted, int) else int(lost[0][1]))
            again = []
            for members, reply in zip(calls, replies, strict=True):
                if isinstance(reply, NoScriptError) and attempt == 0:
                    again.append(members)
                    continue
                if isinstance(reply, BaseException):  # the whole call failed
                    self.script_errors[_SAVE.name] = self.script_errors.get(_SAVE.name, 0) + 1
                    for i in members:
                        results[i] = reply
                    continue
                for i, client_reply in zip(members, reply, strict=True):
                    result = _client_result(client_reply)
                    if isinstance(result, BaseException):
                        self.script_errors[_SAVE.name] = self.script_errors.get(_SAVE.name, 0) + 1
                    results[i] = result
            if again:
                await self.load_scripts()
            calls = again
        return results

    def _calls(self, parts: Mapping[int, _ClientPart]) -> list[list[int]]:
        """The batches of one wave grouped into script calls (see :func:`_script_calls`)."""
        return _script_calls(list(parts), lambda i: parts[i].keys[0], isinstance(self.redis, Redis))

    def counted(self, counter: int) -> None:
        """A save outside a save wave (a queue's) counted the store's counter up to
        ``counter`` in Redis (queue_save.lua): acknowledged, so a failover that loses
        it shows as the counter going back."""
        self._counted = max(self._counted, counter)

    def loss_guard(self) -> tuple[str, int] | None:
        """(this store's durability counter, the highest value Redis acknowledged for
        it), for a save script to check before it stores anything (save_batch.lua,
        queue_save.lua); None when nothing is counted (``redis_wait: off``) or on a
        cluster, whose scripts see one slot (there the fence alone sees a loss)."""
        if self.wait == "off" or not isinstance(self.redis, Redis):
            return None
        return self._counter_key, self._counted

    def lost(self, counter: int) -> LostWrites:
        """A save script found the counter below what Redis acknowledged: count on
        from ``counter`` (where Redis is now) and tell the caller to re-read Kafka.
        The next fence says LOST too: a commit whose wait began before the re-read
        took its committed offsets must not commit past the lost records."""
        floor, self._counted, self._lost_seen = self._counted, counter, True
        self.lost_writes += 1
        return LostWrites(f"redis lost saves it had acknowledged (counter {floor} -> {counter})")

    async def wait_durable(self) -> str:
        """Is everything saved so far as durable as ``persistence.redis_wait`` asks?

        :data:`DURABLE`, :data:`NOT_YET` (try again later) or :data:`LOST`: Redis
        no longer has saves it acknowledged (it restarted from a file without
        them, or a replica without them took over), so they must be saved again.

        WAIT and WAITAOF cover the writes of the connection they run on, and saves
        run on any connection of the pool. So this connection writes a fence
        first, an increment of this store's counter: Redis replicates and appends
        in one order, so once the fence is on the replicas (or fsynced), every
        write that finished before it is too. Every save wave increments the
        same counter after its saves; a fence that reads a value not above the
        highest one acknowledged sees that acknowledged saves are gone. Off:
        always DURABLE. A Redis error counts as NOT_YET.
        """
        wait = self._wait_command()
        if not wait:
            return DURABLE
        pipe = self.redis.pipeline(transaction=False)
        pipe.incr(self._counter_key)
        pipe.expire(self._counter_key, COUNTER_TTL)
        pipe.execute_command(*wait)
        # Compared with what was acknowledged before it was sent: saves answered
        # while the WAIT blocks may be higher, and say nothing about a loss.
        floor = self._counted
        try:
            replies = await pipe.execute(raise_on_error=False)
        except Exception as error:  # connection errors vary by client mode
            replies = [error, error, error]
        counted = replies[0]
        if not isinstance(counted, int):  # no fence written: the WAIT would prove nothing
            self.wait_failures += 1
            return NOT_YET
        if counted <= floor or self._lost_seen:
            # Lost, seen here or by a save since the last fence (a save after the
            # loss already counted from the lower value: saves rebuild the count).
            self._lost_seen = False
            self._counted = counted
            self.lost_writes += 1
            return LOST
        self._counted = max(self._counted, counted)
        return DURABLE if self._waited(replies[-1]) else NOT_YET

    def _wait_command(self) -> tuple[Any, ...]:
        timeout = self.wait_timeout_ms
        if self.wait == "replicas":
            return ("WAIT", self.wait_replicas, timeout)
        if self.wait == "aof":
            return ("WAITAOF", 1, 0, timeout)
        return ()

    def _waited(self, reply: Any) -> bool:
        """Did the wait see the writes durable (persistence.redis_wait)?"""
        if isinstance(reply, BaseException):
            self.wait_failures += 1
            return False
        ok = int(reply) >= self.wait_replicas if self.wait == "replicas" else int(reply[0]) >= 1
        if not ok:
            self.wait_failures += 1
        return ok

    async def check_version(self) -> None:
        """A clear error at start on a Redis older than the scripts need
        (:data:`MIN_REDIS_VERSION`), rather than a script failing mid-replay. A
        Redis user not allowed ``INFO`` is not asked (a warning says so)."""
        try:
            info = await self.redis_info("server")
        except ResponseError as error:  # NoPermissionError: an ACL without INFO
            log.warning("Redis's version not checked (INFO refused: %s)", error)
            return
        old = too_old_redis(info)
        if old is not None:
            raise ValueError(
                f"Redis {'.'.join(map(str, MIN_REDIS_VERSION))} or newer is needed "
                f"(ZMSCORE, ZRANGE BYSCORE); this one is {old}"
            )

    async def redis_info(self, section: str) -> dict[str, Any]:
        """INFO ``section``; on a cluster, of every node (node name -> its INFO)."""
        if isinstance(self.redis, RedisCluster):
            return await self.redis.info(section, target_nodes=RedisCluster.ALL_NODES)
        return await self.redis.info(section)

    async def check_wait(self) -> None:
        """A clear error at start if persistence.redis_wait cannot work on this Redis."""
        if self.wait == "off":
            return
        if isinstance(self.redis, RedisCluster):
            raise ValueError("is not supported with persistence.redis_cluster yet")
        info = await self.redis.info("server")
        version = str(info.get("redis_version", "0"))
        numbers = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
        if self.wait == "aof" and numbers < (7, 2):
            raise ValueError(f"aof needs WAITAOF, Redis 7.2 or newer; this Redis is {version}")

    def _client_part(self, batch: ClientBatch, now: float) -> _ClientPart:
        """One client's keys and arguments in a call of the save script."""
        meta = bytearray()
        values: list[bytes] = []
        pack = _SAVE_META.pack
        for m in batch.messages:
            if isinstance(m, StoredMessage):
                value = stored_value(encode_message(m))
                meta += pack(
                    m.producer, m.seq, m.generation, self._ttl_ms(m.expiry, now), len(value)
                )
            else:
                rid = record_id(m)
                value = stored_value(m)
                ttl = self._ttl_ms(rid.expiry, now)
                meta += pack(rid.producer, rid.seq, rid.generation, ttl, len(value))
            values.append(value)
        args = (batch.partition, len(batch.messages), bytes(meta), batch.premark, b"".join(values))
        return _ClientPart(client_keys(batch.client_id), args)

    # -- reading -----------------------------------------------------------

    async def load_page(self, client_id: str, after_score: int = 0, limit: int = 100) -> Page:
        """Up to ``limit`` stored messages with score > ``after_score``, in order.

        Page on with the last record's score. Refs whose message expired are
        removed from the set on the way. :attr:`Page.last_score` is the
        client's score counter as the page was read.
        """
        if limit < 1:
            raise ValueError("limit must be at least 1")
        keys = client_keys(client_id)
        reply = await self._eval(
            _LOAD_PAGE,
            (keys.messages, keys.last_score, keys.values),
            (int(after_score), limit),
        )
        records = [
            decode_record(int(reply[i]), int(reply[i + 1]), reply[i + 2])
            for i in range(2, len(reply), 3)
        ]
        return Page(records, int(reply[1]))

    async def purge(self, client_id: str) -> list[tuple[int, int]]:
        """An operator empties the backlog: every message never sent is deleted (those
        in flight stay until acknowledged); returns their (packet id, score)."""
        keys = client_keys(client_id)
        reply = await self._eval(_PURGE, (keys.messages, keys.values), ())
        return [(int(reply[i]), int(float(reply[i + 1]))) for i in range(0, len(reply), 2)]

    async def backlog_range(
        self, client_id: str
    ) -> tuple[int, tuple[tuple[int, int], tuple[int, int]] | None]:
        """(refs stored, ((packet id, score) of the oldest, of the newest) or None)."""
        key = client_keys(client_id).messages
        pipe = self.redis.pipeline(transaction=False)
        pipe.zcard(key)
        pipe.zrange(key, 0, 0, withscores=True)
        pipe.zrange(key, -1, -1, withscores=True)
        count, first, last = await pipe.execute()
        if not first or not last:
            return int(count), None
        ends = [(int(ref[0][0]), int(ref[0][1])) for ref in (first, last)]
        return int(count), (ends[0], ends[1])

    async def pending_counts(self, client_ids: Sequence[str]) -> list[int]:
        """Refs stored for each of ``client_ids``, in one round trip."""
        if not client_ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for cid in client_ids:
            pipe.zcard(client_keys(cid).messages)
        return [int(n) for n in await pipe.execute()]

    async def pending_count(self, client_id: str) -> int:
        """Refs stored (including expired ones not yet dropped by a load)."""
        return int(await self.redis.execute_command("ZCARD", client_keys(client_id).messages))

    # -- delivery progress ---------------------------------------------------

    async def ack(self, client_id: str, packet_id: int, score: int = 0) -> bool:
        """PUBACK / PUBCOMP: forget the message. False if it was not stored."""
        return await self.ack_many(client_id, (packet_id,), (score,)) == 1

    async def ack_many(
        self, client_id: str, packet_ids: Iterable[int], scores: Iterable[int] | None = None
    ) -> int:
        """Forget many messages in one call; returns how many were stored. With
        ``scores`` (those the messages were read with), an id now another
        message's is left alone (ack.lua)."""
        ids = list(packet_ids)
        if not ids:
            return 0
        keys = client_keys(client_id)
        wanted = list(scores) if scores is not None else [0] * len(ids)
        pairs = list(zip(ids, wanted, strict=True))
        script_keys, args = _progress_call([((keys.messages, keys.values), pairs)])
        (removed,) = await self._eval(_ACK, script_keys, args)
        return int(removed)

    async def mark_pubrel(self, client_id: str, packet_id: int) -> bool:
        """PUBREC received: keep only the PUBREL stage, with the remaining TTL.

        False if the message is no longer stored (acked, trimmed or expired).
        """
        keys = client_keys(client_id)
        return int(await self._eval(_PUBREL, (keys.messages, keys.values), (packet_id,))) == 1

    async def mark_sent(
        self, client_id: str, packet_ids: Iterable[int], scores: Iterable[int] | None = None
    ) -> list[int]:
        """Record that messages are about to go out (DUP on any later send).

        Returns the ids marked; a message no longer stored (trimmed, expired)
        is left out and must not be sent. With ``scores`` (those the messages
        were read with), an id that now belongs to another message is left
        out too, and that message is left alone (mark_sent.lua).
        """
        ids = list(packet_ids)
        if not ids:
            return []
        keys = client_keys(client_id)
        wanted = list(scores) if scores is not None else [0] * len(ids)
        pairs = list(zip(ids, wanted, strict=True))
        script_keys, args = _progress_call([((keys.messages, keys.values), pairs)])
        (reply,) = await self._eval(_MARK_SENT, script_keys, args)
        return [int(i) for i in reply[::2]]

    async def write_progress(
        self,
        marks: Mapping[str, Sequence[tuple[int, int]]],
        pubrels: Mapping[str, Sequence[int]],
        acks: Mapping[str, Sequence[tuple[int, int]]],
    ) -> dict[str, set[tuple[int, int]]]:
        """Many clients' delivery progress in one pipelined round trip: one mark script
        call and one ack script call for them all on a single Redis (one of each per
        hash slot on a cluster), not one per client.

        ``marks`` and ``acks``: per client, (packet id, score it was read with)
        pairs. Returns, per client, the pairs marked.

        Sent marks first, then PUBREL stages, then acks: the order one
        message's progress can take within one batch. Every command is
        idempotent, so a failed batch is simply written again. Returns, per
        client, the ids marked (see :meth:`mark_sent`).
        """
        started = time.perf_counter()
        try:
            return await self._write_progress(marks, pubrels, acks)
        except NoScriptError:
            await self.load_scripts()
            return await self._write_progress(marks, pubrels, acks)
        except Exception:
            self.script_errors["progress"] = self.script_errors.get("progress", 0) + 1
            raise
        finally:
            self._observe("progress", time.perf_counter() - started)

    async def _write_progress(
        self,
        marks: Mapping[str, Sequence[tuple[int, int]]],
        pubrels: Mapping[str, Sequence[int]],
        acks: Mapping[str, Sequence[tuple[int, int]]],
    ) -> dict[str, set[tuple[int, int]]]:
        pipe = self.redis.pipeline(transaction=False)
        mark_calls = self._by_slot(
            [
                ((client_keys(cid).messages, client_keys(cid).values), sent, cid)
                for cid, sent in marks.items()
            ]
        )
        for group in mark_calls:
            keys, args = _progress_call([(k, pairs) for k, pairs, _cid in group])
            pipe.execute_command("EVALSHA", _MARK_SENT.sha, len(keys), *keys, *args)
        for client_id, ids in pubrels.items():
            if ids:
                keys_ = client_keys(client_id)
                pipe.execute_command("EVALSHA", _PUBREL.sha, 2, keys_.messages, keys_.values, *ids)
        for group in self._by_slot(
            [
                ((client_keys(cid).messages, client_keys(cid).values), acked, cid)
                for cid, acked in acks.items()
            ]
        ):
            keys, args = _progress_call([(k, pairs) for k, pairs, _cid in group])
            pipe.execute_command("EVALSHA", _ACK.sha, len(keys), *keys, *args)
        replies = await pipe.execute()
        marked: dict[str, set[tuple[int, int]]] = {}
        for group, reply in zip(mark_calls, replies, strict=False):
            for (_k, _pairs, client_id), pairs in zip(group, reply, strict=True):
                marked[client_id] = {
                    (int(i), int(sc)) for i, sc in zip(pairs[::2], pairs[1::2], strict=True)
                }
        return marked

    def _by_slot(self, calls: list[_ProgressPart]) -> list[list[_ProgressPart]]:
        """Clients' parts of a mark or ack call grouped into calls (:func:`_script_calls`)."""
        return _script_calls(calls, lambda part: part[0][0], isinstance(self.redis, Redis))

    # -- sessions ----------------------------------------------------------

    async def open_session(
        self,
        client_id: str,
        *,
        resume: bool,
        generation: int,
        state: SessionState,
        enforce_owner: bool = False,
    ) -> SessionState | None:
        """A client connects to a durable session (one script call).

        ``resume`` (clean start 0) with a session stored: returns it, its
        generation and owner included; nothing changes. Otherwise a new
        session: whatever is stored for the client goes, ``state`` is written
        with a generation above every earlier one (at least ``generation``,
        the caller's clock), which is set on ``state``; returns None. With
        ``enforce_owner``, a stored session bound to another owner than
        ``state.owner`` raises :class:`SessionOwned` and changes nothing.
        """
        keys = (*client_keys(client_id), opens_key(client_id))
        args = (
            "resume" if resume else "new",
            generation,
            state.encode(),
            state.owner or "",
            "1" if enforce_owner else "0",
            self._default_ttl_ms,
        )
        reply = await self._eval(_OPEN, keys, args)
        if reply[0] == b"refused":
            raise SessionOwned(client_id)
        gen, stored = reply[0], reply[1]
        if stored:
            found = SessionState.decode(stored)
            found.generation = int(gen)
            found.opens = int(reply[2])
            return found
        state.generation = int(gen)
        return None

    async def save_session(
        self, client_id: str, state: SessionState, *, ttl: int | None = None
    ) -> bool:
        """Store the session. With ``ttl`` (seconds) every key of the client
        expires then; without, all of them are made persistent (connected).
        False: a newer generation than ``state.generation`` holds the client
        (the session ended or moved): nothing was written."""
        ttl_ms = 0 if ttl is None else _positive_ms(ttl)
        args = ("save", ttl_ms, state.encode(), state.generation)
        return int(await self._eval(_SESSION, client_keys(client_id), args)) >= 0

    async def load_session(self, client_id: str) -> SessionState | None:
        keys = client_keys(client_id)
        data, gen = await self.redis.execute_command("MGET", keys.session, keys.generation)
        return _session_state(data, gen)

    async def load_sessions(self, client_ids: Sequence[str]) -> list[SessionState | None]:
        """:meth:`load_session` of many clients in one pipeline (one MGET each, in the
        client's slot): a restore of 100,000 sessions pays a round trip per chunk,
        not one per session (BENCHMARKS.md, "The fleet shape")."""
        pipe = self.redis.pipeline(transaction=False)
        for client_id in client_ids:
            keys = client_keys(client_id)
            pipe.execute_command("MGET", keys.session, keys.generation, opens_key(client_id))
        replies = await pipe.execute()
        return [_session_state(data, gen, opens) for data, gen, opens in replies]

    async def expire_session(self, client_id: str, seconds: int, generation: int = 0) -> bool:
        """Disconnected: every key of the client expires in ``seconds``
        (``<= 0``: the session ends now). Returns whether a session of that
        generation was stored."""
        if seconds <= 0:
            existed = await self.load_session(client_id) is not None
            return existed and await self.end_session(client_id, generation) is not None
        args = ("expire", seconds * 1000, b"", generation)
        reply = await self._eval(_SESSION, client_keys(client_id), args)
        return int(reply) == 1

    async def end_session(
        self, client_id: str, generation: int = 0, opens: int | None = None
    ) -> int | None:
        """The session of ``generation`` ended (0: whichever is stored): delete every
        key of the client, leave a generation tombstone for ``default_ttl`` so
        records still in Kafka for it are dropped. ``opens``: an end by expiry, of a
        session this broker saw resumed that many times; a client that resumed it
        since (on another replica) keeps it. Returns the messages deleted, or None
        if a newer session holds the client or it was resumed since (nothing was
        deleted)."""
        args = (generation, self._default_ttl_ms, "" if opens is None else opens)
        # And what it had in flight from queues (tests/model/FINDINGS.md, finding 35).
        keys = (
            *client_keys(client_id),
            queue_keys(client_id).inflight,
            group_writes_key(client_id),
            opens_key(client_id),
        )
        deleted = int(await self._eval(_END, keys, args))
        return None if deleted < 0 else deleted

    async def delete_session(self, client_id: str) -> int:
        """End whatever session is stored for ``client_id``; returns messages deleted."""
        return await self.end_session(client_id) or 0

    # -- keys of the whole installation (persistence/format.py) -------------------

    async def indexed_sessions(self) -> list[tuple[bytes, float]]:
        """(client id, expiry deadline) of every durable session, for the restore."""
        entries = await self.redis.zrange(SESSIONS_INDEX, 0, -1, withscores=True)
        return cast(list[tuple[bytes, float]], entries)

    async def index_session(self, client_id: str, deadline: float) -> None:
        await self.redis.zadd(SESSIONS_INDEX, {client_id: deadline})

    async def unindex_session(self, client_id: str) -> None:
        await self.redis.zrem(SESSIONS_INDEX, client_id)

    async def next_producer_id(self) -> int:
        """A producer id no other broker process of this installation was given."""
        return int(await self.redis.incr(PRODUCERS_KEY))

    async def topic_epoch(self, topic: str, created: bool) -> int:
        """How many times devicemq created ``topic``: its offsets restart each time."""
        key = epoch_key(topic)
        if created:
            return int(await self.redis.incr(key))
        return int(await self.redis.get(key) or 0)

    async def topic_used(self, topic: str) -> bool:
        """devicemq created ``topic`` before (its epoch is counted)."""
        return bool(await self.redis.exists(epoch_key(topic)))

    async def pending_total(self, client_ids: Sequence[str], chunk: int) -> int:
        """Refs stored for all of ``client_ids``, ``chunk`` clients per round trip."""
        total = 0
        for start in range(0, len(client_ids), chunk):
            pipe = self.redis.pipeline(transaction=False)
            for cid in client_ids[start : start + chunk]:
                pipe.zcard(client_keys(cid).messages)
            total += sum(int(n) for n in await pipe.execute())
        return total

    async def ping(self) -> None:
        await self.redis.ping()


def _check_limit(limit: int) -> None:
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be within 1..{MAX_LIMIT}")


def _positive_ms(seconds: int) -> int:
    if seconds <= 0:
        raise ValueError("ttl must be positive")
    return seconds * 1000
