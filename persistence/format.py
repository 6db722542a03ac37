"""The persistent path's formats and key names, in one place.

Everything that reads or writes a stored message, a session state or a Redis
key of the persistent path goes through this module: the Redis store
(persistence/redis_store.py and its Lua scripts), the Kafka producer and
consumer, the delivery events, and the pipeline (pipeline/common.py). Pure
functions, no I/O.

Message value (the Kafka record value of ``devicemq.device.persisted`` and,
behind an 8-byte deadline, a stored message's entry in Redis)
------------------------------------------------------------------------------
A fixed header, big-endian (``struct`` format ``>BBBddQQQHI``, 49 bytes), then
the topic (UTF-8), the properties, the payload::

    version    u8   2
    flags      u8   0x01 SENT (may have been seen: DUP on any later send)
                    0x02 PUBREL (QoS 2, PUBREC received: only PUBREL is left)
                    0x04 RETAIN  0x08 HAS_EXPIRY
                    0x10 QUEUE (routed to an exclusive compacted queue,
                    broker/ecq.py: its topic is ``$ECQ/{cid}/{key}``; or
                    to a group queue, broker/group_queue.py: its record
                    key is ``$queue/{group}/{filter}``)
                    0x20 REPLAY (stored again by a rewind, persistence/
                    session_rewind.py: its first send carries DUP, yet it is
                    not in flight: limits, ACL and expiry apply as to any)
    qos        u8
    published  f64  publish time, epoch seconds
    expiry     f64  absolute message expiry, epoch seconds (if HAS_EXPIRY)
    producer   u64  the broker process that routed it (0: unknown)
    seq        u64  its sequence number at that producer: (producer, seq)
                    names the record, so a record produced twice (a retried
                    produce request) or read twice is stored once
    generation u64  the generation of the subscriber's session it was routed
                    for (0: unknown): records of an ended session are dropped
    topic_len  u16
    props_len  u32
    topic, properties, payload

Version 1 (``>BBBddqHI``, 33 bytes: an unused Kafka offset instead of
producer, seq and generation) is still read: its records have no id and no
generation. Version 3 (``>BBBddHI``, 25 bytes) is how a client's entry in
Redis keeps a message (:func:`stored_value`): producer, seq and generation
name a record only until the save script has stored it (duplicates, ended
sessions), so the 24 bytes are not kept for each stored message; read back,
they are 0. The properties are MQTT 5 property identifiers with fixed-width
values: ``0x01`` u8 payload format; ``0x03`` content type, ``0x08`` response
topic, ``0x09`` correlation data, each u16 length + bytes; ``0x26`` user
property, u16 length + key, u16 length + value (repeated, order kept);
``0x0B`` subscription identifier, u32 (repeated).

The flags byte is byte 1 (the SENT bit is set in Redis by the scripts of
persistence/lua/). After PUBREC the message is rewritten as the 2-byte value
``02 03`` (SENT | PUBREL): only the packet id is needed to resend PUBREL, so
the payload's memory is released.

Redis keys
----------
A client's keys carry the hash tag ``{cid}``, so they share one Redis
Cluster slot and one script may touch them all (:func:`client_keys`):

``{cid}_messages``
    sorted set; member = packet id as a decimal string, score = the client's
    counter (``{cid}_last_score``).
``{cid}_values``
    hash; field = packet id, value = the entry: the message's deadline (a
    big-endian f64, ms since the epoch; 0: none, it lives as long as the
    session, as a message sent does) then the message value above. Expired
    entries are dropped as they are met (persistence/lua/lib.lua). One small
    hash per client stays one listpack (Redis ``hash-max-listpack-entries``
    and ``-value``; the embedded Redis raises the latter to 512), a few bytes
    per message beyond its value. Before it (up to a7dfed5) each message was a
    string ``{cid}_messages_<packetId>`` with its own TTL, and the last packet
    id had a key ``{cid}_last_packet_id``: a client stored so is moved to the
    hash when a script first touches it (``upgrade`` in lib.lua).
``{cid}_last_score``
    the last score handed out (the last packet id is its
    :func:`packet_id_of`); it outlives a session that ends, with its
    generation tombstone, and the next session counts on from it (a late
    acknowledgement of the old session then names no message of the new one).
``{cid}_seen``
    hash, ``<producer>:<partition>`` -> the last ``seq`` stored from that
    producer through that partition (records of one producer reach a
    partition in order).
``{cid}_session``
    the session state (:class:`SessionState`, orjson).
``{cid}_generation``
    the generation of the client's current session; after the session ends,
    a tombstone one higher, kept for the default message TTL.
``{cid}_opens``
    how many times the stored session was resumed (:func:`opens_key`), kept
    for the default message TTL: an end by expiry that saw another count is
    refused (end_session.lua).
``{cid}_ecq_pending``, ``_log``, ``_values``, ``_times``, ``_seq``, ``_seen``, ``_acked``
    the exclusive compacted queue ``{cid}`` consumes (:func:`queue_keys`,
    persistence/queue_store.py): key -> seq not yet acknowledged, key -> seq
    of the latest value of every key, key -> value, key -> publish time (ms),
    the last seq handed out, ``<producer>:<partition>`` -> last record seq
    stored, the highest seq acknowledged; and, for a persistent session, the
    entries in flight to it (``_inflight``: packet id -> seq, key and value;
    ``gen`` -> the session generation they were sent to), so that a broker
    that restarts re-sends them under their packet identifiers.
``{cid}_id_owner``, ``{cid}_ecq_owner``
    who holds the client ID (:func:`client_id_owner_key`) and whose its queue is
    (:func:`queue_owner_key`): an owner's name (persistence/owner_store.py).
``{cid}_values`` field ``b`` (:data:`BYTES_FIELD`)
    the size of the messages stored (values as stored), for the per-client
    byte limit; messages that expire unread still count until the set empties.
    Before (up to a7dfed5) it was a key of its own, ``{cid}_bytes``
    (:attr:`ClientKeys.bytes`, still passed to the scripts, which move it).

``cid`` is the client id itself, except that ``%`` and ``}`` are written
``%25`` and ``%7D`` and the empty id is written ``%``: a ``}`` would end the
hash tag early. The mapping is injective and leaves ordinary ids alone.

Keys of the whole installation: :data:`SESSIONS_INDEX` (durable sessions for
the restore at start-up), :data:`PRODUCERS_KEY` (producer ids handed out),
:func:`epoch_key` (how often the persisted topic was created anew),
:func:`resets_key` (log resets announced per partition), :data:`RETAINED_KEY`
(retained messages, topic -> message value), :data:`WAIT_FENCE_KEY` (written
before a WAIT: ``persistence.redis_wait``).

Delivery event record (the Kafka record value of ``devicemq.events``)
------------------------------------------------------------------------------
A JSON array: the number :data:`EVENTS_LAYOUT` (2), then one array per event,
in order. An event's array is its layout number, the client id, the time
(epoch seconds), then the fields its layout names (:data:`EVENT_LAYOUTS`)::

    [2, [1, "dev-7", 1764000000.127, 11, 1000011, false], [2, "dev-7", ...]]

is a ``delivered`` event (``pid`` 11, ``sc`` 1000011, ``dup`` false), then an
``acked`` one. A layout gives the event kind (``ev``) and fixed fields (an
``expired`` at ``delivery`` and one at ``arrival`` are two layouts): no field
name, no kind string, nothing the reader knows already is written per event
(issue 41: the keyed form was a tenth of the broker's CPU in the fleet shape).
Numbers are never renumbered or reused; a new kind or variant takes the next.
The records written before this layout (until 2026-11-28) are a JSON array of
objects, one per event with its fields by name (``{"ev": "acked", "cid": ...,
"ts": ..., "pid": ..., "sc": ...}``); :func:`decode_event_record` reads both, and
gives both as those objects. The fields are described in persistence/events.py.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

import orjson
from aiokafka.partitioner import murmur2

from broker.ecq import PREFIX as ECQ_PREFIX

__all__ = [
    "EVENTS_LAYOUT",
    "EVENT_LAYOUTS",
    "FLAG_SENT",
    "MAX_PACKET_ID",
    "PRODUCERS_KEY",
    "RETAINED_KEY",
    "SESSIONS_INDEX",
    "WAIT_FENCE_KEY",
    "ClientKeys",
    "QueueKeys",
    "RecordId",
    "SessionState",
    "Stage",
    "StoredMessage",
    "StoredRecord",
    "SubscriptionState",
    "client_keys",
    "decode_event_record",
    "decode_record",
    "encode_message",
    "entry_live",
    "epoch_key",
    "event_fields",
    "header_fields",
    "is_queue_record",
    "packet_id_of",
    "partition_of",
    "pubrel_value",
    "queue_keys",
    "record_id",
    "resets_key",
    "stored_value",
]

MAX_PACKET_ID = 65_535

VERSION = 2
FLAG_SENT = 0x01
FLAG_PUBREL = 0x02
FLAG_RETAIN = 0x04
FLAG_HAS_EXPIRY = 0x08
FLAG_QUEUE = 0x10
FLAG_REPLAY = 0x20

_HEADER = struct.Struct(">BBBddQQQHI")
_HEADER_V1 = struct.Struct(">BBBddqHI")
_HEADER_V3 = struct.Struct(">BBBddHI")
STORED_VERSION = 3
_HEADER_SIZE = _HEADER.size
_PUBREL_VALUE = bytes((VERSION, FLAG_SENT | FLAG_PUBREL))

_P_PAYLOAD_FORMAT = 0x01
_P_CONTENT_TYPE = 0x03
_P_RESPONSE_TOPIC = 0x08
_P_CORRELATION_DATA = 0x09
_P_SUBSCRIPTION_ID = 0x0B
_P_USER_PROPERTY = 0x26

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_ID_U8 = struct.Struct(">BB")
_ID_U32 = struct.Struct(">BI")

# The Kafka topics of APPLICATION sessions (persistence/application_feed.py, app_topic)
APP_TOPIC_PREFIX = "devicemq.app."
SESSIONS_INDEX = "devicemq:sessions"
BYTES_FIELD = "b"  # a client's stored bytes: this field of its {cid}_values hash
PRODUCERS_KEY = "devicemq:producers"
BLOCKED_KEY = "devicemq:blocked"  # block-list entries: hash of key -> JSON (blocklist_store.py)
RETAINED_KEY = "devicemq:retained"
# A counter written just before WAIT / WAITAOF, on the waiting connection: WAIT
# covers that connection's writes, and this one comes after every save.
WAIT_FENCE_KEY = "devicemq:wait-fence"


def epoch_key(topic: str) -> str:
    """How many times devicemq found ``topic`` created anew (its offsets restart)."""
    return f"devicemq:epoch:{topic}"


def resets_key(topic: str) -> str:
    """Hash, partition -> how many log resets of ``topic`` were announced."""
    return f"devicemq:resets:{topic}"


# ---------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------


class Stage(Enum):
    """Where a stored message is in its outgoing flow."""

    PUBLISH = "publish"  # PUBLISH to (re)send
    PUBREL = "pubrel"  # QoS 2 after PUBREC: only PUBREL is left to send


# Module constants for the per-record path: on Python 3.11 a look-up of a member on
# an Enum class costs about 120 ns (BENCHMARKS.md, "Enum members").
_PUBLISH, _PUBREL = Stage.PUBLISH, Stage.PUBREL


@dataclass(slots=True)
class StoredMessage:
    """One message for one subscriber, as routed to the persistent path.

    ``qos`` and ``retain`` are what this subscriber receives;
    ``subscription_identifiers`` are those of its matching subscriptions.
    ``expiry`` is the absolute MQTT 5 message expiry (epoch seconds) or None.
    ``producer``/``seq`` name the record, ``generation`` is the subscriber's
    session it was routed for (see the module docstring).
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
    producer: int = 0
    seq: int = 0
    generation: int = 0


