"""SUBSCRIBE / SUBACK and UNSUBSCRIBE / UNSUBACK (MQTT 5.0 spec 3.8-3.11)."""

from __future__ import annotations

from broker.packets import (
    Disconnect,
    Properties,
    ReasonCode,
    SubAck,
    Subscribe,
    Subscription,
    UnsubAck,
    Unsubscribe,
)
from tests.unit.core_harness import V311, Harness, payloads, publishes


def test_granted_qos_is_min_of_requested_and_maximum() -> None:
    """MQTT-3.8.4-6 / 3.2.2-9: the server may grant a lower QoS than requested."""
    h = Harness(maximum_qos=1)
    c = h.connected("c")
    assert c.subscribe("a", qos=0) == [0]
    assert c.subscribe("b", qos=1) == [1]
    assert c.subscribe("c", qos=2) == [1]


def test_suback_has_one_code_per_filter_in_order() -> None:
    """MQTT-3.8.4-5, -7 (3.1.1 MQTT-3.8.4-5)."""
    c = Harness().connected("c")
    codes = c.subscribe(
        Subscription("a", 2), Subscription("b", 0), Subscription("c/+", 1), Subscription("#", 2)
    )
    assert codes == [2, 0, 1, 2]


def test_invalid_filter_gets_0x8f_while_others_succeed_v5() -> None:
    h = Harness()
    c = h.connected("c")
    codes = c.subscribe(
        Subscription("ok/1", 1),
        Subscription("a/#/b", 1),
        Subscription("a+", 0),
        Subscription("ok/2"),
    )
    assert codes == [1, ReasonCode.TOPIC_FILTER_INVALID, ReasonCode.TOPIC_FILTER_INVALID, 0]
    assert not c.closed
    pub = h.connected("pub")
    pub.publish("ok/1", b"1")
    pub.publish("ok/2", b"2")
    assert payloads(c.read()) == [b"1", b"2"]


def test_invalid_filter_gets_0x80_while_others_succeed_v311() -> None:
    """3.1.1 spec 3.9.3: 0x80 is the only failure return code."""
    c = Harness().connected("c", V311)
    codes = c.subscribe(Subscription("ok", 1), Subscription("a/#/b", 1), Subscription("$share/g"))
    assert codes == [1, 0x80, 0x80]


def test_wildcards_off_gets_0xa2() -> None:
    c = Harness(wildcard_subscriptions=False).connected("c")
    assert c.subscribe("a/+", "a/#", "a/b") == [0xA2, 0xA2, 0]


def test_shared_subscriptions_off_gets_0x9e() -> None:
    c = Harness(shared_subscriptions=False).connected("c")
    assert c.subscribe("$share/g/a", "a") == [0x9E, 0]


def test_subscription_identifier_when_unsupported_is_disconnect_0xa1() -> None:
    c = Harness(subscription_identifiers=False).connected("c")
    c.send(Subscribe(1, [Subscription("a")], Properties(subscription_identifiers=(7,))))
    assert c.read() == [Disconnect(ReasonCode.SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED)]
    assert c.closed


def test_no_local_on_shared_subscription_is_a_protocol_error() -> None:
    """MQTT-3.8.3-4: No Local on a shared subscription is a Protocol Error."""
    h = Harness()
    c = h.connected("c")
    c.send(Subscribe(1, [Subscription("$share/g/a", 1, no_local=True)]))
    assert c.read() == [Disconnect(ReasonCode.PROTOCOL_ERROR)]
    assert c.closed


def test_resubscribe_replaces_the_subscription() -> None:
    """MQTT-3.8.4-3: same filter replaces the subscription, no duplicate delivery."""
    h = Harness()
    c = h.connected("c")
    c.subscribe("t", qos=0)
    c.subscribe("t", qos=1)
    pub = h.connected("pub")
    pub.publish("t", b"x", qos=1)
    pub.read()
    got = publishes(c.read())
    assert [(p.payload, p.qos) for p in got] == [(b"x", 1)]


def test_unsubscribe_stops_delivery_and_answers_success() -> None:
    h = Harness()
    c = h.connected("c")
    c.subscribe("t")
    ack = c.unsubscribe("t")
    assert ack.reason_codes == [ReasonCode.SUCCESS]
    h.connected("pub").publish("t")
    assert c.read() == []


def test_unsubscribe_unknown_filter_gets_0x11() -> None:
    """Spec 3.11.3: 0x11 No subscription existed."""
    c = Harness().connected("c")
    c.subscribe("a")
    assert c.unsubscribe("a", "b").reason_codes == [0, ReasonCode.NO_SUBSCRIPTION_EXISTED]


def test_unsubscribe_invalid_filter_gets_0x8f() -> None:
    c = Harness().connected("c")
    assert c.unsubscribe("a/#/b").reason_codes == [ReasonCode.TOPIC_FILTER_INVALID]


def test_v311_unsuback_has_no_reason_codes() -> None:
    """3.1.1 spec 3.11.3: UNSUBACK has no payload."""
    c = Harness().connected("c", V311)
    c.subscribe("a")
    c.send(Unsubscribe(9, ["a", "never"]))
    assert c.read() == [UnsubAck(9, [], None)]


def test_unsubscribe_shared_member() -> None:
    h = Harness()
    c = h.connected("c")
    c.subscribe("$share/g/t")
    assert c.unsubscribe("$share/g/t").reason_codes == [0]
    assert c.unsubscribe("$share/g/t").reason_codes == [0x11]


def test_dollar_topics_not_matched_by_leading_wildcards() -> None:
    """MQTT-4.7.2-1: '#' and '+' at the first level do not match topics starting with '$'.

    Not on $SYS, which clients may not publish to (tests/unit/test_sys_topics.py)."""
    h = Harness()
    hash_sub = h.connected("hash")
    hash_sub.subscribe("#")
    plus_sub = h.connected("plus")
    plus_sub.subscribe("+/info")
    sys_sub = h.connected("sys")
    sys_sub.subscribe("$dev/#")
    sys_plus = h.connected("sysplus")
    sys_plus.subscribe("$dev/+")
    pub = h.connected("pub")
    pub.publish("$dev/info", b"s")
    pub.publish("x/info", b"x")
    assert payloads(hash_sub.read()) == [b"x"]
    assert payloads(plus_sub.read()) == [b"x"]
    assert payloads(sys_sub.read()) == [b"s"]
    assert payloads(sys_plus.read()) == [b"s"]


def test_multi_level_wildcard_matches_the_parent_level() -> None:
    """Spec 4.7.1.2: 'sport/#' also matches 'sport'."""
    h = Harness()
    c = h.connected("c")
    c.subscribe("sport/#")
    pub = h.connected("pub")
    pub.publish("sport", b"parent")
    pub.publish("sport/tennis", b"child")
    assert payloads(c.read()) == [b"parent", b"child"]


def test_suback_packet_id_matches_subscribe() -> None:
    """MQTT-3.8.4-2."""
    c = Harness().connected("c")
    c.send(Subscribe(4242, [Subscription("a", 1)]))
    assert c.read() == [SubAck(4242, [1], None)]
