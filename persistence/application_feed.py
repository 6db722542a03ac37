"""APPLICATION sessions: a persistent session served from a Kafka topic of its own.

A DEVICE session (the default) keeps its messages in Redis, one write per
message, at most ``persistence.max_messages_per_client`` of them. An
APPLICATION session (``application.client_ids``, docs/application-sessions.md)
is the backend that subscribes to the whole fleet: its messages go to its own
Kafka topic (:func:`app_topic`), its backlog is bounded by that topic's
retention, and it is read straight from Kafka while its client is connected.

- **Produce.** :meth:`ApplicationSessions.submit` encodes each delivery as the
  persistent path does (persistence/delivery_codec.py, the session's generation
  in it) and sends it to the session's topic; the publisher's PUBACK/PUBREC
  waits for Kafka's acknowledgement (acks=all), under the same deadline
  (``persistence.kafka_request_timeout_ms``). Nothing is written to Redis.
- **Read.** Each connected session has a reader of its own: a consumer with
  no group that is *assigned* the topic's partitions and seeks to the offsets
  stored in Redis (``{cid}_app_offsets``). No group: a group join stalls for
  half its session timeout on Tansu, one group per session would be one more
  coordinator round per connect, and the session is served by the one broker
  its client is connected to anyway; the offsets live beside the session's
  other keys, fenced by its generation, and go with it.
- **Identifiers.** Packet ids are given at the first send, within the window
  (Receive Maximum) the outflow keeps (broker/outflow.py).
- **Progress.** Before a message's first send, ``{cid}_app_inflight`` records
  ``partition:offset -> packet id`` (one write for every message of a pump,
  and one write at a time per session: under load the batches grow, not the
  writes); PUBREC rewrites it ``id:r`` before the PUBREL goes out; an id given
  to a later message turns the older field ``-`` (that flow had completed).
  The committed offset of a partition moves only past messages that are done
  (PUBACK, PUBCOMP, dropped, not this generation's), in order, and the fields
  below it are deleted in the same write.
- **Reconnect.** Everything from the committed offset is read again: a message
  with a field goes again under its id with DUP (MQTT-4.4.0-1), one at ``id:r``
  gets only its PUBREL again (so a QoS 2 message whose PUBREC was recorded is
  never delivered twice), one at ``-`` is skipped, the others are new.
  Acknowledged messages after an unacknowledged one come again (with DUP):
  that is the price of one offset per partition.
- **A log that went back.** Kafka may lose the topic (the embedded one on
  memory storage restarted empty) and start its offsets at 0 again. The
  committed offset is kept with the name of the record just below it
  (``{cid}_app_tail``); after a connect that record is read first, and another
  one there, a record below what was read, or a log end below it means a new
  log: the partition is read from its start, the fields of the old log go, and
  the packet ids they held get a PUBREL at the next connect (``{cid}_app_lost``)
  before they are given again (:meth:`ApplicationSessions.log_went_back`).
- **Copies.** Records are named (producer id, sequence number) as the device
  path's are; the reader skips one at or below the last it read from that
  producer in that partition (``{cid}_app_seen`` keeps it as of the commit),
  so a record Kafka took twice is delivered once.
- **Rewind.** :meth:`ApplicationSessions.rewind` moves the committed offsets
  back (never forward), remembering the old ones (``{cid}_app_replay``: a
  message below it is sent again with DUP) and forgetting the copies' marks;
  a connected client's outflow resumes as on a reconnect.
- **End.** A session that ends (expiry, clean start) has its topic and keys
  deleted (:meth:`ApplicationSessions.ended`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import time
import zlib
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import TYPE_CHECKING, Any, NamedTuple

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError, for_code

from broker.outflow import Outgoing
from broker.packets import ReasonCode
from persistence.delivery_codec import encode_delivery, stored_delivery
from persistence.format import APP_TOPIC_PREFIX, client_keys, decode_record
from persistence.kafka_security import PLAINTEXT, KafkaSecurity

if TYPE_CHECKING:
    from broker.config import ApplicationSettings
    from broker.message import Delivery
    from broker.outflow import Outflow
    from broker.persistent_path import DoneCallback
    from broker.session import Session

log = logging.getLogger("devicemq.application")

TOPIC_PREFIX = APP_TOPIC_PREFIX
REGISTRY = "devicemq:app:sessions"  # hash: client id -> generation of its APPLICATION session
SAFE_LENGTH = 180  # characters of the client ID kept in a topic name (Kafka allows 249)
DEADLINE_TICK = 0.5  # seconds between two looks at the producing deadlines
READ_WAIT_MS = 200  # a reader's longest wait for records (then it looks at its connection)
LOAD_LIMIT = 10.0  # seconds a load script call may go unanswered before it is given up
RETRY_FIRST, RETRY_MOST = 0.5, 2.0  # seconds between tries of a write or a read that failed
DONE = "-"  # an inflight field whose flow completed (its id went to a later message)

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")

# KEYS[1] {cid}_generation  KEYS[2] {cid}_app_offsets  KEYS[3] {cid}_app_inflight
# KEYS[4] {cid}_app_seen  KEYS[5] {cid}_app_tail  KEYS[6] {cid}_app_lost  KEYS[7] {cid}_app_owner
# KEYS[8] {cid}_app_names
# ARGV: generation, owner, n, n (partition, offset) pairs, m, m (field, value) pairs, k, k
# fields (deleted, with their names), s, s ("producer:partition", seq) pairs, t, t
# (partition, "producer:seq") pairs, l, l ids, r, r (field, "producer:seq") pairs: the
# record a field was written for (finding 33)
# Fenced twice. By the generation: a late write of an ended session takes nothing of the
# next (0). By the owner (_LOAD_LUA): a connection that lost the session to a newer one
# (a takeover, on another broker or this one) writes nothing over the progress that one
# read and goes on from (-1).
_PROGRESS_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if redis.call('GET', KEYS[7]) ~= ARGV[2] then return -1 end
local i = 3
local n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]); i = i + 2 end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1]); i = i + 2 end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  redis.call('HDEL', KEYS[3], ARGV[i]); redis.call('HDEL', KEYS[8], ARGV[i]); i = i + 1
end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do redis.call('HSET', KEYS[4], ARGV[i], ARGV[i + 1]); i = i + 2 end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do redis.call('HSET', KEYS[5], ARGV[i], ARGV[i + 1]); i = i + 2 end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do redis.call('HDEL', KEYS[6], ARGV[i]); i = i + 1 end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do redis.call('HSET', KEYS[8], ARGV[i], ARGV[i + 1]); i = i + 2 end
return 1
"""

# KEYS[1] {cid}_generation  KEYS[2..7] {cid}_app_offsets, _inflight, _seen, _replay, _tail,
# _lost  KEYS[8] {cid}_app_owner  KEYS[9] {cid}_app_names
# A connection starts serving the session: it becomes the owner (a number that only grows,
# so the newest reader holds it) and reads the progress in the same step, so no write of
# an earlier owner lands between its read and its own writes. Returns {owner, generation
# ('' if none), then the seven hashes flat}.
_LOAD_LUA = """
local owner = redis.call('INCR', KEYS[8])
local out = {owner, redis.call('GET', KEYS[1]) or ''}
for k = 2, 7 do out[#out + 1] = redis.call('HGETALL', KEYS[k]) end
out[#out + 1] = redis.call('HGETALL', KEYS[9])
return out
"""

