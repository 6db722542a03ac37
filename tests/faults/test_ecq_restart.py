"""A queue ($ECQ) entry in flight to a persistent session when the broker is killed
(found by the model checker, seed 7116 of the queues scenario).

The queue's entries get their packet identifiers when they first go out. A
broker that restarts knew nothing of them: it gave a stored message of the
session the identifier the client still held for an unacknowledged queue
entry. Now a persistent session's entries are recorded in flight under their
identifiers before they go, and the restarted broker sends them again under
those identifiers, with DUP, before any other message takes one.
"""

from __future__ import annotations

import contextlib
import time

import pytest

from broker.packets import (
    ConnAck,
    Properties,
    PubAck,
    Publish,
    SubAck,
    Subscribe,
    Subscription,
    UnsubAck,
    Unsubscribe,
)
from tests.e2e.clients import Raw
from tests.faults.conftest import Stack


def _publish(stack: Stack, topic: str, payload: bytes) -> None:
    producer = Raw(stack.broker)
    try:
        producer.connect(stack.client(f"producer-{time.monotonic_ns()}"))
        producer.send(Publish(topic, payload, 1, packet_id=1))
        ack = producer.recv()
        assert isinstance(ack, PubAck) and ack.reason_code == 0
    finally:
        producer.close()


@pytest.mark.parametrize("unsubscribed", [False, True], ids=["consuming", "unsubscribed"])
def test_a_queue_entry_in_flight_keeps_its_packet_id_across_a_broker_kill(
    stack: Stack, unsubscribed: bool
) -> None:
    """``unsubscribed`` (found by review): the queue's subscription went before the
    kill, with the entry still in flight; the resumed session holds no queue
    subscription, and its record is read back all the same."""
    queue, topic = stack.client("device"), stack.topic("t")
    expiry = Properties(session_expiry_interval=600)
    consumer = Raw(stack.broker)
    consumer.connect(queue, clean_start=True, properties=expiry)
    consumer.send(Subscribe(1, [Subscription(f"$ECQ/{queue}/#", 1), Subscription(topic, 1)]))
    assert isinstance(consumer.recv(), SubAck)
    _publish(stack, f"$ECQ/w/{queue}/k", b"queued")
    entry = consumer.recv()
    assert isinstance(entry, Publish) and entry.payload == b"queued" and entry.packet_id
    if unsubscribed:
        consumer.send(Unsubscribe(2, [f"$ECQ/{queue}/#"]))
        assert isinstance(consumer.recv(), UnsubAck)
    # Held, not acknowledged. A message of the session's own is stored meanwhile, its
    # packet identifier counted by the store (the first: the one the entry holds).
    _publish(stack, topic, b"stored")
    assert consumer.recv_or_none(1.0) is None  # it waits for the identifier
    consumer.close()

    stack.broker.kill()
    stack.broker.start()

    again = Raw(stack.broker)
    connack = None
    for _ in range(100):  # the restarted broker may still be restoring sessions
        with contextlib.suppress(AssertionError, OSError):  # refused, or closed
            connack = again.connect(queue, clean_start=False, properties=expiry)
            if isinstance(connack, ConnAck) and connack.reason_code == 0:
                break
        again.close()
        time.sleep(0.1)
        again = Raw(stack.broker)
    assert isinstance(connack, ConnAck) and connack.session_present
    first = again.recv()
    assert isinstance(first, Publish)
    assert (first.packet_id, first.payload, first.dup) == (entry.packet_id, b"queued", True)
    # Nothing else under that identifier while it is held.
    assert again.recv_or_none(1.0) is None
    again.send(PubAck(entry.packet_id))
    stored = again.recv()
    assert isinstance(stored, Publish) and stored.payload == b"stored"
    assert stored.packet_id is not None
    again.send(PubAck(stored.packet_id))
    again.close()
