"""PUBLISH and PUBREL from the client: the incoming QoS 0, 1 and 2 flows (spec 3.3, 4.3)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Protocol

from broker.budget import BYTES_LIMIT, QUEUE
from broker.connection_state import PendingAck
from broker.ecq import (
    SEQ_PROPERTY,
    TopicKind,
    classify,
    consumer_topic,
    parse_rewind,
    valid_client_id,
)
from broker.errors import MQTTError
from broker.integrations import Refusal
from broker.limits import topic_within_limits
from broker.message import Delivery, Message, forwarded_properties, is_utf8
from broker.packets import PubAck, PubComp, Publish, PubRec, PubRel, ReasonCode
from broker.session import Session

if TYPE_CHECKING:
    from collections.abc import Sequence

    from broker.acl import Authorizer
    from broker.budget import OwnerBudget
    from broker.cluster import ClusterState
    from broker.config import Settings
    from broker.connection import MQTTConnection
    from broker.group_queue import GroupTarget
    from broker.integrations import IntegrationRecord
    from broker.persistent_path import PersistentPath
    from broker.retained import RetainedStore
    from broker.stats import BrokerStats

log = logging.getLogger("devicemq.publish")
# Module constants for the per-publish path: on Python 3.11 a look-up of a member on
# an Enum class costs about 120 ns (BENCHMARKS.md, "Enum members").
_SUCCESS, _NO_MATCHING_SUBSCRIBERS = ReasonCode.SUCCESS, ReasonCode.NO_MATCHING_SUBSCRIBERS
_PLAIN = TopicKind.PLAIN


class PublishHost(Protocol):
    """What the PUBLISH and PUBREL handlers use of the broker."""

    @property
    def settings(self) -> Settings: ...
    @property
    def cluster(self) -> ClusterState | None: ...
    @property
    def clock(self) -> Callable[[], float]: ...
    @property
    def stats(self) -> BrokerStats: ...
    @property
    def acl(self) -> Authorizer: ...
    @property
    def retained(self) -> RetainedStore: ...
    @property
    def persistent_path(self) -> PersistentPath: ...
    @property
    def budget(self) -> OwnerBudget: ...
    def resolve(self, message: Message) -> list[tuple[Session | GroupTarget, Delivery]]: ...
    def dispatch(
        self,
        targets: Sequence[tuple[Session | GroupTarget, Delivery]],
        on_accepted: Callable[[bool], None],
        retained: bool = False,
        on_settled: Callable[[bool], None] | None = None,
    ) -> None: ...
    def integration_records(
        self, message: Message, client_id: str, username: str | None
    ) -> list[IntegrationRecord]: ...
    def integrate(
        self,
        records: Sequence[IntegrationRecord],
        on_accepted: Callable[[bool], None],
        on_settled: Callable[[bool], None] | None = None,
        *,
        best_effort: bool = False,
    ) -> Refusal | None: ...


def handle_publish(conn: MQTTConnection, packet: Publish) -> None:
    broker: PublishHost = conn.broker
    if packet.qos:
        cluster = broker.cluster
        if cluster is not None and not cluster.current:
            # This replica may not know a subscription another one acknowledged: the
            # PUBLISH waits, with what follows it, until it does (finding 39).
            conn.wait_for_cluster(packet, cluster)
            return
    session = conn.session
    assert session is not None
    mqtt = broker.settings.mqtt
    qos = packet.qos
    broker.stats.messages_received[qos] += 1
    broker.stats.payload_bytes_received[qos] += len(packet.payload)
    bucket = conn.publish_bucket
    if bucket is not None and not bucket.take(broker.clock()):
        broker.stats.drop("message_rate_too_high")
        raise MQTTError(ReasonCode.MESSAGE_RATE_TOO_HIGH, "above mqtt.max_publish_rate")
    if qos > mqtt.maximum_qos:
        raise MQTTError(ReasonCode.QOS_NOT_SUPPORTED, f"QoS {qos} above maximum")  # MQTT-3.2.2-11
    if packet.retain and not mqtt.retain_available:
        raise MQTTError(ReasonCode.RETAIN_NOT_SUPPORTED, "retain is not available")  # 3.2.2-14
    if packet.properties is not None and packet.properties.subscription_identifiers:
        # Only the server puts Subscription Identifiers in a PUBLISH (MQTT-3.3.4-6).
        raise MQTTError(ReasonCode.PROTOCOL_ERROR, "subscription identifier in a client PUBLISH")
    topic = packet.topic if packet.properties is None else _resolve_topic(conn, packet)
    packet_id = packet.packet_id
    if qos == 2 and packet_id in session.incoming_qos2:
        # Already counted in the Receive Maximum: a re-send is not a new message.
        _qos2_retransmission(conn, session, packet_id)
        return
    if qos and conn.is_v5 and conn.incoming_in_flight() >= mqtt.receive_maximum:
        raise MQTTError(ReasonCode.RECEIVE_MAXIMUM_EXCEEDED, "too many unacknowledged PUBLISH")
    properties = packet.properties
    if (
        properties is not None
        and properties.payload_format_indicator == 1
        and not is_utf8(packet.payload)
    ):
        _refuse(conn, packet, ReasonCode.PAYLOAD_FORMAT_INVALID)  # spec 3.3.2.3.2
        return
    # Asked without an ACL file too: $SYS is read-only for clients (Authorizer.can_publish).
    if not broker.acl.can_publish(conn.client_id or "", conn.username, topic):
        _denied(conn, session, packet, topic)
        return
    if not topic_within_limits(topic, mqtt.max_topic_length, mqtt.max_topic_levels):
        _denied(conn, session, packet, topic, ReasonCode.TOPIC_NAME_INVALID, "topic_limit")
        return
    expires_at = forwarded = None
    if properties is not None:
        expiry = properties.message_expiry_interval
        if expiry is not None:
            expires_at = broker.clock() + expiry
        forwarded = forwarded_properties(properties)
    # Positional: a dataclass's keyword arguments cost more per message.
    message = Message(
        topic, packet.payload, qos, packet.retain, conn.client_id, forwarded, expires_at
    )
    kind, queue, key = classify(topic)
    if kind is not _PLAIN:
        _to_queue(conn, session, packet, message, kind, queue, key)
        return
    if packet.retain:
        over = broker.retained.over_limit(message)
        if over is not None:
            # mqtt.max_retained_*: the PUBLISH is refused, like one the ACL denies
            # (MQTT 5 QoS 1/2: 0x97 Quota exceeded; else acknowledged and dropped).
            _denied(conn, session, packet, topic, ReasonCode.QUOTA_EXCEEDED, over)
            return
    targets = broker.resolve(message)
    # Only what the ACL let through reaches a rule (the check above).
    records = broker.integration_records(message, conn.client_id or "", conn.username)
    if qos == 0:
        if packet.retain:
            broker.retained.store(message)
        broker.dispatch(targets, _no_ack)
        if records:
            # Best effort, as every QoS 0 delivery: no re-send comes, so the records
            # that can be made are (a rule whose topic is missing loses its own).
            broker.integrate(records, _no_ack, best_effort=True)
        return
    assert packet_id is not None
    matched = targets or records
    reason = _SUCCESS if matched else _NO_MATCHING_SUBSCRIBERS
    if qos == 2:
        session.incoming_qos2[packet_id] = False
    ack = conn.expect_ack(packet_id, qos, reason if conn.is_v5 else 0)
    delivered: _Delivered | None = None
    settled = None
    if qos == 2 and not conn.is_v5:
        # A re-send of a message its subscribers already have (its records failed):
        # only the records are made again.
        delivered = _Delivered(packet_id in session.qos2_delivered)
        session.qos2_delivered.discard(packet_id)
        settled = partial(_settled, session, packet_id, delivered)
    done: Callable[[bool], None]
    if qos == 1:
        done = partial(conn.ack_ready, ack)  # as _accepted does at QoS 1, two calls less
    else:
        done = lambda ok: _accepted(conn, session, ack, ok)  # noqa: E731
    if not packet.retain and not records:
        if delivered is not None and delivered.ok:
            done(True)  # delivered before; no rule takes it now
        else:
            broker.dispatch(targets, done, on_settled=settled)  # the deliveries alone
        return
    # Acknowledged once every part has it: the integration records (the user's Kafka
    # topics), the retained message (Redis, with persistence) and the deliveries
    # (Kafka, with persistence); a failure of any fails the PUBLISH.
    join = _Join(done, settled)
    if records:
        on_accepted, on_settled = join.part(settles=True)
        refused = broker.integrate(records, on_accepted, on_settled)
        if refused is not None:
            # Refused before anything was handed to Kafka: nothing of the PUBLISH is
            # taken (no delivery, no retained message), so the client's re-send is
            # the first copy anyone gets.
            _integration_refused(conn, session, ack, refused, delivered)
            return
    if packet.retain:
        broker.retained.store(message, join.part(settles=False)[0])
    if delivered is not None and delivered.ok:
        join.close()
        return
    on_accepted, on_settled = join.part(settles=True)
    if delivered is not None:
        on_accepted, on_settled = delivered.watch(on_accepted, on_settled)
    broker.dispatch(targets, on_accepted, on_settled=on_settled)
    join.close()


class _Delivered:
    """Whether a 3.1.1 QoS 2 message reached its subscribers for good (its deliveries'
    final outcome was a success), whatever became of its other parts."""

    __slots__ = ("ok",)

    def __init__(self, ok: bool) -> None:
        self.ok = ok

    def watch(
        self, on_accepted: Callable[[bool], None], on_settled: Callable[[bool], None] | None
    ) -> tuple[Callable[[bool], None], Callable[[bool], None] | None]:
        """The deliveries' completions, noting a final success here first."""

        def accepted(ok: bool) -> None:
            self.ok = self.ok or ok
            on_accepted(ok)

        if on_settled is None:
            return accepted, None
        settled_part = on_settled

        def settled(ok: bool) -> None:
            self.ok = self.ok or ok
            settled_part(ok)

        return accepted, settled


