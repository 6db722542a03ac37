"""Retained messages (MQTT 5.0 spec 3.3.1.3, 3.8.3.1 Retain Handling)."""

from __future__ import annotations

from broker.packets import Publish, Subscription
from tests.unit.core_harness import V311, Harness, payloads, publishes


def test_retained_message_sent_to_new_subscriber_with_retain_1() -> None:
    """MQTT-3.3.1-5, -8: stored and sent to future subscribers with RETAIN set."""
    h = Harness()
    pub = h.connected("pub")
    pub.publish("room/temp", b"21", retain=True)
    sub = h.connected("sub")
    sub.subscribe("room/+")
    assert sub.pending == [Publish("room/temp", b"21", 0, True, False, None, None)]


def test_retained_message_replaced_by_next_retained() -> None:
    """MQTT-3.3.1-5: the new retained message replaces the old one."""
    h = Harness()
    pub = h.connected("pub")
    pub.publish("t", b"old", retain=True)
    pub.publish("t", b"new", retain=True)
    pub.publish("t", b"not retained")
    sub = h.connected("sub")
    sub.subscribe("t")
    assert payloads(sub.pending) == [b"new"]


def test_empty_retained_payload_deletes_and_is_delivered_live() -> None:
    """MQTT-3.3.1-6, -7: a zero-byte retained PUBLISH removes the retained message,
    and is delivered to current subscribers as a normal message."""
    h = Harness()
    live = h.connected("live")
    live.subscribe("t")
    pub = h.connected("pub")
    pub.publish("t", b"v", retain=True)
    pub.publish("t", b"", retain=True)
    assert payloads(live.read()) == [b"v", b""]
    later = h.connected("later")
    later.subscribe("t")
    assert later.pending == []
    assert len(h.broker.retained) == 0


def test_retained_qos_is_min_of_message_and_granted() -> None:
    h = Harness()
    pub = h.connected("pub")
    pub.publish_acked("a", b"2", qos=2, retain=True)
    pub.publish_acked("b", b"1", qos=1, retain=True)
    sub = h.connected("sub")
    sub.subscribe("a", "b", qos=1)
    got = publishes(sub.pending)
    assert [(p.topic, p.qos, p.retain) for p in got] == [("a", 1, True), ("b", 1, True)]


def test_retained_v311_sent_with_retain_flag() -> None:
    """3.1.1 MQTT-3.3.1-8."""
    h = Harness()
    h.connected("pub").publish("t", b"r", retain=True)
    sub = h.connected("sub", V311)
    sub.subscribe("t")
    assert sub.pending == [Publish("t", b"r", 0, True, False, None, None)]


def test_retain_handling_0_sends_at_every_subscribe() -> None:
    """MQTT-3.3.1-9."""
    h = Harness()
    h.connected("pub").publish("t", b"r", retain=True)
    sub = h.connected("sub")
    sub.subscribe(Subscription("t", 0, retain_handling=0))
    assert payloads(sub.pending) == [b"r"]
    sub.subscribe(Subscription("t", 0, retain_handling=0))
    assert payloads(sub.pending) == [b"r"]


def test_retain_handling_1_sends_only_for_a_new_subscription() -> None:
    """MQTT-3.3.1-10."""
    h = Harness()
    h.connected("pub").publish("t", b"r", retain=True)
    sub = h.connected("sub")
    sub.subscribe(Subscription("t", 0, retain_handling=1))
    assert payloads(sub.pending) == [b"r"]
    sub.subscribe(Subscription("t", 0, retain_handling=1))
    assert sub.pending == []


def test_retain_handling_2_never_sends() -> None:
    """MQTT-3.3.1-11."""
    h = Harness()
    h.connected("pub").publish("t", b"r", retain=True)
    sub = h.connected("sub")
    sub.subscribe(Subscription("t", 0, retain_handling=2))
    assert sub.pending == []


def test_retained_not_sent_to_shared_subscription() -> None:
    """MQTT-4.8.2: retained messages are not sent on a Shared Subscription."""
    h = Harness()
    h.connected("pub").publish("t", b"r", retain=True)
    sub = h.connected("sub")
    assert sub.subscribe("$share/g/t") == [0]
    assert sub.pending == []
    assert sub.read() == []


def test_retained_carries_subscription_identifier() -> None:
    h = Harness()
    h.connected("pub").publish("t", b"r", retain=True)
    sub = h.connected("sub")
    sub.subscribe("t", sub_id=33)
    (got,) = publishes(sub.pending)
    assert got.properties is not None and got.properties.subscription_identifiers == (33,)


def test_retained_message_expires() -> None:
    """MQTT-3.3.2-5: an expired retained message is not sent; the rest carries the
    remaining interval (MQTT-3.3.2-6)."""
    h = Harness()
    h.connected("pub").publish("t", b"r", retain=True, message_expiry_interval=10)
    h.advance(4)
    early = h.connected("early")
    early.subscribe("t")
    (got,) = publishes(early.pending)
    assert got.properties is not None and got.properties.message_expiry_interval == 6
    h.advance(7)
    late = h.connected("late")
    late.subscribe("t")
    assert late.pending == []


def test_retained_matched_by_wildcards_but_not_dollar_topics() -> None:
    h = Harness()
    pub = h.connected("pub")
    pub.publish("$SYS/x", b"s", retain=True)
    pub.publish("a/b/c", b"abc", retain=True)
    pub.publish("a/x", b"ax", retain=True)
    sub = h.connected("sub")
    sub.subscribe("#")
    assert sorted(payloads(sub.pending)) == [b"abc", b"ax"]
    sub2 = h.connected("sub2")
    sub2.subscribe("a/+/c")
    assert payloads(sub2.pending) == [b"abc"]
