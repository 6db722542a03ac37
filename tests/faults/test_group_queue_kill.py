"""A group queue's entries in flight to a member when its broker is killed
($queue, broker/group_queue.py).

The killed broker gives nothing back: its members' claims hold until their
lease (``group_queues.lease``) runs out, since nobody renews them. Then the
entries are free again and another member gets them, with DUP (they may
have been seen). Nothing acknowledged to the publisher is lost.
"""

from __future__ import annotations

import contextlib
import time

from broker.packets import ConnAck, Properties, PubAck, Publish, SubAck, Subscribe, Subscription
from tests.e2e.clients import Raw
from tests.faults.conftest import Stack

LEASE = 2.0
EXPIRY = Properties(session_expiry_interval=600)


def _connect(stack: Stack, client_id: str, topic_filter: str) -> Raw:
    """A persistent member, subscribed; tried again while a restarted broker restores."""
    for _ in range(100):
        raw = Raw(stack.broker)
        with contextlib.suppress(AssertionError, OSError):
            connack = raw.connect(client_id, clean_start=False, properties=EXPIRY)
            if isinstance(connack, ConnAck) and connack.reason_code == 0:
                raw.send(Subscribe(1, [Subscription(topic_filter, 1)]))
                assert isinstance(raw.recv(), SubAck)
                return raw
        raw.close()
        time.sleep(0.1)
    raise AssertionError(f"{client_id} could not connect")


def test_entries_in_flight_to_a_killed_brokers_member_go_to_another_after_the_lease(
    stack_factory: callable,  # type: ignore[valid-type]
) -> None:
    stack: Stack = stack_factory({"group_queues.lease": LEASE})
    topic, group = stack.topic("t"), f"$queue/g/{stack.topic('#')}"
    a = _connect(stack, stack.client("a"), group)
    producer = Raw(stack.broker)
    producer.connect(stack.client("producer"))
    for i in range(3):
        producer.send(Publish(topic, b"m%d" % i, 1, packet_id=i + 1))
        ack = producer.recv()
        assert isinstance(ack, PubAck) and ack.reason_code == 0
    held = [a.recv() for _ in range(3)]  # in flight to a, never acknowledged
    assert all(isinstance(p, Publish) for p in held)
    a.close()
    producer.close()

    stack.broker.kill()  # a's claims are not given back: nobody is there to
    stack.broker.start()
    started = time.monotonic()
    b = _connect(stack, stack.client("b"), group)
    got: list[Publish] = []
    while len(got) < 3:
        packet = b.recv(timeout=LEASE * 5)
        assert isinstance(packet, Publish) and packet.packet_id is not None
        got.append(packet)
        b.send(PubAck(packet.packet_id))
    assert sorted(p.payload for p in got) == [b"m0", b"m1", b"m2"]
    assert all(p.dup for p in got)  # they may have been seen by a
    # Once the lease lapsed, within a renewal round or two (members claim again then).
    assert time.monotonic() - started < LEASE * 5
    assert b.recv_or_none(1.0) is None  # once each
    b.close()