def _integration_refused(
    conn: MQTTConnection,
    session: Session,
    ack: PendingAck,
    refused: Refusal,
    delivered: _Delivered | None,
) -> None:
    """The sink refused the records at once: the publisher hears it (MQTT 5: 0x80, or
    0x97 when too much waits for Kafka; 3.1.1: the connection is closed and the
    client sends again)."""
    if refused is Refusal.FULL and conn.is_v5:
        ack.reason = ReasonCode.QUOTA_EXCEEDED
    _accepted(conn, session, ack, False)
    if delivered is not None:
        _settled(session, ack.packet_id, delivered, False)  # final: nothing was taken


def _to_queue(
    conn: MQTTConnection,
    session: Session,
    packet: Publish,
    message: Message,
    kind: TopicKind,
    queue: str,
    key: str,
) -> None:
    """A PUBLISH to an ``$ECQ/`` topic (broker/ecq.py): a write to a queue, or its
    consumer's rewind. Acknowledged as any persistent delivery: once Kafka has it."""
    broker: PublishHost = conn.broker
    if not broker.persistent_path.keeps_queues:
        # ecq.enabled false, or no persistence: a queue that a restart empties is none.
        log.warning(
            "client %s published to %r: no $ECQ queues here (ecq.enabled, persistence.enabled)",
            conn.client_id,
            message.topic,
        )
        broker.stats.drop("ecq_unavailable")
        if packet.qos and packet.packet_id is not None:
            # Never a success for a write nobody keeps: MQTT 5 hears 0x83; 3.1.1 has no
            # failure code, so its connection is closed (ack_ready), as for a failed store.
            reason = ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR
            if packet.qos == 2:
                session.incoming_qos2.pop(packet.packet_id, None)
            conn.ack_ready(conn.expect_ack(packet.packet_id, packet.qos, reason), conn.is_v5)
        return
    if kind is TopicKind.INVALID or not valid_client_id(queue):
        _denied(conn, session, packet, message.topic, ReasonCode.TOPIC_NAME_INVALID, "ecq_topic")
        return
    if kind is TopicKind.REWIND:
        if conn.client_id != queue:  # only the queue's consumer rewinds it
            _denied(conn, session, packet, message.topic)
            return
        seq = parse_rewind(message.payload.decode("ascii", "replace"))
        if seq is None:
            reason = ReasonCode.PAYLOAD_FORMAT_INVALID
            _denied(conn, session, packet, message.topic, reason, "ecq_rewind")
            return
        broker.persistent_path.rewind_queue(queue, seq)
        if packet.qos and packet.packet_id is not None:
            if packet.qos == 2:
                session.incoming_qos2[packet.packet_id] = False
            ack = conn.expect_ack(packet.packet_id, packet.qos, ReasonCode.SUCCESS)
            _accepted(conn, session, ack, True)
        return
    # Stored for the queue's consumer under its own topic, at QoS 1, never retained;
    # ``seq`` is the broker's to give (a producer's own would mislead the consumer).
    properties = message.properties
    if properties is not None and any(k == SEQ_PROPERTY for k, _ in properties.user_properties):
        properties = replace(
            properties,
            user_properties=tuple(p for p in properties.user_properties if p[0] != SEQ_PROPERTY),
        )
    stored = Message(
        consumer_topic(queue, key),
        message.payload,
        1,
        False,
        origin=message.origin,
        properties=properties,
        expires_at=message.expires_at,
    )
    delivery = Delivery(stored, 1, False, ())
    qos, packet_id = packet.qos, packet.packet_id
    if broker.persistent_path.queue_full(queue):
        _queue_full(conn, packet, queue, "ecq.max_bytes, max_queues")
        return
    if queue in broker.budget.over_queues:  # its owner holds too much already
        broker.budget.refused(QUEUE, BYTES_LIMIT)
        _queue_full(conn, packet, queue, "auth.max_bytes_per_owner")
        return
    if qos == 0 or packet_id is None:
        broker.persistent_path.enqueue(queue, delivery, _no_ack)
        return
    if qos == 2:
        session.incoming_qos2[packet_id] = False
    ack = conn.expect_ack(packet_id, qos, ReasonCode.SUCCESS)
    settled = None
    if qos == 2 and not conn.is_v5:
        settled = partial(_settled, session, packet_id, _Delivered(False))
    broker.persistent_path.enqueue(
        queue, delivery, lambda ok: _accepted(conn, session, ack, ok), settled
    )