# KEYS[1] {cid}_generation  KEYS[2] {cid}_app_offsets  KEYS[3] {cid}_app_inflight
# KEYS[4] {cid}_app_replay  KEYS[5] {cid}_app_tail  KEYS[6] {cid}_app_lost
# KEYS[7] {cid}_app_owner  KEYS[8] {cid}_app_names
# ARGV: generation, partition, owner. The partition's log went back (Kafka lost it): read
# the new log from its start; the fields name offsets of the old one and go, and the packet
# ids they held (not completed) wait in {cid}_app_lost for a PUBREL each. Fenced by the
# generation (0) and the owner (-1) as _PROGRESS_LUA.
_RESET_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if redis.call('GET', KEYS[7]) ~= ARGV[3] then return -1 end
local p = ARGV[2]
redis.call('HSET', KEYS[2], p, 0)
redis.call('HDEL', KEYS[4], p)
redis.call('HDEL', KEYS[5], p)
local prefix = p .. ':'
local fields = redis.call('HGETALL', KEYS[3])
for i = 1, #fields, 2 do
  local name, value = fields[i], fields[i + 1]
  if string.sub(name, 1, #prefix) == prefix then
    local id = string.match(value, '^(%d+)')
    if id then redis.call('HSET', KEYS[6], id, '1') end
    redis.call('HDEL', KEYS[3], name)
    redis.call('HDEL', KEYS[8], name)
  end
end
return 1
"""


# KEYS as above, KEYS[5] {cid}_app_replay, KEYS[6] {cid}_app_tail, KEYS[7] {cid}_app_owner;
# ARGV: generation, n, n (partition, offset). A partition moves back only (to at most its
# committed offset); what it passes over was seen: DUP when sent again. The copies' marks
# go: the rewound records are read again; so does the tail (it names the record below the
# old offset). The owner number goes up: a connection serving the session (here, or on
# another replica) writes nothing more over the rewound progress; it loads it again.
_REWIND_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return nil end
redis.call('INCR', KEYS[7])
local out = {}
local n = tonumber(ARGV[2])
for k = 0, n - 1 do
  local p, target = ARGV[3 + 2 * k], tonumber(ARGV[4 + 2 * k])
  local old = tonumber(redis.call('HGET', KEYS[2], p) or '0')
  if target < old then
    local seen = tonumber(redis.call('HGET', KEYS[5], p) or '0')
    redis.call('HSET', KEYS[5], p, math.max(seen, old))
    redis.call('HSET', KEYS[2], p, target)
    redis.call('HDEL', KEYS[6], p)
  else
    target = old
  end
  out[#out + 1] = target
end
redis.call('DEL', KEYS[4])
return out
"""


@lru_cache(maxsize=4096)  # asked per message routed (submit): a SHA-256 each, uncached
def app_topic(client_id: str) -> str:
    """The Kafka topic of ``client_id``'s APPLICATION session: the client ID with every
    character Kafka does not allow (and '.') as '_', cut to :data:`SAFE_LENGTH`, then a
    hash of the whole ID, so two IDs never share a topic."""
    safe = _UNSAFE.sub("_", client_id)[:SAFE_LENGTH]
    digest = hashlib.sha256(client_id.encode()).hexdigest()[:12]
    return f"{TOPIC_PREFIX}{safe}.{digest}"


@dataclass(slots=True, frozen=True)
class AppKeys:
    generation: str  # the session's generation (persistence/lua/open_session.lua)
    offsets: str  # hash: partition -> the next offset to read (committed)
    inflight: str  # hash: "partition:offset" -> packet id, "id:r" (PUBREL stage), "-"
    seen: str  # hash: "producer:partition" -> the last seq below the committed offset
    replay: str  # hash: partition -> the committed offset before a rewind (DUP below it)
    tail: str  # hash: partition -> "producer:seq" of the record just below the committed offset
    lost: str  # hash: packet id -> 1, in flight for a record of a log that went back
    owner: str  # the number of the connection serving the session (_LOAD_LUA): a fence
    names: str  # hash: "partition:offset" -> "producer:seq" of the record a field is for

    def listed(self) -> list[str]:
        """Every key, in the order above: the load script's KEYS; all but the
        first are what ending the session deletes."""
        return [
            self.generation,
            self.offsets,
            self.inflight,
            self.seen,
            self.replay,
            self.tail,
            self.lost,
            self.owner,
            self.names,
        ]

    def progress(self) -> list[str]:
        """The progress script's KEYS: every key but ``replay``, which only a
        rewind writes."""
        return [key for key in self.listed() if key != self.replay]


def app_keys(client_id: str) -> AppKeys:
    """The APPLICATION session's keys, in its client's slot."""
    generation = client_keys(client_id).generation
    prefix = generation.removesuffix("_generation")
    return AppKeys(
        generation,
        prefix + "_app_offsets",
        prefix + "_app_inflight",
        prefix + "_app_seen",
        prefix + "_app_replay",
        prefix + "_app_tail",
        prefix + "_app_lost",
        prefix + "_app_owner",
        prefix + "_app_names",
    )


class Classifier:
    """Which new persistent sessions are APPLICATION sessions."""

    def __init__(self, client_ids: Sequence[str], usernames: Sequence[str]) -> None:
        self._ids = [re.compile(p) for p in client_ids]
        self._users = [re.compile(p) for p in usernames]

    @property
    def active(self) -> bool:
        return bool(self._ids)

    def is_application(self, client_id: str, username: str | None) -> bool:
        if not any(p.match(client_id) for p in self._ids):
            return False
        if not self._users:
            return True
        return username is not None and any(p.match(username) for p in self._users)


LAG_READ = 1.0  # seconds a look at a session's lag may read for


class Lag(NamedTuple):
    messages: int  # after the committed offsets
    oldest_age: float | None  # seconds since the oldest of them was published


class _Submission:
    __slots__ = ("failed", "on_accepted", "on_settled", "out", "records", "reported")

    def __init__(
        self,
        records: list[tuple[str, int, bytes, bytes]],
        on_accepted: DoneCallback,
        on_settled: DoneCallback | None,
    ) -> None:
        self.records = records  # (topic, partition, key, value)
        self.on_accepted = on_accepted
        self.on_settled = on_settled
        self.out = len(records)  # no answer from Kafka yet
        self.reported = False
        self.failed = False


class ApplicationSessions:
    """The APPLICATION sessions of this broker: which they are, their topics, their
    producing. ``producer`` is a producer of their own (persistence/producers.py): on
    the device path's, a send to a topic it did not know would replace what its
    metadata holds (aiokafka names only the topics it was asked for), and the
    device path would stall while it learns its own topic again."""

    def __init__(
        self,
        settings: ApplicationSettings,
        redis: Any,
        producer: Any,
        bootstrap: str,
        security: KafkaSecurity = PLAINTEXT,
        timeout: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        producer_id: int = 0,
    ) -> None:
        """``producer_id`` names this process's records with a sequence number: a record
        Kafka took twice (a produce retried after a lost answer) is read once."""
        self.settings = settings
        self.producer_id = producer_id
        self._seq = 0
        self.classifier = Classifier(settings.client_ids, settings.usernames)
        self.redis = redis
        self._producer = producer
        self.bootstrap = bootstrap
        self.security = security
        self._timeout = timeout
        self._clock = clock
        self.kinds: set[str] = set()  # client IDs whose session is an APPLICATION one
        self.progress_script = redis.register_script(_PROGRESS_LUA)
        self._rewind_script = redis.register_script(_REWIND_LUA)
        self._reset_script = redis.register_script(_RESET_LUA)
        self.load_script = redis.register_script(_LOAD_LUA)
        self.fenced = 0  # progress writes refused: their connection had lost the session
        self.log_resets = 0  # partitions of sessions' topics found gone back (Kafka lost them)
        self._chains: dict[str, asyncio.Future[None]] = {}  # per client: topic work in order
        self._pending: deque[_Submission] = deque()
        # Submissions handed to the producer, oldest first, with their deadlines: one
        # timer looks at them (a timer per submission cost ~3% of the broker at 2,000
        # msg/s), at most every DEADLINE_TICK seconds, so a deadline may pass that late.
        self._waiting: deque[tuple[float, _Submission]] = deque()
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._sender: asyncio.Task[None] | None = None
        # Topics made sure of (listed by Kafka) since the producer's last closed
        # connection: a Kafka restarted empty acknowledges records for a topic it no
        # longer has and loses them (finding 32), so each is made again first.
        self._ensured: set[str] = set()
        self._topic_clients: dict[str, str] = {}  # topic -> its client ID
        # Client IDs of APPLICATION sessions held by other replicas that this one
        # routed to (their topics are made sure of as this replica's own)
        self._remote: set[str] = set()
        self._background: set[asyncio.Task[None]] = set()
        self.produced = 0
        self.failed = 0

    # -- which sessions --------------------------------------------------------------

    async def load(self) -> None:
        """Start the producer; learn the APPLICATION sessions Redis holds (before
        sessions are restored)."""
        self._watch_connections()
        await self._producer.start()
        names = await self.redis.hkeys(REGISTRY)
        self.kinds = {n.decode() if isinstance(n, bytes) else n for n in names}

    def is_application(self, session: Session) -> bool:
        """Is ``session`` (held here, or another replica's remote record) an APPLICATION
        one? Its feed, or what its replica said (broker/cluster.py ``ap``)."""
        return session.application or session.client_id in self.kinds

    async def _known(self, client_id: str) -> bool:
        """An APPLICATION session of this broker, or of another replica (the registry)."""
        return client_id in self.kinds or bool(await self.redis.hexists(REGISTRY, client_id))

    async def forget_unrestored(self, restored: Collection[str]) -> None:
        """Sessions ended while no broker ran (expired): their topics go too."""
        for client_id in sorted(self.kinds - set(restored)):
            await self._serial(client_id, partial(self._delete_quietly, client_id, None))

    def opening(
        self, client_id: str, username: str | None, resumed: bool, done: Callable[[bool], None]
    ) -> None:
        """A durable session was opened (``resumed``: a stored one): a resumed session
        keeps the kind it was made with; a new one is an APPLICATION session if the
        classifier says so, and gets its topic (made anew) before ``done(True)``."""

        async def work() -> None:
            if resumed:
                if client_id in self.kinds or await self.redis.hexists(REGISTRY, client_id):
                    self.kinds.add(client_id)
                    await self._create(client_id)  # Kafka may have lost it; else nothing
                return
            was = client_id in self.kinds or await self.redis.hexists(REGISTRY, client_id)
            if was:
                await self._delete(client_id, None)  # an earlier session's, left over
            if self.classifier.is_application(client_id, username):
                generation = await self.redis.get(app_keys(client_id).generation)
                await self._create(client_id)
                await self.redis.hset(REGISTRY, client_id, generation or b"0")
                self.kinds.add(client_id)

        async def run() -> None:
            try:
                await self._serial(client_id, work)
            except Exception as error:
                log.warning("opening APPLICATION session %s failed: %s", client_id, error)
                done(False)
                return
            done(True)

        self._spawn(run())

    def ended(self, client_id: str, generation: int) -> None:
        """The session ended: its topic and keys go (unless a newer one opened). One
        that another replica made (a remote record here, which expired here) is known
        from the registry."""
        if client_id in self.kinds:
            self._spawn(
                self._serial(client_id, partial(self._delete_quietly, client_id, generation))
            )
            return

        async def if_registered() -> None:
            try:
                known = await self._known(client_id)
            except Exception as error:  # Redis away: the next start deletes it
                log.warning("ending APPLICATION session %s: %s", client_id, error)
                return
            if known:
                await self._delete_quietly(client_id, generation)

        self._spawn(self._serial(client_id, if_registered))

    async def _delete_quietly(self, client_id: str, generation: int | None) -> None:
        """:meth:`_delete`; a failure is logged: the topic stays listed in the registry
        and goes at the next start, or when a new session of the client ID opens."""
        try:
            await self._delete(client_id, generation)
        except Exception as error:
            log.warning("deleting the topic of APPLICATION session %s failed: %s", client_id, error)

    async def _delete(self, client_id: str, generation: int | None) -> None:
        keys = app_keys(client_id)
        if generation is not None:
            held = await self.redis.hget(REGISTRY, client_id)
            if held is not None and int(held) > generation:
                return  # a newer session holds the topic now
        admin = await self._admin()
        try:
            response = await admin.delete_topics([app_topic(client_id)])
            for _name, code, *_ in response.topic_error_codes:
                if code and code != 3:  # 3: unknown topic, gone already
                    raise for_code(code)(f"cannot delete kafka topic {app_topic(client_id)}")
        finally:
            await admin.close()
        self._forget_topic(app_topic(client_id))
        self._ensured.discard(app_topic(client_id))
        self._topic_clients.pop(app_topic(client_id), None)
        self._remote.discard(client_id)
        await self.redis.delete(*keys.listed()[1:])
        await self.redis.hdel(REGISTRY, client_id)
        self.kinds.discard(client_id)
        log.info("APPLICATION session %s ended: topic %s deleted", client_id, app_topic(client_id))

    def _watch_connections(self) -> None:
        """A closed connection of the producer (a Kafka restart closes them all) makes
        every topic be made sure of again before records go to it. aiokafka's client
        only; with the confluent one nothing is watched (docs/application-sessions.md)."""
        client = getattr(getattr(self._producer, "producer", None), "client", None)
        closed = getattr(client, "_on_connection_closed", None)
        if client is None or closed is None:
            return

        def on_closed(conn: Any, reason: Any) -> None:
            self._ensured.clear()
            closed(conn, reason)

        client._on_connection_closed = on_closed  # read when a connection is made

    async def _ensure(self, topic: str) -> None:
        """Make ``topic`` again if Kafka lost it (a session's own, still held)."""
        client_id = self._topic_clients.get(topic)
        if client_id is None or (client_id not in self.kinds and client_id not in self._remote):
            return
        try:
            await self._create(client_id)
        except Exception as error:  # Kafka away: the records' sends fail, or it comes back
            log.warning("making sure of kafka topic %s failed: %s", topic, error)
            return
        self._ensured.add(topic)

    def _forget_topic(self, topic: str) -> None:
        """The producer stops naming a deleted topic in its metadata requests: Tansu
        would create it again, at its default size, at the next refresh."""
        client = getattr(getattr(self._producer, "producer", None), "client", None)
        topics = getattr(client, "_topics", None)
        if client is not None and isinstance(topics, set) and topic in topics:
            client.set_topics(topics - {topic})

    async def _create(self, client_id: str) -> None:
        topic = app_topic(client_id)
        retention = str(int(self.settings.retention * 1000))
        admin = await self._admin()
        try:
            new = NewTopic(
                topic, self.settings.partitions, 1, topic_configs={"retention.ms": retention}
            )
            try:
                response = await admin.create_topics([new])
            except TopicAlreadyExistsError:
                return
            for _name, code, *_ in response.topic_errors:
                error = for_code(code)
                if code and error is not TopicAlreadyExistsError:
                    raise error(f"cannot create kafka topic {topic}")
                if not code:
                    log.info("created kafka topic %s for an APPLICATION session", topic)
        finally:
            await admin.close()

    async def _admin(self) -> AIOKafkaAdminClient:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap, **self.security.aiokafka())
        await admin.start()
        return admin

    async def _serial(self, client_id: str, work: Callable[[], Awaitable[None]]) -> None:
        """Run ``work`` after every earlier one of ``client_id`` (an end, then an open)."""
        before = self._chains.get(client_id)
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._chains[client_id] = mine
        try:
            if before is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(before)
            await work()
        finally:
            mine.set_result(None)
            if self._chains.get(client_id) is mine:
                del self._chains[client_id]

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- producing -------------------------------------------------------------------

    def submit(
        self,
        deliveries: Sequence[tuple[Session, Delivery]],
        on_accepted: DoneCallback,
        on_settled: DoneCallback | None = None,
    ) -> None:
        """Produce each delivery to its session's topic; ``on_accepted(ok)`` once Kafka
        acknowledged them all (or one failed, or the deadline passed; then
        ``on_settled(ok)`` once every record has its answer)."""
        wall, now = time.time(), self._clock()
        partitions, producer, seq = self.settings.partitions, self.producer_id, self._seq
        records = []
        for session, delivery in deliveries:
            topic = delivery.message.topic.encode()
            partition = zlib.crc32(topic) % partitions if partitions > 1 else 0
            seq += 1
            value = encode_delivery(
                delivery, wall, now, producer=producer, seq=seq, generation=session.generation
            )
            name = app_topic(session.client_id)
            self._topic_clients[name] = session.client_id
            if session.connection is None and session.client_id not in self.kinds:
                self._remote.add(session.client_id)  # held by another replica
            records.append((name, partition, topic, value))
        self._seq = seq
        self._pending.append(_Submission(records, on_accepted, on_settled))
        if self._sender is None:
            self._sender = asyncio.get_running_loop().create_task(self._send_pending())

    async def _send_pending(self) -> None:
        """Hand the records over in submission order (one partition's stay in order)."""
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                submission = self._pending.popleft()
                self._waiting.append((loop.time() + self._timeout, submission))
                if self._deadline_timer is None:
                    self._deadline_timer = loop.call_later(
                        min(DEADLINE_TICK, self._timeout), self._deadlines
                    )
                ensured = self._ensured
                tried: set[str] = set()
                for record in submission.records:
                    name = record[0]
                    if name not in ensured and name not in tried:
                        tried.add(name)
                        await self._ensure(name)
                for topic, partition, key, value in submission.records:
                    try:
                        future = await self._producer.send(
                            topic, value=value, key=key, partition=partition
                        )
                    except KafkaError as error:
                        log.warning("producing to %s failed: %s", topic, error)
                        submission.out -= 1
                        submission.failed = True
                        self._answered(submission)
                        continue
                    future.add_done_callback(lambda f, s=submission: self._acked(s, f))
        finally:
            self._sender = None

    def _acked(self, submission: _Submission, future: asyncio.Future[Any]) -> None:
        submission.out -= 1
        if future.cancelled() or future.exception() is not None:
            submission.failed = True
        self._answered(submission)

    def _answered(self, submission: _Submission) -> None:
        if submission.failed and not submission.reported:
            self._report(submission, False)
        if submission.out == 0:
            if not submission.reported:
                self._report(submission, True)
            elif submission.on_settled is not None:
                settled, submission.on_settled = submission.on_settled, None
                settled(not submission.failed)

    def _deadlines(self) -> None:
        """Fail the submissions whose deadline passed; forget the answered ones."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        waiting = self._waiting
        while waiting:
            deadline, submission = waiting[0]
            if submission.out == 0 and submission.reported:
                waiting.popleft()  # answered: nothing to wait for
            elif deadline <= now:
                waiting.popleft()
                if not submission.reported:
                    self._report(submission, False)
            else:
                break
        self._deadline_timer = (
            loop.call_later(min(DEADLINE_TICK, self._timeout), self._deadlines) if waiting else None
        )

    def _report(self, submission: _Submission, ok: bool) -> None:
        submission.reported = True
        if ok:
            self.produced += len(submission.records)
        else:
            self.failed += 1
        submission.on_accepted(ok)
        if not ok and submission.out == 0 and submission.on_settled is not None:
            settled, submission.on_settled = submission.on_settled, None
            settled(not submission.failed)

    # -- reading ---------------------------------------------------------------------

    def feed(self, client_id: str) -> ApplicationFeed:
        return ApplicationFeed(client_id, self)

    def consumer(self) -> AIOKafkaConsumer:
        """A reader's Kafka client: no group, partitions assigned, nothing committed."""
        return AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",  # below the log start (retention): from there
            fetch_max_wait_ms=50,
            **self.security.aiokafka(),
        )

    async def rewind(
        self,
        client_id: str,
        feed: ApplicationFeed | None,
        *,
        offset: int | None = None,
        since: float | None = None,
    ) -> dict[int, int]:
        """Deliver ``client_id``'s messages again from ``offset`` (each partition) or from
        the first published at or after ``since`` (epoch seconds), as far as the topic
        still holds them; never forward past the committed offsets. ``feed``: the
        session's, if this broker holds it: it stops reading meanwhile and, if its
        client is connected, starts again from there (what is in flight is sent again,
        under its ids, with DUP). Returns partition -> the offset it reads from now.
        Held by another replica: its connection loses the session (the owner fence,
        _REWIND_LUA) and its client, connecting again, reads from there."""
        if not await self._known(client_id):
            raise KeyError(client_id)
        partitions = range(self.settings.partitions)
        if since is not None:
            targets = await self._offsets_since(client_id, since)
        else:
            targets = dict.fromkeys(partitions, max(0, offset or 0))
        if feed is not None:
            await feed.pause()
        try:
            keys = app_keys(client_id)
            generation = await self.redis.get(keys.generation)
            args: list[Any] = [generation, len(targets)]
            for partition, target in sorted(targets.items()):
                args += [partition, target]
            done = await self._rewind_script(
                keys=[
                    keys.generation,
                    keys.offsets,
                    keys.inflight,
                    keys.seen,
                    keys.replay,
                    keys.tail,
                    keys.owner,
                ],
                args=args,
            )
        finally:
            if feed is not None:
                feed.resume()
        if done is None:
            raise KeyError(client_id)  # the session ended meanwhile
        return {p: int(o) for p, o in zip(sorted(targets), done, strict=True)}

    def log_went_back(self, feed: ApplicationFeed, partition: int) -> None:
        """``feed``'s reader found ``partition`` of its topic shorter than what the
        session had read (Kafka lost the topic: the embedded one restarted on memory
        storage, or it was deleted and made again). The session reads the new log
        from its start; its progress, which names offsets of the old log, goes, and
        the packet ids it held get a PUBREL each at the next connect
        (ApplicationFeed._load), unless their flows end on the connection they are
        in flight on."""
        client_id = feed.client_id
        self.log_resets += 1
        log.warning(
            "partition %d of %s went back (Kafka lost it): APPLICATION session %s reads "
            "it again from its start; the messages it held are lost",
            partition,
            app_topic(client_id),
            client_id,
        )

        async def work() -> None:
            await feed.pause()
            try:
                keys = app_keys(client_id)
                generation = await self.redis.get(keys.generation)
                done = await self._reset_script(
                    keys=[
                        keys.generation,
                        keys.offsets,
                        keys.inflight,
                        keys.replay,
                        keys.tail,
                        keys.lost,
                        keys.owner,
                        keys.names,
                    ],
                    args=[generation, partition, feed.owner],
                )
            except BaseException:
                feed.reread()
                raise
            if done == -1:
                feed.taken_over()  # another connection serves it now: it reads the log
            else:
                feed.reread()

        async def run() -> None:
            try:
                await self._serial(client_id, work)
            except Exception as error:  # Redis away: the reader finds it again
                log.warning("resetting the progress of %s failed: %s", client_id, error)

        self._spawn(run())

    async def _offsets_since(self, client_id: str, since: float) -> dict[int, int]:
        """Per partition: the first offset published at or after ``since`` (the end if
        none), read from the start (the records are in publish order)."""
        topic = app_topic(client_id)
        consumer = self.consumer()
        await consumer.start()
        try:
            tps = [TopicPartition(topic, p) for p in range(self.settings.partitions)]
            consumer.assign(tps)
            for tp in tps:
                consumer.seek(tp, 0)
            found: dict[int, int] = {}
            idle = 0
            while len(found) < len(tps) and idle < 5:
                got = await consumer.getmany(timeout_ms=200, max_records=5000)
                idle = 0 if any(got.values()) else idle + 1
                for tp, records in got.items():
                    if tp.partition in found or not records:
                        continue
                    for record in records:
                        stored = decode_record(0, 0, record.value).message
                        if stored is not None and stored.publish_time >= since:
                            found[tp.partition] = record.offset
                            break
                    else:
                        highwater = consumer.highwater(tp)
                        if highwater is not None and records[-1].offset + 1 >= highwater:
                            found[tp.partition] = highwater  # all older: from the end
                    if tp.partition in found:
                        consumer.pause(tp)
            for tp in tps:
                found.setdefault(tp.partition, consumer.highwater(tp) or 0)
            return found
        finally:
            await consumer.stop()

    async def committed(self, client_id: str) -> dict[int, int]:
        """Partition -> the committed offset (the next one not done with)."""
        raw = await self.redis.hgetall(app_keys(client_id).offsets)
        return {int(p): int(o) for p, o in raw.items()}

    async def lag(self, client_id: str) -> Lag | None:
        """How far behind ``client_id``'s session is: the messages after its committed
        offsets and the age of the oldest of them (None: not an APPLICATION session).
        The high watermark comes from a fetch: Tansu answers ListOffsets with a count
        of batches (pipeline/kafka_source.py)."""
        if not await self._known(client_id):
            return None
        topic = app_topic(client_id)
        committed = await self.committed(client_id)
        consumer = self.consumer()
        await consumer.start()
        try:
            tps = [TopicPartition(topic, p) for p in range(self.settings.partitions)]
            consumer.assign(tps)
            for tp in tps:
                consumer.seek(tp, committed.get(tp.partition, 0))
            first: dict[int, tuple[int, float]] = {}  # partition -> (offset, publish time)
            deadline = time.monotonic() + LAG_READ
            while time.monotonic() < deadline:
                got = await consumer.getmany(timeout_ms=100, max_records=len(tps))
                for tp, records in got.items():
                    if records and tp.partition not in first:
                        stored = decode_record(0, 0, records[0].value).message
                        published = stored.publish_time if stored is not None else time.time()
                        first[tp.partition] = (records[0].offset, published)
                if all(
                    tp.partition in first
                    or (
                        consumer.highwater(tp) is not None
                        and consumer.highwater(tp) <= committed.get(tp.partition, 0)
                    )
                    for tp in tps
                ):
                    break  # every partition has its oldest, or nothing after the commit
            messages = 0
            for tp in tps:
                highwater = consumer.highwater(tp)
                if tp.partition in first and highwater is not None:
                    messages += max(0, highwater - first[tp.partition][0])
            oldest = min((t for _, t in first.values()), default=None)
            return Lag(messages, None if oldest is None else max(0.0, time.time() - oldest))
        finally:
            await consumer.stop()

    async def close(self) -> None:
        """Wait for what was handed to Kafka, then stop."""
        while self._pending or self._sender is not None:
            await asyncio.sleep(0.01)
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        with contextlib.suppress(KafkaError):
            await self._producer.stop()
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None


