"""broker/cluster.py without a network: two brokers whose ClusterStates are wired
by hand (what one sends, the other receives), as the Redis pub/sub edge does."""

from __future__ import annotations

from typing import Any

import orjson

from broker.blocklist import make_entry
from broker.cluster import ClusterState, RemoteSession
from broker.config import ClusterSettings, Settings
from broker.connection import ConnectionState, MQTTConnection
from broker.core import Broker
from broker.message import Delivery, Message
from broker.outflow import MemoryFeed
from broker.topics import SubscriptionEntry


class Node:
    def __init__(self, name: str) -> None:
        settings = Settings(cluster=ClusterSettings(enabled=True, node_id=name))
        self.broker = Broker(settings, clock=lambda: 0.0)
        assert self.broker.cluster is not None
        self.state: ClusterState = self.broker.cluster

    def connect(self, client_id: str, expiry: int = 0) -> MQTTConnection:
        conn = MQTTConnection(self.broker, "test", lambda c: None)
        conn.protocol_level = 5
        conn.state = ConnectionState.CONNECTED
        conn.client_id = client_id
        self.broker.open_session(conn, client_id, expiry == 0, expiry, lambda *opened: None)
        return conn

    def subscribe(self, client_id: str, topic_filter: str, qos: int = 1) -> None:
        session = self.broker.sessions[client_id]
        entry = SubscriptionEntry(client_id, topic_filter, qos)
        self.broker.subscriptions.add(entry)
        session.subscriptions[topic_filter] = entry
        self.state.subscribed(session, entry)


def pump(source: Node, *targets: Node) -> dict[str, list[tuple[str, Delivery]]]:
    control, deliveries = source.state.data_to_send()
    for channel, payload in control:
        for target in targets:
            target.state.receive(channel, payload)
    return deliveries


def test_a_subscription_on_one_replica_routes_there_from_the_other() -> None:
    a, b = Node("a"), Node("b")
    b.connect("sub")
    b.subscribe("sub", "t/+")
    pump(b, a)
    targets = a.broker.resolve(Message("t/x", b"hi", 1, False))
    assert [(s.client_id, type(s)) for s, _ in targets] == [("sub", RemoteSession)]
    a.broker.dispatch(targets, lambda ok: None)
    deliveries = pump(a, b)
    assert list(deliveries) == ["b"] and deliveries["b"][0][0] == "sub"


def test_a_session_ending_removes_its_subscriptions_elsewhere() -> None:
    a, b = Node("a"), Node("b")
    conn = b.connect("sub")
    b.subscribe("sub", "t")
    pump(b, a)
    conn.close(publish_will=False)  # clean session: ends
    pump(b, a)
    assert "sub" not in a.broker.sessions
    assert not a.broker.resolve(Message("t", b"", 0, False))


def test_connecting_elsewhere_takes_the_connection_over_with_0x8e() -> None:
    a, b = Node("a"), Node("b")
    old = a.connect("c")
    pump(a, b)
    b.connect("c")
    pump(b, a)
    assert old.state is ConnectionState.CLOSED
    assert old.data_to_send().endswith(b"\xe0\x01\x8e")  # DISCONNECT, Session taken over
    record = a.broker.sessions["c"]
    assert isinstance(record, RemoteSession) and record.node == "b"


def test_shared_group_members_on_both_replicas_take_turns() -> None:
    a, b = Node("a"), Node("b")
    a.connect("m1")
    a.subscribe("m1", "$share/g/t")
    b.connect("m2")
    b.subscribe("m2", "$share/g/t")
    pump(a, b)
    pump(b, a)
    picked = [a.broker.resolve(Message("t", b"", 1, False))[0][0].client_id for _ in range(4)]
    assert sorted(picked) == ["m1", "m1", "m2", "m2"]


