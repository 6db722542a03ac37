"""The hand-off point for traffic to persistent sessions.

A session is persistent when it outlives its connection (clean session 0 in
3.1.1, Session Expiry Interval > 0 in 5.0). The router sends every delivery
for such a session through a :class:`PersistentPath`, and acknowledges the
publisher only when the path reports the deliveries stored. DESIGN.md's
durable path (Kafka, then Redis) implements this interface; until it is
configured, :class:`InMemoryPersistentPath` keeps the messages in the
session's own queue, as an ordinary broker does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from broker.message import Delivery
    from broker.session import Session

StoredCallback = Callable[[bool], None]


class PersistentPath(Protocol):
    def submit(
        self, deliveries: Sequence[tuple[Session, Delivery]], on_stored: StoredCallback
    ) -> None:
        """Store ``deliveries`` durably, then call ``on_stored(True)``.

        ``on_stored(False)`` means they could not be stored: the publisher must
        not be told the message was accepted. Calls for one publisher complete
        in submission order.
        """
        ...


class InMemoryPersistentPath:
    """Queues in the session itself: survives disconnects, not broker restarts."""

    def submit(
        self, deliveries: Sequence[tuple[Session, Delivery]], on_stored: StoredCallback
    ) -> None:
        for session, delivery in deliveries:
            session.deliver(delivery)
        on_stored(True)
