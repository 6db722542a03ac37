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

Key layout
----------
All of a client's keys carry the same hash tag ``{cid}``, so they share one
Redis Cluster slot and one script may touch them all:

``{cid}_messages``
    sorted set; member = packet id as a decimal string, score = the client's
    counter (``{cid}_last_score``).
``{cid}_messages_<packetId>``
    string: the message (encoding below), ``SET ... PX ttl`` where ttl is
    the MQTT 5 message expiry if the message has one, else ``default_ttl``
    (7 days).
``{cid}_last_packet_id``
    last packet id handed out, 1..65535.
``{cid}_last_score``
    last score handed out.
``{cid}_last_offset``
    hash, Kafka partition -> last offset stored for this client.
``{cid}_session``
    the session state (:class:`SessionState`, orjson).

``cid`` is the client id itself, except that ``%`` and ``}`` are written
``%25`` and ``%7D`` and the empty id is written ``%``: a ``}`` would end the
hash tag early (an id starting with ``}`` would give an empty tag and spread
the keys over slots). The mapping is injective and leaves ordinary ids alone.

Value encoding
--------------
A stored message is a fixed header, big-endian (``struct`` format
``>BBBddqHI``, 33 bytes), then the topic (UTF-8), the properties, the
payload::

    version   u8   1
    flags     u8   0x01 SENT (sent at least once: DUP on replay)
                   0x02 PUBREL (QoS 2, PUBREC received: only PUBREL is left)
                   0x04 RETAIN  0x08 HAS_EXPIRY
    qos       u8
    published f64  publish time, epoch seconds
    expiry    f64  absolute message expiry, epoch seconds (if HAS_EXPIRY)
    offset    i64  Kafka offset, -1 if unknown
    topic_len u16
    props_len u32
    topic, properties, payload

The properties are MQTT 5 property identifiers with fixed-width values:
``0x01`` u8 payload format; ``0x03`` content type, ``0x08`` response topic,
``0x09`` correlation data, each u16 length + bytes; ``0x26`` user property,
u16 length + key, u16 length + value (repeated, order kept); ``0x0B``
subscription identifier, u32 (repeated).

The flags byte is byte 1 so the SENT bit can be set in Redis with ``SETBIT
key 15 1``, which keeps the key's TTL. After PUBREC the message is rewritten
(``SET key value XX KEEPTTL``: the TTL is kept) as the 2-byte header
``01 03`` (version 1, SENT | PUBREL): only the packet id is needed to resend
PUBREL, so the payload's memory is released.

Invariants
----------
* **Packet ids** follow the score: ``packet_id = (score - 1) % 65535 + 1``
  (:func:`packet_id_of`), so they wrap 65535 -> 1 and are never 0;
  ``{cid}_last_packet_id`` records the last one. An id is never given out
  while a ref with that id is in ``{cid}_messages``: the save script first
  trims the set below the limit (``limit <= 65535``), so at least one id is
  free, then moves the score on past any score whose id is still stored (an
  old unacknowledged message can outlive 65535 newer, acknowledged ones; its
  id is skipped, never overwritten, and the scores show a gap there). A
  stored ref can only clash with a new score 65535 or more steps later, so
  the script checks ids one by one only when its oldest ref is that old.
  Acknowledged as they go, the ids run 1..65535, 1, 2, ... with no gap.
* **Scores** come from ``{cid}_last_score``, which only grows (strictly
  increasing per client, gaps only where an id was skipped); it is not
  derived from the set (which empties), and if the counter key were lost the
  script continues above the set's highest score.
* **Idempotent save**: messages at offsets ``<=`` the partition's stored
  offset are skipped (reported as duplicates), so a batch retried after a
  crash before the Kafka commit stores nothing twice and advances no counter.
* **In flight until acknowledged**: a message marked sent (it may have been
  seen) is never trimmed and never expires: its string lives as long as the
  session (no TTL while the client is connected, the session's TTL while it
  is not), so its packet id stays taken until the client acknowledges it
  (MQTT-4.4.0-1: it is re-sent on reconnect whatever its age). Sent messages
  are the oldest refs (delivery goes in score order), at most a window's
  worth.
