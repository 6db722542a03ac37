"""The ``kept`` notice between replicas (broker/cluster.py, tests/model/FINDINGS.md,
finding 37): the replica that takes a group member's connection over gives it no
packet id until the old one says the group writes it had in flight are kept in
Redis. Brokers wired by hand as in test_cluster_state.py, with a persistent path
that records the waits DevicePersistence would make and can hold keeps back."""

from __future__ import annotations

from collections.abc import Callable

import orjson

from broker.config import ClusterSettings, Settings
from broker.connection import ConnectionState, MQTTConnection
from broker.core import Broker
from broker.persistent_path import InMemoryPersistentPath
from broker.session import Session
from broker.topics import SubscriptionEntry
from tests.unit.test_cluster_state import pump

GROUP = "$queue/g/t"


class Path(InMemoryPersistentPath):
    def __init__(self) -> None:
        self.broker: Broker | None = None
        self.waited: list[str] = []  # "client@t from node" of each wait begun
        self.ended: list[str] = []  # "client@t" of each wait that ended
        self.keeping: list[Callable[[], None]] = []  # keeps not landed yet
        self.slow_keeps = False

    def restore_group_writes(self, session: Session, taken_from: str | None = None) -> None:
        assert self.broker is not None and self.broker.cluster is not None
        if taken_from is not None:
            key = f"{session.client_id}@{session.connected_at}"
            self.waited.append(f"{key} from {taken_from}")
            self.broker.cluster.await_kept(
                session.client_id, session.connected_at, taken_from, lambda: self.ended.append(key)
            )

    def after_keeps(self, client_id: str, then: Callable[[], None]) -> None:
        if self.slow_keeps:
            self.keeping.append(then)
        else:
            then()


class Node:
    def __init__(self, name: str, wall: float) -> None:
        self.path = Path()
        self.wall = wall
        settings = Settings(cluster=ClusterSettings(enabled=True, node_id=name))
        self.broker = Broker(
            settings, clock=lambda: 0.0, persistent_path=self.path, wall_clock=lambda: self.wall
        )
        self.path.broker = self.broker
        assert self.broker.cluster is not None
        self.state = self.broker.cluster

    def connect(self, client_id: str, member: bool = True) -> MQTTConnection:
        """A persistent session resumed, a member of GROUP; then what the CONNECT
        handler does after CONNACK."""
        conn = MQTTConnection(self.broker, "test", lambda c: None)
        conn.protocol_level = 5
        conn.state = ConnectionState.CONNECTED
        conn.client_id = client_id
        opened: list[Session | None] = []
        self.broker.open_session(conn, client_id, False, 60, lambda s, *_: opened.append(s))
        session = opened[0]
        assert session is not None
        if member and GROUP not in session.subscriptions:
            entry = SubscriptionEntry(client_id, GROUP, 1)
            session.subscriptions[GROUP] = entry
            self.state.subscribed(session, entry)
        self.broker.restore_group_writes(session)
        return conn


def test_a_takeover_waits_for_the_old_replicas_notice_for_that_connection() -> None:
    a, b = Node("a", 100.0), Node("b", 200.0)
    a.connect("c")
    pump(a, b)
    b.connect("c")
    assert b.path.waited == ["c@200.0 from a"] and b.path.ended == []
    pump(b, a)  # a hands the session over: its (instant) keep landed
    pump(a, b)
    assert b.path.ended == ["c@200.0"]


def test_a_session_that_was_no_group_member_does_not_wait() -> None:
    a, b = Node("a", 100.0), Node("b", 200.0)
    a.connect("c", member=False)
    pump(a, b)
    b.connect("c", member=False)
    assert b.path.waited == []


def test_a_notice_for_another_connection_or_replica_ends_nothing() -> None:
    a, b, z = Node("a", 100.0), Node("b", 200.0), Node("z", 300.0)
    a.connect("c")
    pump(a, b, z)
    b.connect("c")
    a.state._send(op="kept", c="c", t=999.0, to="b")  # another connection's answer
    a.state._send(op="kept", c="c", t=200.0, to="z")  # another replica's
    pump(a, b)
    assert b.path.ended == []


