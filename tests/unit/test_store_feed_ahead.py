"""persistence/store_feed.py: while a backlog waits behind a full window, the next
window's sent marks are asked ahead, so acknowledgements open the window onto
messages that go at once (issue 39: the replay waited a Redis round trip per window)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection

from broker.stats import BrokerStats
from persistence.format import Stage, StoredMessage, StoredRecord
from persistence.store_feed import StoreFeed


class Writer:
    """The feed's writer as far as marks go: what was asked, and who waits."""

    def __init__(self) -> None:
        self.asked: list[tuple[list[tuple[int, int]], Callable[[Collection[int]], None]]] = []

    def mark_sent(
        self, client_id: str, sent: list[tuple[int, int]], then: Callable[[Collection[int]], None]
    ) -> None:
        self.asked.append((list(sent), then))


class Outflow:
    def __init__(self, window: int) -> None:
        self.connection = object()
        self._window = window
        self.pumps = 0

    def window(self) -> int:
        return self._window

    def pump(self) -> None:
        self.pumps += 1


def _feed(backlog: int, window: int) -> tuple[StoreFeed, Writer, Outflow]:
    writer, outflow = Writer(), Outflow(window)
    feed = StoreFeed("dev", None, writer, 500, BrokerStats(), time.monotonic)  # type: ignore[arg-type]
    feed.outflow = outflow  # type: ignore[assignment]
    message = StoredMessage("t", b"x", 1)
    feed._buffer = deque(
        StoredRecord(i, i, Stage.PUBLISH, False, message) for i in range(1, backlog + 1)
    )
    feed._caught_up = True  # the whole backlog is read: no page read here
    return feed, writer, outflow


def test_the_next_window_is_marked_while_one_is_in_flight() -> None:
    feed, writer, outflow = _feed(backlog=7, window=2)
    first = feed.take(2)
    assert [(o.packet_id, o.marked) for o in first] == [
        (1, False),
        (2, False),
    ]  # marked by the outflow
    assert [sent for sent, _ in writer.asked] == [[(3, 3), (4, 4)]]  # the next window, ahead
    assert feed.take(2) == []  # their marks have not landed: they wait, in order
    writer.asked[0][1]([3, 4])
    assert outflow.pumps == 1  # landed: the outflow is woken
    second = feed.take(2)
    assert [(o.packet_id, o.marked, o.sent) for o in second] == [(3, True, False), (4, True, False)]
    assert [sent for sent, _ in writer.asked[1:]] == [[(5, 5), (6, 6)]]


def test_a_message_gone_before_its_mark_ahead_is_never_sent() -> None:
    feed, writer, _outflow = _feed(backlog=4, window=2)
    feed.take(2)
    writer.asked[0][1]([4])  # 3 was trimmed or expired meanwhile
    assert [(o.packet_id, o.marked) for o in feed.take(2)] == [(4, True)]


def test_a_new_connection_drops_the_marks_asked_for_the_last() -> None:
    feed, writer, outflow = _feed(backlog=4, window=2)
    feed.take(2)
    feed.restart()
    writer.asked[0][1]([3, 4])  # landed after the connection went: nothing to do here
    assert outflow.pumps == 0 and feed.queued() == 0


def test_a_message_with_an_expiry_is_not_marked_ahead() -> None:
    """A mark drops the stored deadline: one marked ahead that expired behind the window
    while the client was away went out on the next connection, never having been sent
    (MQTT-3.3.2-5). Those with an expiry are marked when they go, as before."""
    feed, writer, _outflow = _feed(backlog=5, window=2)
    expiring = StoredMessage("t", b"x", 1, expiry=time.time() + 60)
    feed._buffer[2].message = expiring  # packet id 3
    feed.take(2)
    assert [sent for sent, _ in writer.asked] == [[(4, 4)]]
    third = feed.take(1)
    assert [(o.packet_id, o.marked) for o in third] == [(3, False)]  # the outflow marks it
    assert feed.take(1) == []  # 4's mark ahead has not landed: it waits, in order