* **Limit**: over the per-client limit (default 10000, at most 65535) the
  oldest refs never sent (lowest scores) and their strings are removed,
  reported in :attr:`SaveResult.trimmed_ids`; when every stored message is in
  flight, the new message is not stored (:attr:`SaveResult.unstored`).
* **Bounded growth**: while the session key has a TTL (client disconnected)
  every key of the client expires with it; with no session key at all the
  keys expire after the longest message TTL (at least ``default_ttl``).
  Strings never sent have a TTL of their own. Refs whose string expired are
  dropped by :meth:`RedisMessageStore.load_page`.

Atomicity comes from each batch being one script: on a crash a batch is
either stored with its offset record or not at all.
"""

from __future__ import annotations

import hashlib
import math
import struct
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from importlib import resources
from typing import Any, NamedTuple, Protocol

import orjson
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError

from broker.stats import Histogram

__all__ = [
    "DEFAULT_LIMIT",
    "DEFAULT_TTL",
    "MAX_LIMIT",
    "Assigned",
    "BatchSaveError",
    "ClientBatch",
    "ClientKeys",
    "Page",
    "PersistedMessageStore",
    "RedisMessageStore",
    "SaveResult",
    "SessionState",
    "Stage",
    "StoredMessage",
    "StoredRecord",
    "SubscriptionState",
    "client_keys",
    "decode_record",
    "encode_message",
    "encoded_expiry",
    "packet_id_of",
]

DEFAULT_LIMIT = 10_000
MAX_LIMIT = 65_535
MAX_PACKET_ID = 65_535
DEFAULT_TTL = 7 * 24 * 3600  # seconds

RedisClient = Redis | RedisCluster

# ---------------------------------------------------------------------------
# Messages and their encoding (pure, no I/O)
# ---------------------------------------------------------------------------

VERSION = 1
FLAG_SENT = 0x01
FLAG_PUBREL = 0x02
FLAG_RETAIN = 0x04
FLAG_HAS_EXPIRY = 0x08

_HEADER = struct.Struct(">BBBddqHI")
_PUBREL_VALUE = bytes((VERSION, FLAG_SENT | FLAG_PUBREL))

_P_PAYLOAD_FORMAT = 0x01
_P_CONTENT_TYPE = 0x03
_P_RESPONSE_TOPIC = 0x08
_P_CORRELATION_DATA = 0x09
_P_SUBSCRIPTION_ID = 0x0B
_P_USER_PROPERTY = 0x26

POOL_CONNECTIONS = 64  # Redis connections of one broker (single-node mode)
_SAVE_META = struct.Struct(">ddd")  # per message to the save script: offset, TTL, length
_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_ID_U8 = struct.Struct(">BB")
_ID_U16 = struct.Struct(">BH")
_ID_U32 = struct.Struct(">BI")


class Stage(Enum):
    """Where a stored message is in its outgoing flow."""

    PUBLISH = "publish"  # PUBLISH to (re)send
    PUBREL = "pubrel"  # QoS 2 after PUBREC: only PUBREL is left to send


@dataclass(slots=True)
class StoredMessage:
    """One message for one subscriber, as the consumer hands it to the store.

    ``qos`` and ``retain`` are what this subscriber receives;
    ``subscription_identifiers`` are those of its matching subscriptions.
    ``expiry`` is the absolute MQTT 5 message expiry (epoch seconds) or None.
    """

    topic: str
    payload: bytes
    qos: int
    retain: bool = False
    payload_format_indicator: int | None = None
    content_type: str | None = None
    response_topic: str | None = None
    correlation_data: bytes | None = None
    user_properties: tuple[tuple[str, str], ...] = ()
    subscription_identifiers: tuple[int, ...] = ()
    publish_time: float = 0.0
    expiry: float | None = None
    kafka_offset: int = -1


@dataclass(slots=True)
class StoredRecord:
    """A message read back for delivery or replay.

    ``sent`` means it went out at least once: resend with DUP. In the PUBREL
    stage ``message`` is None (only PUBREL ``packet_id`` is to be sent).
    ``marked``: not sent yet, but the store has it marked sent already (it was
    saved for a client waiting for it): it goes out without a mark write.
    """

    packet_id: int
    score: int
    stage: Stage
    sent: bool
    message: StoredMessage | None
    marked: bool = False


def _short(data: bytes, what: str) -> bytes:
    if len(data) > 0xFFFF:
        raise ValueError(f"{what} is longer than 65535 bytes")
    return _U16.pack(len(data)) + data


def _encode_properties(m: StoredMessage) -> bytes:
    parts: list[bytes] = []
    if m.payload_format_indicator is not None:
        parts.append(_ID_U8.pack(_P_PAYLOAD_FORMAT, m.payload_format_indicator))
    if m.content_type is not None:
        parts.append(bytes((_P_CONTENT_TYPE,)) + _short(m.content_type.encode(), "content type"))
    if m.response_topic is not None:
        parts.append(
            bytes((_P_RESPONSE_TOPIC,)) + _short(m.response_topic.encode(), "response topic")
        )
    if m.correlation_data is not None:
        parts.append(bytes((_P_CORRELATION_DATA,)) + _short(m.correlation_data, "correlation"))
    for key, value in m.user_properties:
        parts.append(
            bytes((_P_USER_PROPERTY,))
            + _short(key.encode(), "user property")
            + _short(value.encode(), "user property")
        )
    for sid in m.subscription_identifiers:
        parts.append(_ID_U32.pack(_P_SUBSCRIPTION_ID, sid))
    return b"".join(parts)


def encode_message(m: StoredMessage, *, sent: bool = False) -> bytes:
    """The stored value of ``m`` (see the module docstring for the layout)."""
    topic = m.topic.encode()
    if len(topic) > 0xFFFF:
        raise ValueError("topic is longer than 65535 bytes")
    props = _encode_properties(m)
    flags = (FLAG_SENT if sent else 0) | (FLAG_RETAIN if m.retain else 0)
    if m.expiry is not None:
        flags |= FLAG_HAS_EXPIRY
    header = _HEADER.pack(
        VERSION,
        flags,
        m.qos,
        m.publish_time,
        m.expiry if m.expiry is not None else 0.0,
        m.kafka_offset,
        len(topic),
        len(props),
    )
    return b"".join((header, topic, props, m.payload))


def _decode_properties(data: bytes) -> dict[str, Any]:
    out: dict[str, Any] = {}
    users: list[tuple[str, str]] = []
    sids: list[int] = []
    pos = 0
    end = len(data)

    def short() -> bytes:
        nonlocal pos
        (n,) = _U16.unpack_from(data, pos)
        pos += 2 + n
        return data[pos - n : pos]

    while pos < end:
        pid = data[pos]
        pos += 1
        if pid == _P_PAYLOAD_FORMAT:
            out["payload_format_indicator"] = data[pos]
            pos += 1
        elif pid == _P_CONTENT_TYPE:
            out["content_type"] = short().decode()
        elif pid == _P_RESPONSE_TOPIC:
            out["response_topic"] = short().decode()
        elif pid == _P_CORRELATION_DATA:
            out["correlation_data"] = short()
        elif pid == _P_USER_PROPERTY:
            key = short().decode()
            users.append((key, short().decode()))
        elif pid == _P_SUBSCRIPTION_ID:
            sids.append(_U32.unpack_from(data, pos)[0])
            pos += 4
        else:
            raise ValueError(f"unknown stored property 0x{pid:02x}")
    if users:
        out["user_properties"] = tuple(users)
    if sids:
        out["subscription_identifiers"] = tuple(sids)
    return out


def encoded_expiry(value: bytes) -> float | None:
    """The absolute expiry of an encoded message, read from its header alone."""
    if value[1] & FLAG_HAS_EXPIRY:
        return float(_HEADER.unpack_from(value)[4])
    return None


def decode_record(
    packet_id: int, score: int, value: bytes, *, marked: bool = False
) -> StoredRecord:
    """Read a stored value back (inverse of :func:`encode_message`).

    ``marked``: the store holds it marked sent though this value is not
    (see :attr:`StoredRecord.marked`).
    """
    if len(value) < 2 or value[0] != VERSION:
        raise ValueError(f"unknown stored message format (packet id {packet_id})")
    flags = value[1]
    sent = bool(flags & FLAG_SENT)
    if flags & FLAG_PUBREL:
        return StoredRecord(packet_id, score, Stage.PUBREL, True, None)
    _, _, qos, published, expiry, offset, topic_len, props_len = _HEADER.unpack_from(value)
    pos = _HEADER.size
    topic = value[pos : pos + topic_len].decode()
    pos += topic_len
    props = _decode_properties(value[pos : pos + props_len]) if props_len else {}
    pos += props_len
    message = StoredMessage(
        topic=topic,
        payload=value[pos:],
        qos=qos,
        retain=bool(flags & FLAG_RETAIN),
        publish_time=published,
        expiry=expiry if flags & FLAG_HAS_EXPIRY else None,
        kafka_offset=offset,
        **props,
    )
    return StoredRecord(packet_id, score, Stage.PUBLISH, sent, message, marked)


# ---------------------------------------------------------------------------
# Session state
# ---------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class SubscriptionState:
    qos: int
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0
    subscription_id: int | None = None


@dataclass(slots=True)
class SessionState:
    """What a persistent session must keep across broker restarts.

    ``expiry_interval`` is the Session Expiry Interval in seconds (None: the
    session never expires). ``last_seen`` is epoch seconds.
    """

    expiry_interval: int | None
    last_seen: float
    subscriptions: dict[str, SubscriptionState] = field(default_factory=dict)
    protocol_level: int = 5
    # QoS 2 packet ids received from the client and not yet released by PUBREL
    qos2_received: tuple[int, ...] = ()

    def encode(self) -> bytes:
        return orjson.dumps(
            {
                "v": 1,
                "e": self.expiry_interval,
                "l": self.last_seen,
                "p": self.protocol_level,
                "q": list(self.qos2_received),
                "s": [
                    [
                        f,
                        s.qos,
                        s.no_local,
                        s.retain_as_published,
                        s.retain_handling,
                        s.subscription_id,
                    ]
                    for f, s in self.subscriptions.items()
                ],
            }
        )

    @classmethod
    def decode(cls, data: bytes) -> SessionState:
        doc = orjson.loads(data)
        if doc.get("v") != 1:
            raise ValueError("unknown session state format")
        subs = {
            f: SubscriptionState(qos, bool(nl), bool(rap), rh, sid)
            for f, qos, nl, rap, rh, sid in doc["s"]
        }
        return cls(doc["e"], doc["l"], subs, doc["p"], tuple(doc.get("q", ())))


# ---------------------------------------------------------------------------
# Keys
# ---------------------------------------------------------------------------


class ClientKeys(NamedTuple):
    messages: str
    last_packet_id: str
    last_score: str
    last_offset: str
    session: str

    def message(self, packet_id: int) -> str:
        return f"{self.messages}_{packet_id}"


def _tag(client_id: str) -> str:
    if not client_id:
        return "%"
    if "%" in client_id or "}" in client_id:
        return client_id.replace("%", "%25").replace("}", "%7D")
    return client_id


def packet_id_of(score: int) -> int:
    """The packet id that goes with a score: 1..65535, wrapping, never 0."""
    return (score - 1) % MAX_PACKET_ID + 1


def client_keys(client_id: str) -> ClientKeys:
    """The Redis keys of ``client_id`` (all in one cluster slot)."""
    p = "{" + _tag(client_id) + "}"
    return ClientKeys(
        p + "_messages",
        p + "_last_packet_id",
        p + "_last_score",
        p + "_last_offset",
        p + "_session",
    )


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
    increasing scores), or None when it was
    not stored: its offset had been stored before (counted in
    ``duplicates``) or it had already expired (``expired``).
    ``trimmed_ids`` are packet ids removed, oldest first, to respect the
    limit; they may include messages of this very batch. ``unstored`` are
    the indexes of messages refused for the limit itself: every message
    stored was in flight, none could make room.
    """

    assigned: list[Assigned | None]
    trimmed_ids: list[int]
    duplicates: int
    expired: int
    unstored: list[int] = field(default_factory=list)

    @property
    def saved(self) -> int:
        return len(self.assigned) - self.duplicates - self.expired - len(self.unstored)

    @property
    def trimmed(self) -> int:
        return len(self.trimmed_ids) + len(self.unstored)


