"""MQTT clients that report everything they do and see to the model.

- :class:`RawClient`: a plain socket and :mod:`broker.codec` (3.1.1 or 5.0),
  one reader thread per connection. As a subscriber it controls every
  acknowledgement (hold PUBACK, PUBREC without PUBCOMP, ...) and keeps the
  receiver's side of the session across reconnects: ids received and not yet
  PUBACKed / PUBCOMPed. As a publisher it sends QoS 0/1/2 with a window and
  never re-sends (a PUBLISH without an answer when its connection ends is
  simply not acknowledged).
- :class:`PahoSubscriber`: paho-mqtt with manual acks (``client.ack``),
  subscribing at QoS 0/1.
- :class:`PahoPublisher`: paho-mqtt publishing with its automatic reconnect;
  what it had in flight when a connection dropped is re-sent by paho, so
  those messages are *ambiguous* (may arrive twice).

Acknowledgement policies of a subscriber: ``auto`` (at once), ``delay``
(after a short delay), ``hold`` (not until released), ``hold_comp`` (QoS 2:
PUBREC at once, PUBCOMP held).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties as PahoProperties
from paho.mqtt.subscribeoptions import SubscribeOptions

from broker.codec import PacketDecoder, encode
from broker.packets import (
    ConnAck,
    Connect,
    Disconnect,
    Packet,
    Properties,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    Subscription,
    UnsubAck,
    Unsubscribe,
)
from tests.model.groups import group_of
from tests.model.model import Copy, Model, Msg, Sub

POLICIES = ("auto", "delay", "hold", "hold_comp")
ACK_DELAY = 0.3  # s, the "delay" policy


class Scheduler:
    """One thread running delayed calls (the ``delay`` policy)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._cond = threading.Condition()
        self._ids = itertools.count()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="model-scheduler", daemon=True)
        self._thread.start()

    def later(self, delay: float, call: Callable[[], None]) -> None:
        with self._cond:
            heapq.heappush(self._heap, (time.monotonic() + delay, next(self._ids), call))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and (not self._heap or self._heap[0][0] > time.monotonic()):
                    wait = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cond.wait(wait)
                if self._stop:
                    return
                _, _, call = heapq.heappop(self._heap)
            with contextlib.suppress(Exception):
                call()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(5)


@dataclass
class Held:
    """A received PUBLISH not yet finally acknowledged (receiver's session state)."""

    payload: bytes
    qos: int
    conn: int  # connection it was last received (or released) on
    copy: Copy | None
    stage: str = "pub"  # pub: no ack yet; rec: PUBREC sent; rel: PUBREL seen
    acked_conn: int = 0  # connection the PUBREC went out on
    expiry: float | None = None  # absolute, from the Message Expiry Interval received
    queued: bool = False  # an entry of the client's $ECQ queue (tests/model/queues.py)