def _queue_full(conn: MQTTConnection, packet: Publish, queue: str, limit: str) -> None:
    """A write to a full queue (ecq.max_bytes; or ecq.max_queues, a queue that could
    not start; or its owner's auth.max_bytes_per_owner: ``limit``) is refused: MQTT 5
    hears 0x97 Quota exceeded; 3.1.1 has no failure code, so its connection is
    closed, as for a store that failed; QoS 0 is dropped. Counted as ``ecq_full``."""
    conn.broker.stats.drop("ecq_full")
    log.info("client %s wrote to full queue %s (%s)", conn.client_id, queue, limit)
    if not packet.qos or packet.packet_id is None:
        return
    ack = conn.expect_ack(packet.packet_id, packet.qos, ReasonCode.QUOTA_EXCEEDED)
    conn.ack_ready(ack, False)  # the id is not held: a QoS 2 re-send is a new write


def handle_pubrel(conn: MQTTConnection, packet: PubRel) -> None:
    """Release a QoS 2 id: the message was routed on PUBLISH (method A, MQTT-4.3.3-9)."""
    session = conn.session
    assert session is not None
    packet_id = packet.packet_id
    if session.incoming_qos2.pop(packet_id, None) is None:
        conn.send(PubComp(packet_id, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND))
        return
    if not session.durable:
        conn.send(PubComp(packet_id))
        return

    def released(saved: bool) -> None:
        # Forgotten durably first: a held id restored after a crash would make the
        # client's next message with this id look like a re-send and drop it.
        if saved:
            conn.send(PubComp(packet_id))
        else:
            conn.disconnect(ReasonCode.UNSPECIFIED_ERROR)  # PUBREL comes again

    conn.broker.persistent_path.save_session(session, released)