@dataclass(slots=True)
class ClientBatch:
    """One client's messages from one Kafka partition, in offset order.

    ``offsets`` defaults to each message's ``kafka_offset``. The first
    ``premark`` messages stored are stored marked sent (see
    :attr:`StoredRecord.marked`).
    """

    client_id: str
    messages: Sequence[StoredMessage | bytes]
    partition: int | str  # the offset record's key: Kafka partition (qualified)
    offsets: Sequence[int] | None = None
    premark: int = 0


def _save_result(reply: Any) -> SaveResult:
    """The save script's reply: a score per message (>0 stored, -1 duplicate, 0 expired,
    -3 no room: every stored message in flight)."""
    scores, trimmed = reply
    assigned: list[Assigned | None] = []
    duplicates = expired = 0
    unstored: list[int] = []
    for i, score in enumerate(scores):
        if score > 0:
            assigned.append(Assigned(packet_id_of(score), score))
            continue
        assigned.append(None)
        if score == -1:
            duplicates += 1
        elif score == 0:
            expired += 1
        else:
            unstored.append(i)
    return SaveResult(assigned, [int(t) for t in trimmed], duplicates, expired, unstored)


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

    async def load_page(self, client_id: str, after_score: int = 0, limit: int = 100) -> Page: ...

    async def ack(self, client_id: str, packet_id: int) -> bool: ...

    async def ack_many(self, client_id: str, packet_ids: Iterable[int]) -> int: ...

    async def mark_pubrel(self, client_id: str, packet_id: int) -> bool: ...

    async def mark_sent(self, client_id: str, packet_ids: Iterable[int]) -> list[int]: ...

    async def write_progress(
        self,
        marks: Mapping[str, Sequence[int]],
        pubrels: Mapping[str, Sequence[int]],
        acks: Mapping[str, Sequence[int]],
    ) -> dict[str, set[int]]: ...

    async def pending_count(self, client_id: str) -> int: ...

    async def save_session(
        self, client_id: str, state: SessionState, *, ttl: int | None = None
    ) -> None: ...

    async def load_session(self, client_id: str) -> SessionState | None: ...

    async def delete_session(self, client_id: str, *, keep_offsets: bool = True) -> int: ...

    async def expire_session(self, client_id: str, seconds: int) -> bool: ...


