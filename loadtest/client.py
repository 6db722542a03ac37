"""The load generator's MQTT clients: one ``asyncio.Protocol`` per connection.

Speed matters more here than generality, because the tool must not be what
limits the measurement:

- no streams, no per-packet objects on the hot path: ``data_received`` walks
  the buffer itself and handles PUBLISH, PUBACK, PUBREC, PUBREL and PUBCOMP
  inline (``fast_path_bench`` in this package compares it with
  ``broker.codec.PacketDecoder``); every other packet (CONNACK, SUBACK,
  PINGRESP, DISCONNECT) goes through the project's codec;
- a PUBLISH is a pre-encoded prefix (fixed header, topic), one ``struct``
  pack of the packet id and the payload header, and a constant padding;
- everything one ``data_received`` call produces (acknowledgements, the next
  PUBLISHes) leaves in one ``transport.write``;
- one clock read per ``data_received`` call, not per message.

The payload starts with ``>IIIQ``: run nonce, publisher index, sequence
number, send time (``time.monotonic_ns``, CLOCK_MONOTONIC, which is one clock
for every process of the machine, so worker processes can time each other's
messages). Messages with another nonce (a stale persistent session of an
earlier run) are counted as foreign and otherwise ignored.
"""

from __future__ import annotations

import asyncio
import errno
import math
import random
import struct
from array import array
from collections import deque
from collections.abc import Callable
from time import monotonic_ns
from typing import cast

from broker.codec import PacketDecoder, encode
from broker.packets import (
    ConnAck,
    Connect,
    Disconnect,
    Properties,
    SubAck,
    Subscribe,
    Subscription,
)

__all__ = [
    "HEADER",
    "PAYLOAD_MIN",
    "THROTTLE_HINT",
    "Bucket",
    "ClientError",
    "Publisher",
    "Stats",
    "Subscriber",
]

HEADER = struct.Struct(">IIIQ")  # nonce, publisher index, sequence number, send time ns
PAYLOAD_MIN = HEADER.size
NS = 1_000_000_000

_ACK = struct.Struct(">BBH")
_PID_HEADER = struct.Struct(">HIIIQ")  # packet id + payload header (3.1.1)
_PID_PROPS_HEADER = struct.Struct(">HBIIIQ")  # packet id, empty properties, header (5)
_NO_PID_HEADER = struct.Struct(">IIIQ")  # QoS 0, 3.1.1
_NO_PID_PROPS_HEADER = struct.Struct(">BIIIQ")  # QoS 0, 5
_PINGREQ = b"\xc0\x00"
_DISCONNECT = b"\xe0\x00"
# CONNACK codes that mean "busy, come back later": 3.1.1 server unavailable (3),
# MQTT 5 server busy (0x89) and connection rate exceeded (0x9F)
_BUSY = frozenset({3, 0x89, 0x9F})


# What to change when the broker refused CONNECTs as busy: the load tool's clients
# all come from one address (broker/config.py, MqttSettings; broker/core.py connect_allowed)
THROTTLE_HINT = (
    "the broker paces CONNECTs: raise mqtt.max_connection_rate_per_source "
    "(DEVICEMQ_MQTT_MAX_CONNECTION_RATE_PER_SOURCE, default 100/s from one address; "
    "0 turns it off) and, past 1,000/s, mqtt.max_connection_rate "
    "(DEVICEMQ_MQTT_MAX_CONNECTION_RATE)"
)


# Addresses where a CONNECT of this process was accepted: a connection refused
# there later is retried (a broker briefly overwhelmed); before, it is an error.
_REACHED: set[tuple[str, int]] = set()


class ClientError(Exception):
    """A connection was refused or failed before the run could start."""

    def __init__(self, message: str, os_errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = os_errno


def _nofile() -> int | str:
    try:
        import resource

        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError):  # pragma: no cover - not Linux
        return "?"


class Bucket:
    """What one worker saw during one second of the run (second 0 starts at t0).

    Latencies are microseconds; the number of delivered messages is
    ``len(e2e)``. ``acked`` counts PUBLISHes the broker acknowledged (QoS 0:
    written to the socket), ``puback`` has their acknowledgement latency.
    """

    __slots__ = ("acked", "e2e", "puback", "sent")

    def __init__(self) -> None:
        self.sent = 0
        self.acked = 0
        self.e2e = array("I")
        self.puback = array("I")