@dataclass(slots=True)
class StoredRecord:
    """A message read back for delivery or replay.

    ``sent`` means it may have been seen: send with DUP. In the PUBREL stage
    ``message`` is None (only PUBREL ``packet_id`` is to be sent).
    ``marked``: not sent yet, but the store has it marked sent already (it was
    saved for a client waiting for it): it goes out without a mark write.
    """

    packet_id: int
    score: int
    stage: Stage
    sent: bool
    message: StoredMessage | None
    marked: bool = False
    replay: bool = False  # a rewind's copy: DUP on its first send too (FLAG_REPLAY)


class RecordId(NamedTuple):
    """What the save script needs of a value, read from its header alone."""

    expiry: float | None
    producer: int
    seq: int
    generation: int


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


def encode_message(
    m: StoredMessage, *, sent: bool = False, replay: bool = False, queue: bool = False
) -> bytes:
    """The value of ``m`` (see the module docstring for the layout); ``queue``: for a
    queue store whatever its topic (a group queue's, broker/group_queue.py)."""
    return encode_fields(
        m.topic,
        m.payload,
        m.qos,
        m.retain,
        _encode_properties(m),
        m.publish_time,
        m.expiry,
        m.producer,
        m.seq,
        m.generation,
        sent=sent,
        replay=replay,
        queue=queue,
    )