@dataclass(slots=True)
class _Progress:
    """Progress writes asked and not yet handed to Redis, with who waits for them."""

    offsets: dict[int, int] = field(default_factory=dict)
    seen: dict[str, int] = field(default_factory=dict)
    set_fields: dict[str, str] = field(default_factory=dict)
    del_fields: set[str] = field(default_factory=set)
    tail: dict[int, str] = field(default_factory=dict)  # partition -> "producer:seq"
    lost_done: set[int] = field(default_factory=set)  # lost ids that got their PUBCOMP
    names: dict[str, str] = field(default_factory=dict)  # field -> its record's name
    callbacks: list[Callable[[], None]] = field(default_factory=list)

    def set(self, name: str, value: str) -> None:
        self.del_fields.discard(name)
        self.set_fields[name] = value

    def delete(self, name: str) -> None:
        self.set_fields.pop(name, None)
        self.names.pop(name, None)
        self.del_fields.add(name)

    def __bool__(self) -> bool:
        return bool(
            self.offsets
            or self.set_fields
            or self.del_fields
            or self.seen
            or self.lost_done
            or self.callbacks
        )


class _Ref:
    """Where a message is in the topic, and whether it is done with."""

    __slots__ = ("done", "log", "name", "offset", "partition", "producer", "seq")

    def __init__(self, partition: int, offset: int, name: str = "0:0", log: int = 0) -> None:
        self.partition = partition
        self.offset = offset
        self.log = log  # the partition's log it was read from (ApplicationFeed._logs)
        self.done = False
        self.producer = 0  # the record's name, if it is not a copy (0: none, or a copy)
        self.seq = 0
        self.name = name  # "producer:seq" of the record, copy or not: the log's fingerprint


