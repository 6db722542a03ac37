"""A replica that may have missed what the others said routes no QoS 1/2 PUBLISH
until it has caught up (broker/cluster.py ``ClusterState.current``,
tests/model/FINDINGS.md, finding 39): a subscription acknowledged on another
replica meanwhile would be missed, and the publisher told its message was taken.
Brokers wired by hand as in test_cluster_state.py; the subscriber is a clean session,
so what the publisher's replica routes to it shows as a delivery forwarded to its own."""

from __future__ import annotations

from redis.asyncio import Redis

from broker.config import ClusterSettings, Settings
from broker.connection import ConnectionState, MQTTConnection
from broker.core import Broker
from broker.handlers.publish import handle_publish
from broker.packets import Publish
from persistence.cluster_link import ClusterLink
from tests.unit.test_cluster_state import Node, pump


def _send(conn: MQTTConnection, *packets: Publish) -> None:
    """The client's packets, as one read brings them (decoded)."""
    conn._process(list(packets))


def _behind() -> tuple[Node, Node]:
    """b lost its link (a Redis restart) after both heard each other; s2 on a then
    subscribed, and b never heard it."""
    a, b = Node("a"), Node("b")
    b.connect("p")
    a.connect("s2")
    pump(a, b)
    pump(b, a)
    b.state.link_lost()
    a.subscribe("s2", "m/+")
    a.state.data_to_send()  # published while b's link was down: lost to b
    return a, b


def test_a_publish_waits_for_the_resync_and_reaches_the_subscription_made_meanwhile() -> None:
    a, b = _behind()
    publisher = b.broker.sessions["p"].connection
    assert publisher is not None
    _send(
        publisher,
        Publish("m/a", b"x", qos=1, packet_id=1),
        Publish("m/b", b"y", qos=1, packet_id=2),
    )
    assert "a" not in pump(b, a)  # routed nowhere yet
    assert b.broker.stats.messages_received[1] == 0  # not even taken in: no PUBACK
    b.state.resync()  # the link is back: b asks the others
    pump(b, a)  # a hears the sync
    pump(a, b)  # b hears a's answer: s2's subscription, and that it is all
    assert b.state.current
    forwarded = pump(b, a)["a"]
    assert [(cid, d.message.topic) for cid, d in forwarded] == [("s2", "m/a"), ("s2", "m/b")]


def test_the_limit_routes_with_what_is_known() -> None:
    """The link stays down past the edge's HOLD_LIMIT: routed as a replica alone would."""
    a, b = _behind()
    publisher = b.broker.sessions["p"].connection
    assert publisher is not None
    _send(publisher, Publish("m/a", b"x", qos=1, packet_id=1))
    b.state.stop_holding()
    assert b.state.current and b.broker.stats.messages_received[1] == 1
    assert "a" not in pump(b, a)  # s2's subscription was not heard: the old limit


def test_qos_0_is_not_held() -> None:
    _, b = _behind()
    publisher = b.broker.sessions["p"].connection
    assert publisher is not None
    handle_publish(publisher, Publish("t", b"x", qos=0))
    assert not publisher.input_paused and b.broker.stats.messages_received[0] == 1


def test_a_resync_with_no_replica_heard_lately_is_current_at_once() -> None:
    b = Node("b")
    b.state.link_lost()
    assert not b.state.current
    b.state.resync()
    assert b.state.current


def test_an_answer_without_its_end_is_waited_for_until_the_window_ends() -> None:
    """A replica of a version before the end marker: the re-sync window bounds the wait."""
    a, b = _behind()
    b.state.resync()
    pump(b, a)
    control, _ = a.state.data_to_send()
    for channel, payload in control:
        b.state.receive(channel, payload.replace(b',"e":1', b""))
    assert not b.state.current
    b.state.resync_done()
    assert b.state.current


def test_the_keep_alive_waits_with_the_input() -> None:
    """Its input is not read while it waits: the client is not silent, and the
    keep-alive counts again from when what waited was handled."""
    _, b = _behind()
    publisher = b.broker.sessions["p"].connection
    assert publisher is not None
    publisher.keep_alive = 1
    _send(publisher, Publish("m/a", b"x", qos=1, packet_id=1))
    assert publisher.check_timeouts(100.0) is not None
    assert publisher.state is ConnectionState.CONNECTED


async def test_a_link_that_stays_down_holds_once() -> None:
    """After HOLD_LIMIT the link's retried reads do not hold the publishes again
    until it is back (persistence/cluster_link.py)."""
    broker = Broker(Settings(cluster=ClusterSettings(enabled=True, node_id="n")))
    assert broker.cluster is not None
    link = ClusterLink(Redis.from_url("redis://127.0.0.1:1"), "p", broker, None)  # type: ignore[arg-type]
    link._link_lost()
    assert not broker.cluster.current
    link._stop_holding()  # HOLD_LIMIT passed, Redis still away
    assert broker.cluster.current
    link._link_lost()  # the next read failed too
    assert broker.cluster.current and link._hold_limit is None