# ---------------------------------------------------------------------------
# Redis implementation
# ---------------------------------------------------------------------------


class _Script(NamedTuple):
    name: str
    text: bytes
    sha: str


def _load_script(name: str) -> _Script:
    text = resources.files("persistence").joinpath("lua", f"{name}.lua").read_bytes()
    return _Script(name, text, hashlib.sha1(text).hexdigest())


_SAVE = _load_script("save_batch")
_LOAD_PAGE = _load_script("load_page")
_ACK = _load_script("ack")
_MARK_SENT = _load_script("mark_sent")
_SESSION = _load_script("session")
_DELETE = _load_script("delete_client")
_SCRIPTS = (_SAVE, _LOAD_PAGE, _ACK, _MARK_SENT, _SESSION, _DELETE)


class RedisMessageStore:
    """:class:`PersistedMessageStore` on redis-py asyncio (single or cluster).

    ``redis`` must not decode responses. ``limit`` is the per-client stored
    limit (1..65535), ``default_ttl`` the TTL in seconds of messages without
    an MQTT 5 expiry. ``clock`` gives epoch seconds (message expiry is absolute).
    """

    def __init__(
        self,
        redis: RedisClient,
        *,
        limit: int = DEFAULT_LIMIT,
        default_ttl: int = DEFAULT_TTL,
        clock: Callable[[], float] = time.time,
    ) -> None:
        _check_limit(limit)
        if default_ttl <= 0:
            raise ValueError("default_ttl must be positive")
        self.redis = redis
        self.limit = limit
        self.default_ttl = default_ttl
        self._clock = clock
        self._default_ttl_ms = default_ttl * 1000
        # Exported by broker/metrics.py: seconds per script call, failed calls.
        self.script_latency: dict[str, Histogram] = {}
        self.script_errors: dict[str, int] = {}

    @classmethod
    def from_url(cls, url: str, *, cluster: bool = False, **kwargs: Any) -> RedisMessageStore:
        """A store on ``redis://host:port`` (``cluster``: any node of a cluster).

        The single-node pool makes callers wait for a free connection instead
        of failing: redis-py's default pool raises "Too many connections"
        past 100, which a reconnect storm of replays reaches easily.
        """
        client: RedisClient
        if cluster:
            client = RedisCluster.from_url(url, decode_responses=False)
        else:
            pool = BlockingConnectionPool.from_url(
                url, max_connections=POOL_CONNECTIONS, timeout=None, decode_responses=False
            )
            client = Redis(connection_pool=pool)
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
        Kafka consumer passes record values through untouched; then
        ``offsets`` must be given.
        """
        if limit is not None:
            _check_limit(limit)
        keys, args = self._save_call(
            ClientBatch(client_id, messages, partition, offsets), self._clock(), limit or self.limit
        )
        if not messages:
            return SaveResult([], [], 0, 0)
        return _save_result(await self._eval(_SAVE, keys, args))

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
        """One script call per batch (of different clients), pipelined.

        Calls refused with NOSCRIPT (a restarted or new Redis) ran nothing:
        they are sent again once the scripts are loaded.
        """
        now, limit = self._clock(), self.limit
        results: list[SaveResult | BaseException] = [SaveResult([], [], 0, 0)] * len(batches)
        calls: dict[int, tuple[ClientKeys, tuple[Any, ...]]] = {}
        for i, batch in enumerate(batches):
            if batch.messages:
                try:
                    calls[i] = self._save_call(batch, now, limit)
                except ValueError as error:  # a malformed batch fails alone
                    results[i] = error
        todo = list(calls)
        for attempt in range(2):
            if not todo:
                break
            started = time.perf_counter()
            pipe = self.redis.pipeline(transaction=False)
            for i in todo:
                keys, args = calls[i]
                pipe.execute_command("EVALSHA", _SAVE.sha, len(keys), *keys, *args)
            try:
                replies = await pipe.execute(raise_on_error=False)
            finally:
                self._observe(_SAVE.name, time.perf_counter() - started)
            again = []
            for i, reply in zip(todo, replies, strict=True):
                if isinstance(reply, NoScriptError) and attempt == 0:
                    again.append(i)
                elif isinstance(reply, BaseException):
                    self.script_errors[_SAVE.name] = self.script_errors.get(_SAVE.name, 0) + 1
                    results[i] = reply
                else:
                    results[i] = _save_result(reply)
            if again:
                await self.load_scripts()
            todo = again
        return results

    def _save_call(
        self, batch: ClientBatch, now: float, limit: int
    ) -> tuple[ClientKeys, tuple[Any, ...]]:
        """Keys and arguments of the save script for one client batch."""
        messages, offsets = batch.messages, batch.offsets
        if offsets is None:
            offsets = [m.kafka_offset if isinstance(m, StoredMessage) else -1 for m in messages]
        elif len(offsets) != len(messages):
            raise ValueError("one offset per message")
        meta = bytearray()
        values: list[bytes] = []
        for m, offset in zip(messages, offsets, strict=True):
            if offset < 0:
                raise ValueError("Kafka offsets are >= 0")
            if isinstance(m, StoredMessage):
                value = encode_message(m)
                ttl = self._ttl_ms(m.expiry, now)
            else:
                value = m
                ttl = self._ttl_ms(encoded_expiry(m), now)
            meta += _SAVE_META.pack(offset, ttl, len(value))
            values.append(value)
        args = (
            limit,
            batch.partition,
            self._default_ttl_ms,
            len(messages),
            bytes(meta),
            batch.premark,
            b"".join(values),
        )
        return client_keys(batch.client_id), args

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
            _LOAD_PAGE, (keys.messages, keys.last_score), (int(after_score), limit)
        )
        records = [
            decode_record(int(reply[i]), int(reply[i + 1]), reply[i + 2])
            for i in range(2, len(reply), 3)
        ]
        return Page(records, int(reply[1]))

    async def pending_count(self, client_id: str) -> int:
        """Refs stored (including expired ones not yet dropped by a load)."""
        return int(await self.redis.execute_command("ZCARD", client_keys(client_id).messages))

    # -- delivery progress ---------------------------------------------------

    async def ack(self, client_id: str, packet_id: int) -> bool:
        """PUBACK / PUBCOMP: forget the message. False if it was not stored."""
        return await self.ack_many(client_id, (packet_id,)) == 1

    async def ack_many(self, client_id: str, packet_ids: Iterable[int]) -> int:
        """Forget many messages in one call; returns how many were stored."""
        ids = list(packet_ids)
        if not ids:
            return 0
        return int(await self._eval(_ACK, client_keys(client_id)[:1], ids))

    async def mark_pubrel(self, client_id: str, packet_id: int) -> bool:
        """PUBREC received: keep only the PUBREL stage, with the remaining TTL.

        False if the message is no longer stored (acked, trimmed or expired).
        """
        key = client_keys(client_id).message(packet_id)
        reply = await self.redis.execute_command("SET", key, _PUBREL_VALUE, "XX", "KEEPTTL")
        return reply is not None and reply is not False

    async def mark_sent(self, client_id: str, packet_ids: Iterable[int]) -> list[int]:
        """Record that messages are about to go out (DUP on any later send).

        Returns the ids marked; a message no longer stored (trimmed, expired)
        is left out and must not be sent.
        """
        ids = list(packet_ids)
        if not ids:
            return []
        keys = client_keys(client_id)
        reply = await self._eval(_MARK_SENT, (keys.messages, keys.session), ids)
        return [int(i) for i in reply]

    async def write_progress(
        self,
        marks: Mapping[str, Sequence[int]],
        pubrels: Mapping[str, Sequence[int]],
        acks: Mapping[str, Sequence[int]],
    ) -> dict[str, set[int]]:
        """Many clients' delivery progress in one pipelined round trip.

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
        marks: Mapping[str, Sequence[int]],
        pubrels: Mapping[str, Sequence[int]],
        acks: Mapping[str, Sequence[int]],
    ) -> dict[str, set[int]]:
        pipe = self.redis.pipeline(transaction=False)
        for client_id, ids in marks.items():
            keys = client_keys(client_id)
            pipe.execute_command("EVALSHA", _MARK_SENT.sha, 2, keys.messages, keys.session, *ids)
        for client_id, ids in pubrels.items():
            keys = client_keys(client_id)
            for packet_id in ids:
                pipe.execute_command("SET", keys.message(packet_id), _PUBREL_VALUE, "XX", "KEEPTTL")
        for client_id, ids in acks.items():
            key = client_keys(client_id).messages
            pipe.execute_command("EVALSHA", _ACK.sha, 1, key, *ids)
        replies = await pipe.execute()
        return {
            client_id: {int(i) for i in reply}
            for client_id, reply in zip(marks, replies, strict=False)
        }

    # -- sessions ----------------------------------------------------------

    async def save_session(
        self, client_id: str, state: SessionState, *, ttl: int | None = None
    ) -> None:
        """Store the session. With ``ttl`` (seconds) every key of the client
        expires then; without, all of them are made persistent (connected)."""
        ttl_ms = 0 if ttl is None else _positive_ms(ttl)
        await self._eval(_SESSION, client_keys(client_id), ("save", ttl_ms, state.encode()))

    async def load_session(self, client_id: str) -> SessionState | None:
        data = await self.redis.execute_command("GET", client_keys(client_id).session)
        return None if data is None else SessionState.decode(data)

    async def expire_session(self, client_id: str, seconds: int) -> bool:
        """Disconnected: every key of the client expires in ``seconds``
        (``<= 0``: now). Returns whether a session was stored."""
        if seconds <= 0:
            existed = await self.load_session(client_id) is not None
            await self.delete_session(client_id)
            return existed
        reply = await self._eval(_SESSION, client_keys(client_id), ("expire", seconds * 1000, b""))
        return bool(reply)

    async def delete_session(self, client_id: str, *, keep_offsets: bool = True) -> int:
        """Clean start: delete every key of the client; returns messages deleted.

        ``keep_offsets`` keeps the Kafka offset record for ``default_ttl`` so
        a retried batch from before the clean start is not stored into the
        new session.
        """
        keep_ms = self._default_ttl_ms if keep_offsets else 0
        return int(await self._eval(_DELETE, client_keys(client_id), (keep_ms,)))


def _check_limit(limit: int) -> None:
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be within 1..{MAX_LIMIT}")


def _positive_ms(seconds: int) -> int:
    if seconds <= 0:
        raise ValueError("ttl must be positive")
    return seconds * 1000
