"""A backlog behind a full window, then the client goes (persistence/store_feed.py).

What was sent goes again with DUP under its packet id (MQTT-4.4.0-1); what never
went goes without DUP, and, expired while the client was away, not at all: the
server had not started its onward delivery (MQTT-3.3.2-5). The store feed once
marked the next window sent ahead of its send (to save a Redis round trip per
window); a client that went then got that window with DUP on its next
connection, though it never saw it (CI: tests/faults/test_client_vanish.py).
"""

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


def _away_after_one_window_of_six(sub: RawSubscriber, pub: Publisher, topic: str) -> None:
    """Six messages stored for the subscriber while it is away; back, it takes the
    first window (Receive Maximum 2) without acknowledging it and goes: 1 and 2
    were sent, 3 to 6 never went."""
    sub.connect(subscribe=[(topic, 1)])
    sub.close()
    pub.publish(6)
    pub.stop()
    assert pub.acked == set(range(1, 7))
    sub.ack = lambda packet: False  # the window stays full
    sub.connect()
    wait_until(lambda: len(sub.snapshot()) >= 2, 10, "the first window")
    assert [parse(r.payload)[1] for r in sub.snapshot()] == [1, 2]  # 3 and 4 never went
    sub.close()


def test_a_message_never_sent_behind_the_window_still_expires(stack: Stack) -> None:
    topic = stack.topic("t")
    cid = stack.client("sub")
    sub = RawSubscriber(stack.broker.address, cid, receive_maximum=2)
    pub = Publisher(stack.broker.address, stack.client("pub"), topic, properties=_expiring(2))
    late = Publisher(stack.broker.address, stack.client("late"), topic)
    try:
        _away_after_one_window_of_six(sub, pub, topic)
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


def test_only_what_was_sent_goes_again_with_dup(stack: Stack) -> None:
    """A disconnect with a backlog behind the full window: nothing is lost or
    skipped; what was sent goes with DUP, what never went without."""
    topic = stack.topic("t")
    cid = stack.client("sub")
    sub = RawSubscriber(stack.broker.address, cid, receive_maximum=2)
    pub = Publisher(stack.broker.address, stack.client("pub"), topic)
    try:
        _away_after_one_window_of_six(sub, pub, topic)
        sub.ack = lambda packet: True
        sub.connect()
        wait_until(lambda: len(sub.snapshot()) >= 8, 15, "the backlog")
        again = [(parse(r.payload)[1], r.dup) for r in sub.snapshot()[2:]]
        # 3 and 4 waited behind the window and never went (marked ahead, they had DUP).
        assert again == [(1, True), (2, True), (3, False), (4, False), (5, False), (6, False)]
    finally:
        sub.close()
        pub.close()
