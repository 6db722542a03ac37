"""A QoS 2 publisher whose broker is killed between PUBREC and PUBREL.

PUBREC promises the publisher that the broker holds the message and will not
deliver it twice; the publisher then re-sends the PUBLISH (DUP=1) after a
reconnect if it never got PUBCOMP. A broker that kept the received id only in
memory would route that re-send as a new message after the crash, and a
persistent subscriber would receive a second copy without DUP.
"""

from __future__ import annotations

import time

import pytest

from broker.packets import ConnAck, PubComp, Publish, PubRec, PubRel, Subscribe, Subscription
from tests.e2e.clients import Raw
from tests.faults.conftest import Stack


@pytest.mark.parametrize("level", [5, 4], ids=["v5", "v311"])
def test_qos2_resend_after_broker_crash_is_not_delivered_twice(stack: Stack, level: int) -> None:
    topic = stack.topic("q2")
    broker = stack.broker
    expiry = {"properties": None}
    if level == 5:
        from broker.packets import Properties

        expiry = {"properties": Properties(session_expiry_interval=3600)}
    with Raw(broker, level=level) as sub:
        ack = sub.connect(stack.client("sub"), clean_start=False, **expiry)
        assert isinstance(ack, ConnAck) and ack.reason_code == 0
        sub.send(Subscribe(1, [Subscription(topic, qos=2)]))
        sub.recv()  # SUBACK: the subscription is saved before it is sent

    pub = Raw(broker, level=level)
    try:
        pub.connect(stack.client("pub"), clean_start=False, **expiry)
        pub.send(Publish(topic, b"once", qos=2, packet_id=7))
        rec = pub.recv()
        assert isinstance(rec, PubRec) and rec.packet_id == 7 and rec.reason_code == 0
    finally:
        pub.close()

    broker.kill()  # before PUBREL: the broker holds id 7 for this publisher
    broker.start()

    with Raw(broker, level=level) as pub:
        ack = pub.connect(stack.client("pub"), clean_start=False, **expiry)
        assert isinstance(ack, ConnAck) and ack.session_present
        pub.send(Publish(topic, b"once", qos=2, dup=True, packet_id=7))
        rec = pub.recv()
        assert isinstance(rec, PubRec) and rec.packet_id == 7
        pub.send(PubRel(7))
        comp = pub.recv()
        assert isinstance(comp, PubComp) and comp.reason_code == 0
        # Id 7 is free again: a new message with it is a new message.
        pub.send(Publish(topic, b"next", qos=2, packet_id=7))
        assert isinstance(pub.recv(), PubRec)
        pub.send(PubRel(7))
        assert isinstance(pub.recv(), PubComp)

    with Raw(broker, level=level) as sub:
        sub.connect(stack.client("sub"), clean_start=False, **expiry)
        payloads = []
        # The restarted broker's consumer rejoins its group first (seconds, on the
        # embedded Kafka): wait for both, then a moment more for a (wrong) third.
        deadline = time.monotonic() + 30
        while len(payloads) < 3:
            wait = deadline - time.monotonic() if len(payloads) < 2 else 1.0
            packet = sub.recv_or_none(timeout=max(wait, 0.1))
            if packet is None:
                break
            if isinstance(packet, Publish):
                payloads.append(packet.payload)
                assert packet.packet_id is not None
                sub.send(PubRec(packet.packet_id))
            elif isinstance(packet, PubRel):
                sub.send(PubComp(packet.packet_id))
    assert payloads == [b"once", b"next"]
