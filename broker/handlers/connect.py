"""CONNECT (spec 3.1) and the CONNACK that answers it (spec 3.2)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from broker.auth import AuthResult
from broker.connection_state import ConnectionState, WillMessage
from broker.ecq import consumer_filter, is_queue_topic
from broker.errors import MQTTError
from broker.group_queue import is_group_filter
from broker.limits import topic_within_limits
from broker.message import Message, forwarded_properties, is_utf8
from broker.packets import ConnAck, Connect, ConnectReturnCode, Properties, ReasonCode
from broker.session import Session
from broker.topics import is_valid_topic_name

if TYPE_CHECKING:
    from collections.abc import Callable

    from broker.acl import Authorizer
    from broker.auth import Authenticator
    from broker.blocklist import BlockEntry
    from broker.cluster import ClusterState
    from broker.config import Settings
    from broker.connection import MQTTConnection
    from broker.limits import LogLimiter
    from broker.persistent_path import PersistentPath
    from broker.stats import BrokerStats
    from broker.topics import SubscriptionTree

log = logging.getLogger("devicemq.connect")


class ConnectHost(Protocol):
    """What the CONNECT handler uses of the broker."""

    @property
    def settings(self) -> Settings: ...
    @property
    def clock(self) -> Callable[[], float]: ...
    @property
    def stats(self) -> BrokerStats: ...
    @property
    def auth(self) -> Authenticator: ...
    @property
    def acl(self) -> Authorizer: ...
    @property
    def refusal_log(self) -> LogLimiter: ...
    @property
    def subscriptions(self) -> SubscriptionTree: ...
    @property
    def persistent_path(self) -> PersistentPath: ...
    @property
    def cluster(self) -> ClusterState | None: ...
    def connect_allowed(self, source: str) -> str | None: ...
    def blocked(self, client_id: str, username: str | None, address: str) -> BlockEntry | None: ...
    def flapping(self, client_id: str) -> BlockEntry | None: ...
    def ban(self, entry: BlockEntry) -> None: ...
    def assign_client_id(self) -> str: ...
    def client_id_refusal(self, conn: MQTTConnection, client_id: str) -> str: ...
    def claim_client_id(
        self, conn: MQTTConnection, client_id: str, then: Callable[[str], None]
    ) -> None: ...
    def claim_queue(self, conn: MQTTConnection, then: Callable[[str], None]) -> None: ...
    def connect_began(self, conn: MQTTConnection, client_id: str) -> None: ...
    def connect_settled(self, conn: MQTTConnection, client_id: str) -> None: ...
    def watch_connection(self, conn: MQTTConnection, when: float) -> None: ...
    def open_session(
        self,
        conn: MQTTConnection,
        client_id: str,
        clean_start: bool,
        expiry_interval: int,
        then: Callable[[Session | None, bool, str], None],
    ) -> None: ...
    def consume_queue(self, session: Session) -> bool: ...
    def join_group(self, session: Session, topic_filter: str) -> None: ...
    def restore_queue_inflight(self, session: Session) -> None: ...
    def restore_group_writes(self, session: Session) -> None: ...


# 3.1.1 has six return codes; 5.0 reasons without an equivalent close the socket.
_V3_RETURN_CODES = {
    ReasonCode.UNSUPPORTED_PROTOCOL_VERSION: ConnectReturnCode.UNACCEPTABLE_PROTOCOL_VERSION,
    ReasonCode.CLIENT_IDENTIFIER_NOT_VALID: ConnectReturnCode.IDENTIFIER_REJECTED,
    ReasonCode.SERVER_UNAVAILABLE: ConnectReturnCode.SERVER_UNAVAILABLE,
    ReasonCode.SERVER_BUSY: ConnectReturnCode.SERVER_UNAVAILABLE,
    ReasonCode.BAD_USER_NAME_OR_PASSWORD: ConnectReturnCode.BAD_USER_NAME_OR_PASSWORD,
    ReasonCode.NOT_AUTHORIZED: ConnectReturnCode.NOT_AUTHORIZED,
    ReasonCode.CONNECTION_RATE_EXCEEDED: ConnectReturnCode.SERVER_UNAVAILABLE,
    ReasonCode.QUOTA_EXCEEDED: ConnectReturnCode.SERVER_UNAVAILABLE,
    ReasonCode.BANNED: ConnectReturnCode.NOT_AUTHORIZED,
}


class ConnectRefused(Exception):
    """The CONNECT is well formed but cannot be accepted: answer CONNACK ``reason``.

    ``counter`` is the rejected-connections reason it is counted under
    (default: the reason code's name), to tell limits sharing a code apart.
    """

    def __init__(self, reason: ReasonCode, message: str, counter: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.counter = counter or reason.name.lower()


def handle_connect(conn: MQTTConnection, packet: Connect) -> None:
    if conn.state is not ConnectionState.AWAITING_CONNECT:
        raise MQTTError(ReasonCode.PROTOCOL_ERROR, "second CONNECT")  # MQTT-3.1.0-2
    conn.protocol_level = packet.protocol_level
    # The block list before anything else: a banned client costs one lookup, never
    # an argon2 hash, and takes nothing from the connection rates below. Asked
    # again once authentication names the user (_authenticated).
    blocked = conn.broker.blocked(packet.client_id, packet.username, conn.address)
    if blocked is not None:
        _refuse(conn, _banned(blocked))
        return
    # mqtt.max_connection_rate_per_source, then mqtt.max_connection_rate: before any
    # password work, and one address cannot use up the broker-wide rate.
    over = conn.broker.connect_allowed(conn.source)
    if over is not None:
        limit = (
            "its address's connection rate" if over.endswith("per_source") else "connection rate"
        )
        _refuse(conn, ConnectRefused(ReasonCode.CONNECTION_RATE_EXCEEDED, limit, over))
        return
    # Authentication may hash a password in a worker thread: whatever the
    # client sends meanwhile waits in the connection until CONNACK is decided.
    conn.hold_input()
    conn.broker.auth.authenticate(
        packet.username,
        packet.password,
        conn.peer_certificate,
        lambda result: _authenticated(conn, packet, result),
        conn.source,
        lambda: conn.state is ConnectionState.AWAITING_CONNECT,
        packet.client_id,
        conn.address,
    )


def _authenticated(conn: MQTTConnection, packet: Connect, result: AuthResult) -> None:
    refusal = None
    if not result.ok:
        who = f"client {packet.client_id!r}" + (
            f" user {packet.username!r}" if packet.username is not None else ""
        )
        refusal = ConnectRefused(result.reason, f"{who}: {result.message}", result.counter)
    if conn.state is not ConnectionState.AWAITING_CONNECT:
        # The socket closed (or timed out) while the password was checked, or
        # before it was: nobody to answer, but a failed attempt is still counted
        # and logged like any other (SECURITY.md: every failure is).
        if refusal is not None:
            _count_refusal(conn, refusal, " (the client was gone)")
        return
    try:
        if refusal is not None:
            raise refusal
        conn.username = result.username
        conn.grant = result.grant
        # Who the client is is known now: a username entry also names a user whose
        # identity came from its certificate. Flapping is counted later, once the
        # client ID and its session are known to be this client's (_opened).
        blocked = conn.broker.blocked(packet.client_id, conn.username, conn.address)
        if blocked is not None:
            raise _banned(blocked)
        _accept(conn, packet)
    except ConnectRefused as refusal:
        _refuse(conn, refusal)


def _banned(entry: BlockEntry) -> ConnectRefused:
    return ConnectRefused(ReasonCode.BANNED, f"blocked ({entry.key})", "banned")


def _accept(conn: MQTTConnection, packet: Connect) -> None:
    broker: ConnectHost = conn.broker
    mqtt = broker.settings.mqtt
    v5 = conn.is_v5
    properties = packet.properties or Properties()
    if properties.authentication_method is not None:
        raise ConnectRefused(
            ReasonCode.BAD_AUTHENTICATION_METHOD,
            f"authentication method {properties.authentication_method!r} is not supported",
        )

    client_id = packet.client_id
    assigned = None
    if not client_id:
        if not v5 and not packet.clean_start:
            # MQTT-3.1.3-8: a 3.1.1 client without an id must start clean.
            raise ConnectRefused(ReasonCode.CLIENT_IDENTIFIER_NOT_VALID, "empty client id")
        client_id = assigned = broker.assign_client_id()
    if len(client_id.encode()) > mqtt.max_client_id_length:  # a length in bytes
        raise ConnectRefused(ReasonCode.CLIENT_IDENTIFIER_NOT_VALID, "client id too long")
    not_users = broker.client_id_refusal(conn, client_id) if assigned is None else ""
    if not_users:  # auth.client_id_owner username: the ID is not this user's
        raise ConnectRefused(
            ReasonCode.CLIENT_IDENTIFIER_NOT_VALID, not_users, "client_id_not_the_users"
        )

    will = _will(conn, packet, client_id)
    acl = broker.acl
    if will is not None and not acl.may_publish(
        client_id, conn.username, will.grant, will.message.topic
    ):
        raise ConnectRefused(ReasonCode.NOT_AUTHORIZED, f"will topic {will.message.topic!r} denied")

    if v5:
        requested_expiry = properties.session_expiry_interval or 0
    else:
        requested_expiry = 0 if packet.clean_start else mqtt.max_session_expiry_interval
    expiry = min(requested_expiry, mqtt.max_session_expiry_interval)

    keep_alive = packet.keep_alive
    server_keep_alive = None
    if keep_alive > mqtt.max_keep_alive:
        if not v5:
            # 3.1.1 cannot announce a shorter keep alive (no Server Keep Alive), and
            # enforcing one silently times out a client that pings on time.
            # Refused as Mosquitto refuses it (max_keepalive), with return code 2.
            raise ConnectRefused(
                ReasonCode.CLIENT_IDENTIFIER_NOT_VALID, "keep alive above max_keep_alive"
            )
        keep_alive = server_keep_alive = mqtt.max_keep_alive

    conn.client_id = client_id
    conn.keep_alive = keep_alive
    if properties.receive_maximum is not None:
        conn.client_receive_maximum = properties.receive_maximum
    if properties.maximum_packet_size is not None:
        conn.client_max_packet_size = properties.maximum_packet_size
    if properties.topic_alias_maximum is not None:
        conn.client_topic_alias_maximum = properties.topic_alias_maximum
    conn.request_problem_information = properties.request_problem_information != 0

    def opened(session: Session | None, present: bool, refused: str) -> None:
        _opened(
            conn,
            packet,
            session,
            present,
            refused,
            will,
            assigned,
            requested_expiry,
            server_keep_alive,
        )

    def claimed(refused: str) -> None:
        if conn.state is not ConnectionState.AWAITING_CONNECT:
            return  # the socket closed while the claim was asked
        if refused:
            opened(None, False, f"client_id_{refused}")
            return
        broker.open_session(conn, client_id, packet.clean_start, expiry, opened)

    broker.connect_began(conn, client_id)
    if assigned is not None:  # random: nobody else's, and not worth a claim
        claimed("")
    else:  # auth.client_id_owner first: the ID must be this owner's, or free
        broker.claim_client_id(conn, client_id, claimed)


def _opened(
    conn: MQTTConnection,
    packet: Connect,
    session: Session | None,
    present: bool,
    refused: str,
    will: WillMessage | None,
    assigned: str | None,
    requested_expiry: int,
    server_keep_alive: int | None,
) -> None:
    """The session is open (or its store could not be reached): answer CONNACK."""
    assert conn.client_id is not None
    conn.broker.connect_settled(conn, conn.client_id)
    if conn.state is not ConnectionState.AWAITING_CONNECT:
        return  # the socket closed while the session was opened
    if session is None:
        if refused == "client_id_not_owner":
            who = f"user {conn.username!r}" if conn.username is not None else "anonymous"
            refusal = ConnectRefused(
                ReasonCode.NOT_AUTHORIZED,
                f"client id {conn.client_id!r} belongs to another owner ({who}; "
                "auth.client_id_owner: first)",
                "client_id_owned_by_another",
            )
        elif refused == "not_owner":
            who = f"user {conn.username!r}" if conn.username is not None else "anonymous"
            refusal = ConnectRefused(
                ReasonCode.NOT_AUTHORIZED,
                f"client id {conn.client_id!r} belongs to another owner's session ({who})",
                "session_owned_by_another",
            )
        elif refused == "owner_quota":
            refusal = ConnectRefused(
                ReasonCode.QUOTA_EXCEEDED,
                f"{conn.username!r} holds auth.max_sessions_per_owner sessions already",
                "max_sessions_per_owner",
            )
        elif refused == "owner_budget":
            refusal = ConnectRefused(
                ReasonCode.QUOTA_EXCEEDED,
                f"{conn.username!r} holds more stored messages than "
                "auth.max_bytes_per_owner: no new persistent session",
                "max_bytes_per_owner",
            )
        else:
            refusal = ConnectRefused(
                ReasonCode.SERVER_UNAVAILABLE, "the session store is unreachable"
            )
        _refuse(conn, refusal)
        return
    broker: ConnectHost = conn.broker
    client_id = session.client_id
    # Counted only now that the client proved who it is and may use the client ID and
    # its session: nobody gets another client banned by connecting with its ID.
    flapping = broker.flapping(client_id)
    if flapping is not None:
        _refuse(conn, _banned(flapping))
        broker.ban(flapping)
        return
    mqtt = broker.settings.mqtt
    v5 = conn.is_v5
    expiry = session.expiry_interval
    broker.acl.client_connected(client_id, conn.username, conn.grant)
    conn.will = will
    conn.state = ConnectionState.CONNECTED
    # Its keep-alive (MQTT-3.1.2-22) and in-flight deadlines from the next tick on.
    broker.watch_connection(conn, broker.clock())
    ack_properties = None
    if v5:
        ack_properties = Properties(
            receive_maximum=mqtt.receive_maximum if mqtt.receive_maximum != 65535 else None,
            maximum_qos=mqtt.maximum_qos if mqtt.maximum_qos < 2 else None,
            retain_available=None if mqtt.retain_available else 0,
            maximum_packet_size=mqtt.max_packet_size,
            assigned_client_identifier=assigned,
            topic_alias_maximum=mqtt.topic_alias_maximum or None,
            wildcard_subscription_available=None if mqtt.wildcard_subscriptions else 0,
            subscription_identifier_available=None if mqtt.subscription_identifiers else 0,
            shared_subscription_available=None if mqtt.shared_subscriptions else 0,
            server_keep_alive=server_keep_alive,
            session_expiry_interval=expiry if expiry != requested_expiry else None,
        )
    conn.send(ConnAck(present, ReasonCode.SUCCESS, ack_properties))
    log.info(
        "client %s connected from %s (MQTT %s, %s session%s)",
        client_id,
        conn.peer,
        {3: "3.1", 4: "3.1.1", 5: "5.0"}[conn.protocol_level],
        "persistent" if session.outlives_connection else "clean",
        ", resumed" if present else "",
    )
    if present and session.durable:
        # Group writes it may still hold from before this process: back in flight under
        # their packet ids before any identifier is given (finding 35).
        broker.restore_group_writes(session)
    session.outflow.resume()
    if consumer_filter(client_id) in session.subscriptions:
        _resume_queue(conn, session)  # a resumed session consuming its queue
    elif present and session.durable:
        conn.broker.restore_queue_inflight(session)  # queue entries it may still hold
    for topic_filter in session.subscriptions:
        if is_group_filter(topic_filter):
            conn.broker.join_group(session, topic_filter)  # a member of a group queue again
    conn.release_input()


def _resume_queue(conn: MQTTConnection, session: Session) -> None:
    """A resumed session holds ``$ECQ/{cid}/#``: the queue is delivered again only if
    its read rule and its owner still let this client (broker/ownership.py); else the
    subscription goes, as if refused at SUBSCRIBE, and the entries wait for the
    owner. An unreachable claim store delivers nothing until the next connection."""
    broker: ConnectHost = conn.broker

    def claimed(refused: str) -> None:
        topic_filter = consumer_filter(session.client_id)
        if conn.session is not session or topic_filter not in session.subscriptions:
            return  # gone meanwhile, or unsubscribed
        if not refused:
            broker.consume_queue(session)
            return
        client_id = session.client_id
        if refused == "unavailable":
            log.warning("client %s: its queue's owner could not be checked", client_id)
            return
        log.info("client %s may no longer consume its queue (%s)", client_id, refused)
        broker.stats.drop("ecq_subscribe_refused")
        session.subscriptions.pop(topic_filter, None)
        broker.subscriptions.remove(client_id, topic_filter)
        if broker.cluster is not None:
            broker.cluster.unsubscribed(session, topic_filter)
        if session.durable:
            broker.persistent_path.save_session(session, _ignore)

    broker.claim_queue(conn, claimed)


def _ignore(ok: bool) -> None:
    """A session saved with nobody waiting on it."""


def _will(conn: MQTTConnection, packet: Connect, client_id: str) -> WillMessage | None:
    will = packet.will
    if will is None:
        return None
    mqtt = conn.broker.settings.mqtt
    if not is_valid_topic_name(will.topic):
        raise ConnectRefused(ReasonCode.TOPIC_NAME_INVALID, "invalid will topic")
    if is_queue_topic(will.topic):
        # $ECQ topics are queue writes, acknowledged once in Kafka: a will is neither.
        raise ConnectRefused(ReasonCode.TOPIC_NAME_INVALID, "a will cannot go to an $ECQ/ topic")
    if not topic_within_limits(will.topic, mqtt.max_topic_length, mqtt.max_topic_levels):
        raise ConnectRefused(ReasonCode.TOPIC_NAME_INVALID, "will topic beyond the topic limits")
    if will.qos > mqtt.maximum_qos:
        raise ConnectRefused(ReasonCode.QOS_NOT_SUPPORTED, "will QoS above maximum")
    if will.retain and not mqtt.retain_available:
        raise ConnectRefused(ReasonCode.RETAIN_NOT_SUPPORTED, "retained will not available")
    properties = will.properties
    delay = 0
    expiry_interval = None
    forwarded = None
    if properties is not None:
        delay = properties.will_delay_interval or 0
        expiry_interval = properties.message_expiry_interval
        forwarded = forwarded_properties(properties)
        if properties.payload_format_indicator == 1 and not is_utf8(will.payload):
            raise ConnectRefused(ReasonCode.PAYLOAD_FORMAT_INVALID, "will payload is not UTF-8")
    message = Message(
        will.topic,
        will.payload,
        will.qos,
        will.retain,
        origin=packet.client_id or None,
        properties=forwarded,
    )
    return WillMessage(message, delay, expiry_interval, client_id, conn.username, conn.grant)


def _count_refusal(conn: MQTTConnection, refusal: ConnectRefused, note: str = "") -> None:
    """Every refusal is counted; its log line goes through the rate-limited log."""
    broker: ConnectHost = conn.broker
    broker.stats.reject(refusal.counter)
    broker.refusal_log.log(
        broker.clock(), logging.INFO, "connection from %s refused: %s%s", conn.peer, refusal, note
    )


def _refuse(conn: MQTTConnection, refusal: ConnectRefused) -> None:
    _count_refusal(conn, refusal)
    if conn.is_v5:
        conn.send(ConnAck(False, refusal.reason))
    elif refusal.reason in _V3_RETURN_CODES:
        conn.send(ConnAck(False, _V3_RETURN_CODES[refusal.reason]))
    conn.close(publish_will=False)
