"""``$SYS`` topics: Mosquitto's ``$SYS/broker/...`` numbers and EMQX-shaped presence events.

**Numbers.** Every ``sys_interval`` seconds (0: no ``$SYS`` at all; the task
that calls :meth:`SysTopics.publish_numbers` is in app/serve.py) the broker
publishes, as Mosquitto does, RETAINED at QoS 0 with plain-text payloads:
``$SYS/broker/version``, ``uptime`` ("N seconds"), ``clients/connected``,
``clients/disconnected``, ``clients/total`` (sessions held, connected or not),
``messages/received`` and ``messages/sent`` (PUBLISH packets: devicemq counts
no others, so the same as ``publish/messages/received`` and ``/sent``),
``bytes/received`` and ``bytes/sent`` (all MQTT bytes on the sockets),
``subscriptions/count``, ``retained messages/count`` (the clients' retained
messages, the ones ``mqtt.max_retained_*`` limit); with persistence also
``$SYS/broker/devicemq/persisted/backlog`` (messages in Redis for the durable
sessions, as ``devicemq_persisted_backlog_messages``) and
``$SYS/broker/devicemq/kafka/consumer_lag`` (records of this broker's
partitions not yet stored, summed over them); with APPLICATION sessions
(docs/application-sessions.md) and /metrics served (the lag is read from
Kafka, at most every 5 s, and shared with /metrics)
``$SYS/broker/devicemq/application/sessions`` and, per session,
``$SYS/broker/devicemq/application/{client_id}/lag/messages`` (messages after
its committed offsets) and ``.../lag/seconds`` (age of the oldest of them; 0:
none), the client ID one level as in the presence topics. A session that
ended gets a zero-length retained message on its two topics, which removes
them (MQTT-3.3.1-10), as a client deletes a retained message.

They describe the broker the subscriber is connected to. They are this
process's own: kept in memory outside the retained limits, ``len`` and Redis
(:meth:`~broker.retained.RetainedStore.keep_own`) and routed only to sessions
connected here. In a cluster every replica publishes its own numbers under
the same topics, and a subscriber sees those of the replica it is connected
to, as a Mosquitto tool expects of "the broker"; the per-replica view of all
of them is /metrics. There are no per-node copies: node ids are host-PID,
new at every start, and retained copies of them would pile up.

**Presence.** When a session gets its connection (just before CONNACK) and
when it loses it (DISCONNECT, takeover, keep-alive timeout, socket lost,
...), ``$SYS/brokers/{node}/clients/{client_id}/connected`` or
``.../disconnected``, QoS 0, not retained, a JSON object shaped as EMQX's
(:func:`connected_payload`, :func:`disconnected_payload`), routed as any
message: in a cluster it reaches subscribers on every replica. ``{node}`` is
the cluster node id (``cluster.enabled``), else ``cluster.node_id`` if set,
else the host name (stable across restarts). A client id with ``/``, ``+``,
``#`` or ``%`` is percent-encoded in the topic (it must stay one level of a
valid topic name); the payload has it as it is.

Clients cannot publish to ``$SYS`` (:meth:`broker.acl.Authorizer.can_publish`).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import orjson

from broker import __version__
from broker.cluster import RemoteSession, node_id_of
from broker.message import Message

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from broker.config import Settings
    from broker.connection import MQTTConnection
    from broker.group_queue import GroupTarget
    from broker.message import Delivery
    from broker.retained import RetainedStore
    from broker.session import Session
    from broker.stats import BrokerStats

__all__ = [
    "SysNumbers",
    "SysTopics",
    "connected_payload",
    "disconnected_payload",
    "node_name",
    "presence_topic",
    "sys_messages",
]

log = logging.getLogger("devicemq.sys")

BROKER_PREFIX = "$SYS/broker/"
MAX_TOPIC_BYTES = 65535  # an MQTT string (MQTT-1.5.4-1)
_PROTOCOL_NAMES = {3: "MQIsdp", 4: "MQTT", 5: "MQTT"}
_ESCAPES = str.maketrans({"%": "%25", "/": "%2F", "+": "%2B", "#": "%23"})


@dataclass(frozen=True, slots=True)
class SysNumbers:
    """What ``$SYS/broker/...`` reports, read from the broker at one moment."""

    uptime: float  # seconds
    clients_connected: int
    clients_total: int  # sessions held here, connected or not
    messages_received: int  # PUBLISH packets
    messages_sent: int
    bytes_received: int
    bytes_sent: int
    subscriptions: int
    retained: int
    persisted_backlog: int | None = None  # None: persistence off, or not counted yet
    kafka_consumer_lag: int | None = None
    # client ID -> (messages after its committed offsets, age of the oldest in s) of
    # each APPLICATION session; None: none configured, or not counted
    application_lag: Mapping[str, tuple[int, float | None]] | None = None


def sys_messages(numbers: SysNumbers, version: str = __version__) -> list[tuple[str, bytes]]:
    """(topic, payload) of every ``$SYS/broker/...`` message, in Mosquitto's format."""
    n = numbers
    values: list[tuple[str, object]] = [
        ("version", f"devicemq version {version}"),
        ("uptime", f"{int(n.uptime)} seconds"),
        ("clients/connected", n.clients_connected),
        ("clients/disconnected", n.clients_total - n.clients_connected),
        ("clients/total", n.clients_total),
        ("messages/received", n.messages_received),
        ("messages/sent", n.messages_sent),
        ("publish/messages/received", n.messages_received),
        ("publish/messages/sent", n.messages_sent),
        ("bytes/received", n.bytes_received),
        ("bytes/sent", n.bytes_sent),
        ("subscriptions/count", n.subscriptions),
        ("retained messages/count", n.retained),
    ]
    if n.persisted_backlog is not None:
        values.append(("devicemq/persisted/backlog", n.persisted_backlog))
    if n.kafka_consumer_lag is not None:
        values.append(("devicemq/kafka/consumer_lag", n.kafka_consumer_lag))
    if n.application_lag is not None:
        values.append(("devicemq/application/sessions", len(n.application_lag)))
        for client_id, (messages, age) in sorted(n.application_lag.items()):
            lag = application_lag_topic(client_id)
            if len((BROKER_PREFIX + lag).encode()) + len("/seconds") > MAX_TOPIC_BYTES:
                continue  # a client ID near 64 KiB: no topic can name it
            values.append((f"{lag}/messages", messages))
            values.append((f"{lag}/seconds", f"{age or 0.0:.1f}"))
    return [(BROKER_PREFIX + name, str(value).encode()) for name, value in values]


