"""Offline queueing and replay through Kafka and Redis (real processes, paho clients)."""

from __future__ import annotations

import pytest

from tests.faults.checker import V5, V311, PahoSubscriber, Publisher, assert_ok, check
from tests.faults.conftest import Stack

N = 500


@pytest.mark.parametrize("version", [V5, V311], ids=["v5", "v311"])
def test_offline_messages_replayed_in_order_without_dup(stack: Stack, version: int) -> None:
    topic = stack.topic("t")
    sub = PahoSubscriber(stack.broker.address, stack.client("sub"), version=version)
    pub = None
    try:
        assert sub.connect() is False
        sub.subscribe(topic, qos=1)
        sub.close()

        pub = Publisher(stack.broker.address, stack.client("pub"), topic, version=version)
        pub.publish(N)
        pub.stop()
        assert pub.acked == set(range(1, N + 1)), f"failed: {sorted(pub.failed)[:10]}"

        assert sub.connect() is True
        sub.wait_all([pub], timeout=20)
        report = check([pub], sub)
        assert_ok(report)
        received = sub.snapshot()
        assert len(received) == N, f"{len(received) - N} extra deliveries"
        assert not any(r.dup for r in received), "never sent before, yet DUP=1"
        assert [r.payload for r in received] == [
            f"{pub.name}:{i}".encode() for i in range(1, N + 1)
        ]
    finally:
        sub.close()
        if pub is not None:
            pub.close()