def _resolve_topic(conn: MQTTConnection, packet: Publish) -> str:
    """Apply an incoming Topic Alias (spec 3.3.2.3.4)."""
    properties = packet.properties
    alias = properties.topic_alias if properties is not None else None
    if alias is None:
        return packet.topic
    if alias > conn.broker.settings.mqtt.topic_alias_maximum:
        raise MQTTError(ReasonCode.TOPIC_ALIAS_INVALID, f"topic alias {alias} above maximum")
    if packet.topic:
        conn.incoming_aliases[alias] = packet.topic
        return packet.topic
    topic = conn.incoming_aliases.get(alias)
    if topic is None:
        raise MQTTError(ReasonCode.PROTOCOL_ERROR, f"topic alias {alias} was never set")
    return topic


def _qos2_retransmission(conn: MQTTConnection, session: Session, packet_id: int) -> None:
    """A QoS 2 PUBLISH seen before is not routed again (MQTT-4.3.3-10).

    If it is stored, PUBREC goes out now; if storage is still under way, the
    PUBREC follows when it completes (see :func:`_accepted`).
    """
    if session.incoming_qos2[packet_id]:
        conn.send(PubRec(packet_id))
    else:
        session.qos2_awaiting_pubrec.add(packet_id)


def _accepted(conn: MQTTConnection, session: Session, ack: PendingAck, ok: bool) -> None:
    if ack.qos == 2 and ok and session.durable:
        # PUBREC promises the id is held until PUBREL: a durable session keeps it
        # through a broker crash, or the client's re-send would be routed again.
        session.incoming_qos2[ack.packet_id] = True
        conn.broker.persistent_path.save_session(
            session, lambda saved: _received(conn, session, ack, saved)
        )
    else:
        _received(conn, session, ack, ok)