def encode_fields(
    topic_name: str,
    payload: bytes,
    qos: int,
    retain: bool,
    props: bytes,
    publish_time: float,
    expiry: float | None,
    producer: int,
    seq: int,
    generation: int,
    *,
    sent: bool = False,
    replay: bool = False,
    queue: bool = False,
) -> bytes:
    """:func:`encode_message` from its fields, ``props`` encoded already: the Kafka
    path's encoding of a message without properties builds no :class:`StoredMessage`
    (persistence/delivery_codec.py)."""
    topic = topic_name.encode()
    if len(topic) > 0xFFFF:
        raise ValueError("topic is longer than 65535 bytes")
    flags = (FLAG_SENT if sent else 0) | (FLAG_RETAIN if retain else 0)
    if replay:
        flags |= FLAG_REPLAY
    if queue or topic_name.startswith(ECQ_PREFIX):
        flags |= FLAG_QUEUE
    if expiry is not None:
        flags |= FLAG_HAS_EXPIRY
    header = _HEADER.pack(
        VERSION,
        flags,
        qos,
        publish_time,
        expiry if expiry is not None else 0.0,
        producer,
        seq,
        generation,
        len(topic),
        len(props),
    )
    return b"".join((header, topic, props, payload))


_DEADLINE = struct.Struct(">d")


