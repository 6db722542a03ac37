"""Review of fleet-store's mark-ahead (persistence/store_feed.py, StoreFeed._mark_ahead):
a message marked sent ahead of the window but never sent, its expiry passed while
the client was away, must not be delivered on the next connection: the server had
not started its onward delivery (MQTT-3.3.2-5)."""

from __future__ import annotations

import time

from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties as PahoProperties

from tests.faults.checker import Publisher, RawSubscriber, parse, wait_until
from tests.faults.conftest import Stack


def _expiring(seconds: int) -> PahoProperties:
    p = PahoProperties(PacketTypes.PUBLISH)
    p.MessageExpiryInterval = seconds
    return p


def test_a_message_marked_ahead_and_never_sent_still_expires(stack: Stack) -> None:
    topic = stack.topic("t")
    cid = stack.client("sub")
    sub = RawSubscriber(stack.broker.address, cid, receive_maximum=2)
    pub = Publisher(stack.broker.address, stack.client("pub"), topic, properties=_expiring(2))
    late = Publisher(stack.broker.address, stack.client("late"), topic)
    try:
        sub.connect(subscribe=[(topic, 1)])
        sub.close()
        pub.publish(6)
        pub.stop()
        assert pub.acked == set(range(1, 7))
        sub.ack = lambda packet: False  # the window (Receive Maximum 2) stays full
        sub.connect()
        wait_until(lambda: len(sub.snapshot()) >= 2, 10, "the first window")
        # 1 and 2 go only once their marks landed; marks asked ahead for 3 and 4 were
        # asked before those (StoreFeed.take, then the outflow's mark), so they
        # landed in the same progress write or an earlier one.
        first = [parse(r.payload)[1] for r in sub.snapshot()]
        assert first == [1, 2]  # 3 and 4 were never sent
        sub.close()
        time.sleep(2.5)  # every message's expiry passes while the client is away
        sub.ack = lambda packet: True
        sub.connect()
        # A fresh message after them: per-client order puts anything of 3 to 6 first.
        late.publish(1)
        late.stop()
        wait_until(lambda: late.name in {parse(r.payload)[0] for r in sub.snapshot()}, 15, "late")
        again = [(parse(r.payload), r.dup) for r in sub.snapshot()[2:]]
        # 1 and 2 were sent: re-sent whatever their age (MQTT-4.4.0-1). 3 and 4 never
        # went out: expired, they must not go now (MQTT-3.3.2-5).
        assert again == [((pub.name, 1), True), ((pub.name, 2), True), ((late.name, 1), False)]
    finally:
        sub.close()
        pub.close()
        late.close()


def test_messages_marked_ahead_go_on_the_next_connection_with_dup(stack: Stack) -> None:
    """A disconnect with the next window marked ahead: nothing is lost or skipped,
    and what may have been seen (marked) goes with DUP, the rest without."""
    topic = stack.topic("t")
    cid = stack.client("sub")
    sub = RawSubscriber(stack.broker.address, cid, receive_maximum=2)
    pub = Publisher(stack.broker.address, stack.client("pub"), topic)
    try:
        sub.connect(subscribe=[(topic, 1)])
        sub.close()
        pub.publish(6)
        pub.stop()
        assert pub.acked == set(range(1, 7))
        sub.ack = lambda packet: False
        sub.connect()
        wait_until(lambda: len(sub.snapshot()) >= 2, 10, "the first window")
        assert [parse(r.payload)[1] for r in sub.snapshot()] == [1, 2]
        sub.close()
        sub.ack = lambda packet: True
        sub.connect()
        wait_until(lambda: len(sub.snapshot()) >= 8, 15, "the backlog")
        again = [(parse(r.payload)[1], r.dup) for r in sub.snapshot()[2:]]
        # 3 and 4 were marked ahead (may have been seen, as far as the store knows).
        assert again == [(1, True), (2, True), (3, True), (4, True), (5, False), (6, False)]
    finally:
        sub.close()
        pub.close()