def application_lag_topic(client_id: str) -> str:
    """``devicemq/application/{client_id}/lag`` (under ``$SYS/broker/``), the client
    ID one level, escaped as in :func:`presence_topic`."""
    return f"devicemq/application/{client_id.translate(_ESCAPES)}/lag"


def node_name(settings: Settings) -> str:
    """``{node}`` of the presence topics: the cluster's node id, else a stable name."""
    if settings.cluster.enabled:
        return node_id_of(settings)
    return settings.cluster.node_id or socket.gethostname()


def presence_topic(node: str, client_id: str, event: str) -> str:
    """``$SYS/brokers/{node}/clients/{client_id}/{event}``, each name one level."""
    node, client_id = node.translate(_ESCAPES), client_id.translate(_ESCAPES)
    return f"$SYS/brokers/{node}/clients/{client_id}/{event}"


def _who(
    client_id: str, username: str | None, address: str, protocol_level: int
) -> dict[str, object]:
    """The fields both presence events start with."""
    return {
        "clientid": client_id,
        "username": username,
        "ipaddress": address,
        "proto_name": _PROTOCOL_NAMES.get(protocol_level, "MQTT"),
        "proto_ver": protocol_level,
    }


def connected_payload(
    client_id: str,
    username: str | None,
    address: str,
    protocol_level: int,
    keep_alive: int,
    clean_start: bool,
    expiry_interval: int,
    at_ms: int,
) -> bytes:
    """EMQX's ``client_connected`` event body (the fields devicemq knows)."""
    return orjson.dumps(
        {
            **_who(client_id, username, address, protocol_level),
            "keepalive": keep_alive,
            "clean_start": clean_start,
            "expiry_interval": expiry_interval,
            "connected_at": at_ms,
            "ts": at_ms,
        }
    )


def disconnected_payload(
    client_id: str, username: str | None, address: str, protocol_level: int, reason: str, at_ms: int
) -> bytes:
    """EMQX's ``client_disconnected`` event body. ``reason``: ``normal`` (the client's
    DISCONNECT), ``connection_lost``, a server DISCONNECT's reason code name
    (``session_taken_over``, ``keep_alive_timeout``, ...), or ``closed``."""
    return orjson.dumps(
        {
            **_who(client_id, username, address, protocol_level),
            "reason": reason,
            "disconnected_at": at_ms,
            "ts": at_ms,
        }
    )