class Subscriber:
    """Receiver-side bookkeeping shared by the raw and the paho subscriber."""

    paho = False

    def __init__(self, model: Model, cid: str, version: int, scheduler: Scheduler) -> None:
        self.model = model
        self.cid = cid
        self.version = version
        self.scheduler = scheduler
        self.policy = "auto"
        self.lock = threading.RLock()
        self.held: dict[int, Held] = {}
        self.conn = 0  # current connection number (0: none yet)
        self.connected = False
        self.broker = 0
        self.resumed_at = 0.0  # CONNACK time of the current connection
        model.add_client(cid, version, self.paho)

    # -- what a transport implements ---------------------------------------------------

    def _send_ack(self, pid: int, kind: str) -> bool:
        raise NotImplementedError

    # -- receiving ---------------------------------------------------------------------

    def _new_session(self) -> None:
        with self.lock:
            self.held.clear()

    def _on_publish(
        self,
        conn: int,
        pid: int | None,
        payload: bytes,
        qos: int,
        dup: bool,
        sub_ids: tuple[int, ...],
        expiry: int | None,
        topic: str = "",
    ) -> None:
        with self.lock:
            held = self.held.get(pid) if pid is not None else None
            queued = topic.startswith("$ECQ/")
            if queued or group_of(topic) is not None:
                side = self.model.queues if queued else self.model.groups
                side.received(self.cid, conn, topic, payload, dup)
                if pid is None:
                    return
                self.model.held_reused(
                    self.cid,
                    conn,
                    pid,
                    payload,
                    held.payload if held is not None else None,
                )
                held = self.held[pid] = Held(payload, qos, conn, None, queued=queued)
                self._apply_policy(pid, held, conn)
                return
            copy = self.model.received(
                self.cid,
                conn,
                pid,
                payload,
                qos,
                dup,
                sub_ids,
                held.payload if held is not None else None,
                held is not None and held.qos == 2 and held.payload == payload,
            )
            if qos == 0 or pid is None:
                return
            now = time.monotonic()
            if held is None or held.payload != payload:
                held = self.held[pid] = Held(
                    payload, qos, conn, copy, expiry=None if expiry is None else now + expiry
                )
            else:
                held.conn = conn
                if held.copy is None:
                    held.copy = copy
            if held.stage in ("rec", "rel"):
                self._ack(pid, held, conn, "rec")  # a re-sent PUBLISH: PUBREC again
                return
            self._apply_policy(pid, held, conn)

    def _on_pubrel(self, conn: int, pid: int) -> None:
        with self.lock:
            held = self.held.get(pid)
            if held is None or held.qos != 2:
                self._send_ack(pid, "comp")  # a PUBREL re-sent after our PUBCOMP got lost
                return
            held.stage = "rel"
            held.conn = conn
            if self.policy in ("hold", "hold_comp"):
                return
            if self.policy == "delay":
                self.scheduler.later(ACK_DELAY, lambda: self._ack_later(pid, held, conn))
                return
            self._ack(pid, held, conn, "comp")

    def _apply_policy(self, pid: int, held: Held, conn: int) -> None:
        kind = "ack" if held.qos == 1 else "rec"
        if self.policy == "hold":
            return
        if self.policy == "delay":
            self.scheduler.later(ACK_DELAY, lambda: self._ack_later(pid, held, conn))
            return
        self._ack(pid, held, conn, kind)

    def _ack_later(self, pid: int, held: Held, conn: int) -> None:
        with self.lock:
            if self.held.get(pid) is not held or self.conn != conn or not self.connected:
                return  # gone, or another connection: the broker sends it again
            kind = {"pub": "ack" if held.qos == 1 else "rec", "rel": "comp"}.get(held.stage)
            if kind is not None:
                self._ack(pid, held, conn, kind)

    def _ack(self, pid: int, held: Held, conn: int, kind: str) -> None:
        if not self._send_ack(pid, kind):
            return
        if kind == "ack" or kind == "comp":
            del self.held[pid]
            if held.queued:
                self.model.queues.acked(self.cid, held.payload, conn)
            self.model.final_ack(held.copy)
        else:
            held.stage = "rec" if held.stage == "pub" else held.stage
            held.acked_conn = conn

    def release(self) -> None:
        """Acknowledge everything held that was received on the current connection."""
        with self.lock:
            if not self.connected:
                return
            for pid, held in list(self.held.items()):
                if held.conn != self.conn:
                    continue
                if held.stage == "pub":
                    self._ack(pid, held, self.conn, "ack" if held.qos == 1 else "rec")
                elif held.stage == "rel":
                    self._ack(pid, held, self.conn, "comp")

    def set_policy(self, policy: str) -> None:
        with self.lock:
            self.policy = policy

    def unreleased(self) -> list[tuple[int, Held]]:
        """QoS 2 ids PUBREC'd and not completed, last seen on an earlier connection."""
        with self.lock:
            return [
                (pid, h)
                for pid, h in self.held.items()
                if h.qos == 2 and h.stage in ("rec", "rel") and h.conn != self.conn
            ]


# ---------------------------------------------------------------------------
# Raw socket client
# ---------------------------------------------------------------------------


@dataclass
class _Out:
    msg: Msg
    qos: int
    stage: str = "sent"  # sent, rel (PUBREL sent)


class _Connection:
    def __init__(self, sock: socket.socket, level: int, number: int) -> None:
        self.sock = sock
        self.level = level
        self.number = number
        self.decoder = PacketDecoder(protocol_level=level)
        self.pending: list[Packet] = []
        self.closed = threading.Event()
        self.wlock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.receive_maximum = 65535

    def send(self, packet: Packet) -> bool:
        with self.wlock:
            if self.closed.is_set():
                return False
            try:
                self.sock.sendall(encode(packet, self.level))
            except OSError:
                return False
        return True


