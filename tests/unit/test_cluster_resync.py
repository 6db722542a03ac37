"""broker/cluster.py rules for missed messages and dead replicas, without a network:
re-sync after a lost pub/sub connection, a replica gone (heartbeat expired),
the ``retained`` notice."""

from __future__ import annotations

from broker.cluster import RETAINED, RemoteSession
from broker.message import Message
from tests.unit.test_cluster_state import Node, pump


def test_a_resync_drops_the_records_no_snapshot_confirms() -> None:
    a, b = Node("a"), Node("b")
    b.connect("live")
    b.subscribe("live", "t")
    conn = b.connect("ended")
    b.subscribe("ended", "t")
    b.connect("durable", expiry=600)
    b.subscribe("durable", "t")
    pump(b, a)
    conn.close(publish_will=False)
    b.state.data_to_send()  # a missed the ``end`` (its pub/sub connection dropped)
    assert "ended" in a.broker.sessions
    a.state.resync()
    pump(a, b)  # a's ``sync`` -> b answers with snapshots
    pump(b, a)
    a.state.resync_done()
    assert "ended" not in a.broker.sessions
    live = a.broker.sessions["live"]
    assert isinstance(live, RemoteSession) and live.online
    assert {s.client_id for s, _ in a.broker.resolve(Message("t", b"", 0, False))} == {
        "live",
        "durable",
    }


def test_an_unconfirmed_durable_record_goes_offline_not_away() -> None:
    a, b = Node("a"), Node("b")
    b.connect("durable", expiry=600)
    b.subscribe("durable", "t")
    pump(b, a)
    a.state.resync()
    a.state.data_to_send()  # nobody answers
    a.state.resync_done()
    record = a.broker.sessions["durable"]
    assert isinstance(record, RemoteSession) and not record.online
    assert [s.client_id for s, _ in a.broker.resolve(Message("t", b"", 1, False))] == ["durable"]


def test_a_dead_replica_loses_its_clean_records_and_its_durable_ones_go_offline() -> None:
    a, b = Node("a"), Node("b")
    b.connect("clean")
    b.subscribe("clean", "$share/g/t")
    b.connect("durable", expiry=600)
    b.subscribe("durable", "t")
    pump(b, a)
    assert a.state.remote_nodes() == {"b"}
    a.state.node_gone("b")
    assert "clean" not in a.broker.sessions
    record = a.broker.sessions["durable"]
    assert isinstance(record, RemoteSession) and not record.online
    assert a.state.remote_nodes() == set()  # nothing live left to check on b


def test_retained_topics_are_announced_once_and_handed_back() -> None:
    a, b = Node("a"), Node("b")
    a.state.retained_changed(["x", "y"])
    a.state.retained_changed(["x"])
    control, _ = a.state.data_to_send()
    assert [channel for channel, _ in control] == [RETAINED]
    assert b.state.receive(RETAINED, control[0][1]) == ["x", "y"]
    assert a.state.receive(RETAINED, control[0][1]) == []  # its own notice
