"""MQTT session state: what outlives a network connection (spec 4.1).

The session owns its subscriptions, its outgoing QoS 1/2 flow (an
:class:`~broker.outflow.Outflow`) and the receiver side of incoming QoS 2. The
connection that is currently attached, if any, is only a way to send bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from broker.message import Delivery
from broker.outflow import Feed, Outflow
from broker.stats import BrokerStats
from broker.topics import SubscriptionEntry

if TYPE_CHECKING:
    from broker.connection import MQTTConnection
    from broker.connection_state import WillMessage
    from broker.retained import RetainedSender

NEVER_EXPIRES = 0xFFFFFFFF


class Session:
    def __init__(
        self,
        client_id: str,
        expiry_interval: int,
        max_inflight: int,
        feed: Feed,
        stats: BrokerStats,
        durable: bool = False,
        may_receive: Callable[[str], bool] | None = None,
    ) -> None:
        self.client_id = client_id
        self.expiry_interval = expiry_interval
        self.subscriptions: dict[str, SubscriptionEntry] = {}
        self.connection: MQTTConnection | None = None
        # QoS 2 ids received and not yet released: id -> stored by the persistent path
        self.incoming_qos2: dict[int, bool] = {}
        self.qos2_awaiting_pubrec: set[int] = set()  # re-sent while storage was under way
        # 3.1.1 QoS 2 ids whose message reached its subscribers while its integration
        # records failed: the client's re-send makes the records only (MQTT-4.3.3-10:
        # not delivered twice). In memory: a broker crash forgets them.
        self.qos2_delivered: set[int] = set()
        self.expires_at: float | None = None  # set while no connection is attached
        self.pending_will: WillMessage | None = None  # a will waiting out its delay
        self.will_at: float | None = None
        # The deadline the broker's tick has this session queued at (Broker.tick).
        self.watched_at: float | None = None
        self.due_entry: list[Any] | None = None  # its entry in that heap
        self.stats = stats
        self.outflow = Outflow(self, max_inflight, feed, may_receive)
        # Created persistent: deliveries and state go through the persistent path.
        self.durable = durable
        # Tells this durable session from earlier and later ones of the same client id
        # (the persistent path assigns it; 0: none). Its records carry it.
        self.generation = 0
        # Its resumes from the store so far (the persistent path's count): an end by its
        # expiry is refused if a client resumed it since, elsewhere (finding 40).
        self.opens = 0
        # Who the session belongs to (auth.session_owner), None: not bound.
        self.owner: str | None = None
        # Who last connected with it: the ACL's user rules and %u apply to it.
        self.username: str | None = None
        # Retained messages still to be sent after a SUBSCRIBE (broker/retained.py).
        self.retained_sender: RetainedSender | None = None
        # For operators (app/admin.py), epoch seconds: the last connect, and the
        # last moment a connection was known to be open (its end, once it ended).
        self.connected_at: float | None = None
        self.last_seen: float | None = None
        # Where the connection is from: its IP address and protocol level (None:
        # never connected on this replica, and not told by another).
        self.address: str | None = None
        self.protocol_level: int | None = None

    @property
    def outlives_connection(self) -> bool:
        """Kept after its connection closes, as of now (a 5.0 DISCONNECT may set the
        expiry to 0). Not :attr:`durable`, fixed at creation: whether the
        persistent path holds the session."""
        return self.expiry_interval > 0

    @property
    def application(self) -> bool:
        """An APPLICATION session (docs/application-sessions.md): its messages go to a
        Kafka topic of its own, not to Redis. Its feed says so here; a replica that
        holds it as a remote record is told (broker/cluster.py)."""
        return bool(getattr(self.outflow.feed, "application", False))

    def deliver(self, delivery: Delivery) -> None:
        """QoS 0 goes out now or never: a session may keep it (spec 3.1.2.4), this
        one does not, as Mosquitto by default. QoS 1 and 2 go to the outflow."""
        if delivery.qos:
            self.outflow.deliver(delivery)
            return
        conn = self.connection
        if conn is None or not conn.accepts_publish:
            return
        if conn.congested:
            self.stats.drop("qos0_congested")
            return
        conn.send_delivery(delivery, None, dup=False)
