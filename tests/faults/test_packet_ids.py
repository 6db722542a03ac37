"""Packet ids assigned by the store, seen through the broker.

A wrap past 65535 takes too long end to end on 2 cores; it is covered at
store level (tests/integration/test_redis_store.py). Here ~2,000 messages to
a 3.1.1 persistent subscriber: ids 1..2000 in order, none used twice.
"""

from __future__ import annotations

from collections import Counter

import pytest

from tests.faults.checker import Publisher, RawSubscriber, assert_ok, check, parse
from tests.faults.conftest import Stack

N = 2000


@pytest.mark.parametrize("online", [True, False], ids=["online", "replay"])
def test_packet_ids_follow_the_store(stack: Stack, online: bool) -> None:
    topic = stack.topic("t")
    sub = RawSubscriber(stack.broker.address, stack.client("sub"), level=4)
    pub = Publisher(stack.broker.address, stack.client("pub"), topic, window=200)
    try:
        sub.connect(subscribe=[(topic, 1)])
        if not online:
            sub.close()
        pub.publish(N)
        pub.stop()
        assert pub.acked == set(range(1, N + 1))
        if not online:
            assert sub.connect().session_present
        sub.wait_all([pub], timeout=30)
        got = sub.snapshot()
        assert len(got) == N, "repeats on a healthy connection"
        assert [r.packet_id for r in got] == list(range(1, N + 1))
        assert [parse(r.payload)[1] for r in got] == list(range(1, N + 1))
        assert max(Counter(r.packet_id for r in got).values()) == 1
        assert not any(r.dup for r in got)
        assert_ok(check([pub], sub))
    finally:
        sub.close()
        pub.close()