def _received(conn: MQTTConnection, session: Session, ack: PendingAck, ok: bool) -> None:
    if ack.qos == 2:
        packet_id = ack.packet_id
        if ok:
            session.incoming_qos2[packet_id] = True
        elif not conn.is_v5:
            # 3.1.1 has no failure code: the client is disconnected and re-sends the
            # same PUBLISH. Storage may still take the first one (a Kafka timeout):
            # the id stays held, the re-send waits for the outcome (_settled).
            conn.ack_ready(ack, ok)
            return
        else:
            session.incoming_qos2.pop(packet_id, None)  # the client's re-send is routed afresh
        if packet_id in session.qos2_awaiting_pubrec:
            session.qos2_awaiting_pubrec.discard(packet_id)
            current = session.connection
            if current is not None and current is not conn:
                # The client re-sent on a new connection and waits for PUBREC there.
                if ok:
                    current.send(PubRec(packet_id))
                elif current.is_v5:
                    current.send(PubRec(packet_id, ReasonCode.UNSPECIFIED_ERROR))
                else:
                    current.disconnect(ReasonCode.UNSPECIFIED_ERROR)
    conn.ack_ready(ack, ok)


def _settled(session: Session, packet_id: int, delivered: _Delivered, ok: bool) -> None:
    """The final outcome of a 3.1.1 QoS 2 PUBLISH whose storage was reported failed.

    Stored after all (Kafka took it past the deadline): the id is held, and a
    re-send gets PUBREC without being routed again, so it is delivered once.
    Not stored: the id is free, and a re-send waiting for this is asked again
    (the client is disconnected and re-sends, now routed afresh; if its
    subscribers had it already, and only its integration records failed, the
    re-send makes the records only: ``session.qos2_delivered``).
    """
    if session.incoming_qos2.get(packet_id) is not False:
        return  # released, or the session moved on
    current = session.connection
    waiting = packet_id in session.qos2_awaiting_pubrec
    session.qos2_awaiting_pubrec.discard(packet_id)
    if not ok:
        session.incoming_qos2.pop(packet_id, None)
        if delivered.ok:
            session.qos2_delivered.add(packet_id)
        if waiting and current is not None:
            current.disconnect(ReasonCode.UNSPECIFIED_ERROR)
        return
    session.incoming_qos2[packet_id] = True

    def held(saved: bool) -> None:
        conn = session.connection
        if not waiting or conn is None:
            return
        if saved:
            conn.send(PubRec(packet_id))
        else:
            conn.disconnect(ReasonCode.UNSPECIFIED_ERROR)

    if session.durable and current is not None:
        current.broker.persistent_path.save_session(session, held)
    else:
        held(True)


