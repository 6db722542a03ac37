"""SUBSCRIBE and UNSUBSCRIBE (spec 3.8, 3.10)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from broker.budget import BYTES_LIMIT, GROUP, QUEUE, QUEUES_LIMIT
from broker.ecq import (
    REWIND_PROPERTY,
    SubscribeVerdict,
    consumer_filter,
    parse_rewind,
    subscribe_verdict,
)
from broker.errors import MQTTError
from broker.group_queue import is_group_filter
from broker.limits import topic_within_limits
from broker.packets import (
    Properties,
    ReasonCode,
    SubAck,
    Subscribe,
    Subscription,
    UnsubAck,
    Unsubscribe,
)
from broker.topics import SHARE_PREFIX, SubscriptionEntry, is_valid_topic_filter

if TYPE_CHECKING:
    from broker.acl import Authorizer
    from broker.budget import OwnerBudget
    from broker.cluster import ClusterState
    from broker.config import Settings
    from broker.connection import MQTTConnection
    from broker.persistent_path import PersistentPath
    from broker.session import Session
    from broker.stats import BrokerStats
    from broker.topics import SubscriptionTree

log = logging.getLogger("devicemq.subscribe")


class SubscribeHost(Protocol):
    """What the SUBSCRIBE and UNSUBSCRIBE handlers use of the broker."""

    @property
    def settings(self) -> Settings: ...
    @property
    def stats(self) -> BrokerStats: ...
    @property
    def acl(self) -> Authorizer: ...
    @property
    def subscriptions(self) -> SubscriptionTree: ...
    @property
    def persistent_path(self) -> PersistentPath: ...
    @property
    def cluster(self) -> ClusterState | None: ...
    @property
    def budget(self) -> OwnerBudget: ...
    def send_retained(
        self, session: Session, topic_filter: str, qos: int, subscription_ids: tuple[int, ...]
    ) -> None: ...
    def claim_queue(self, conn: MQTTConnection, then: Callable[[str], None]) -> None: ...
    def consume_queue(self, session: Session) -> bool: ...
    def join_group(self, session: Session, topic_filter: str) -> None: ...
    def group_queues_of(self, owner: str) -> set[str]: ...


def handle_subscribe(conn: MQTTConnection, packet: Subscribe) -> None:
    session = conn.session
    assert session is not None and conn.client_id is not None
    broker: SubscribeHost = conn.broker
    mqtt = broker.settings.mqtt
    properties = packet.properties
    subscription_id = None
    if properties is not None and properties.subscription_identifiers:
        if not mqtt.subscription_identifiers:
            raise MQTTError(
                ReasonCode.SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED,
                "subscription identifiers are off",
            )
        subscription_id = properties.subscription_identifiers[0]
    reason_codes: list[int] = []
    # Retained messages to send after SUBACK: (filter, granted QoS), each filter once.
    retained: dict[str, int] = {}
    ids = (subscription_id,) if subscription_id else ()
    queue = _Queue()
    joined: list[str] = []  # group queues ($queue/...) subscribed to
    for request in packet.subscriptions:
        refusal = _refusal(conn, request)
        verdict = subscribe_verdict(conn.client_id, request.topic_filter)
        group = is_group_filter(request.topic_filter)
        if refusal is None and verdict is not SubscribeVerdict.PLAIN:
            refusal = _queue_refusal(conn, request, verdict, queue, properties)
        elif refusal is None and group:
            refusal = _group_refusal(conn, request) or _membership_refusal(conn, request)
        if (
            refusal is None
            and verdict is SubscribeVerdict.PLAIN
            and not broker.acl.can_subscribe(
                conn.client_id, conn.username, request.topic_filter, conn.address
            )
        ):
            # 0x87 Not authorized; 3.1.1 knows only 0x80 Failure (spec 3.9.3).
            refusal = ReasonCode.NOT_AUTHORIZED if conn.is_v5 else ReasonCode.UNSPECIFIED_ERROR
            broker.stats.drop("subscribe_not_authorized")
            log.info("client %s may not subscribe to %r", conn.client_id, request.topic_filter)
        if (
            refusal is None
            and request.topic_filter not in session.subscriptions
            and len(session.subscriptions) >= mqtt.max_subscriptions_per_client
        ):
            refusal = ReasonCode.QUOTA_EXCEEDED  # 0x80 in 3.1.1 (the codec maps it)
            broker.stats.drop("subscription_quota")
        if refusal is not None:
            reason_codes.append(refusal)
            continue
        qos = min(request.qos, mqtt.maximum_qos)
        if verdict is SubscribeVerdict.CONSUMER:
            # Its messages go at QoS 1: the acknowledgements move the queue on. Held
            # until its read rule and owner are known (below).
            queue.indexes.append(len(reason_codes))
            reason_codes.append(1)
            queue.entry = SubscriptionEntry(
                conn.client_id,
                request.topic_filter,
                1,
                request.no_local,
                request.retain_as_published,
                request.retain_handling,
                subscription_id,
            )
            continue
        if group:
            qos = 1  # a group queue's entries go at QoS 1: an acknowledgement ends one
            joined.append(request.topic_filter)
        entry = SubscriptionEntry(
            conn.client_id,
            request.topic_filter,
            qos,
            request.no_local,
            request.retain_as_published,
            request.retain_handling,
            subscription_id,
        )
        is_new = _add(conn, entry)
        reason_codes.append(qos)
        # Retained messages: not for a new shared subscription (spec 4.8.2),
        # and as Retain Handling says (MQTT-3.3.1-9, -10, -11). A filter
        # repeated in this packet replaces its subscription each time, but its
        # retained messages are sent once: repeating it cannot multiply work.
        if entry.share_group is None and (
            request.retain_handling == 0 or (request.retain_handling == 1 and is_new)
        ):
            retained[request.topic_filter] = qos

    def saved(ok: bool) -> None:
        # A durable session's subscriptions are stored before SUBACK promises them.
        codes = reason_codes if ok else [_failed(code) for code in reason_codes]
        conn.send(SubAck(packet.packet_id, codes))
        if ok:
            for topic_filter in joined:
                broker.join_group(session, topic_filter)
        if ok and queue.subscribed:
            broker.consume_queue(session)
            if queue.rewind is not None:
                broker.persistent_path.rewind_queue(session.client_id, queue.rewind)
        if ok:
            # Sent a chunk per event-loop iteration, after the SUBACK
            # (broker/retained.py RetainedSender); the ACL is asked per message.
            for topic_filter, granted in retained.items():
                broker.send_retained(session, topic_filter, granted, ids)

    wanted = queue.entry
    if wanted is None:
        _after_save(conn, saved)
        return

    def claimed(refused: str) -> None:
        if conn.session is not session:
            return  # gone meanwhile: no SUBACK to send
        if refused in (BYTES_LIMIT, QUEUES_LIMIT):
            # A new queue for an owner at its limit: 0x97 Quota exceeded (3.1.1: 0x80).
            for i in queue.indexes:
                reason_codes[i] = ReasonCode.QUOTA_EXCEEDED
            broker.budget.refused(QUEUE, refused)
            broker.stats.drop("ecq_subscribe_refused")
            setting = "auth." if refused == BYTES_LIMIT else "ecq."
            log.info(
                "client %s may not claim its queue: its owner is at %s%s",
                conn.client_id,
                setting,
                refused,
            )
        elif refused:
            # 0x87 Not authorized (3.1.1: 0x80), as for any filter the ACL refuses.
            code = ReasonCode.NOT_AUTHORIZED if conn.is_v5 else ReasonCode.UNSPECIFIED_ERROR
            if refused == "unavailable":
                code = ReasonCode.UNSPECIFIED_ERROR
            for i in queue.indexes:
                reason_codes[i] = code
            broker.stats.drop("ecq_subscribe_refused")
            log.info("client %s may not consume its queue (%s)", conn.client_id, refused)
        else:
            _add(conn, wanted)
            queue.subscribed = True
        _after_save(conn, saved)

    # The ACL's read rule for $ECQ/{cid}/#, then the queue's owner (broker/ownership.py).
    broker.claim_queue(conn, claimed)


def _add(conn: MQTTConnection, entry: SubscriptionEntry) -> bool:
    """The subscription in force (replacing the filter's older one); True: it is new."""
    session = conn.session
    assert session is not None
    broker: SubscribeHost = conn.broker
    is_new = broker.subscriptions.add(entry)
    session.subscriptions[entry.topic_filter] = entry
    if broker.cluster is not None:
        broker.cluster.subscribed(session, entry)
    return is_new


class _Queue:
    """What a SUBSCRIBE asked of the client's own queue ($ECQ, broker/ecq.py)."""

    __slots__ = ("entry", "indexes", "rewind", "subscribed")

    def __init__(self) -> None:
        self.subscribed = False
        self.rewind: int | None = None
        self.entry: SubscriptionEntry | None = None  # its subscription, once allowed
        self.indexes: list[int] = []  # where its SUBACK codes are


def _queue_refusal(
    conn: MQTTConnection,
    request: Subscription,
    verdict: SubscribeVerdict,
    queue: _Queue,
    properties: Properties | None,
) -> int | None:
    """The SUBACK failure code of an ``$ECQ/`` filter, or None: the client's own queue.

    Exclusive, a built-in rule with or without an ACL file: only ``{cid}``
    subscribes to ``$ECQ/{cid}/#``, at QoS 1 or 2 (granted 1); anything else
    under ``$ECQ/`` is refused (0x87; 3.1.1 0x80).
    """
    broker: SubscribeHost = conn.broker
    if verdict is SubscribeVerdict.REFUSED:
        broker.stats.drop("ecq_subscribe_refused")
        log.info("client %s may not subscribe to %r", conn.client_id, request.topic_filter)
        return ReasonCode.NOT_AUTHORIZED if conn.is_v5 else ReasonCode.UNSPECIFIED_ERROR
    if not broker.persistent_path.keeps_queues:
        log.warning(
            "client %s subscribed to %r: no $ECQ queues here (ecq.enabled, persistence.enabled)",
            conn.client_id,
            request.topic_filter,
        )
        return ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR
    if request.qos == 0:
        log.info("client %s: a queue is consumed at QoS 1, not 0", conn.client_id)
        return ReasonCode.UNSPECIFIED_ERROR
    for name, value in properties.user_properties if properties is not None else ():
        if name == REWIND_PROPERTY:
            queue.rewind = parse_rewind(value)
            if queue.rewind is None:
                log.info("client %s: rewind=%r is no sequence number", conn.client_id, value)
                return ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR
    return None


def _group_refusal(conn: MQTTConnection, request: Subscription) -> int | None:
    """The SUBACK failure code of a ``$queue/{group}/{filter}`` filter (a durable group
    queue, broker/group_queue.py), or None: accepted, at QoS 1 or 2 (granted 1)."""
    broker: SubscribeHost = conn.broker
    if not broker.persistent_path.keeps_groups:
        log.warning(
            "client %s subscribed to %r: no group queues here "
            "(group_queues.enabled, persistence.enabled)",
            conn.client_id,
            request.topic_filter,
        )
        return ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR
    if request.qos == 0:
        log.info("client %s: a group queue is consumed at QoS 1, not 0", conn.client_id)
        return ReasonCode.UNSPECIFIED_ERROR
    return None


def _membership_refusal(conn: MQTTConnection, request: Subscription) -> int | None:
    """0x97 Quota exceeded (3.1.1: 0x80, as the subscription cap) for a new group queue
    membership over group_queues.max_groups_per_client, or one more distinct group
    queue than group_queues.max_groups_per_owner over the owner's sessions (this
    SUBSCRIBE's earlier filters are the session's already): each group queue keeps
    every matching message once more. Any new membership of an owner over
    auth.max_bytes_per_owner, too."""
    session = conn.session
    assert session is not None
    topic_filter = request.topic_filter
    if topic_filter in session.subscriptions:
        return None  # a subscription replaced is no new membership
    broker: SubscribeHost = conn.broker
    limits = broker.settings.group_queues
    per_client, per_owner = limits.max_groups_per_client, limits.max_groups_per_owner
    over = ""
    if per_client and sum(1 for f in session.subscriptions if is_group_filter(f)) >= per_client:
        over = "group_queues.max_groups_per_client"
    owner = session.owner
    if not over and per_owner and owner is not None:
        held = broker.group_queues_of(owner)
        if topic_filter not in held and len(held) >= per_owner:
            over = "group_queues.max_groups_per_owner"
    if not over and broker.budget.over and owner in broker.budget.over:
        over = f"auth.{BYTES_LIMIT}"
        broker.budget.refused(GROUP, BYTES_LIMIT)
    if not over:
        return None
    broker.stats.drop("group_membership_quota")
    log.info("client %s may not join %r: %s reached", conn.client_id, topic_filter, over)
    return ReasonCode.QUOTA_EXCEEDED  # 0x80 in 3.1.1 (the codec maps it)


def _refusal(conn: MQTTConnection, request: Subscription) -> int | None:
    """The SUBACK failure code for one topic filter, or None if it is accepted."""
    mqtt = conn.broker.settings.mqtt
    topic_filter = request.topic_filter
    if not is_valid_topic_filter(topic_filter):
        return ReasonCode.TOPIC_FILTER_INVALID
    if not topic_within_limits(topic_filter, mqtt.max_topic_length, mqtt.max_topic_levels):
        conn.broker.stats.drop("subscribe_topic_limit")
        return ReasonCode.TOPIC_FILTER_INVALID
    shared = topic_filter.startswith(SHARE_PREFIX) or is_group_filter(topic_filter)
    if shared:
        if request.no_local:
            raise MQTTError(ReasonCode.PROTOCOL_ERROR, "no local on a shared subscription")
        if not mqtt.shared_subscriptions:
            return ReasonCode.SHARED_SUBSCRIPTIONS_NOT_SUPPORTED
    if not mqtt.wildcard_subscriptions and ("+" in topic_filter or "#" in topic_filter):
        return ReasonCode.WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED
    return None


def handle_unsubscribe(conn: MQTTConnection, packet: Unsubscribe) -> None:
    session = conn.session
    assert session is not None and conn.client_id is not None
    tree = conn.broker.subscriptions
    reason_codes: list[int] = []
    for topic_filter in packet.topic_filters:
        if not is_valid_topic_filter(topic_filter):
            reason_codes.append(ReasonCode.TOPIC_FILTER_INVALID)
            continue
        session.subscriptions.pop(topic_filter, None)
        if topic_filter == consumer_filter(conn.client_id):
            session.outflow.detach_side()  # what is in flight completes
        elif is_group_filter(topic_filter):
            session.outflow.detach_group(topic_filter)  # its unacknowledged go to others
        existed = tree.remove(conn.client_id, topic_filter)
        if existed and conn.broker.cluster is not None:
            conn.broker.cluster.unsubscribed(session, topic_filter)
        reason_codes.append(ReasonCode.SUCCESS if existed else ReasonCode.NO_SUBSCRIPTION_EXISTED)

    def saved(ok: bool) -> None:
        codes = reason_codes if ok else [_failed(code) for code in reason_codes]
        conn.send(UnsubAck(packet.packet_id, codes if conn.is_v5 else []))

    _after_save(conn, saved)


def _after_save(conn: MQTTConnection, answer: Callable[[bool], None]) -> None:
    session = conn.session
    assert session is not None
    if session.durable:
        conn.broker.persistent_path.save_session(session, answer)
    else:
        answer(True)


def _failed(code: int) -> int:
    return code if code >= 0x80 else ReasonCode.UNSPECIFIED_ERROR
