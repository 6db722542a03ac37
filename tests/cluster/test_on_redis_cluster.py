"""Replicas on a Redis Cluster keep the promises of one broker.

Three replicas on a Redis Cluster (:func:`tests.cluster.conftest.running_replicas`)
and the embedded Kafka-protocol broker.

- A replica resumes a durable session from the store, never from its replicated
  view or a detached copy of its own, which may be stale (issue 16, 1): the QoS 2
  packet ids held for a publisher and the subscriptions made elsewhere survive the
  move, and nothing emptier is saved over Redis's copy.
- Liveness keys live in one hash slot and go through the cluster client (issue
  16, 2): a replica starts whatever its node id hashes to, and one killed without
  a goodbye is noticed by the others.
- Takeover mid-stream at QoS 1 and 2, and a replica leaving and joining under load
  (two replicas, then three: partitions rebalance), lose nothing.
- A ``stored`` notice lost with a replica's pub/sub connection does not stall a
  delivery (issue 16, 3): the re-subscription (or a gap in the sender's sequence
  numbers) makes every connected persistent session's store feed re-read the store.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from broker.packets import (
    ConnAck,
    Properties,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    Subscription,
)
from tests.cluster.conftest import Replicas
from tests.cluster.test_replicas import (
    Client,
    _partition,
    in_order_without_loss,
    probe,
    wait_until,
)
from tests.e2e.clients import Raw
from tests.kafka_fixtures import freeze

EXPIRY = Properties(session_expiry_interval=600)
# A stored message reaches its connected client within this, whatever pub/sub lost
# (issue 16, 3 asks about 1 s; generous here: two cores shared with other tests).
CATCH_UP_BOUND = 5.0


def _connect(raw: Raw, client_id: str) -> ConnAck:
    ack = raw.connect(client_id, clean_start=False, properties=EXPIRY)
    assert isinstance(ack, ConnAck) and ack.reason_code == 0, ack
    return ack


def _publish_qos2_until_pubrec(raw: Raw, topic: str, payload: bytes, dup: bool = False) -> None:
    raw.send(Publish(topic, payload, qos=2, dup=dup, packet_id=7))
    rec = raw.recv()
    assert isinstance(rec, PubRec) and rec.packet_id == 7 and rec.reason_code == 0, rec


def _complete(raw: Raw) -> None:
    raw.send(PubRel(7))
    comp = raw.recv()
    assert isinstance(comp, PubComp) and comp.reason_code == 0, comp


def _subscriber(replicas: Replicas, node: int, topic: str, suffix: str) -> tuple[Client, Client]:
    """A persistent QoS 2 subscriber on replica ``node`` and a publisher on r0 whose
    probes it has received (every replica routes the topic to it)."""
    sub = Client(replicas.nodes[node], replicas.name(suffix), expiry=600)
    sub.subscribe(topic, 2)
    pub = Client(replicas.nodes[0], replicas.name(f"{suffix}-prober"))
    probe(pub, sub, topic, 1, 30)
    return sub, pub


def test_qos2_resend_on_another_replica_is_delivered_once(replicas: Replicas) -> None:
    """PUBREC on r0, drop before PUBREL, DUP re-send on r1: one copy."""
    topic = replicas.name("q2/t")
    sub, prober = _subscriber(replicas, 2, topic, "q2-sub")
    publisher = replicas.name("q2-pub")
    try:
        with Raw(replicas.nodes[0]) as raw:
            _connect(raw, publisher)
            _publish_qos2_until_pubrec(raw, topic, b"once")
        with Raw(replicas.nodes[1]) as raw:
            assert _connect(raw, publisher).session_present
            _publish_qos2_until_pubrec(raw, topic, b"once", dup=True)
            _complete(raw)
            raw.send(Publish(topic, b"after", qos=1, packet_id=8))
            raw.recv()  # PUBACK
        wait_until(lambda: bool(sub.received(b"after")), 15, "the message after")
        time.sleep(0.5)  # room for a (wrong) second copy behind it
        assert sub.received(b"once") == [b"once"]
    finally:
        sub.close()
        prober.close()


def test_a_stale_detached_copy_is_not_resumed(replicas: Replicas) -> None:
    """r1 holds a detached copy of a session and misses (pub/sub cut while it is
    paused) everything the session did on r0 meanwhile: a subscription and a
    QoS 2 id held. Back on r1, the session is the store's: both are there."""
    q2_topic, old_topic, new_topic = (replicas.name(f"stale/{t}") for t in ("q2", "old", "new"))
    sub, prober = _subscriber(replicas, 2, q2_topic, "stale-sub")
    device = replicas.name("stale-device")
    r1 = replicas.nodes[1]
    assert r1.proc is not None
    try:
        with Raw(r1) as raw:
            _connect(raw, device)
            raw.send(Subscribe(1, [Subscription(old_topic, qos=1)]))
            assert isinstance(raw.recv(), SubAck)
        time.sleep(0.3)  # r1 keeps the detached copy; the others learn it is offline
        freeze(r1.proc.pid)
        try:
            replicas.kill_pubsub("r1")  # what r0 says now never reaches r1
            with Raw(replicas.nodes[0]) as raw:
                assert _connect(raw, device).session_present
                raw.send(Subscribe(2, [Subscription(new_topic, qos=1)]))
                assert isinstance(raw.recv(), SubAck)
                _publish_qos2_until_pubrec(raw, q2_topic, b"once")
        finally:
            os.kill(r1.proc.pid, signal.SIGCONT)
        with Raw(r1) as raw:
            assert _connect(raw, device).session_present
            _publish_qos2_until_pubrec(raw, q2_topic, b"once", dup=True)
            _complete(raw)
            # The subscription made on r0 is the session's: a message on it arrives.
            deadline = time.monotonic() + 20
            got = None
            n = 0
            while got is None and time.monotonic() < deadline:
                n += 1
                prober.client.publish(new_topic, b"new-%d" % n, 1).wait_for_publish(10)
                packet = raw.recv_or_none(0.5)
                while packet is not None and not isinstance(packet, Publish):
                    packet = raw.recv_or_none(0.5)
                got = packet
            assert isinstance(got, Publish) and got.payload.startswith(b"new-"), got
        prober.client.publish(q2_topic, b"after", 1).wait_for_publish(10)
        wait_until(lambda: bool(sub.received(b"after")), 15, "the message after")
        time.sleep(0.5)
        assert sub.received(b"once") == [b"once"]
    finally:
        sub.close()
        prober.close()