def _ignore(ok: bool) -> None:
    """QoS 0: nobody waits for these."""


class SysHost(Protocol):
    """What ``$SYS`` uses of the broker (``Broker`` is one)."""

    @property
    def clock(self) -> Callable[[], float]: ...
    @property
    def wall_clock(self) -> Callable[[], float]: ...
    @property
    def stats(self) -> BrokerStats: ...
    @property
    def sessions(self) -> dict[str, Session]: ...
    @property
    def retained(self) -> RetainedStore: ...
    def resolve(self, message: Message) -> list[tuple[Session | GroupTarget, Delivery]]: ...
    def dispatch(
        self,
        targets: Sequence[tuple[Session | GroupTarget, Delivery]],
        on_accepted: Callable[[bool], None],
    ) -> None: ...


class SysTopics:
    """Publishes the broker's ``$SYS`` messages through its own routing (sans IO:
    the caller says when; time comes from the broker's clocks)."""

    def __init__(self, broker: SysHost, node: str) -> None:
        self.broker = broker
        self.node = node
        self.wall: Callable[[], float] = broker.wall_clock
        self.started = broker.clock()
        self._published: set[str] = set()  # topics of the last publish_numbers

    def numbers(
        self,
        backlog: int | None = None,
        lag: int | None = None,
        application: Mapping[str, tuple[int, float | None]] | None = None,
    ) -> SysNumbers:
        """This broker's numbers now; other replicas' sessions are not counted."""
        broker = self.broker
        stats = broker.stats
        total = connected = subscriptions = 0
        for session in broker.sessions.values():
            if isinstance(session, RemoteSession):
                continue
            total += 1
            connected += session.connection is not None
            subscriptions += len(session.subscriptions)
        return SysNumbers(
            uptime=broker.clock() - self.started,
            clients_connected=connected,
            clients_total=total,
            messages_received=sum(stats.messages_received),
            messages_sent=sum(stats.messages_sent),
            bytes_received=stats.bytes_received,
            bytes_sent=stats.bytes_sent,
            subscriptions=subscriptions,
            retained=len(broker.retained),
            persisted_backlog=backlog,
            kafka_consumer_lag=lag,
            application_lag=application,
        )

    def publish_numbers(
        self,
        backlog: int | None = None,
        lag: int | None = None,
        application: Mapping[str, tuple[int, float | None]] | None = None,
    ) -> None:
        """Publish ``$SYS/broker/...``: kept retained here, sent to sessions connected here.
        A topic of the last publish that is not in this one (an APPLICATION session that
        ended) is removed: a zero-length retained message (MQTT-3.3.1-10)."""
        broker = self.broker
        messages = sys_messages(self.numbers(backlog, lag, application))
        published = {topic for topic, _ in messages}
        for topic in sorted(self._published - published):
            broker.retained.drop_own(topic)
            self._send(Message(topic, b"", 0, True))
        self._published = published
        for topic, payload in messages:
            message = Message(topic, payload, 0, True)
            broker.retained.keep_own(message)
            self._send(message)

    def _send(self, message: Message) -> None:
        """To the sessions connected here (``$SYS/broker`` is this process's own)."""
        broker = self.broker
        targets = [
            (session, delivery)
            for session, delivery in broker.resolve(message)
            if not isinstance(session, RemoteSession)
        ]
        broker.dispatch(targets, _ignore)

    def connected(self, conn: MQTTConnection, session: Session, clean_start: bool) -> None:
        payload = connected_payload(
            session.client_id,
            conn.username,
            conn.address,
            conn.protocol_level,
            conn.keep_alive,
            clean_start,
            session.expiry_interval,
            self._now_ms(),
        )
        self._presence(session.client_id, "connected", payload)

    def disconnected(self, conn: MQTTConnection, session: Session) -> None:
        payload = disconnected_payload(
            session.client_id,
            conn.username,
            conn.address,
            conn.protocol_level,
            conn.close_reason or "closed",
            self._now_ms(),
        )
        self._presence(session.client_id, "disconnected", payload)

    def _presence(self, client_id: str, event: str, payload: bytes) -> None:
        topic = presence_topic(self.node, client_id, event)
        if len(topic.encode()) > MAX_TOPIC_BYTES:
            log.debug("no %s event for %.40s...: its topic would be too long", event, client_id)
            return
        broker = self.broker
        message = Message(topic, payload, 0, False)
        broker.dispatch(broker.resolve(message), _ignore)

    def _now_ms(self) -> int:
        return int(self.wall() * 1000)