def entry_live(entry: bytes | None, now_ms: float) -> bool:
    """A ``{cid}_values`` entry (deadline, then the value) still holds a message at
    ``now_ms`` (ms since the epoch): its deadline is 0 (none) or later."""
    if not entry or len(entry) < _DEADLINE.size:
        return False
    (deadline,) = _DEADLINE.unpack_from(entry)
    return bool(deadline == 0 or deadline > now_ms)


def is_queue_record(value: bytes) -> bool:
    """The value is a message for an exclusive compacted queue (FLAG_QUEUE)."""
    return len(value) > 1 and value[0] in (VERSION, STORED_VERSION) and bool(value[1] & FLAG_QUEUE)


def stored_value(value: bytes) -> bytes:
    """A version 2 value as a client's ``{cid}_values`` entry keeps it: version 3,
    without producer, seq and generation (see the module docstring); any other
    value unchanged."""
    if len(value) >= _HEADER.size and value[0] == VERSION:
        return b"".join((b"\x03", value[1:19], value[43:]))
    return value


def pubrel_value() -> bytes:
    """The value a message is rewritten to after PUBREC: only PUBREL is left."""
    return _PUBREL_VALUE


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


def _header(value: bytes) -> tuple[int, float, float | None, int, int, int, int, int, int]:
    """(flags, published, expiry, producer, seq, generation, topic_len, props_len, size)."""
    version = value[0] if value else 0
    if version == VERSION and len(value) >= _HEADER.size:
        _, flags, _q, published, expiry, producer, seq, gen, tlen, plen = _HEADER.unpack_from(value)
        size = _HEADER.size
    elif version == STORED_VERSION and len(value) >= _HEADER_V3.size:
        _, flags, _q, published, expiry, tlen, plen = _HEADER_V3.unpack_from(value)
        producer = seq = gen = 0
        size = _HEADER_V3.size
    elif version == 1 and len(value) >= _HEADER_V1.size:
        _, flags, _q, published, expiry, _off, tlen, plen = _HEADER_V1.unpack_from(value)
        producer = seq = gen = 0
        size = _HEADER_V1.size
    else:
        raise ValueError("unknown stored message format")
    return (
        flags,
        published,
        expiry if flags & FLAG_HAS_EXPIRY else None,
        producer,
        seq,
        gen,
        tlen,
        plen,
        size,
    )