def _one_id_per_partition(replicas: Replicas, prefix: str, partitions: int = 4) -> list[str]:
    """Client ids whose Kafka records fall one in each partition: whichever replicas
    consume them, some are stored by another replica than their subscriber's."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < partitions:
        client_id = replicas.name(f"{prefix}-{i}")
        found.setdefault(_partition(client_id, partitions), client_id)
        i += 1
    return [found[p] for p in range(partitions)]


def test_a_notice_lost_with_the_pubsub_connection_is_caught_up(replicas: Replicas) -> None:
    """r1's pub/sub connection is killed while r0 and r2 store messages for its
    clients (their ``stored`` notices go nowhere): once r1 runs again, every
    connected client gets its message within the bound, not at the next one."""
    topic = replicas.name("lost/t")
    r1 = replicas.nodes[1]
    assert r1.proc is not None
    subs = [Client(r1, cid, expiry=600) for cid in _one_id_per_partition(replicas, "lost-sub")]
    pub = Client(replicas.nodes[0], replicas.name("lost-pub"))
    try:
        for sub in subs:
            sub.subscribe(topic, 1)
        for sub in subs:
            probe(pub, sub, topic, 1, 30)
        freeze(r1.proc.pid)
        try:
            replicas.kill_pubsub("r1")
            pub.client.publish(topic, b"while-away", 1).wait_for_publish(10)
            time.sleep(0.5)  # stored by the replicas that consume it; notices lost
        finally:
            os.kill(r1.proc.pid, signal.SIGCONT)
        resumed = time.monotonic()
        wait_until(lambda: all(s.received(b"while-away") for s in subs), 10, "every client")
        took = time.monotonic() - resumed
        assert took < CATCH_UP_BOUND, f"{took:.2f} s after r1 resumed"
        assert "re-syncing" in r1.log()
    finally:
        pub.close()
        for sub in subs:
            sub.close()


class Load:
    """A publisher on ``node`` sending ``m-0``, ``m-1``, ... at ``qos`` from a thread
    until stopped; ``sent`` holds what was acknowledged."""

    def __init__(self, publisher: Client, topic: str, qos: int) -> None:
        self.sent: list[bytes] = []
        self._stop = threading.Event()

        def run() -> None:
            i = 0
            while not self._stop.is_set():
                payload = b"m-%d" % i
                publisher.client.publish(topic, payload, qos).wait_for_publish(30)
                self.sent.append(payload)
                i += 1
                time.sleep(0.005)

        self._thread = threading.Thread(target=run)
        self._thread.start()

    def stop(self) -> list[bytes]:
        self._stop.set()
        self._thread.join(60)
        return self.sent


def _everything_arrives(sent: list[bytes], *receivers: Client) -> None:
    """Each message at least once, first receipts in order (the receivers' lists
    concatenated, in the order they held the session). What a receiver that lost
    the session had accepted at QoS 2 counts as its own (:meth:`Client.held`)."""

    assert sent, "nothing published"

    def got() -> list[bytes]:
        return [p for r in receivers for p in (*r.received(b"m-"), *r.held(b"m-"))]

    wait_until(lambda: len(set(got()) & set(sent)) == len(sent), 30, f"{len(sent)} messages")
    in_order_without_loss(got(), sent)


@pytest.mark.parametrize("qos", [1, 2])
def test_takeover_mid_stream_loses_nothing(replicas: Replicas, qos: int) -> None:
    """A persistent subscriber on r1 receiving a stream published on r0 is taken
    over by a connection to r2 mid-stream: nothing is lost, nothing reordered."""
    topic = replicas.name(f"takeover{qos}/t")
    device = replicas.name(f"takeover{qos}-sub")
    first = Client(replicas.nodes[1], device, expiry=600)
    first.subscribe(topic, qos)
    pub = Client(replicas.nodes[0], replicas.name(f"takeover{qos}-pub"))
    probe(pub, first, topic, qos, 30)
    load = Load(pub, topic, qos)
    second = None
    try:
        time.sleep(0.5)
        second = Client(replicas.nodes[2], device, expiry=600)  # session present: no SUBSCRIBE
        time.sleep(1.0)
        sent = load.stop()
        _everything_arrives(sent, first, second)
    finally:
        load.stop()
        pub.close()
        first.close()
        if second is not None:
            second.close()


def test_routing_while_a_replica_leaves_and_joins_under_load(replicas: Replicas) -> None:
    """Persistent and clean subscribers on every replica get what r0 publishes while
    r2 leaves (SIGTERM: its Kafka partitions move to r0 and r1, two replicas
    left) and joins again (partitions rebalance over three)."""
    topic = replicas.name("route/t")
    r0, r1, r2 = replicas.nodes
    durable = [Client(r, replicas.name(f"route-d{i}"), expiry=600) for i, r in enumerate((r0, r1))]
    clean = Client(r1, replicas.name("route-clean"))
    pub = Client(r0, replicas.name("route-pub"))
    for sub in (*durable, clean):
        sub.subscribe(topic, 1)
        probe(pub, sub, topic, 1, 30)
    load = Load(pub, topic, 1)
    try:
        time.sleep(0.5)
        assert r2.terminate() == 0  # leaves: two replicas
        time.sleep(1.0)
        r2.start()  # joins: three again
        time.sleep(1.0)
    finally:
        sent = load.stop()
    try:
        for sub in durable:
            _everything_arrives(sent, sub)
        # A clean subscriber's forwards are at most once, but none is expected to be
        # lost here; what must hold is that it still gets messages in order.
        wait_until(lambda: bool(clean.received(b"m-")), 30, "messages to the clean one")
        got = [int(p[2:]) for p in clean.received(b"m-")]
        assert got == sorted(got)
    finally:
        pub.close()
        for sub in (*durable, clean):
            sub.close()


def test_a_replica_killed_under_load_is_forgotten_and_comes_back(replicas: Replicas) -> None:
    """kill -9 r2 while r0 publishes: r0 notices by r2's expired liveness key, and
    r2's persistent subscriber, back on a restarted r2, gets every message."""
    topic = replicas.name("kill/t")
    r0, r2 = replicas.nodes[0], replicas.nodes[2]
    device = replicas.name("kill-sub")
    sub = Client(r2, device, expiry=600)
    sub.subscribe(topic, 1)
    pub = Client(r0, replicas.name("kill-pub"))
    probe(pub, sub, topic, 1, 30)
    sent: list[bytes] = []
    stop = threading.Event()

    def load() -> None:
        i = 0
        while not stop.is_set():
            payload = b"m-%d" % i
            pub.client.publish(topic, payload, 1).wait_for_publish(30)
            sent.append(payload)
            i += 1
            time.sleep(0.005)

    loader = threading.Thread(target=load)
    loader.start()
    again = None
    try:
        time.sleep(0.5)
        r2.kill()
        sub.client.loop_stop()
        # HEARTBEAT_TTL (5 s) after the last refresh, read by one MGET on the cluster.
        wait_until(lambda: "replica r2 missed its heartbeat" in r0.log(), 20, "r0 noticing")
        r2.start()
        again = Client(r2, device, expiry=600)
        time.sleep(1.0)
    finally:
        stop.set()
        loader.join(60)
    assert again is not None
    try:
        assert sent, "nothing published"

        def got() -> set[bytes]:
            return set(sub.received(b"m-")) | set(again.received(b"m-"))

        wait_until(lambda: len(got()) == len(sent), 30, f"{len(sent)} messages")
        in_order_without_loss(sub.received(b"m-") + again.received(b"m-"), sent)
    finally:
        pub.close()
        again.close()
