"""The bridge between what the persistence consumer stores and the live feeds.

The persistent path makes the feeds of this process's sessions (a durable
session's :class:`StoreFeed`, the :class:`QueueFeed` of the $ECQ queue a client
consumes) and keeps them here, by client ID, while they are live: a session's
feed until the session ends (``discard``), a queue's feed while its outflow
takes from it (``restart`` to ``discard``). What the consumer stores goes to
those feeds straight away, and ``room_for`` asks them; the broker is not
asked which session holds them. A feed reaches its outflow through the one
port the broker declares, :class:`broker.outflow.Feed` (its ``outflow``); a
client whose feed is not connected here may be connected to another replica,
which ``ClusterState.stored_elsewhere`` tells (it decides from the broker's
record of the session).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from broker.group_queue import is_group_store

if TYPE_CHECKING:
    from broker.cluster import ClusterState
    from persistence.format import StoredRecord
    from persistence.group_feed import GroupQueues
    from persistence.queue_feed import QueueFeed
    from persistence.queue_store import QueueEntry
    from persistence.store_feed import StoreFeed

__all__ = ["Elsewhere", "FeedBridge"]

log = logging.getLogger("devicemq.persistence")


class Elsewhere(Protocol):
    """Where the bridge tells of messages stored for a client not connected here: the
    broker's cluster state (broker/cluster.py), when it has one."""

    def stored_elsewhere(self, client_id: str, queue: bool = False) -> None: ...
    def await_kept(
        self, client_id: str, since: object, node: str, then: Callable[[], None]
    ) -> Callable[[], None]: ...


class FeedBridge:
    """The live feeds of this process by client ID, fed by the persistence consumer."""

    def __init__(self) -> None:
        self._sessions: dict[str, StoreFeed] = {}  # a durable session's, until it ends
        self._queues: dict[str, QueueFeed] = {}  # an $ECQ queue's, while consumed
        self.groups: GroupQueues | None = None  # group queues, if kept
        self.elsewhere: Elsewhere | None = None  # the cluster, once attached (if any)

    def attach(self, cluster: ClusterState | None) -> None:
        """The broker is served: a client not connected here is told of via ``cluster``."""
        self.elsewhere = cluster

    # -- the registry: the feeds tell when they are live ---------------------------------

    def session_feed(self, feed: StoreFeed) -> None:
        """A durable session's feed was made (it replaces an earlier one of the client)."""
        self._sessions[feed.client_id] = feed

    def session_ended(self, feed: StoreFeed) -> None:
        if self._sessions.get(feed.client_id) is feed:
            del self._sessions[feed.client_id]

    def queue_live(self, feed: QueueFeed, live: bool) -> None:
        """A queue's feed was restarted by its outflow (``live``) or discarded."""
        if live:
            self._queues[feed.client_id] = feed
        elif self._queues.get(feed.client_id) is feed:
            del self._queues[feed.client_id]

    # -- fed by the persistence consumer ---------------------------------------------------

    def stored(self, client_id: str, records: Callable[[], list[StoredRecord]]) -> None:
        """Offer just-stored messages to the session if its client is connected here."""
        feed = self._sessions.get(client_id)
        if feed is None or not _connected(feed):
            elsewhere = self.elsewhere
            if elsewhere is not None:  # connected to another replica: tell it to re-read
                elsewhere.stored_elsewhere(client_id)
            return
        feed.stored(records())

    def queue_stored(self, client_id: str, entries: list[QueueEntry]) -> None:
        """Offer just-stored queue entries to their consumer if it reads them here
        (empty: re-read, something was stored the feed did not see). A group queue's:
        its members here claim them, and the other replicas' are told."""
        if is_group_store(client_id):
            if self.groups is not None:
                self.groups.stored(client_id)
            return
        feed = self._queues.get(client_id)
        if feed is None or not _connected(feed):
            elsewhere = self.elsewhere
            if elsewhere is not None:  # connected to another replica: tell it to re-read
                elsewhere.stored_elsewhere(client_id, queue=True)
            return
        feed.stored(entries)

    def room_for(self, client_id: str) -> int:
        """How many just-stored messages the client's outflow would send at once."""
        feed = self._sessions.get(client_id)
        return feed.room() if feed is not None else 0

    def announce_group(self, store_id: str) -> None:
        """Tell the other replicas' members of a group queue to claim."""
        elsewhere = self.elsewhere
        if elsewhere is not None:
            elsewhere.stored_elsewhere(store_id, queue=True)

    # -- asked by the cluster link ---------------------------------------------------------

    def connected(self) -> list[str]:
        """The clients connected here whose feeds read the store: a durable session's,
        or the queue a client consumes."""
        found = dict.fromkeys(cid for cid, feed in self._sessions.items() if _connected(feed))
        found.update(dict.fromkeys(cid for cid, f in self._queues.items() if _connected(f)))
        return list(found)

    def reread(self, client_ids: list[str]) -> None:
        """Another replica stored messages for these clients: connected ones re-read."""
        for client_id in client_ids:
            if is_group_store(client_id) and self.groups is not None:
                self.groups.stored(client_id, elsewhere=False)  # entries to claim
                # (no continue: a client ID may begin with "$queue/" too)
            feed = self._sessions.get(client_id)
            if feed is not None and _connected(feed):
                feed.stored([])
            queue = self._queues.get(client_id)
            if queue is not None and _connected(queue):
                queue.stored([])


def _connected(feed: StoreFeed | QueueFeed) -> bool:
    """Its outflow's client is connected here (the outflow's session's connection)."""
    outflow = feed.outflow
    return outflow is not None and outflow.connection is not None