class RawClient(Subscriber):
    """A subscriber and/or publisher on a plain socket."""

    def __init__(
        self,
        model: Model,
        cid: str,
        version: int,
        scheduler: Scheduler,
        *,
        receive_maximum: int | None = None,
        tag: str = "",
    ) -> None:
        super().__init__(model, cid, version, scheduler)
        self.level = 5 if version == 5 else 4
        self.receive_maximum = receive_maximum
        self.tag = tag
        self._c: _Connection | None = None
        self._ids = itertools.cycle(range(1, 65536))
        self._out: dict[int, _Out] = {}
        self._subacks: dict[int, tuple[list[Sub], threading.Event]] = {}
        self._unsubacks: dict[int, threading.Event] = {}
        self.seq = 0
        self._out_cond = threading.Condition(self.lock)
        self.refused = 0

    # -- connection --------------------------------------------------------------------

    def connect(
        self,
        address: tuple[str, int],
        broker: int,
        clean_start: bool,
        expiry: int,
        timeout: float = 5.0,
    ) -> bool:
        """Close any current connection, then CONNECT; True once CONNACKed."""
        self.disconnect(abrupt=False)
        clean = clean_start if self.level == 5 else (clean_start or expiry == 0)
        if self.level != 5 and clean:
            expiry = 0  # 3.1.1 clean session: it ends with the connection
        opened = self._open(address, clean, expiry, timeout)
        if opened is None:
            return False
        c, connect = opened
        connack = self._recv_sync(c, timeout) if c.send(connect) else None
        if not self._connacked(c, connack, broker):
            return False
        c.sock.settimeout(0.2)
        c.thread = threading.Thread(target=self._read, args=(c,), name=f"raw-{self.cid}")
        c.thread.daemon = True
        c.thread.start()
        return True

    def blink(
        self, address: tuple[str, int], broker: int, expiry: int, timeout: float = 5.0
    ) -> bool:
        """Resume the session and leave at once: CONNECT and DISCONNECT in one write, so
        the broker reads the DISCONNECT right after it resumed the session, before
        what it started for that connection (a group queue member's claim) has
        answered (tests/model/FINDINGS.md, finding 34). What the broker sends after
        the CONNACK is never read (as by a client that died). True once CONNACKed."""
        self.disconnect(abrupt=False)
        opened = self._open(address, False, expiry, timeout)
        if opened is None:
            return False
        c, connect = opened
        try:
            c.sock.sendall(encode(connect, self.level) + encode(Disconnect(0), self.level))
        except OSError:
            connack = None
        else:
            connack = self._recv_sync(c, timeout)
        if not self._connacked(c, connack, broker):
            return False
        with contextlib.suppress(OSError):
            c.sock.close()
        self._closed(c)
        return True

    def _open(
        self, address: tuple[str, int], clean: bool, expiry: int, timeout: float
    ) -> tuple[_Connection, Connect] | None:
        """Tell the model a CONNECT is on its way and open the socket: the connection
        and the CONNECT to send on it, or None (the model told it failed)."""
        self.model.connect_sent(self.cid, clean, expiry)
        try:
            sock = socket.create_connection(address, timeout=timeout)
        except OSError:
            self.model.connect_failed(self.cid)
            return None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        props = None
        if self.level == 5:
            props = Properties(
                session_expiry_interval=expiry or None, receive_maximum=self.receive_maximum
            )
        connect = Connect(
            self.cid, protocol_level=self.level, clean_start=clean, keep_alive=0, properties=props
        )
        return _Connection(sock, self.level, 0), connect

    def _connacked(self, c: _Connection, connack: Packet | None, broker: int) -> bool:
        """Take a successful CONNACK as this client's connection (True); anything
        else closes the socket and tells the model the CONNECT failed."""
        if not isinstance(connack, ConnAck) or connack.reason_code != 0:
            with contextlib.suppress(OSError):
                c.sock.close()
            self.model.connect_failed(self.cid)
            self.refused += 1
            return False
        with self.lock:
            number = self.model.connack(self.cid, connack.session_present)
            if not connack.session_present:
                self._new_session()
            c.number = number
            if connack.properties is not None and connack.properties.receive_maximum:
                c.receive_maximum = connack.properties.receive_maximum
            self.conn = number
            self.connected = True
            self.broker = broker
            self.resumed_at = time.monotonic()
            self._c = c
        return True

    @staticmethod
    def _recv_sync(c: _Connection, timeout: float) -> Packet | None:
        deadline = time.monotonic() + timeout
        while not c.pending:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            c.sock.settimeout(left)
            try:
                data = c.sock.recv(65536)
            except OSError:
                return None
            if not data:
                return None
            try:
                c.pending.extend(c.decoder.feed(data))
            except Exception:
                return None
        return c.pending.pop(0)

    def disconnect(self, abrupt: bool) -> None:
        """DISCONNECT and close, or (``abrupt``) reset the socket without a word."""
        c = self._c
        if c is None:
            return
        if not abrupt:
            c.send(Disconnect(0))
        with c.wlock:
            if abrupt:
                with contextlib.suppress(OSError):
                    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            with contextlib.suppress(OSError):
                c.sock.close()
        if c.thread is not None and c.thread is not threading.current_thread():
            c.thread.join(5)
        self._closed(c)

    def _closed(self, c: _Connection) -> None:
        with self.lock:
            if c.closed.is_set():
                return
            c.closed.set()
            if self._c is c:
                self._c = None
                self.connected = False
            self.model.connection_closed(self.cid, c.number)
            for out in self._out.values():
                self.model.publish_answered(out.msg, False)
            self._out.clear()
            for _, event in self._subacks.values():
                event.set()
            self._subacks.clear()
            for event in self._unsubacks.values():
                event.set()
            self._unsubacks.clear()
            self._out_cond.notify_all()

    def _read(self, c: _Connection) -> None:
        try:
            for packet in c.pending:
                self._handle(c, packet)
            c.pending = []
            while not c.closed.is_set():
                try:
                    data = c.sock.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    break
                if not data:
                    break
                for packet in c.decoder.feed(data):
                    self._handle(c, packet)
        except Exception as error:  # a decoding error is the broker's
            self.model.violate("broker", f"{self.cid}: bad packet from the broker: {error!r}")
        finally:
            with contextlib.suppress(OSError):
                c.sock.close()
            self._closed(c)

    def _send_ack(self, pid: int, kind: str) -> bool:
        c = self._c
        if c is None:
            return False
        packet: Packet
        if kind == "ack":
            packet = PubAck(pid)
        elif kind == "rec":
            packet = PubRec(pid)
        else:
            packet = PubComp(pid)
        return c.send(packet)

    def _handle(self, c: _Connection, packet: Packet) -> None:
        if isinstance(packet, Publish):
            props = packet.properties
            expiry = props.message_expiry_interval if props is not None else None
            sub_ids = props.subscription_identifiers if props is not None else ()
            self._on_publish(
                c.number,
                packet.packet_id,
                packet.payload,
                packet.qos,
                packet.dup,
                sub_ids,
                expiry,
                packet.topic,
            )
        elif isinstance(packet, PubRel):
            self._on_pubrel(c.number, packet.packet_id)
        elif isinstance(packet, (PubAck, PubRec, PubComp)):
            self._on_publish_ack(c, packet)
        elif isinstance(packet, SubAck):
            with self.lock:
                waiting = self._subacks.pop(packet.packet_id, None)
            if waiting is not None:
                subs, event = waiting
                self.model.suback(subs, list(packet.reason_codes))
                event.set()
        elif isinstance(packet, UnsubAck):
            with self.lock:
                done = self._unsubacks.pop(packet.packet_id, None)
            if done is not None:
                done.set()

    # -- subscribing -------------------------------------------------------------------

    def _next_id(self) -> int:
        while True:
            pid = next(self._ids)
            if pid not in self._out and pid not in self._subacks and pid not in self._unsubacks:
                return pid

    def subscribe(self, entries: Sequence[tuple[str, int, int | None]], timeout: float) -> bool:
        """One SUBSCRIBE per entry (each its own Subscription Identifier); wait for SUBACKs."""
        events = []
        for topic_filter, qos, sub_id in entries:
            with self.lock:
                c = self._c
                if c is None:
                    return False
                pid = self._next_id()
                subs = self.model.subscribe_sent(self.cid, [(topic_filter, qos, sub_id)])
                event = threading.Event()
                self._subacks[pid] = (subs, event)
            props = Properties(subscription_identifiers=(sub_id,)) if sub_id else None
            c.send(Subscribe(pid, [Subscription(topic_filter, qos=qos)], props))
            events.append(event)
        deadline = time.monotonic() + timeout
        return all(e.wait(max(0.0, deadline - time.monotonic())) for e in events)

    def send_control(self, topic: str, payload: bytes) -> bool:
        """A QoS 0 PUBLISH outside the model's messages (a queue's rewind)."""
        with self.lock:
            c = self._c
        return c is not None and c.send(Publish(topic, payload, 0))

    def unsubscribe(self, filters: list[str], timeout: float) -> bool:
        with self.lock:
            c = self._c
            if c is None:
                return False
            pid = self._next_id()
            self.model.unsubscribe_sent(self.cid, filters)
            event = threading.Event()
            self._unsubacks[pid] = event
        c.send(Unsubscribe(pid, list(filters)))
        return event.wait(timeout)

    # -- publishing --------------------------------------------------------------------

    def publish(
        self,
        items: list[tuple[str, int, int | None]],
        window: int,
        timeout: float,
        stop: threading.Event | None = None,
    ) -> int:
        """Publish (topic, qos, expiry) items in order within ``window``; returns how
        many were sent. Waits up to ``timeout`` for the answers at the end."""
        sent = 0
        for topic, qos, expiry in items:
            with self.lock:
                while True:
                    c = self._c
                    if c is None or (stop is not None and stop.is_set()):
                        return sent
                    if len(self._out) < min(window, c.receive_maximum):
                        break
                    self._out_cond.wait(0.2)
                self.seq += 1
                payload = f"{self.tag}:{self.cid}:{self.seq}".encode()
                pid = self._next_id() if qos else None
                msg = self.model.publish_sent(
                    self.cid, self.seq, c.number, payload, topic, qos, expiry, self.broker
                )
                if pid is not None:
                    self._out[pid] = _Out(msg, qos)
            props = Properties(message_expiry_interval=expiry) if expiry is not None else None
            if not c.send(Publish(topic, payload, qos, False, False, pid, props)):
                return sent
            if qos == 0:
                self.model.publish_answered(msg, True)
            sent += 1
        deadline = time.monotonic() + timeout
        with self.lock:
            while self._out and time.monotonic() < deadline:
                self._out_cond.wait(0.1)
        return sent

    def unanswered(self) -> int:
        with self.lock:
            return len(self._out)

    def _on_publish_ack(self, c: _Connection, packet: PubAck | PubRec | PubComp) -> None:
        with self.lock:
            out = self._out.get(packet.packet_id)
            if out is None:
                return
            if isinstance(packet, PubRec) and out.stage == "sent":
                if packet.reason_code >= 0x80:
                    del self._out[packet.packet_id]
                    self.model.publish_answered(out.msg, False)
                else:
                    self.model.publish_received(out.msg)
                    out.stage = "rel"
                    c.send(PubRel(packet.packet_id))
            elif (isinstance(packet, PubAck) and out.qos == 1) or (
                isinstance(packet, PubComp) and out.stage == "rel"
            ):
                del self._out[packet.packet_id]
                self.model.publish_answered(out.msg, packet.reason_code < 0x80)
            self._out_cond.notify_all()