def test_a_notice_heard_before_the_wait_counts() -> None:
    a, b = Node("a", 100.0), Node("b", 200.0)
    heard: list[str] = []
    a.state._send(op="kept", c="d", t=3.0, to="b")
    pump(a, b)
    b.state.await_kept("d", 3.0, "a", lambda: heard.append("early"))
    assert heard == ["early"]
    forget = b.state.await_kept("e", 4.0, "a", lambda: heard.append("e"))
    forget()  # given up: called once, never again
    a.state._send(op="kept", c="e", t=4.0, to="b")
    pump(a, b)
    assert heard == ["early", "e"]


def test_the_old_replica_that_saw_the_break_first_still_answers() -> None:
    """a notices the connection break after b's CONNECT but before b's ``conn``
    reaches it: a detaches as usual (its keeps started) and must still answer."""
    a, b = Node("a", 100.0), Node("b", 200.0)
    old = a.connect("c")
    pump(a, b)
    b.connect("c")
    old.connection_lost()
    pump(b, a)
    pump(a, b)
    assert b.path.ended == ["c@200.0"]


def test_a_second_takeover_during_the_wait_follows_the_first_notice() -> None:
    """a's keep is slow; b took over from a and waits; z takes over from b: b's own
    notice to z follows a's, or z would read before a's keep landed."""
    a, b, z = Node("a", 100.0), Node("b", 200.0), Node("z", 300.0)
    a.path.slow_keeps = True
    a.connect("c")
    pump(a, b, z)
    b.connect("c")
    pump(b, a, z)  # a hands over to b: its keep is on the way
    assert a.path.keeping and b.path.ended == []
    z.connect("c")
    assert z.path.waited == ["c@300.0 from b"]
    pump(z, a, b)  # b hands over to z while it still waits for a
    pump(b, a, z)
    assert z.path.ended == []
    a.path.keeping.pop()()  # a's keep lands: a says so to b, then b to z
    pump(a, b, z)
    assert b.path.ended == ["c@200.0"]
    pump(b, a, z)
    assert z.path.ended == ["c@300.0"]


def test_a_replica_gone_ends_the_waits_on_it() -> None:
    a, b = Node("a", 100.0), Node("b", 200.0)
    a.path.slow_keeps = True
    a.connect("c")
    pump(a, b)
    b.connect("c")
    b.state.node_gone("a")
    assert b.path.ended == ["c@200.0"]


def pump_as_older_version(source: Node, *targets: Node) -> None:
    """What ``source`` sends, as a replica of a version before ``kept`` sends it."""
    control, _ = source.state.data_to_send()
    for channel, payload in control:
        change = orjson.loads(payload)
        change.pop("kv", None)
        for target in targets:
            target.state.receive(channel, orjson.dumps(change))


def test_a_takeover_from_a_replica_of_an_older_version_does_not_wait() -> None:
    """A rolling upgrade: the old replica never sends ``kept``, so waiting for it
    would hold every group member taken over from it for KEPT_WAIT seconds."""
    a, b = Node("a", 100.0), Node("b", 200.0)
    a.connect("c")
    pump_as_older_version(a, b)
    b.connect("c")
    assert b.path.waited == []


def test_a_replica_restarted_as_an_older_version_is_waited_for_no_more() -> None:
    a, b = Node("a", 100.0), Node("b", 200.0)
    a.connect("c")
    pump(a, b)
    assert b.state.sends_kept("a")
    # a restarts as the older version: its next words carry no ``kv``
    b.state.receive("subscriptions", orjson.dumps({"op": "tick", "n": "a", "b": "x", "q": 1}))
    assert not b.state.sends_kept("a")
    b.connect("c")
    assert b.path.waited == []
