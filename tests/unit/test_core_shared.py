"""Shared subscriptions (MQTT 5.0 spec 4.8.2)."""

from __future__ import annotations

from broker.packets import Subscription
from tests.unit.core_harness import V311, Client, Harness, payloads, publishes


def _group(h: Harness, names: list[str], qos: int = 1, **kw: object) -> dict[str, Client]:
    members = {}
    for name in names:
        c = h.connected(name, **kw)
        assert c.subscribe("$share/g/jobs/+", qos=qos) == [qos]
        members[name] = c
    return members


def test_round_robin_one_member_per_message() -> None:
    """Spec 4.8.2: each message goes to exactly one member of the group."""
    h = Harness()
    members = _group(h, ["a", "b", "c"])
    pub = h.connected("pub")
    for i in range(9):
        pub.publish_acked("jobs/x", bytes([i]), qos=1)
    got = {name: [p.payload[0] for p in publishes(c.read())] for name, c in members.items()}
    assert got == {"a": [0, 3, 6], "b": [1, 4, 7], "c": [2, 5, 8]}


def test_two_groups_and_a_plain_subscriber_each_get_a_copy() -> None:
    h = Harness()
    g1 = h.connected("g1")
    g1.subscribe("$share/one/t")
    g2 = h.connected("g2")
    g2.subscribe("$share/two/t")
    plain = h.connected("plain")
    plain.subscribe("t")
    h.connected("pub").publish("t", b"m")
    assert payloads(g1.read()) == [b"m"]
    assert payloads(g2.read()) == [b"m"]
    assert payloads(plain.read()) == [b"m"]


def test_prefers_online_members() -> None:
    """A member whose session is offline is skipped while another is online."""
    h = Harness()
    members = _group(h, ["a", "b", "c"], session_expiry_interval=3600)
    members["b"].disconnect()
    pub = h.connected("pub")
    for i in range(6):
        pub.publish_acked("jobs/x", bytes([i]), qos=1)
    a = [p.payload[0] for p in publishes(members["a"].read())]
    c = [p.payload[0] for p in publishes(members["c"].read())]
    assert sorted(a + c) == list(range(6))
    assert a and c
    back = h.client()
    back.connect("b", clean_start=False, session_expiry_interval=3600)
    assert back.pending == []


def test_all_members_offline_message_is_queued_not_lost() -> None:
    h = Harness()
    members = _group(h, ["a", "b"], session_expiry_interval=3600)
    for c in members.values():
        c.disconnect()
    pub = h.connected("pub")
    assert pub.publish_acked("jobs/x", b"m", qos=1) == 0
    got = []
    for name in members:
        back = h.client()
        back.connect(name, clean_start=False, session_expiry_interval=3600)
        got += payloads(back.pending)
    assert got == [b"m"]


def test_shared_delivery_qos_is_min_of_member_grant() -> None:
    h = Harness()
    a = h.connected("a")
    a.subscribe(Subscription("$share/g/t", 0))
    pub = h.connected("pub")
    pub.publish_acked("t", b"m", qos=2)
    (got,) = publishes(a.read())
    assert got.qos == 0


def test_shared_with_v311_member() -> None:
    h = Harness()
    a = h.connected("a", V311)
    assert a.subscribe("$share/g/t", qos=1) == [1]
    h.connected("pub").publish_acked("t", b"m", qos=1)
    (got,) = publishes(a.read())
    assert (got.payload, got.qos, got.packet_id) == (b"m", 1, 1)


def test_member_leaving_keeps_the_group_going() -> None:
    h = Harness()
    members = _group(h, ["a", "b", "c"])
    members["b"].unsubscribe("$share/g/jobs/+")
    pub = h.connected("pub")
    for i in range(4):
        pub.publish_acked("jobs/x", bytes([i]), qos=1)
    a = [p.payload[0] for p in publishes(members["a"].read())]
    c = [p.payload[0] for p in publishes(members["c"].read())]
    assert members["b"].read() == []
    assert sorted(a + c) == [0, 1, 2, 3]
    assert len(a) == len(c) == 2


def test_non_persistent_member_disconnect_removes_it() -> None:
    h = Harness()
    members = _group(h, ["a", "b"])
    members["a"].conn.connection_lost()
    pub = h.connected("pub")
    for i in range(3):
        pub.publish_acked("jobs/x", bytes([i]), qos=1)
    assert payloads(members["b"].read()) == [b"\x00", b"\x01", b"\x02"]