# ---------------------------------------------------------------------------
# paho-mqtt
# ---------------------------------------------------------------------------


def _rc(value: Any) -> int:
    return int(value.value) if hasattr(value, "value") else int(value)


class PahoSubscriber(Subscriber):
    """paho-mqtt with manual acks; one paho client per connection, no auto reconnect."""

    paho = True

    def __init__(self, model: Model, cid: str, version: int, scheduler: Scheduler) -> None:
        super().__init__(model, cid, version, scheduler)
        self.client: mqtt.Client | None = None
        self._suback: dict[int, tuple[list[Sub], threading.Event]] = {}
        self._early: dict[int, list[int]] = {}
        self._unsub: set[int] = set()

    def connect(
        self,
        address: tuple[str, int],
        broker: int,
        clean_start: bool,
        expiry: int,
        timeout: float = 5.0,
    ) -> bool:
        self.disconnect(abrupt=False)
        v5 = self.version == 5
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.cid,
            protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311,
            clean_session=None if v5 else (clean_start or expiry == 0),
            reconnect_on_failure=False,
            manual_ack=True,
        )
        connected = threading.Event()
        result: dict[str, Any] = {}

        def on_connect(c: Any, u: Any, flags: Any, rc: Any, props: Any) -> None:
            result["rc"] = _rc(rc)
            if _rc(rc) == 0:
                with self.lock:
                    number = self.model.connack(self.cid, bool(flags.session_present))
                    if not flags.session_present:
                        self._new_session()
                    self.conn = number
                    self.connected = True
                    self.broker = broker
                    self.resumed_at = time.monotonic()
                    result["conn"] = number
            connected.set()

        def on_disconnect(c: Any, u: Any, flags: Any, rc: Any, props: Any) -> None:
            number = result.get("conn")
            with self.lock:
                if number is not None and number == self.conn:
                    self.connected = False
                if number is not None:
                    self.model.connection_closed(self.cid, number)
                for _, event in self._suback.values():
                    event.set()
            connected.set()

        def on_message(c: Any, u: Any, msg: mqtt.MQTTMessage) -> None:
            props = msg.properties
            sub_ids: tuple[int, ...] = ()
            expiry = None
            if props is not None:
                sid = getattr(props, "SubscriptionIdentifier", None)
                if sid is not None:
                    sub_ids = tuple(sid) if isinstance(sid, list) else (int(sid),)
                expiry = getattr(props, "MessageExpiryInterval", None)
            number = result.get("conn", 0)
            self._on_publish(
                number,
                msg.mid if msg.qos else None,
                bytes(msg.payload),
                msg.qos,
                bool(msg.dup),
                sub_ids,
                expiry,
                msg.topic,
            )

        def on_subscribe(c: Any, u: Any, mid: int, codes: Any, props: Any) -> None:
            with self.lock:
                waiting = self._suback.pop(mid, None)
                if waiting is None:
                    self._early[mid] = [_rc(x) for x in codes]
                    return
            subs, event = waiting
            self.model.suback(subs, [_rc(x) for x in codes])
            event.set()

        client.on_connect = on_connect
        client.on_disconnect = on_disconnect
        client.on_message = on_message
        client.on_subscribe = on_subscribe
        if not v5 and (clean_start or expiry == 0):
            clean_start, expiry = True, 0  # 3.1.1 clean session: it ends with the connection
        self.model.connect_sent(self.cid, clean_start, expiry)
        properties = None
        if v5:
            properties = PahoProperties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
            if expiry:
                properties.SessionExpiryInterval = expiry
        try:
            if v5:
                client.connect(
                    *address, keepalive=30, clean_start=clean_start, properties=properties
                )
            else:
                client.connect(*address, keepalive=30)
        except OSError:
            self.model.connect_failed(self.cid)
            return False
        client.loop_start()
        self.client = client
        if not connected.wait(timeout) or result.get("rc") != 0 or "conn" not in result:
            self.model.connect_failed(self.cid)
            self.disconnect(abrupt=True)
            return False
        return True

    def disconnect(self, abrupt: bool) -> None:
        client, self.client = self.client, None
        if client is None:
            return
        if abrupt:
            client.loop_stop()
            sock = client.socket()
            if isinstance(sock, socket.socket):
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    sock.close()
            with self.lock:
                if self.connected:
                    self.connected = False
                    self.model.connection_closed(self.cid, self.conn)
        else:
            with contextlib.suppress(Exception):
                client.disconnect()
            client.loop_stop()
            with self.lock:
                if self.connected:
                    self.connected = False
                    self.model.connection_closed(self.cid, self.conn)

    def _send_ack(self, pid: int, kind: str) -> bool:
        client = self.client
        if client is None or not self.connected or kind == "rec":
            return False  # paho sends PUBREC itself; QoS 2 is not subscribed here
        return client.ack(pid, 1 if kind == "ack" else 2) == mqtt.MQTT_ERR_SUCCESS

    def subscribe(self, entries: Sequence[tuple[str, int, int | None]], timeout: float) -> bool:
        events = []
        for topic_filter, qos, sub_id in entries:
            client = self.client
            if client is None or not self.connected:
                return False
            properties = None
            if self.version == 5 and sub_id:
                properties = PahoProperties(PacketTypes.SUBSCRIBE)  # type: ignore[no-untyped-call]
                properties.SubscriptionIdentifier = sub_id
            subs = self.model.subscribe_sent(self.cid, [(topic_filter, qos, sub_id)])
            event = threading.Event()
            if self.version == 5:
                _, mid = client.subscribe(
                    topic_filter, options=SubscribeOptions(qos=qos), properties=properties
                )
            else:
                _, mid = client.subscribe(topic_filter, qos)
            if mid is None:
                return False
            with self.lock:
                early = self._early.pop(mid, None)
                if early is None:
                    self._suback[mid] = (subs, event)
            if early is not None:
                self.model.suback(subs, early)
                event.set()
            events.append(event)
        deadline = time.monotonic() + timeout
        return all(e.wait(max(0.0, deadline - time.monotonic())) for e in events)

    def unsubscribe(self, filters: list[str], timeout: float) -> bool:
        client = self.client
        if client is None or not self.connected:
            return False
        self.model.unsubscribe_sent(self.cid, filters)
        client.unsubscribe(list(filters))
        return True