class Stats:
    """Per-second buckets of one worker, indexed by ``(now - t0) // 1 s``."""

    __slots__ = ("buckets", "t0")

    def __init__(self) -> None:
        self.t0 = monotonic_ns()  # until the run sets it: CONNACKs must not count from boot
        self.buckets: list[Bucket] = [Bucket()]

    def restart(self, t0: int) -> None:
        self.t0 = t0
        self.buckets = [Bucket()]

    def bucket(self, now: int) -> Bucket:
        sec = (now - self.t0) // NS
        buckets = self.buckets
        if sec < len(buckets):
            return buckets[sec] if sec >= 0 else buckets[0]
        while len(buckets) <= sec:
            buckets.append(Bucket())
        return buckets[sec]


def _micros(value: int) -> int:
    """Clamp to what an unsigned 32-bit microsecond sample can hold."""
    return 0 if value < 0 else min(value // 1000, 0xFFFFFFFF)


class _Client(asyncio.Protocol):
    """CONNECT/CONNACK, SUBSCRIBE/SUBACK and the slow path shared by both roles."""

    transport: asyncio.Transport | None

    def __init__(
        self,
        client_id: str,
        level: int,
        clean: bool,
        session_expiry: int,
        stats: Stats,
        keep_alive: int = 600,
    ) -> None:
        self.client_id = client_id
        self.level = level
        self.v5 = level == 5
        self.clean = clean
        self.session_expiry = session_expiry
        self.keep_alive = keep_alive
        self.stats = stats
        self.transport = None
        self._rest = b""
        self._decoder = PacketDecoder(protocol_level=level)
        self._waiter: asyncio.Future[object] | None = None
        self.connected = False
        self.session_present = False
        self.lost_connections = 0
        self.busy_refusals = 0  # CONNECTs refused as busy, then retried (connect)
        self.connect_failures = 0  # connections failed before a CONNACK, then retried
        self.closed: asyncio.Future[None] | None = None
        self.paused = False
        # The broker's Receive Maximum (MQTT 5 CONNACK): QoS 1/2 PUBLISHes it takes in
        # flight from us; a client must not send more (MQTT-3.3.4-7).
        self.send_maximum = 65535

    # -- connection -------------------------------------------------------------

    async def connect(self, host: str, port: int, timeout: float = 30.0) -> None:
        """Connect, retrying as devices do until ``timeout`` seconds have passed.

        Retried, with exponential backoff (50 ms doubling to 2 s, jittered): a
        CONNECT the broker refused as busy (devicemq's connection rate limits,
        ``THROTTLE_HINT``: the load tool's clients share one address; 3.1.1 return
        code 3, MQTT 5 0x89/0x9F) and a connection that failed or broke before its
        CONNACK (a full listen backlog, a reset). Not retried: any other refusal,
        running out of file descriptors (``ulimit -n``), and a connection refused
        where no client of this process has connected yet (a wrong port, a broker
        not started: said at once, not after ``timeout``). ``busy_refusals`` and
        ``connect_failures`` count the retries, for the report.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        backoff = 0.05
        while True:
            try:
                code = await self._connect_once(host, port, max(deadline - loop.time(), 0.1))
            except ClientError as e:
                if e.errno == errno.EMFILE or loop.time() + backoff >= deadline:
                    raise
                if e.errno == errno.ECONNREFUSED and (host, port) not in _REACHED:
                    raise  # nothing listens there (yet): a wrong port fails at once
                self.connect_failures += 1
                if self.transport is not None:  # no CONNACK in time: start over
                    self.transport.abort()
                else:  # no connection was made, none will close
                    self.closed = None
            else:
                if code == 0:
                    return
                if code not in _BUSY:
                    raise ClientError(f"{self.client_id}: CONNECT refused: {code!r}")
                self.busy_refusals += 1
                if loop.time() + backoff >= deadline:
                    raise ClientError(
                        f"{self.client_id}: CONNECT refused as busy ({code!r}) "
                        f"{self.busy_refusals} times in {timeout:.0f} s: {THROTTLE_HINT}"
                    )
            if self.closed is not None:
                await asyncio.shield(self.closed)
            await asyncio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, 2.0)

    async def _connect_once(self, host: str, port: int, timeout: float) -> object:
        """One TCP connection and CONNECT; the CONNACK's code (0: connected)."""
        loop = asyncio.get_running_loop()
        self._rest = b""
        self.closed = loop.create_future()
        try:
            await asyncio.wait_for(loop.create_connection(lambda: self, host, port), timeout)
        except (OSError, TimeoutError) as e:
            code = getattr(e, "errno", None)
            if code == errno.EMFILE:
                raise ClientError(
                    f"{self.client_id}: out of file descriptors ({e}): raise the limit with "
                    f"`ulimit -n` (now {_nofile()}) or run more --processes",
                    errno.EMFILE,
                ) from e
            raise ClientError(
                f"{self.client_id}: cannot connect to {host}:{port}: {e!r}", code
            ) from e
        properties = None
        if self.v5:
            properties = Properties(
                session_expiry_interval=self.session_expiry or None, receive_maximum=65535
            )
        connack = await self._request(
            encode(
                Connect(
                    self.client_id,
                    protocol_level=self.level,
                    clean_start=self.clean,
                    keep_alive=self.keep_alive,
                    properties=properties,
                ),
                self.level,
            ),
            timeout,
        )
        if not isinstance(connack, ConnAck) or connack.reason_code != 0:
            if self.transport is not None:
                self.transport.close()
            return getattr(connack, "reason_code", connack)
        _REACHED.add((host, port))
        self.session_present = connack.session_present
        if connack.properties is not None and connack.properties.receive_maximum:
            self.send_maximum = connack.properties.receive_maximum
        self.connected = True
        return 0

    async def subscribe(self, topic_filter: str, qos: int, timeout: float = 30.0) -> None:
        packet = Subscribe(1, [Subscription(topic_filter, qos)])
        suback = await self._request(encode(packet, self.level), timeout)
        if not isinstance(suback, SubAck) or suback.reason_codes[0] >= 0x80:
            raise ClientError(f"{self.client_id}: SUBSCRIBE {topic_filter!r} refused: {suback!r}")
        if suback.reason_codes[0] != qos:
            raise ClientError(
                f"{self.client_id}: SUBSCRIBE {topic_filter!r} granted QoS "
                f"{suback.reason_codes[0]}, asked {qos}"
            )

    async def _request(self, data: bytes, timeout: float) -> object:
        if self.transport is None:
            raise ClientError(f"{self.client_id}: not connected")
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        try:
            return await asyncio.wait_for(self._waiter, timeout)
        except TimeoutError:
            raise ClientError(f"{self.client_id}: no answer within {timeout} s") from None
        finally:
            self._waiter = None

    def ping(self) -> None:
        if self.transport is not None and self.connected:
            self.transport.write(_PINGREQ)

    async def disconnect(self, timeout: float = 5.0) -> None:
        transport = self.transport
        if transport is None:
            return
        self.connected = False
        transport.write(
            encode(Disconnect(), self.level) if self.v5 else _DISCONNECT,
        )
        transport.close()
        if self.closed is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self.closed), timeout)
            except TimeoutError:
                transport.abort()

    def drop(self) -> None:
        """Lose the connection abruptly (no DISCONNECT), like a device going away."""
        if self.transport is not None:
            self.connected = False
            self.transport.abort()

    # -- asyncio.Protocol -----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self._decoder = PacketDecoder(protocol_level=self.level)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.connected:
            self.lost_connections += 1
        self.connected = False
        self.transport = None
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(ClientError(f"{self.client_id}: connection lost: {exc}"))
        if self.closed is not None and not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False

    def data_received(self, data: bytes) -> None:
        self._other(data)  # the roles below override this with their fast paths

    def _other(self, packet: bytes) -> None:
        """Slow path: any packet the fast path does not handle, through the codec."""
        for decoded in self._decoder.feed(packet):
            if isinstance(decoded, ConnAck | SubAck):
                if self._waiter is not None and not self._waiter.done():
                    self._waiter.set_result(decoded)
            elif isinstance(decoded, Disconnect):
                self.connected = False