def well_formed(value: bytes | None) -> bool:
    """``value`` has a header :func:`record_id` reads (version 1 or 2, long enough):
    the consumer's check of every record, without decoding it."""
    if not value:
        return False
    version = value[0]
    if version == VERSION:
        return len(value) >= _HEADER_SIZE
    return version == 1 and len(value) >= _HEADER_V1.size


def record_id(value: bytes) -> RecordId:
    """Expiry, producer, seq and generation of a value, from its header alone. A
    version 3 value is a stored entry, not a record (it names none): refused, as
    :func:`well_formed` refuses it."""
    if value[:1] == bytes((STORED_VERSION,)):
        raise ValueError("a stored entry (version 3) is not a record")
    _flags, _pub, expiry, producer, seq, generation, *_ = _header(value)
    return RecordId(expiry, producer, seq, generation)


def header_fields(value: bytes) -> tuple[str, int, float, float | None]:
    """(topic, payload size, publish time, expiry) of a value, without decoding it all."""
    if value and value[0] == VERSION and len(value) >= _HEADER_SIZE:
        # the current version in one step: once per stored message for its event
        _, flags, _q, published, expiry, _p, _s, _g, topic_len, props_len = _HEADER.unpack_from(
            value
        )
        end = _HEADER_SIZE + topic_len
        return (
            str(value[_HEADER_SIZE:end], "utf-8", "replace"),
            len(value) - end - props_len,
            published,
            expiry if flags & FLAG_HAS_EXPIRY else None,
        )
    _flags, published, expiry, _p, _s, _g, topic_len, props_len, start = _header(value)
    topic = bytes(value[start : start + topic_len]).decode("utf-8", "replace")
    size = len(value) - start - topic_len - props_len
    return topic, size, published, expiry


