"""A subscriber whose socket dies mid-flight, holding unacknowledged messages.

A raw-socket client (broker.codec) acknowledges only some messages, then its
socket is reset without DISCONNECT. On the next connection the broker must
re-send exactly the unacknowledged ones first, with DUP=1 and the same
packet ids, then the rest (never sent: DUP=0), losing nothing.
"""

from __future__ import annotations

import time

import pytest

from tests.faults.checker import (
    Publisher,
    RawSubscriber,
    assert_ok,
    check,
    parse,
    wait_until,
)
from tests.faults.conftest import Stack

N = 40
ACKED = 15


@pytest.mark.parametrize("level", [5, 4], ids=["v5", "v311"])
def test_unacked_resent_with_dup_and_same_packet_ids(stack: Stack, level: int) -> None:
    topic = stack.topic("t")
    window = 10 if level == 5 else 64  # Receive Maximum 10, or the broker's max_inflight
    sub = RawSubscriber(
        stack.broker.address,
        stack.client("sub"),
        level=level,
        receive_maximum=window if level == 5 else None,
    )
    pub = Publisher(stack.broker.address, stack.client("pub"), topic)
    try:
        sub.ack = lambda p: parse(p.payload)[1] <= ACKED
        sub.connect(subscribe=[(topic, 1)])
        pub.publish(N)
        pub.stop()
        assert pub.acked == set(range(1, N + 1))
        in_flight = min(window, N - ACKED)
        wait_until(lambda: len(sub.snapshot()) >= ACKED + in_flight, 10, "first deliveries")
        time.sleep(0.3)  # the window is full: nothing more may come
        first = sub.snapshot()
        assert len(first) == ACKED + in_flight, "the broker overran the window"
        unacked = first[ACKED:]
        assert not any(r.dup for r in first)

        sub.abort()
        sub.ack = lambda p: True
        connack = sub.connect()
        assert connack.session_present
        sub.wait_all([pub], timeout=15)
        time.sleep(0.2)
        again = [r for r in sub.snapshot() if r.connection == 2]
        resent, rest = again[: len(unacked)], again[len(unacked) :]
        assert [(r.payload, r.packet_id) for r in resent] == [
            (r.payload, r.packet_id) for r in unacked
        ], "not the same messages under the same packet ids"
        assert all(r.dup for r in resent), "a re-sent message without DUP"
        assert not any(r.dup for r in rest), "DUP on a message never sent before"
        assert [parse(r.payload)[1] for r in rest] == list(range(ACKED + in_flight + 1, N + 1))
        assert_ok(check([pub], sub))
    finally:
        sub.close()
        pub.close()


def test_qos2_pubrel_stage_survives_a_vanished_client(stack: Stack) -> None:
    """PUBREC'd but not completed: the next connection gets PUBREL, not the PUBLISH."""
    topic = stack.topic("t")
    sub = RawSubscriber(stack.broker.address, stack.client("sub"), level=5, receive_maximum=20)
    pub = Publisher(stack.broker.address, stack.client("pub"), topic, qos=2)
    try:
        sub.ack = lambda p: parse(p.payload)[1] <= 10  # PUBREC 1..10, hold 11..20
        sub.complete = False  # and never PUBCOMP
        sub.connect(subscribe=[(topic, 2)])
        pub.publish(30)
        pub.stop()
        assert pub.acked == set(range(1, 31))
        wait_until(lambda: len(sub.pubrels) >= 10 and len(sub.snapshot()) >= 20, 10, "flows")
        ids = {parse(r.payload)[1]: r.packet_id for r in sub.snapshot()}
        time.sleep(0.3)  # let the broker store the PUBREL stages it announced

        sub.abort()
        sub.ack = lambda p: True
        sub.complete = True
        assert sub.connect().session_present
        sub.wait_all([pub], timeout=15)
        wait_until(lambda: len(sub.pubrels) >= 20, 10, "PUBREL again")
        time.sleep(0.3)
        second = [r for r in sub.snapshot() if r.connection == 2]
        resent = {parse(r.payload)[1] for r in second}
        assert not resent & set(range(1, 11)), "PUBLISH again after PUBREC"
        assert {pid for pid, conn in sub.pubrels if conn == 2} >= {ids[s] for s in range(1, 11)}
        for r in second:
            seq = parse(r.payload)[1]
            if seq in ids:
                assert r.dup and r.packet_id == ids[seq], r
        assert_ok(check([pub], sub, exactly_once=True))
        assert sorted(parse(p)[1] for p in sub.delivered_qos2) == list(range(1, 31))
    finally:
        sub.close()
        pub.close()