def test_a_block_made_on_one_replica_closes_the_connection_on_the_other() -> None:
    """The entry travels in the ``block`` message itself (its field must not be one
    of the envelope's: ``b`` is the sender's boot token)."""
    a, b = Node("a"), Node("b")
    conn = b.connect("dev-9")
    pump(b, a)
    a.broker.add_block(make_entry("client_id_regex", "dev-[0-9]", reason="r", until=5e9))
    pump(a, b)
    assert conn.state is ConnectionState.CLOSED
    assert conn.data_to_send().endswith(b"\xe0\x01\x98")  # DISCONNECT, Administrative action
    (entry,) = b.broker.blocklist.entries()
    assert (entry.key, entry.reason, entry.until) == ("client_id_regex:dev-[0-9]", "r", 5e9)
    b.broker.remove_block(entry.key)
    pump(b, a)
    assert len(a.broker.blocklist) == 0


def test_a_kick_reaches_the_replica_holding_the_connection() -> None:
    a, b = Node("a"), Node("b")
    conn = b.connect("dev", expiry=600)
    pump(b, a)
    assert a.broker.kick("dev", end_session=True)
    pump(a, b)
    assert conn.state is ConnectionState.CLOSED
    assert "dev" not in b.broker.sessions  # ended, not only disconnected
    pump(b, a)
    assert "dev" not in a.broker.sessions
    assert not a.broker.kick("dev")


def test_a_remote_record_carries_where_the_client_is_from() -> None:
    a, b = Node("a"), Node("b")
    b.connect("dev")
    pump(b, a)
    record = a.broker.sessions["dev"]
    assert isinstance(record, RemoteSession)
    assert (record.address, record.protocol_level) == ("test", 5)
    assert record.connected_at == b.broker.sessions["dev"].connected_at is not None


def test_an_offline_session_of_a_gone_replica_is_ended_from_here() -> None:
    """A kick would wait for a replica that is gone: the session is ended where the
    operator asked, and the other replicas drop their records."""
    a, b, c = Node("a"), Node("b"), Node("c")
    conn = b.connect("dev", expiry=600)
    b.state.went_offline(b.broker.sessions["dev"])  # as a durable session's disconnect
    conn.state = ConnectionState.CLOSED
    pump(b, a, c)
    record = a.broker.sessions["dev"]
    assert isinstance(record, RemoteSession) and not record.online
    assert a.broker.kick("dev", end_session=True)
    assert "dev" not in a.broker.sessions
    pump(a, c)  # b is gone: only c hears it
    assert "dev" not in c.broker.sessions


class _ApplicationFeed:
    """A memory feed that says it is an APPLICATION session's, as
    persistence/application_feed.py ApplicationFeed does. By delegation: the unit
    tests also run on the mypyc-compiled modules, whose classes cannot be
    subclassed by interpreted ones."""

    application = True

    def __init__(self, inner: MemoryFeed) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_every_replica_learns_that_a_session_is_an_application_one() -> None:
    """``conn``, ``sub`` and the ``snaps`` of a re-sync each say so: whichever of
    them a replica heard, a message it routes goes to the session's topic
    (persistence/device_persistence.py submit asks ``Session.application``)."""
    b = Node("b")
    b.connect("app", expiry=3600)
    b.connect("dev", expiry=3600)
    session = b.broker.sessions["app"]
    session.outflow.feed = _ApplicationFeed(MemoryFeed(10, b.broker.stats))  # type: ignore[assignment]
    assert session.application and not b.broker.sessions["dev"].application
    b.state.opened(session, False)
    b.subscribe("app", "t/#")
    control, _ = b.state.data_to_send()
    by_op = {orjson.loads(p)["op"]: (c, p) for c, p in control if orjson.loads(p)["op"] != "conn"}
    conns = [(c, p) for c, p in control if orjson.loads(p)["op"] == "conn"]

    heard_conn = Node("a")
    for channel, payload in conns:
        heard_conn.state.receive(channel, payload)
    assert heard_conn.broker.sessions["app"].application
    assert not heard_conn.broker.sessions["dev"].application

    heard_sub = Node("c")  # the conn was lost: the sub installs the record
    heard_sub.state.receive(*by_op["sub"])
    record = heard_sub.broker.sessions["app"]
    assert isinstance(record, RemoteSession) and record.application

    b.state._answer_sync()
    heard_snaps = Node("d")
    for channel, payload in b.state.data_to_send()[0]:
        if orjson.loads(payload)["op"] == "snaps":
            heard_snaps.state.receive(channel, payload)
    assert heard_snaps.broker.sessions["app"].application
    assert not heard_snaps.broker.sessions["dev"].application