class _LostId:
    """A packet id held for a record of a log that went back (``{cid}_app_lost``):
    it gets a PUBREL, and is free once the client answers PUBCOMP."""

    __slots__ = ("packet_id",)

    def __init__(self, packet_id: int) -> None:
        self.packet_id = packet_id


class ApplicationFeed:
    """An APPLICATION session's messages, read from its Kafka topic (see the module)."""

    durable = True
    application = True  # Session.application

    def __init__(self, client_id: str, apps: ApplicationSessions) -> None:
        self.client_id = client_id
        self._apps = apps
        self._topic = app_topic(client_id)
        self._keys = app_keys(client_id)
        self._partitions = apps.settings.partitions
        self._read_ahead = apps.settings.read_ahead
        self.outflow: Outflow | None = None
        self._epoch = 0
        self._buffer: deque[Outgoing] = deque()
        self._order: dict[int, deque[_Ref]] = {}  # per partition, read and not yet committed
        self.committed: dict[int, int] = {}  # per partition: next offset not done with
        self.read_to: dict[int, int] = {}  # per partition: next offset to read
        self._fields: dict[int, deque[int]] = {}  # per partition: offsets with a field, in order
        self._field_of_id: dict[int, tuple[int, int]] = {}  # packet id -> its latest field
        self._known: dict[tuple[int, int], str] = {}  # fields read back, not reached yet
        self._names: dict[tuple[int, int], str] = {}  # their records' names (finding 33)
        # (producer, partition) -> the last seq read; a record at or below it is a copy
        self._seen: dict[tuple[int, int], int] = {}
        self._replay: dict[int, int] = {}  # partition -> below it, seen before a rewind
        # partition -> (offset, "producer:seq") of the record just below the committed
        # offset, read first after a connect: is the log still the one the offset is of?
        self._unverified: dict[int, tuple[int, str]] = {}
        self._tail: dict[int, str] = {}
        self._last: dict[int, str] = {}  # partition -> "producer:seq" of the last record read
        self._broken = False  # the reader's Kafka connection closed: is the log the same?
        self._frozen = False  # paused (a rewind, a reset): nothing is written meanwhile
        # partition -> logs found gone back so far: a message of an earlier one is
        # stale, its progress is not recorded (its offset names a record of the new one)
        self._logs: dict[int, int] = {}
        self._reserved: set[int] = set()  # their ids: not given to new messages
        # From a connection's start until its progress is read back: the ids the client
        # may hold are not known yet, so the outflow gives none to side messages
        # (tests/model/FINDINGS.md, finding 36).
        self.replaying = False
        self._last_id = 0
        self._generation: bytes | None = None
        # Its number as the session's owner ({cid}_app_owner), taken at each load: a
        # progress write with an older one is refused (another connection took over).
        self.owner = 0
        self._loading: int | None = None  # the epoch whose load is under way: no writes
        # The load script calls sent and not answered (at most LOAD_LIMIT each): each
        # may make this feed the owner anew (INCR), even one whose reader was stopped
        # meanwhile, so nothing is written and no other load is sent until they are
        # answered (_load_answered).
        self._loads: set[asyncio.Future[Any]] = set()
        self._reader: asyncio.Task[None] | None = None
        self._room = asyncio.Event()
        self._asked = _Progress()
        self._writer: asyncio.Task[None] | None = None
        self._written = asyncio.Event()
        self._written.set()
        self.write_errors = 0

    # -- Feed ------------------------------------------------------------------------

    def offer(self, delivery: Delivery) -> None:
        """A message routed in memory (not through the persistent path): to the topic,
        with nobody waiting for it."""
        session = self.outflow._session if self.outflow is not None else None
        if session is not None:
            self._apps.submit([(session, delivery)], _ignore)

    def take(self, n: int) -> list[Outgoing]:
        outflow = self.outflow
        assert outflow is not None
        buffer = self._buffer
        items: list[Outgoing] = []
        while buffer and len(items) < n:
            item = buffer.popleft()
            self._reserved.discard(item.packet_id)
            if item.packet_id == 0 or item.packet_id in outflow.inflight:
                item.packet_id = self._next_id(outflow)
            items.append(item)
        if len(buffer) < self._read_ahead // 2 + 1:
            self._room.set()
        return items

    def mark(self, items: list[Outgoing], done: Callable[[Collection[int]], None]) -> None:
        # Recorded before the first send: sent again after any crash, it has DUP
        # (MQTT-3.3.1-1) and its packet id (MQTT-4.4.0-1).
        asked = self._asked
        for item in items:
            ref = item.ref
            assert isinstance(ref, _Ref)
            if not self._stale(ref):  # a stale one goes unrecorded: its log is gone
                self._record(ref, str(item.packet_id), item.packet_id)
        ids = [item.packet_id for item in items]
        asked.callbacks.append(lambda: done(ids))
        self._schedule()

    def release(self, item: Outgoing, done: Callable[[], None]) -> None:
        ref = item.ref
        assert isinstance(ref, _Ref)
        if self._stale(ref):  # its id is in {cid}_app_lost: a PUBREL at the next connect
            done()
            return
        self._record(ref, f"{item.packet_id}:r", item.packet_id)
        self._asked.callbacks.append(done)
        self._schedule()

    def finished(self, item: Outgoing) -> None:
        if isinstance(item.ref, _LostId):
            self._asked.lost_done.add(item.ref.packet_id)
            self._schedule()
            return
        self._done(item)

    def undeliverable(self, item: Outgoing) -> None:
        self._done(item)

    def sent(self, item: Outgoing, dup: bool) -> None:
        pass

    def restart(self) -> None:
        self._stop()
        self.replaying = True
        self._reader = asyncio.get_running_loop().create_task(self._read(self._epoch))

    @property
    def held_ids(self) -> set[int]:
        """Packet ids the client may hold for this session's messages that are not in
        flight here yet (read back with the progress, or lost with a log): the outflow
        gives none of them to a side message (MQTT-2.2.1-3; finding 36)."""
        return self._reserved

    async def pause(self) -> None:
        """Stop reading and wait until every progress write landed (a rewind, a reset);
        what is asked from then on is not written (the progress is being replaced)."""
        self._stop()
        await self._loads_answered()  # a load the stop cut short: its owner number first
        await self._written.wait()
        self._frozen = True

    def resume(self) -> None:
        """After a rewind or a reset: a connected client gets what is in flight again
        (under its ids, DUP) and the rest from the progress as it is now."""
        self._frozen = False
        self._asked = _Progress()  # asked while paused: of the progress replaced
        outflow = self.outflow
        if outflow is not None and outflow.connection is not None:
            outflow.resume()

    def reread(self) -> None:
        """After a reset: read again from the progress as it is now. What is in flight
        stays so: its flows end on this connection (MQTT-4.4.0-2: nothing is sent
        again on it)."""
        self._frozen = False
        self._schedule()
        outflow = self.outflow
        if outflow is not None and outflow.connection is not None:
            self.restart()

    def discard(self) -> None:
        self._stop()

    def queued(self) -> int:
        return len(self._buffer)

    # -- progress --------------------------------------------------------------------

    def _next_id(self, outflow: Outflow) -> int:
        packet_id = outflow.next_packet_id(self._last_id)
        while packet_id in self._reserved:
            packet_id = outflow.next_packet_id(packet_id)
        self._last_id = packet_id
        return packet_id

    def _record(self, ref: _Ref, value: str, packet_id: int) -> None:
        """Ask for ``partition:offset -> value``; an older field of the same id is done."""
        name = f"{ref.partition}:{ref.offset}"
        asked = self._asked
        older = self._field_of_id.get(packet_id)
        where = (ref.partition, ref.offset)
        if older is not None and older != where and older[1] >= self.committed.get(older[0], 0):
            asked.set(f"{older[0]}:{older[1]}", DONE)  # that flow completed: never again
        self._field_of_id[packet_id] = where
        offsets = self._fields.setdefault(ref.partition, deque())
        if not offsets or offsets[-1] < ref.offset:
            offsets.append(ref.offset)
        asked.set(name, value)
        if ref.name != "0:0":  # which record this field is for: is the log the same?
            asked.names[name] = ref.name

    def _stale(self, ref: _Ref) -> bool:
        """Was ``ref`` read from a log that went back since?"""
        return ref.log != self._logs.get(ref.partition, 0)

    def _done(self, item: Outgoing) -> None:
        ref = item.ref
        if not isinstance(ref, _Ref) or ref.done:
            return
        ref.done = True
        if self._stale(ref):  # its flow ended: its id is no longer lost
            self._asked.lost_done.add(item.packet_id)
            self._schedule()
            return
        self._advance(ref.partition)

    def _advance(self, partition: int) -> None:
        """Commit past every message of ``partition`` that is done, in order."""
        order = self._order.get(partition)
        if not order or not order[0].done:
            return
        asked = self._asked
        while order and order[0].done:
            head = order.popleft()
            if head.producer:  # past the commit: read again from there, it is a copy
                asked.seen[f"{head.producer}:{partition}"] = head.seq
        committed = head.offset + 1
        self.committed[partition] = committed
        asked.offsets[partition] = committed
        asked.tail[partition] = self._tail[partition] = head.name
        fields = self._fields.get(partition)
        while fields and fields[0] < committed:
            asked.delete(f"{partition}:{fields.popleft()}")
        self._schedule()

    def _schedule(self) -> None:
        if (
            self._writer is None
            and self._generation is not None
            and not self._frozen
            and self._loading is None
            and not self._loads
        ):
            self._written.clear()
            self._writer = asyncio.get_running_loop().create_task(self._write())

    async def _write(self) -> None:
        """One write at a time; what is asked meanwhile goes into the next."""
        wait = RETRY_FIRST
        try:
            while self._asked and not self._loads:
                asked, self._asked = self._asked, _Progress()
                args: list[Any] = [self._generation, self.owner, len(asked.offsets)]
                for partition, offset in asked.offsets.items():
                    args += [partition, offset]
                args.append(len(asked.set_fields))
                for name, value in asked.set_fields.items():
                    args += [name, value]
                args.append(len(asked.del_fields))
                args += list(asked.del_fields)
                args.append(len(asked.seen))
                for name, seq in asked.seen.items():
                    args += [name, seq]
                args.append(len(asked.tail))
                for partition, name in asked.tail.items():
                    args += [partition, name]
                args.append(len(asked.lost_done))
                args += sorted(asked.lost_done)
                args.append(len(asked.names))
                for name, record in asked.names.items():
                    args += [name, record]
                keys = self._keys.progress()
                while True:
                    try:
                        written = await self._apps.progress_script(keys=keys, args=args)
                        break
                    except Exception as error:  # Redis away: messages wait for their marks
                        self.write_errors += 1
                        log.warning("progress of %s not written: %s", self.client_id, error)
                        await asyncio.sleep(wait)
                        wait = min(wait * 2, RETRY_MOST)
                wait = RETRY_FIRST
                if written == -1:
                    # Another connection serves the session now and reads the progress
                    # as it stood: nothing of this one is written, nothing more is sent.
                    self._asked = _Progress()
                    self.taken_over()
                    return
                for callback in asked.callbacks:
                    callback()
        finally:
            self._writer = None
            self._written.set()

    def taken_over(self) -> None:
        """A write was refused: a newer connection of the client (on another broker, or
        a later one here) took the session over and goes on from the progress in
        Redis. This one stops reading and its client is disconnected (0x8E, as for a
        takeover on one broker); nothing asked on it is sent: its marks were not
        written. Its next connection loads the session again."""
        self._apps.fenced += 1
        self._generation = None  # nothing more is written until a load makes it owner again
        log.warning(
            "APPLICATION session %s is served by a newer connection: this one (owner %d) "
            "stops, its progress not written",
            self.client_id,
            self.owner,
        )
        self._stop()
        outflow = self.outflow
        conn = outflow.connection if outflow is not None else None
        if conn is not None:
            conn.disconnect(ReasonCode.SESSION_TAKEN_OVER)

    # -- the reader ------------------------------------------------------------------

    def _stop(self) -> None:
        self._epoch += 1
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        self._buffer.clear()
        self._order.clear()
        self._known.clear()
        self._names.clear()
        self._reserved.clear()
        self.replaying = False
        self._room.set()

    def _connected(self, epoch: int) -> bool:
        outflow = self.outflow
        return epoch == self._epoch and outflow is not None and outflow.connection is not None

    async def _read(self, epoch: int) -> None:
        """Read from the committed offsets while the client is connected."""
        self._loading = epoch  # what is asked meanwhile is written as the new owner
        try:
            await self._written.wait()  # the last connection's progress is in Redis first
            wait = RETRY_FIRST
            while self._connected(epoch):
                try:
                    await self._load(epoch)
                    break
                except Exception as error:
                    log.warning("reading the progress of %s failed: %s", self.client_id, error)
                    await asyncio.sleep(wait)
                    wait = min(wait * 2, RETRY_MOST)
        finally:
            if self._loading == epoch:
                self._loading = None
                self._schedule()
            if epoch == self._epoch:
                self.replaying = False
        if self._connected(epoch) and self.outflow is not None:
            self.outflow.pump()  # the lost ids' PUBRELs; side messages waited for the load
        while self._connected(epoch):
            consumer = self._apps.consumer()
            self._watch(consumer)
            try:
                await consumer.start()
                tps = [TopicPartition(self._topic, p) for p in range(self._partitions)]
                consumer.assign(tps)
                for tp in tps:
                    check = self._unverified.get(tp.partition)
                    consumer.seek(tp, check[0] if check else self.read_to.get(tp.partition, 0))
                self._broken = False
                wait = RETRY_FIRST
                while self._connected(epoch):
                    room = self._read_ahead - len(self._buffer)
                    if room <= 0:
                        self._room.clear()
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._room.wait(), READ_WAIT_MS / 1000)
                        continue
                    got = await consumer.getmany(timeout_ms=READ_WAIT_MS, max_records=room)
                    if not self._connected(epoch):
                        return
                    if self._broken:  # Kafka may have restarted empty: these may be a new log's
                        self._broken = False
                        for tp in tps:
                            consumer.seek(tp, self._verify_again(tp.partition))
                        continue  # read again from the record below what was read
                    for tp, records in got.items():
                        for record in records:
                            if not self._add(tp.partition, record.offset, record.value):
                                self._went_back(tp.partition)
                                return
                    for tp in tps:
                        if self._shorter(tp.partition, consumer.highwater(tp)):
                            self._went_back(tp.partition)
                            return
                    if got and self.outflow is not None:
                        self.outflow.pump()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # Kafka away: read again from where it was
                log.warning("reading the topic of %s failed: %s", self.client_id, error)
                await asyncio.sleep(wait)
                wait = min(wait * 2, RETRY_MOST)
            finally:
                with contextlib.suppress(Exception):
                    await consumer.stop()

    async def _load(self, epoch: int) -> None:
        await self._loads_answered()  # one at a time: a cut one's INCR lands before this one's
        call = asyncio.ensure_future(self._apps.load_script(keys=self._keys.listed()))
        self._loads.add(call)
        limit = asyncio.get_running_loop().call_later(LOAD_LIMIT, call.cancel)
        call.add_done_callback(partial(self._load_answered, limit))
        await asyncio.wait({call})  # not cancelled with this reader: the answer counts
        if call.cancelled():
            raise TimeoutError(f"no answer in {LOAD_LIMIT} s")
        got = call.result()
        if epoch != self._epoch:
            return  # a later connection loads it again (and owns it then)
        owner, raw_generation, *hashes = got
        offsets, inflight, seen, replay, tail, lost, names = (_pairs(flat) for flat in hashes)
        generation = raw_generation or None
        self.owner = int(owner)
        self._tail = {int(p): name.decode() for p, name in tail.items()}
        self._replay = {int(p): int(o) for p, o in replay.items()}
        self._seen = {}
        for name, seq in seen.items():
            producer, partition = (int(x) for x in name.split(b":"))
            self._seen[(producer, partition)] = int(seq)
        self._generation = generation
        self.committed = {int(p): int(o) for p, o in offsets.items()}
        self.read_to = dict(self.committed)
        tails = self._tail
        self._unverified = {
            p: (o - 1, tails[p]) for p, o in self.committed.items() if o > 0 and p in tails
        }
        # the record below where it reads from now: the tail, or unknown (a rewind)
        self._last = {p: tails[p] for p in self.committed if p in tails}
        self._order = {}
        self._fields = {}
        self._field_of_id = {}
        known: dict[tuple[int, int], str] = {}
        for name, value in sorted(
            ((n.decode(), v.decode()) for n, v in inflight.items()),
            key=lambda nv: tuple(int(x) for x in nv[0].split(":")),
        ):
            partition, offset = (int(x) for x in name.split(":"))
            known[(partition, offset)] = value
            self._fields.setdefault(partition, deque()).append(offset)
            if value != DONE:
                packet_id = int(value.split(":")[0])
                self._reserved.add(packet_id)
                self._field_of_id[packet_id] = (partition, offset)
        self._known = known
        self._names = {}
        for name, record in names.items():
            partition, offset = (int(x) for x in name.split(b":"))
            self._names[(partition, offset)] = record.decode()
        inflight = self.outflow.inflight if self.outflow is not None else {}
        for raw_id in sorted(int(i) for i in lost):
            if raw_id in inflight:
                continue  # its flow goes on, on this connection (ApplicationFeed.reread)
            # Held for a record Kafka lost: a PUBREL, QoS 2's last step (MQTT-4.4.0-1; a
            # client holding no QoS 2 flow of the id answers PUBCOMP), before it goes again.
            self._reserved.add(raw_id)
            self._buffer.append(Outgoing(raw_id, None, sent=True, marked=True, ref=_LostId(raw_id)))

    async def _loads_answered(self) -> None:
        while self._loads:
            await asyncio.wait(set(self._loads))

    def _load_answered(self, limit: asyncio.TimerHandle, call: asyncio.Future[Any]) -> None:
        """A load script call answered (or was given up). Its INCR made this feed the
        session's owner, unless a newer connection's came after, even when the reader
        that sent it was stopped first (tests/model/FINDINGS.md, finding 41). With no
        reader to load again (a pause for a reset or a rewind, the client gone) its
        number is the feed's from now on: kept from before, it refused the feed's own
        next write, and the feed disconnected its client 0x8E. A reader that follows
        takes the number of its own load."""
        limit.cancel()
        self._loads.discard(call)
        if self._reader is None and not call.cancelled() and call.exception() is None:
            self.owner = int(call.result()[0])
        self._schedule()

    def _watch(self, consumer: AIOKafkaConsumer) -> None:
        """A closed connection of the reader (a Kafka restart closes it) makes it check
        that the log is the one it read before it takes more of it: a Kafka restarted
        empty may have a new log there, already longer than what was read."""
        client = getattr(consumer, "_client", None)
        closed = getattr(client, "_on_connection_closed", None)
        if client is None or closed is None:
            return

        def on_closed(conn: Any, reason: Any) -> None:
            self._broken = True
            closed(conn, reason)

        client._on_connection_closed = on_closed  # read when a connection is made

    def _verify_again(self, partition: int) -> int:
        """Where to read ``partition`` from so that its last record read is read (and
        compared) first; the offset to seek to."""
        check = self._unverified.get(partition)
        if check is not None:
            return check[0]
        read_to = self.read_to.get(partition, 0)
        last = self._last.get(partition)
        if read_to == 0 or last is None:
            return read_to
        self._unverified[partition] = (read_to - 1, last)
        return read_to - 1

    def _went_back(self, partition: int) -> None:
        """The partition's log went back: what was read of it is stale from now on
        (nothing more of it is recorded), and the progress is reset
        (:meth:`ApplicationSessions.log_went_back`)."""
        self._logs[partition] = self._logs.get(partition, 0) + 1
        self._apps.log_went_back(self, partition)

    def _shorter(self, partition: int, highwater: int | None) -> bool:
        """Does the partition's log end below what was read of it (it went back)?"""
        if highwater is None:
            return False
        check = self._unverified.get(partition)
        expected = check[0] + 1 if check is not None else self.read_to.get(partition, 0)
        return highwater < expected

    def _add(self, partition: int, offset: int, value: bytes) -> bool:
        """A record read: to the buffer, or done with at once (not this session's, or
        its flow completed before). False: the log went back (Kafka lost it); the
        record is not taken."""
        try:
            stored = decode_record(0, 0, value).message
        except ValueError:
            stored = None
        name = f"{stored.producer}:{stored.seq}" if stored is not None else "0:0"
        check = self._unverified.pop(partition, None)
        if check is not None:  # the first record after a connect: the one below the commit?
            at, expected = check
            if offset < at or (offset == at and name != expected):
                return False
            if offset == at:
                self.read_to[partition] = offset + 1
                self._last[partition] = name
                return True  # the same log: done with already
            # past it (retention took it): nothing to compare, the commit is below
        if offset < self.read_to.get(partition, 0):
            return False  # below what was read: a new log
        was = self._names.get((partition, offset))
        if was is not None and was != name:
            # Another record where a field's was (sent, perhaps seen): a new log, whose
            # offsets start below the old one's fields (nothing committed: no tail to
            # compare; finding 33)
            return False
        if was is not None:
            del self._names[(partition, offset)]
        self.read_to[partition] = offset + 1
        self._last[partition] = name
        ref = _Ref(partition, offset, name, self._logs.get(partition, 0))
        self._order.setdefault(partition, deque()).append(ref)
        known = self._known.pop((partition, offset), None)
        generation = int(self._generation or 0)
        if stored is not None and stored.producer:
            producer = (stored.producer, partition)
            if stored.seq <= self._seen.get(producer, 0):
                stored = None  # Kafka took it twice: read once
            else:
                self._seen[producer] = ref.seq = stored.seq
                ref.producer = stored.producer
        if stored is None or stored.generation != generation or known == DONE:
            ref.done = True
            self._advance(partition)
            return True
        delivery = stored_delivery(stored, time.time(), self._apps_clock())
        if known is None:  # new, or a rewind's copy of what was seen: DUP
            item = Outgoing(0, delivery, ref=ref, replay=offset < self._replay.get(partition, 0))
        elif known.endswith(":r"):  # PUBREC recorded: only the PUBREL is left
            # MQTT-4.4.0-1: the PUBREL again, never the PUBLISH (QoS 2: once)
            item = Outgoing(int(known[:-2]), None, sent=True, marked=True, ref=ref)
        else:  # may have been seen: again under its id (MQTT-4.4.0-1), DUP (MQTT-3.3.1-1),
            # whatever its expiry, as a DEVICE session's message marked sent
            item = Outgoing(int(known), delivery, sent=True, marked=True, ref=ref)
        self._buffer.append(item)
        return True

    def _apps_clock(self) -> float:
        outflow = self.outflow
        conn = outflow.connection if outflow is not None else None
        return conn.broker.clock() if conn is not None else time.monotonic()


def _pairs(flat: list[Any]) -> dict[Any, Any]:
    """A hash as a script returns it (HGETALL: field, value, ...) as a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _ignore(ok: bool) -> None:
    """Nobody waits for this one."""
