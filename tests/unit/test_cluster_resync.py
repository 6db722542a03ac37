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


def test_a_skipped_sequence_number_makes_the_receiver_catch_up() -> None:
    missed: list[str] = []
    a, b = Node("a"), Node("b")
    b.state._missed = lambda: missed.append("b")
    a.connect("x", expiry=600)
    a.subscribe("x", "t1")
    pump(a, b)
    a.subscribe("x", "t2")
    a.state.data_to_send()  # lost on the way to b
    a.subscribe("x", "t3")
    pump(a, b)
    assert missed == ["b"]  # noticed at the next message
    pump(a, b)
    assert missed == ["b"]


def test_a_tick_reveals_a_lost_last_message_and_repeats_are_ignored() -> None:
    missed: list[str] = []
    a, b = Node("a"), Node("b")
    b.state._missed = lambda: missed.append("b")
    a.connect("x", expiry=600)
    control, _ = a.state.data_to_send()
    for channel, payload in control:
        b.state.receive(channel, payload)
    b.state.receive(*a.state.tick())
    assert missed == []  # nothing new
    a.state.stored_elsewhere("nobody")
    a.subscribe("x", "t")
    a.state.data_to_send()  # the last message before a quiet spell: lost
    assert missed == []
    b.state.receive(*a.state.tick())
    assert missed == ["b"]
    for channel, payload in control:  # a batch sent again after a failure: ignored
        b.state.receive(channel, payload)
    assert "x" in b.broker.sessions and missed == ["b"]


def test_a_restarted_replica_starts_a_new_sequence_without_a_gap() -> None:
    missed: list[str] = []
    a, b = Node("a"), Node("b")
    b.state._missed = lambda: missed.append("b")
    a.connect("x", expiry=600)
    a.subscribe("x", "t")
    pump(a, b)
    again = Node("a")  # same node id, new process
    again.connect("y", expiry=600)
    pump(again, b)
    assert missed == []


def test_stored_messages_of_a_detached_copy_are_announced() -> None:
    """A durable session restored here (detached) may be connected to another
    replica that this one has not heard of yet: its replica must be told."""
    a, b = Node("a"), Node("b")
    b.connect("x", expiry=600)
    pump(b, a)
    conn_a = a.connect("x", expiry=600)  # not pumped: b missed the takeover
    b.broker.sessions["x"].connection = None  # b's copy, detached
    b.state.stored_elsewhere("x")
    control, _ = b.state.data_to_send()
    assert [c for c, _ in control] == ["stored"]
    assert a.state.receive(*control[0]) == ["x"]
    assert conn_a.session is not None
