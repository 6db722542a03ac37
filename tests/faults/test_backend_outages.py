"""Redis restarts and Kafka stalls under traffic: the broker rides them out.

Redis: a real restart (SIGTERM, which makes redis-server fsync its AOF and
exit, then a new redis-server on the same port and dir). Kafka: Tansu keeps
its data in memory only, so it is paused (SIGSTOP) rather than restarted;
its clients see it as unreachable until SIGCONT.
"""

from __future__ import annotations

import os
import signal
import time

from tests.faults.checker import (
    V5,
    V311,
    PahoSubscriber,
    Publisher,
    assert_ok,
    check,
    start_publishers,
    wait_until,
)
from tests.faults.conftest import Stack
from tests.kafka_fixtures import freeze


def _grows(pubs: list[Publisher], by: int, timeout: float, what: str) -> None:
    before = [len(p.acked) for p in pubs]
    wait_until(
        lambda: all(len(p.acked) >= b + by for p, b in zip(pubs, before, strict=True)),
        timeout,
        what,
    )


def test_redis_restart_while_publishing(stack: Stack) -> None:
    topic = stack.topic("t")
    subs = [
        PahoSubscriber(stack.broker.address, stack.client(f"sub-{v}"), version=v)
        for v in (V5, V311)
    ]
    pubs: list[Publisher] = []
    try:
        for sub in subs:
            sub.connect()
            sub.subscribe(topic + "/#", qos=1)
        start_publishers(pubs, stack, topic)
        _grows(pubs, 200, 15, "traffic before the Redis restart")
        stack.redis.stop()
        time.sleep(2.0)
        stack.redis.start()
        _grows(pubs, 200, 20, "traffic after the Redis restart")
        for pub in pubs:
            pub.stop()
        for sub in subs:
            sub.wait_all(pubs, timeout=30)
            assert_ok(check(pubs, sub))
        assert stack.broker.alive(), stack.broker.log()[-3000:]
        assert "failed" in stack.broker.log()  # it did notice the outage
    finally:
        for sub in subs:
            sub.close()
        for pub in pubs:
            pub.close()


def test_kafka_unreachable_for_a_while(stack_factory) -> None:  # type: ignore[no-untyped-def]
    """No success code for what Kafka did not take; service resumes after SIGCONT."""
    stack: Stack = stack_factory({"persistence.kafka_request_timeout_ms": 2000})
    assert stack.tansu_pid is not None
    topic = stack.topic("t")
    sub = PahoSubscriber(stack.broker.address, stack.client("sub"), version=V5)
    pubs: list[Publisher] = []
    paused = False
    try:
        sub.connect()
        sub.subscribe(topic + "/#", qos=1)
        start_publishers(pubs, stack, topic)
        _grows(pubs, 200, 15, "traffic before the Kafka stall")
        freeze(stack.tansu_pid)
        paused = True
        time.sleep(5.0)
        os.kill(stack.tansu_pid, signal.SIGCONT)
        paused = False
        _grows(pubs, 200, 25, "traffic after Kafka came back")
        for pub in pubs:
            pub.stop()
        sub.wait_all(pubs, timeout=30)
        assert_ok(check(pubs, sub))
        v5 = pubs[0]
        # Which publisher's messages were in the produce request that timed out is
        # a matter of timing; messages queued behind it wait for Kafka instead.
        felt = bool(v5.failed) or pubs[1].disconnects >= 1
        assert felt, (
            "nobody saw a failure during a 5 s Kafka stall: "
            f"v5 {len(v5.acked)} acked, {len(v5.failed)} failed; "
            f"3.1.1 {len(pubs[1].acked)} acked, {pubs[1].disconnects} disconnects"
        )
        assert all(rc == 0x80 or rc < 0x80 for rc in v5.outcomes.values() if rc is not None)
        assert stack.broker.alive(), stack.broker.log()[-3000:]
    finally:
        if paused:
            os.kill(stack.tansu_pid, signal.SIGCONT)
        sub.close()
        for pub in pubs:
            pub.close()


def test_a_311_publisher_is_not_read_while_kafka_owes_it_receive_maximum(stack_factory) -> None:  # type: ignore[no-untyped-def]
    """Finding 7 of the persistent path: a 3.1.1 publisher has no in-flight cap of its
    own, so during a Kafka stall its QoS 1 publishes queued in the broker without
    bound. Now the broker stops reading it at mqtt.receive_maximum acknowledgements
    owed: the client's socket fills and blocks, and everything it got to send is
    acknowledged once Kafka is back."""
    from broker.packets import Connect, PubAck, Publish, Subscribe, Subscription
    from tests.e2e.clients import Raw

    stack: Stack = stack_factory({"mqtt.receive_maximum": 50})
    assert stack.tansu_pid is not None
    topic = stack.topic("t")
    with Raw(stack.broker, level=5) as sub:  # a persistent subscriber: records go to Kafka
        from broker.packets import Properties

        sub.send(
            Connect(
                stack.client("sub"),
                protocol_level=5,
                clean_start=False,
                properties=Properties(session_expiry_interval=600),
            )
        )
        sub.recv()
        sub.send(Subscribe(1, [Subscription(topic, qos=1)]))
        sub.recv()
    payload = b"x" * 65536
    pub = Raw(stack.broker, level=4)
    freeze(stack.tansu_pid)
    try:
        pub.connect(stack.client("pub"), clean_start=True)
        pub.sock.settimeout(2.0)
        sent = 0
        try:
            for packet_id in range(1, 5001):  # 320 MB if nothing pushed back
                pub.send(Publish(topic, payload, qos=1, packet_id=packet_id))
                sent = packet_id
        except TimeoutError:
            pass
        # 50 owed, plus what the two sockets' buffers hold (a few MB on loopback)
        assert sent < 500, f"the broker kept reading: {sent} publishes of 64 KiB taken"
    finally:
        os.kill(stack.tansu_pid, signal.SIGCONT)
    pub.sock.settimeout(30)
    acked = set()
    while len(acked) < sent:
        packet = pub.recv()
        if isinstance(packet, PubAck):
            acked.add(packet.packet_id)
    assert acked == set(range(1, sent + 1))
    pub.close()


def test_a_retained_message_is_acknowledged_only_once_redis_has_it(stack_factory) -> None:  # type: ignore[no-untyped-def]
    """Finding 7 of the persistent path: a retained message was acknowledged before its
    Redis write, so a broker crash right after the PUBACK lost it. With Redis paused
    no PUBACK can come; once Redis answers, the PUBACK does, and Redis has it."""
    import redis as redis_py

    from broker.packets import PubAck, Publish
    from tests.e2e.clients import Raw

    stack: Stack = stack_factory({"persistence.kafka_request_timeout_ms": 30_000})
    assert stack.redis.proc is not None
    topic = stack.topic("state")
    pub = Raw(stack.broker, level=5)
    try:
        pub.connect(stack.client("pub"))
        freeze(stack.redis.proc.pid)
        try:
            pub.send(Publish(topic, b"on", qos=1, retain=True, packet_id=1))
            assert pub.recv_or_none(timeout=1.5) is None, "acknowledged before Redis had it"
        finally:
            os.kill(stack.redis.proc.pid, signal.SIGCONT)
        ack = pub.recv_or_none(timeout=15)
        assert isinstance(ack, PubAck) and ack.packet_id == 1 and ack.reason_code < 0x80
        stored = redis_py.Redis.from_url(stack.redis.url).hget("devicemq:retained", topic)
        assert stored is not None and stored.endswith(b"on")
    finally:
        pub.close()