def decode_record(
    packet_id: int, score: int, value: bytes, *, marked: bool = False
) -> StoredRecord:
    """Read a stored value back (inverse of :func:`encode_message`).

    ``marked``: the store holds it marked sent though this value is not
    (see :attr:`StoredRecord.marked`).
    """
    if len(value) < 2 or value[0] not in (1, VERSION, STORED_VERSION):
        raise ValueError(f"unknown stored message format (packet id {packet_id})")
    flags = value[1]
    sent = bool(flags & FLAG_SENT)
    if flags & FLAG_PUBREL:
        return StoredRecord(packet_id, score, _PUBREL, True, None)
    if value[0] == VERSION and len(value) >= _HEADER_SIZE:
        # The current version in one step (every record a consumer's poll hands to a
        # connected client is decoded here): no properties, no keywords.
        _, _f, qos, published, expiry, producer, seq, generation, topic_len, props_len = (
            _HEADER.unpack_from(value)
        )
        if not props_len:
            end = _HEADER_SIZE + topic_len
            message = StoredMessage(
                value[_HEADER_SIZE:end].decode(),
                value[end:],
                qos,
                bool(flags & FLAG_RETAIN),
                None,
                None,
                None,
                None,
                (),
                (),
                published,
                expiry if flags & FLAG_HAS_EXPIRY else None,
                producer,
                seq,
                generation,
            )
            return StoredRecord(
                packet_id, score, _PUBLISH, sent, message, marked, bool(flags & FLAG_REPLAY)
            )
    _f, published, expiry, producer, seq, generation, topic_len, props_len, pos = _header(value)
    qos = value[2]
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
        expiry=expiry,
        producer=producer,
        seq=seq,
        generation=generation,
        **props,
    )
    return StoredRecord(
        packet_id, score, _PUBLISH, sent, message, marked, bool(flags & FLAG_REPLAY)
    )


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
    """What a persistent session must keep across broker restarts and replicas.

    ``expiry_interval`` is the Session Expiry Interval in seconds (None: the
    session never expires). ``last_seen`` is epoch seconds. ``generation``
    tells this session from earlier and later ones of the same client id (it
    lives in its own key, ``{cid}_generation``, not in the encoded state);
    ``owner`` is who it belongs to under ``auth.session_owner`` (None: not
    bound), ``username`` who last connected with it.
    """

    expiry_interval: int | None
    last_seen: float
    subscriptions: dict[str, SubscriptionState] = field(default_factory=dict)
    protocol_level: int = 5
    # QoS 2 packet ids received from the client and not yet released by PUBREL
    qos2_received: tuple[int, ...] = ()
    generation: int = 0
    owner: str | None = None
    username: str | None = None  # who last connected with it (ACL user rules, %u)
    # its resumes so far ({cid}_opens): not in the encoded state either, nor compared
    opens: int = field(default=0, compare=False)

    def encode(self) -> bytes:
        # "q", "o" and "u" are left out when empty: one per durable session, the
        # bytes count (BENCHMARKS.md, "The fleet's size"); decode reads them absent.
        doc: dict[str, Any] = {
            "v": 1,
            "e": self.expiry_interval,
            "l": self.last_seen,
            "p": self.protocol_level,
        }
        if self.qos2_received:
            doc["q"] = list(self.qos2_received)
        if self.owner is not None:
            doc["o"] = self.owner
        if self.username is not None:
            doc["u"] = self.username
        return orjson.dumps(
            {
                **doc,
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
        return cls(
            doc["e"],
            doc["l"],
            subs,
            doc["p"],
            tuple(doc.get("q", ())),
            owner=doc.get("o"),
            username=doc.get("u"),
        )


# ---------------------------------------------------------------------------
# Keys
# ---------------------------------------------------------------------------


class ClientKeys(NamedTuple):
    """A client's keys, in the order the Lua scripts take them (KEYS[1..7])."""

    messages: str
    values: str
    last_score: str
    seen: str
    session: str
    generation: str
    bytes: str

    def message(self, packet_id: int) -> str:
        """The string of one message in the layout before the values hash (up to
        a7dfed5), read once by the upgrade (persistence/lua/lib.lua)."""
        return f"{self.messages}_{packet_id}"


def _tag(client_id: str) -> str:
    if not client_id:
        return "%"
    if "%" in client_id or "}" in client_id:
        return client_id.replace("%", "%25").replace("}", "%7D")
    return client_id


class QueueKeys(NamedTuple):
    """An exclusive compacted queue's keys (persistence/lua/queue_*.lua)."""

    pending: str
    log: str
    values: str
    times: str
    seq: str
    seen: str
    acked: str
    inflight: str
    claims: str  # a group queue's: key -> the member's claim token (persistence/group_feed.py)
    tokens: str  # a group queue's: claim token -> lease deadline (ms)
    bytes: str  # the bytes of the values kept (persistence/lua/queue_save.lua)
    full: str  # set for a while once a write was refused over the byte limit


def queue_keys(client_id: str) -> QueueKeys:
    """The keys of the queue consumed by ``client_id``, in its client's slot (a group
    queue's, ``$queue/{group}/{filter}``, in its own)."""
    p = "{" + _tag(client_id) + "}_ecq_"
    return QueueKeys(
        p + "pending",
        p + "log",
        p + "values",
        p + "times",
        p + "seq",
        p + "seen",
        p + "acked",
        p + "inflight",
        p + "claims",
        p + "tokens",
        p + "bytes",
        p + "full",
    )


def group_writes_key(client_id: str) -> str:
    """The group writes a persistent member has in flight (packet id -> group store,
    entry), recorded before each is sent, in its client's slot
    (persistence/group_feed.py, :class:`GroupQueues`)."""
    return "{" + _tag(client_id) + "}_ecq_group_writes"


def client_id_owner_key(client_id: str) -> str:
    """Who holds the client ID (``auth.client_id_owner: first``), in its client's slot:
    the owner's name, expiring ``auth.client_id_release_after`` after its last use."""
    return "{" + _tag(client_id) + "}_id_owner"


def queue_owner_key(client_id: str) -> str:
    """Whose the $ECQ queue ``client_id`` consumes is (its first consumer's owner), in
    its client's slot, beside the queue's keys; kept until an admin changes it."""
    return "{" + _tag(client_id) + "}_ecq_owner"


# Owner -> how many $ECQ queues it holds (a sorted set: the owner tally asks only for
# the owners with many, persistence/owner_tally.py), beside each owner's index.
QUEUE_OWNERS_KEY = "devicemq:ecq:owners"


def owner_queues_key(owner: str) -> str:
    """The $ECQ queues ``owner`` holds (a set of client IDs), kept beside their claims
    (:func:`queue_owner_key`) by persistence/owner_store.py; one key per owner."""
    return "devicemq:ecq:owned:" + owner


def packet_id_of(score: int) -> int:
    """The packet id that goes with a score: 1..65535, wrapping, never 0."""
    return (score - 1) % MAX_PACKET_ID + 1


def client_keys(client_id: str) -> ClientKeys:
    """The Redis keys of ``client_id`` (all in one cluster slot)."""
    p = "{" + _tag(client_id) + "}"
    return ClientKeys(
        p + "_messages",
        p + "_values",
        p + "_last_score",
        p + "_seen",
        p + "_session",
        p + "_generation",
        p + "_bytes",
    )


def opens_key(client_id: str) -> str:
    """How many times the client's stored session was resumed (open_session.lua), in
    its slot: an end for expiry that saw another count is refused (end_session.lua)."""
    return "{" + _tag(client_id) + "}_opens"


def partition_of(client_id: str, partitions: int) -> int:
    """The partition of a client's records among ``partitions``: Kafka's default
    partitioner on the client id as key, as the producers (persistence/kafka_path.py)
    give it; the delivery events of the client go to the same one (persistence/events.py)."""
    if partitions == 1:  # the embedded Kafka of a single broker
        return 0
    return _key_hash(client_id) % partitions


@functools.lru_cache(maxsize=65_536)
def _key_hash(client_id: str) -> int:
    """murmur2 is pure Python (~2 us a key): asked per client per event flush, so
    remembered for as many clients as a broker commonly serves."""
    return int(murmur2(client_id.encode()) & 0x7FFFFFFF)


# -- delivery events (module docstring: "Delivery event record") -------------------------

EVENTS_LAYOUT = 2  # first element of a positional events record; keyed records have none
# The event layouts by number: (ev, fixed fields, the fields after number, cid and ts).
(
    EV_PERSISTED, EV_DELIVERED, EV_ACKED, EV_EXPIRED_DELIVERY, EV_DROPPED, EV_PURGED,
    EV_DUPLICATE, EV_EXPIRED_ARRIVAL, EV_DISCARDED_ARRIVAL, EV_TRIMMED_ARRIVAL, EV_TRIMMED,
    EV_CONNECTED, EV_DISCONNECTED, EV_SESSION_EXPIRED, EV_SESSION_ENDED, EV_ADMIN, EV_GAP,
    EV_Q_PERSISTED, EV_Q_REFUSED, EV_Q_COMPACTED, EV_Q_EXPIRED, EV_Q_TRIMMED,
    EV_Q_DELIVERED, EV_Q_ACKED, EV_Q_DROPPED, EV_Q_PURGED,
) = range(26)  # fmt: skip
_ARRIVED = ("part", "off", "ep", "topic", "size", "pub")
EVENT_LAYOUTS: tuple[tuple[str, dict[str, Any], tuple[str, ...]], ...] = (
    ("persisted", {}, ("pid", "sc", "part", "off", "ep", "topic", "size", "pub", "exp")),
    ("delivered", {}, ("pid", "sc", "dup")),
    ("acked", {}, ("pid", "sc")),
    ("expired", {"at": "delivery"}, ("pid", "sc")),
    ("dropped", {}, ("pid", "sc")),  # too large for the client
    ("purged", {}, ("pid", "sc")),
    ("duplicate", {}, ("part", "off", "ep")),
    ("expired", {"at": "arrival"}, _ARRIVED),
    ("discarded", {"at": "arrival"}, _ARRIVED),
    ("trimmed", {"at": "arrival"}, _ARRIVED),
    ("trimmed", {}, ("pids",)),  # by the per-client limit, oldest first
    ("connected", {}, ()),
    ("disconnected", {}, ()),
    ("session_expired", {}, ()),
    ("session_ended", {}, ()),
    ("admin", {}, ("action", "detail")),
    ("gap", {}, ("n",)),
    # a queue's entries (broker/ecq.py, group queues): pid 0, sc the negated sequence, q its key
    ("persisted", {"pid": 0, "exp": None},
     ("sc", "q", "part", "off", "ep", "topic", "size", "pub")),
    ("trimmed", {"at": "arrival"}, ("part", "off", "ep")),  # refused at the byte limit
    ("compacted", {"pid": 0}, ("sc", "by", "q")),
    ("expired", {"at": "retention", "pid": 0}, ("sc", "q")),
    ("trimmed", {"at": "queue", "pid": 0}, ("sc", "q")),
    ("delivered", {"pid": 0}, ("sc", "q", "dup")),
    ("acked", {"pid": 0}, ("sc", "q")),
    ("dropped", {"pid": 0}, ("sc", "q")),
    ("purged", {"pid": 0}, ("sc", "q")),
)  # fmt: skip
# (ev, the names of an event's array after its number, fixed fields), per layout
_LAYOUT_NAMES = tuple((ev, ("cid", "ts", *names), fixed) for ev, fixed, names in EVENT_LAYOUTS)


def decode_event_record(value: bytes) -> list[dict[str, Any]]:
    """The events of a record of ``devicemq.events`` as objects with their fields by
    name, in order, whichever its layout (positional or keyed, the module docstring).

    Not JSON, or not an array: no event (ValueError for bad JSON, as orjson's). An
    element that is not an object (keyed) or an array of a known layout (positional)
    is skipped; an array of the wrong length is a ValueError."""
    decoded = orjson.loads(value)
    if not isinstance(decoded, list):
        return []
    if decoded and decoded[0] == EVENTS_LAYOUT and type(decoded[0]) is int:
        return [event for event in map(event_fields, decoded[1:]) if event is not None]
    return [e for e in decoded if isinstance(e, dict)]


def event_fields(event: Any) -> dict[str, Any] | None:
    """One positional event as its object (None: not an array of a known layout)."""
    if type(event) is not list or not event:
        return None
    number = event[0]
    if type(number) is not int or not 0 <= number < len(_LAYOUT_NAMES):
        return None
    ev, names, fixed = _LAYOUT_NAMES[number]
    fields = dict(zip(names, event[1:], strict=True))
    fields["ev"] = ev
    if fixed:
        fields.update(fixed)
    return fields