def _split(data: bytes, pos: int, size: int) -> tuple[int, int] | None:
    """Remaining length (beyond one byte) at ``pos``: ``(length, body)`` or None if short."""
    value = 0
    shift = 0
    for i in range(pos, min(pos + 4, size)):
        byte = data[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i + 1
        shift += 7
    return None


class Publisher(_Client):
    """Publishes ``nonce, index, seq, time`` messages, keeping at most ``inflight``
    unacknowledged (QoS 1/2); ``rate`` messages per second, or as fast as
    the window allows when ``rate`` is 0."""

    def __init__(
        self,
        index: int,
        client_id: str,
        topic: str,
        qos: int,
        payload_size: int,
        nonce: int,
        level: int,
        stats: Stats,
        rate: float,
        inflight: int,
        padding: bytes,
    ) -> None:
        super().__init__(client_id, level, True, 0, stats)
        self.index = index
        self.qos = qos
        self.nonce = nonce
        self.rate = rate
        self.inflight = inflight
        self.sent = 0  # next sequence number
        self.acked = bytearray()  # 1 at each acknowledged sequence number
        self.acked_count = 0
        self.rejected = 0  # PUBACK/PUBREC with a failure reason code (MQTT 5)
        self.no_subscribers = 0  # PUBACK 0x10 (MQTT 5)
        self.outstanding = 0
        self.start_ns = 0
        self.running = False
        # Packet ids 1..inflight, reused as their exchanges end: the slots below are
        # as many as the window, not 65,535 (two lists of 65,536 per publisher were
        # a megabyte each: 4 GB at 4,000 publishers).
        slots = min(max(inflight, 1), 65535)
        self._free_pids = deque(range(1, slots + 1))
        self._pid_seq = [0] * (slots + 1)
        self._pid_ts = [0] * (slots + 1)
        self.limit = 0  # stop after this many messages (0: no limit; loadtest/storm.py)
        self._scheduled = False
        topic_bytes = topic.encode()
        header = _PID_HEADER if qos else _NO_PID_HEADER
        if level == 5:
            header = _PID_PROPS_HEADER if qos else _NO_PID_PROPS_HEADER
        self._header = header
        self._padding = padding[: max(0, payload_size - PAYLOAD_MIN)]
        length = 2 + len(topic_bytes) + header.size + len(self._padding)
        first = 0x30 | qos << 1
        self._prefix = (
            bytes((first,))
            + _remaining_length(length)
            + struct.pack(">H", len(topic_bytes))
            + topic_bytes
        )

    # -- sending ----------------------------------------------------------------------

    def start(self, start_ns: int) -> None:
        self.start_ns = start_ns
        self.running = True
        self.fill(monotonic_ns())

    def stop(self) -> None:
        self.running = False

    def fill(self, now: int) -> None:
        """Send what the window and the rate allow right now, in one write."""
        transport = self.transport
        if not self.running or transport is None or not self.connected:
            return
        qos = self.qos
        if qos:
            budget = min(self.inflight, self.send_maximum) - self.outstanding
        else:  # QoS 0 has no window: a burst per call, none while the socket is full
            budget = 0 if self.paused else self.inflight
        rate = self.rate
        if rate:
            # floor, not int(): before its start (its phase in the first second) a
            # publisher has nothing due; int() rounded -0.5 up to 0, one message due
            due = math.floor((now - self.start_ns) * rate / NS) + 1 - self.sent
            budget = min(budget, due)
        if self.limit:
            budget = min(budget, self.limit - self.sent)
        if budget <= 0:
            return
        prefix = self._prefix
        padding = self._padding
        pack = self._header.pack
        nonce = self.nonce
        index = self.index
        seq = self.sent
        parts: list[bytes] = []
        append = parts.append
        if qos:
            take = self._free_pids.popleft
            pid_seq = self._pid_seq
            pid_ts = self._pid_ts
            v5 = self.v5
            for _ in range(budget):
                pid = take()
                pid_seq[pid] = seq
                pid_ts[pid] = now
                append(prefix)
                if v5:
                    append(pack(pid, 0, nonce, index, seq, now))
                else:
                    append(pack(pid, nonce, index, seq, now))
                append(padding)
                seq += 1
            self.outstanding += budget
            self.acked.extend(bytes(budget))
        else:
            v5 = self.v5
            for _ in range(budget):
                append(prefix)
                if v5:
                    append(pack(0, nonce, index, seq, now))
                else:
                    append(pack(nonce, index, seq, now))
                append(padding)
                seq += 1
            # QoS 0 has no acknowledgement: "acked" means written to the socket.
            self.acked.extend(b"\x01" * budget)
            self.acked_count += budget
        self.sent = seq
        bucket = self.stats.bucket(now)
        bucket.sent += budget
        if not qos:
            bucket.acked += budget
        transport.write(b"".join(parts))
        if not qos and not rate and not self._scheduled:
            # QoS 0 unthrottled: keep going from the loop, yielding to readers.
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._again)

    def next_due(self) -> int:
        """When the rate lets the next message go (``rate`` > 0): the worker wakes a
        publisher then, instead of asking every publisher at every tick."""
        return self.start_ns + math.ceil(self.sent * NS / self.rate)

    def _again(self) -> None:
        self._scheduled = False
        self.fill(monotonic_ns())

    # -- receiving --------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._rest:
            data = self._rest + data
            self._rest = b""
        now = monotonic_ns()
        size = len(data)
        pos = 0
        replies: list[bytes] = []
        bucket = self.stats.bucket(now)
        record = bucket.puback.append
        pid_seq = self._pid_seq
        pid_ts = self._pid_ts
        slots = len(pid_seq)
        release = self._free_pids.append
        acked = self.acked
        done = 0
        ok = 0
        while size - pos >= 2:
            first = data[pos]
            length = data[pos + 1]
            body = pos + 2
            if length & 0x80:
                split = _split(data, pos + 1, size)
                if split is None:
                    break
                length, body = split
            end = body + length
            if end > size:
                break
            kind = first >> 4
            if kind == 4 or kind == 7:  # PUBACK, PUBCOMP: the exchange is over
                pid = (data[body] << 8) | data[body + 1]
                # a packet id none of ours has (never sent, or acknowledged already):
                # ignored, so that the window stays right
                if not 0 < pid < slots or not pid_ts[pid]:
                    pos = end
                    continue
                sent_at = pid_ts[pid]
                pid_ts[pid] = 0
                release(pid)
                done += 1
                if length > 2 and data[body + 2] >= 0x80:
                    self.rejected += 1
                else:
                    if length > 2 and data[body + 2] == 0x10:
                        self.no_subscribers += 1
                    acked[pid_seq[pid]] = 1
                    ok += 1
                    record((now - sent_at) // 1000)  # non-negative: sent before now
            elif kind == 5:  # PUBREC: answer PUBREL, keep the slot until PUBCOMP
                pid = (data[body] << 8) | data[body + 1]
                if length > 2 and data[body + 2] >= 0x80:
                    self.rejected += 1
                    if 0 < pid < slots and pid_ts[pid]:
                        pid_ts[pid] = 0
                        done += 1
                        release(pid)
                else:
                    replies.append(_ACK.pack(0x62, 2, pid))
            else:
                self._other(data[pos:end])
            pos = end
        if pos < size:
            self._rest = data[pos:]
        if done:
            self.outstanding -= done
            self.acked_count += ok
            bucket.acked += ok
        if replies and self.transport is not None:
            self.transport.write(b"".join(replies))
        if done:
            self.fill(now)


class _Stream:
    """What one subscriber got from one publisher."""

    __slots__ = ("counts", "highest")

    def __init__(self, size: int) -> None:
        self.counts = bytearray(size)  # times each sequence number arrived (saturates at 255)
        self.highest = -1  # highest sequence number received so far


class Subscriber(_Client):
    """Receives, acknowledges and checks messages: every (publisher, seq) it
    gets is counted in a per-publisher bytearray, so loss, duplicates and
    order can be checked at the end without keeping the messages."""

    def __init__(
        self,
        index: int,
        client_id: str,
        topic_filter: str,
        qos: int,
        nonce: int,
        level: int,
        clean: bool,
        session_expiry: int,
        stats: Stats,
    ) -> None:
        super().__init__(client_id, level, clean, session_expiry, stats)
        self.index = index
        self.topic_filter = topic_filter
        self.qos = qos
        self.nonce = nonce
        self.streams: dict[int, _Stream] = {}  # by publisher index
        self.received = 0
        self.duplicates = 0
        self.duplicates_flagged = 0  # of which arrived with DUP=1
        self.out_of_order = 0
        self.foreign = 0
        self._qos2_pending: set[int] = set()
        self.on_activity: Callable[[], None] | None = None
        # e2e us of each first delivery received inside ``window`` (monotonic ns,
        # the run's measured seconds): the tail by client, and by replica
        self.latencies: array[int] | None = None
        self.window = (0, 0)

    async def start(self, host: str, port: int, timeout: float = 30.0) -> None:
        await self.connect(host, port, timeout)
        if not self.session_present:
            await self.subscribe(self.topic_filter, self.qos)

    def data_received(self, data: bytes) -> None:
        if self._rest:
            data = self._rest + data
            self._rest = b""
        now = monotonic_ns()
        size = len(data)
        pos = 0
        replies: list[bytes] = []
        reply = replies.append
        record = self.stats.bucket(now).e2e.append
        own = self.latencies
        if own is not None and not self.window[0] <= now < self.window[1]:
            own = None
        unpack = HEADER.unpack_from
        v5 = self.v5
        nonce = self.nonce
        streams = self.streams
        ack_pack = _ACK.pack
        received = 0
        while size - pos >= 2:
            first = data[pos]
            length = data[pos + 1]
            body = pos + 2
            if length & 0x80:
                split = _split(data, pos + 1, size)
                if split is None:
                    break
                length, body = split
            end = body + length
            if end > size:
                break
            kind = first >> 4
            if kind == 3:  # PUBLISH
                qos = (first >> 1) & 3
                p = body + 2 + ((data[body] << 8) | data[body + 1])
                pid = 0
                if qos:
                    pid = (data[p] << 8) | data[p + 1]
                    p += 2
                    if qos == 1:
                        reply(ack_pack(0x40, 2, pid))
                    else:
                        reply(ack_pack(0x50, 2, pid))
                        if pid in self._qos2_pending:  # a resend before our PUBREC arrived
                            pos = end
                            continue
                        self._qos2_pending.add(pid)
                if v5:
                    if data[p] == 0:
                        p += 1
                    else:
                        plen, p = _varint(data, p)
                        p += plen
                if end - p < PAYLOAD_MIN:
                    self.foreign += 1
                    pos = end
                    continue
                msg_nonce, publisher, seq, sent_ns = unpack(data, p)
                if msg_nonce != nonce:
                    self.foreign += 1
                    pos = end
                    continue
                stream = streams.get(publisher)
                if stream is None:
                    stream = streams[publisher] = _Stream(max(1024, seq * 2))
                counts = stream.counts
                if seq >= len(counts):
                    counts.extend(bytes(seq * 2 - len(counts) + 1024))
                seen = counts[seq]
                if seen:
                    self.duplicates += 1
                    if first & 0x08:
                        self.duplicates_flagged += 1
                    if seen < 255:
                        counts[seq] = seen + 1
                else:
                    counts[seq] = 1
                    if seq < stream.highest:
                        self.out_of_order += 1
                    else:
                        stream.highest = seq
                received += 1
                latency = (now - sent_ns) // 1000
                if not 0 <= latency <= 0xFFFFFFFF:
                    latency = _micros(now - sent_ns)
                record(latency)
                if own is not None:
                    own.append(latency)
            elif kind == 6:  # PUBREL (QoS 2): release and complete
                pid = (data[body] << 8) | data[body + 1]
                self._qos2_pending.discard(pid)
                reply(ack_pack(0x70, 2, pid))
            else:
                self._other(data[pos:end])
            pos = end
        self.received += received
        if pos < size:
            self._rest = data[pos:]
        if replies and self.transport is not None:
            self.transport.write(b"".join(replies))

    def unique(self, publisher: int) -> int:
        """Distinct sequence numbers received from ``publisher``."""
        stream = self.streams.get(publisher)
        if stream is None:
            return 0
        return len(stream.counts) - stream.counts.count(0)

    def counts(self) -> dict[int, bytearray]:
        """Per publisher, how often each sequence number arrived (trailing zeros cut)."""
        return {
            publisher: bytearray(stream.counts.rstrip(b"\x00"))
            for publisher, stream in self.streams.items()
        }


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = 0
    shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _remaining_length(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | 0x80 if n else byte)
        if not n:
            return bytes(out)
