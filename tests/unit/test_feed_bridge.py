"""persistence/feed_bridge.py: the live feeds the persistent path made, by client ID,
fed by what the consumer stores; a client not connected here is told of elsewhere."""

from __future__ import annotations

import time
from typing import Any

from broker.stats import BrokerStats
from persistence.feed_bridge import FeedBridge
from persistence.store_feed import StoreFeed


class Connected:
    """An outflow as the feed sees it: its connection, its room."""

    def __init__(self, connected: bool, room: int = 5) -> None:
        self.connection = object() if connected else None
        self._room = room
        self.pumps = 0

    def room(self) -> int:
        return self._room if self.connection is not None else 0

    def pump(self) -> None:
        self.pumps += 1


class Cluster:
    def __init__(self) -> None:
        self.told: list[tuple[str, bool]] = []

    def stored_elsewhere(self, client_id: str, queue: bool = False) -> None:
        self.told.append((client_id, queue))


def _feed(bridge: FeedBridge, client_id: str, outflow: Any) -> StoreFeed:
    # No store or writer: nothing here reads or writes one (room, stored([]), discard).
    feed = StoreFeed(
        client_id,
        None,
        None,
        10,
        BrokerStats(),
        time.monotonic,  # type: ignore[arg-type]
        on_discard=bridge.session_ended,
    )
    feed.outflow = outflow
    bridge.session_feed(feed)
    return feed


def test_stored_goes_to_the_connected_feed_else_to_the_cluster() -> None:
    bridge, cluster = FeedBridge(), Cluster()
    bridge.attach(cluster)  # type: ignore[arg-type]
    here = Connected(True)
    _feed(bridge, "here", here)
    _feed(bridge, "offline", Connected(False))
    bridge.stored("here", list)
    bridge.stored("offline", list)
    bridge.stored("unknown", list)
    assert here.pumps == 1  # the feed took the offer (a re-read) and woke its outflow
    assert cluster.told == [("offline", False), ("unknown", False)]
    assert (bridge.room_for("here"), bridge.room_for("offline"), bridge.room_for("x")) == (0, 0, 0)
    assert bridge.connected() == ["here"]


def test_a_feed_leaves_when_its_session_ends_and_not_its_successor() -> None:
    bridge, cluster = FeedBridge(), Cluster()
    bridge.attach(cluster)  # type: ignore[arg-type]
    old = _feed(bridge, "c", Connected(True))
    new = _feed(bridge, "c", Connected(True))  # a new session of the client
    old.discard()  # the old session's end comes late: the new feed stays
    assert bridge.connected() == ["c"]
    bridge.stored("c", list)
    assert cluster.told == []
    new.discard()
    assert bridge.connected() == []
    bridge.stored("c", list)
    assert cluster.told == [("c", False)]