def _refuse(conn: MQTTConnection, packet: Publish, reason: ReasonCode) -> None:
    conn.broker.stats.drop(reason.name.lower())
    if packet.qos and packet.packet_id is not None:
        ack_type = PubAck if packet.qos == 1 else PubRec
        conn.send(ack_type(packet.packet_id, reason))


def _denied(
    conn: MQTTConnection,
    session: Session,
    packet: Publish,
    topic: str,
    reason_v5: ReasonCode = ReasonCode.NOT_AUTHORIZED,
    counter: str = "not_authorized",
) -> None:
    """The ACL forbids this client to publish on ``topic``, or it is a ``$SYS`` topic:
    drop it (spec 3.3.4).

    Also a topic beyond mqtt.max_topic_length/levels (``reason_v5`` 0x90), and
    a retained message over mqtt.max_retained_* (0x97 Quota exceeded).

    MQTT 5 says so in the PUBACK/PUBREC (0x87 Not authorized, which ends a
    QoS 2 flow). 3.1.1 has no way to say it: the message is acknowledged as
    usual and dropped, as Mosquitto does, so the client does not re-send it
    forever. Acknowledgements keep their order behind stored ones.
    """
    broker: PublishHost = conn.broker
    broker.stats.drop(counter)
    log.debug("client %s may not publish to %r: dropped (%s)", conn.client_id, topic, counter)
    packet_id = packet.packet_id
    if not packet.qos or packet_id is None:
        return
    if conn.is_v5:
        reason = reason_v5
    else:
        reason = ReasonCode.SUCCESS
        if packet.qos == 2:
            session.incoming_qos2[packet_id] = True  # PUBREL completes it as usual
    conn.ack_ready(conn.expect_ack(packet_id, packet.qos, reason), True)


class _Join:
    """The parts a PUBLISH was handed to, each with its completion (``on_accepted``,
    ``on_settled``: :meth:`broker.persistent_path.PersistentPath.submit`).

    ``on_accepted(ok)`` runs once every part answered, ok if all were, and not
    before :meth:`close` (a part may answer at once). After a failure,
    ``on_settled(ok)`` runs once every part's outcome is final: a part that
    failed and ``settles`` says it later; one that does not is final at once.
    """

    __slots__ = ("_accepted", "_closed", "_finals", "_on_accepted", "_on_settled", "_parts")

    def __init__(
        self, on_accepted: Callable[[bool], None], on_settled: Callable[[bool], None] | None
    ) -> None:
        self._on_accepted: Callable[[bool], None] | None = on_accepted
        self._on_settled = on_settled
        self._parts = 0
        self._accepted: list[bool] = []
        self._finals: list[bool] = []
        self._closed = False

    def part(
        self, *, settles: bool
    ) -> tuple[Callable[[bool], None], Callable[[bool], None] | None]:
        """(on_accepted, on_settled) of one more part; on_settled None if nobody waits."""
        self._parts += 1

        def accepted(ok: bool) -> None:
            self._accepted.append(ok)
            self._check()
            if ok or not settles:
                self._final(ok)

        return accepted, (self._final if settles and self._on_settled is not None else None)

    def close(self) -> None:
        """Every part was added."""
        self._closed = True
        self._check()

    def _final(self, ok: bool) -> None:
        self._finals.append(ok)
        self._check()

    def _check(self) -> None:
        if not self._closed or len(self._accepted) < self._parts:
            return
        on_accepted, self._on_accepted = self._on_accepted, None
        if on_accepted is not None:
            on_accepted(all(self._accepted))
        if len(self._finals) == self._parts and not all(self._accepted):
            on_settled, self._on_settled = self._on_settled, None
            if on_settled is not None:
                on_settled(all(self._finals))


def _no_ack(ok: bool) -> None:
    """QoS 0: nobody to acknowledge."""
