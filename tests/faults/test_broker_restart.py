"""devicemq itself dies (SIGKILL) or is stopped (SIGTERM) while messages flow.

Redis and Kafka stay up; the broker restarts on the same port, data dir,
Redis and Kafka topic, and the clients reconnect by themselves.
"""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest

from tests.faults.checker import (
    V5,
    V311,
    PahoSubscriber,
    Publisher,
    RawSubscriber,
    assert_ok,
    check,
    start_publishers,
    wait_until,
)
from tests.faults.conftest import Stack
from tests.kafka_fixtures import freeze


@pytest.mark.parametrize("version", [V5, V311], ids=["v5", "v311"])
def test_sigkill_mid_stream_loses_nothing_acknowledged(stack: Stack, version: int) -> None:
    topic = stack.topic("t")
    sub = PahoSubscriber(stack.broker.address, stack.client("sub"), version=version)
    pubs: list[Publisher] = []
    try:
        sub.connect()
        sub.subscribe(topic + "/#", qos=1)
        for i in range(2):
            pub = Publisher(
                stack.broker.address, stack.client(f"pub{i}"), f"{topic}/{i}", version=version
            )
            pubs.append(pub)
            pub.start(interval=0.003)
        wait_until(lambda: len(sub.snapshot()) > 300, 15, "traffic before the kill")
        stack.broker.kill()
        time.sleep(0.3)
        stack.broker.start()
        sub.wait_connected()
        wait_until(lambda: all(p.connects >= 2 for p in pubs), 15, "publishers to reconnect")
        before = [len(p.acked) for p in pubs]
        wait_until(
            lambda: all(len(p.acked) > b + 100 for p, b in zip(pubs, before, strict=True)),
            15,
            "traffic after the restart",
        )
        for pub in pubs:
            pub.stop()
        sub.wait_all(pubs, timeout=30)
        report = check(pubs, sub)
        assert_ok(report)
        assert all(p.disconnects >= 1 for p in pubs)
        assert sub.connections >= 2 and sub.session_present[-1] is True
    finally:
        sub.close()
        for pub in pubs:
            pub.close()


def test_sigkill_mid_stream_qos2_exactly_once(stack: Stack) -> None:
    topic = stack.topic("t")
    sub = RawSubscriber(stack.broker.address, stack.client("sub"), level=5)
    pubs: list[Publisher] = []
    try:
        sub.connect(subscribe=[(topic + "/#", 2)], reconnect=True)
        start_publishers(pubs, stack, topic, qos=2)
        wait_until(lambda: len(sub.snapshot()) > 200, 15, "traffic before the kill")
        stack.broker.kill()
        time.sleep(0.3)
        stack.broker.start()
        wait_until(lambda: sub.connections >= 2, 15, "subscriber to reconnect")
        wait_until(lambda: all(p.connects >= 2 for p in pubs), 15, "publishers to reconnect")
        before = [len(p.acked) for p in pubs]
        wait_until(
            lambda: all(len(p.acked) > b + 100 for p, b in zip(pubs, before, strict=True)),
            15,
            "traffic after the restart",
        )
        for pub in pubs:
            pub.stop()
        sub.wait_all(pubs, timeout=30)
        time.sleep(0.5)  # let any (wrong) re-delivery show up
        report = check(pubs, sub, exactly_once=True)
        assert_ok(report)
        assert sub.connacks[-1].session_present
    finally:
        sub.close()
        for pub in pubs:
            pub.close()


def test_sigterm_drains_everything_acknowledged(stack: Stack) -> None:
    """Publishers acknowledged, SIGTERM right away: after a restart it is all there.

    One subscriber is online at the SIGTERM (paho 5.0), one is offline (raw
    3.1.1): the first reconnects by itself, the second comes back after the
    restart and gets its backlog.
    """
    topic = stack.topic("t")
    online = PahoSubscriber(stack.broker.address, stack.client("online"), version=V5)
    offline = RawSubscriber(stack.broker.address, stack.client("offline"), level=4)
    pubs: list[Publisher] = []
    try:
        online.connect()
        online.subscribe(topic + "/#", qos=1)
        offline.connect(subscribe=[(topic + "/#", 1)])
        offline.close()
        start_publishers(pubs, stack, topic, interval=0.002)
        wait_until(lambda: all(len(p.acked) > 400 for p in pubs), 15, "traffic")
        assert stack.broker.terminate() == 0, stack.broker.log()[-3000:]
        acked_at_stop = [set(p.acked) for p in pubs]
        stack.broker.start()
        online.wait_connected()
        for pub in pubs:
            pub.stop()
        offline.connect()
        offline.wait_all(pubs, timeout=30)
        online.wait_all(pubs, timeout=30)
        for sub in (online, offline):
            assert_ok(check(pubs, sub))
        for pub, acked in zip(pubs, acked_at_stop, strict=True):
            assert acked <= offline.seqs(pub.name)
        assert offline.connacks[-1].session_present
    finally:
        online.close()
        offline.close()
        for pub in pubs:
            pub.close()


def test_a_second_sigterm_ends_a_drain_that_a_paused_kafka_holds(stack_factory) -> None:  # type: ignore[no-untyped-def]
    """A PUBLISH for a persistent subscriber waits for a paused Kafka, so the drain
    after SIGTERM waits too (up to the request timeout, a minute here). A second
    SIGTERM exits at once with status 1, as after a crash: nothing acknowledged
    is lost. On the code before, it was ignored and the process stayed until
    Kafka answered. The drain's own bound, ``app.serve.SHUTDOWN_TIMEOUT``, exits
    the same way."""
    from broker.packets import Publish
    from tests.e2e.clients import Raw

    stack: Stack = stack_factory({"persistence.kafka_request_timeout_ms": 60_000})
    broker = stack.broker
    assert broker.proc is not None and stack.tansu_pid is not None
    topic = stack.topic("t")
    sub = RawSubscriber(broker.address, stack.client("sub"), level=5)
    pub = Raw(broker, level=5)
    try:
        sub.connect(subscribe=[(topic, 1)])
        pub.connect(stack.client("pub"))
        # Stopped before the PUBLISH, every thread: CI once saw it acknowledged at
        # once (cause not found; a stop still under way is one way, and the first
        # thread's state, checked then, says nothing of Tansu's other threads).
        freeze(stack.tansu_pid)
        pub.send(Publish(topic, b"m", qos=1, packet_id=1))
        assert pub.recv_or_none(timeout=1.0) is None  # waits for Kafka: the drain will too
        os.kill(broker.proc.pid, signal.SIGTERM)
        wait_until(lambda: not _accepting(broker.address), 10, "the listener to close")
        os.kill(broker.proc.pid, signal.SIGTERM)
        assert broker.proc.wait(10) == 1
        assert "a second signal during the drain: exiting" in broker.log()
    finally:
        os.kill(stack.tansu_pid, signal.SIGCONT)
        pub.close()
        sub.close()


def _accepting(address: tuple[str, int]) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(address) == 0