class PahoPublisher:
    """paho-mqtt publisher (clean session) with paho's own reconnect and re-send."""

    def __init__(self, model: Model, cid: str, version: int, tag: str) -> None:
        self.model = model
        self.cid = cid
        self.version = version
        self.tag = tag
        self.lock = threading.Lock()
        self.seq = 0
        self.conn = 0
        self.broker = 0
        self._mids: dict[int, Msg] = {}
        self._done: dict[int, int] = {}
        self._connected = threading.Event()
        self._resync = threading.Event()
        self.client: mqtt.Client | None = None

    def connect(self, address: tuple[str, int], broker: int, timeout: float = 5.0) -> bool:
        if self.client is not None:
            return self._connected.wait(timeout)
        v5 = self.version == 5
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.cid,
            protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311,
            clean_session=None if v5 else True,
            reconnect_on_failure=True,
        )
        client.reconnect_delay_set(0.1, 0.5)  # type: ignore[arg-type]  # floats work
        client.max_queued_messages_set(0)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_publish = self._on_publish
        self.broker = broker
        self.client = client
        client.connect_async(*address, keepalive=30)
        client.loop_start()
        return self._connected.wait(timeout)

    def _on_connect(self, c: Any, u: Any, flags: Any, rc: Any, props: Any) -> None:
        if _rc(rc) == 0:
            with self.lock:
                self.conn += 1
            self._connected.set()

    def _on_disconnect(self, c: Any, u: Any, flags: Any, rc: Any, props: Any) -> None:
        self._connected.clear()
        self._resync.set()
        with self.lock:
            for mid, msg in self._mids.items():
                if mid not in self._done:
                    msg.ambiguous = True  # paho sends it again after the reconnect

    def _on_publish(self, c: Any, u: Any, mid: int, rc: Any, props: Any) -> None:
        with self.lock:
            msg = self._mids.pop(mid, None)
            if msg is None:
                self._done[mid] = _rc(rc)
                return
        self.model.publish_answered(msg, _rc(rc) < 0x80)

    def _pending(self) -> int:
        with self.lock:
            return len(self._mids)

    def publish(
        self,
        items: list[tuple[str, int, int | None]],
        window: int,
        timeout: float,
        stop: threading.Event | None = None,
    ) -> int:
        client = self.client
        if client is None:
            return 0
        sent = 0
        for topic, qos, expiry in items:
            deadline = time.monotonic() + timeout
            while True:  # connected, nothing from before a reconnect pending, room
                if stop is not None and stop.is_set():
                    return sent
                if time.monotonic() > deadline:
                    return sent
                if self._connected.is_set():
                    pending = self._pending()
                    if self._resync.is_set() and pending == 0:
                        self._resync.clear()
                    if not self._resync.is_set() and pending < window:
                        break
                time.sleep(0.002)
            with self.lock:
                self.seq += 1
                seq = self.seq
                conn = self.conn
            payload = f"{self.tag}:{self.cid}:{seq}".encode()
            msg = self.model.publish_sent(
                self.cid, seq, conn, payload, topic, qos, expiry, self.broker
            )
            properties = None
            if self.version == 5 and expiry is not None:
                properties = PahoProperties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
                properties.MessageExpiryInterval = expiry
            info = client.publish(topic, payload, qos, properties=properties)
            if qos == 0:
                self.model.publish_answered(msg, True)
                sent += 1
                continue
            with self.lock:
                rc = self._done.pop(info.mid, None)
                if rc is None:
                    self._mids[info.mid] = msg
            if rc is not None:
                self.model.publish_answered(msg, rc < 0x80)
            sent += 1
        deadline = time.monotonic() + timeout
        while self._pending() and time.monotonic() < deadline:
            time.sleep(0.02)
        return sent

    def unanswered(self) -> int:
        return self._pending()

    def give_up(self) -> None:
        """What is still unanswered is not acknowledged (it may still arrive)."""
        with self.lock:
            msgs = list(self._mids.values())
        for msg in msgs:
            msg.ambiguous = True

    def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.disconnect()
            client.loop_stop()
        self._connected.clear()
