"""A group write in flight to a member that went, then a restart of the broker
($queue, broker/group_queue.py; tests/model/FINDINGS.md, finding 35).

The member holds the write unacknowledged and its connection closes: the write
goes back to its group (another member gets it, with DUP: MQTT 5 section 4.8.2
allows it as soon as the connection is lost). The member's session still holds
it under its packet id, as every message in flight (MQTT-4.4.0-1). While the
broker lives it is sent again there on the next connection; before the fix, a
killed broker forgot it, and the resumed session gave its packet id to a new
message while the client still held it (MQTT-2.2.1-3): a late acknowledgement
of the old one would have acknowledged a message the client never processed.
The rule is one now: the member's session keeps the write as it leaves, and a
restarted broker sends it again under its packet id, with DUP, before it gives
any identifier; the id is free once the client acknowledges it.

A broker killed with the write in flight closes no connection, so nothing is
kept as the member leaves (finding 43): the write is recorded with the session
before it is sent, and the restarted broker finds it there all the same.

And the other way round (finding 36): an APPLICATION session's own messages the
client holds from an earlier connection take their ids back only once read from
Kafka; a group write given meanwhile must not take one of those ids.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
import redis

from broker.packets import ConnAck, Properties, PubAck, Publish, SubAck, Subscribe, Subscription
from persistence.format import group_writes_key, queue_keys
from tests.e2e.clients import Raw
from tests.faults.checker import wait_until
from tests.faults.conftest import Stack
from tests.kafka_fixtures import freeze

EXPIRY = Properties(session_expiry_interval=600)
BEFORE = 2  # group writes the member takes and acknowledges first: the next id is not 1
DIRECT = BEFORE + 2  # messages to the member's own subscription after the restart


def _connect(stack: Stack, client_id: str, *filters: str) -> Raw:
    """A persistent member (subscribed to ``filters`` if any), tried again while a
    restarted broker restores its sessions."""
    for _ in range(100):
        raw = Raw(stack.broker)
        with contextlib.suppress(AssertionError, OSError):
            connack = raw.connect(client_id, clean_start=False, properties=EXPIRY)
            if isinstance(connack, ConnAck) and connack.reason_code == 0:
                if filters:
                    raw.send(Subscribe(1, [Subscription(f, 1) for f in filters]))
                    assert isinstance(raw.recv(), SubAck)
                else:
                    assert connack.session_present, "the member's session was lost"
                return raw
        raw.close()
        time.sleep(0.1)
    raise AssertionError(f"{client_id} could not connect")


def _recorded(client: redis.Redis, member_id: str) -> set[int]:
    """The packet ids of the member's group writes recorded with its session."""
    fields = client.hkeys(group_writes_key(member_id))
    return {int(field) for field in fields if field != b"gen"}


def _publish(stack: Stack, topic: str, payloads: list[bytes]) -> None:
    with Raw(stack.broker) as producer:
        producer.connect(stack.client(f"pub-{time.monotonic_ns()}"))
        for i, payload in enumerate(payloads, start=1):
            producer.send(Publish(topic, payload, 1, packet_id=i))
            ack = producer.recv()
            assert isinstance(ack, PubAck) and ack.reason_code == 0, ack


@pytest.mark.parametrize("session", ["device", "application"])
def test_a_given_back_group_writes_id_is_not_reused_after_a_restart(
    stack_factory: callable,  # type: ignore[valid-type]
    session: str,
) -> None:
    settings: dict[str, object] = {"group_queues.lease": 2.0}
    if session == "application":
        settings["application.client_ids"] = '[".*-member$"]'  # the member alone
    stack: Stack = stack_factory(settings)
    group_topic, direct_topic = stack.topic("g"), stack.topic("d")
    group = f"$queue/g/{group_topic}"
    member_id = stack.client("member")

    member = _connect(stack, member_id, group, direct_topic)
    # A restarted broker's first identifiers are the lowest: the write the member
    # holds is not the first it gets, so its id is one a new message would take.
    _publish(stack, group_topic, [b"before:%d" % i for i in range(BEFORE)] + [b"write"])
    for _ in range(BEFORE):
        taken = member.recv()
        assert isinstance(taken, Publish) and taken.packet_id is not None, taken
        member.send(PubAck(taken.packet_id))
    write = member.recv()
    assert isinstance(write, Publish) and write.payload == b"write" and not write.dup, write
    held = write.packet_id
    assert held is not None and held > 1  # held: never acknowledged

    other = _connect(stack, stack.client("other"), group)
    member.close()  # abruptly: no DISCONNECT
    # Given back to the group: the other member gets it, with DUP (it may have been seen).
    again = other.recv(timeout=10)
    assert isinstance(again, Publish) and again.payload == b"write" and again.dup, again
    assert again.packet_id is not None
    other.send(PubAck(again.packet_id))
    # Its acknowledgement landed: the group queue holds nothing (the write cannot
    # come back to the member through the group after the restart).
    pending = queue_keys(group).pending
    with redis.Redis.from_url(stack.redis.url) as client:
        wait_until(lambda: client.zcard(pending) == 0, 10, "the group's acknowledgement")
    other.close()

    stack.broker.kill()
    stack.broker.start()
    member = _connect(stack, member_id)  # resumes its session
    _publish(stack, direct_topic, [b"direct:%d" % i for i in range(DIRECT)])

    direct: list[bytes] = []
    resent = False
    while len(direct) < DIRECT:
        packet = member.recv(timeout=15)
        assert isinstance(packet, Publish) and packet.packet_id is not None, packet
        if not resent:
            # The client holds `held` unacknowledged: nothing else may come under it
            # (MQTT-2.2.1-3); the write itself comes again under it (MQTT-4.4.0-1).
            assert packet.packet_id != held or packet.payload == b"write", (
                f"packet id {held}, held unacknowledged for the group write, was given to "
                f"{packet.payload!r}"
            )
        if packet.payload == b"write":
            assert packet.packet_id == held and packet.dup, packet
            resent = True
        else:
            direct.append(packet.payload)
        member.send(PubAck(packet.packet_id))
    assert resent, "the group write held under its packet id never came again"
    assert sorted(direct) == [b"direct:%d" % i for i in range(DIRECT)]
    member.close()


def test_a_group_write_in_flight_when_its_broker_is_killed_keeps_its_id(
    stack_factory: callable,  # type: ignore[valid-type]
) -> None:
    """Finding 43: the broker dies with the member connected and a group write
    unacknowledged. The claim holds for a lease longer than the test, so the write
    can only come back through the member's session: under its packet id, with
    DUP, and no other message may take that id first (MQTT-2.2.1-3, MQTT-4.4.0-1)."""
    stack: Stack = stack_factory({"group_queues.lease": 120.0})
    group_topic, direct_topic = stack.topic("g"), stack.topic("d")
    group = f"$queue/g/{group_topic}"
    member_id = stack.client("member")

    member = _connect(stack, member_id, group, direct_topic)
    _publish(stack, group_topic, [b"before:%d" % i for i in range(BEFORE)] + [b"write"])
    for _ in range(BEFORE):
        taken = member.recv()
        assert isinstance(taken, Publish) and taken.packet_id is not None, taken
        member.send(PubAck(taken.packet_id))
    write = member.recv()
    assert isinstance(write, Publish) and write.payload == b"write" and not write.dup, write
    held = write.packet_id
    assert held is not None and held > 1  # held: never acknowledged
    with redis.Redis.from_url(stack.redis.url) as client:
        recorded = _recorded(client, member_id)
        # Recorded before it went out: the member's connection is still open.
        assert held in recorded, f"no record of packet id {held}: {recorded}"
        # The acknowledged ones' records gone (else they come again, with DUP, as an
        # acknowledgement the kill cut short would): the test's state, not a race.
        wait_until(
            lambda: _recorded(client, member_id) == {held},
            10,
            "the acknowledged writes' records to go",
        )

    stack.broker.kill()  # the member's connection is not closed by the broker: it dies
    member.close()
    stack.broker.start()
    member = _connect(stack, member_id)  # resumes its session
    _publish(stack, direct_topic, [b"direct:%d" % i for i in range(DIRECT)])

    direct: list[bytes] = []
    resent = False
    while len(direct) < DIRECT or not resent:
        packet = member.recv(timeout=15)
        assert isinstance(packet, Publish) and packet.packet_id is not None, packet
        if not resent:
            assert packet.packet_id != held or packet.payload == b"write", (
                f"packet id {held}, held unacknowledged for the group write, was given to "
                f"{packet.payload!r}"
            )
        if packet.payload == b"write":
            assert packet.packet_id == held and packet.dup, packet
            resent = True
        else:
            direct.append(packet.payload)
        member.send(PubAck(packet.packet_id))
    assert sorted(direct) == [b"direct:%d" % i for i in range(DIRECT)]
    # Acknowledged: its record goes.
    with redis.Redis.from_url(stack.redis.url) as client:
        wait_until(
            lambda: held not in _recorded(client, member_id),
            10,
            "the acknowledged write's record to go",
        )
    member.close()


def test_a_group_write_takes_no_id_an_application_sessions_own_message_holds(
    stack_factory: callable,  # type: ignore[valid-type]
) -> None:
    """Finding 36: an APPLICATION session resumes holding its own messages unacknowledged
    (ids 1-3); its progress (which ids) is read back from Redis at once, its messages
    from Kafka later (here: Kafka frozen). Group writes waiting in Redis meanwhile must
    take other ids: the client still holds 1-3 (MQTT-2.2.1-3)."""
    stack: Stack = stack_factory(
        {"group_queues.lease": 2.0, "application.client_ids": '[".*-member$"]'}
    )
    assert stack.tansu_pid is not None
    group_topic, direct_topic = stack.topic("g"), stack.topic("d")
    group = f"$queue/g/{group_topic}"
    member_id = stack.client("member")

    member = _connect(stack, member_id, group, direct_topic)
    own = [b"own:%d" % i for i in range(3)]
    _publish(stack, direct_topic, own)
    held: dict[int, bytes] = {}
    while len(held) < len(own):
        packet = member.recv()
        assert isinstance(packet, Publish) and packet.packet_id is not None, packet
        held[packet.packet_id] = packet.payload  # never acknowledged
    member.close()

    writes = [b"write:%d" % i for i in range(3)]
    _publish(stack, group_topic, writes)
    pending = queue_keys(group).pending
    with redis.Redis.from_url(stack.redis.url) as client:
        wait_until(lambda: client.zcard(pending) == len(writes), 10, "the group's writes stored")

    freeze(stack.tansu_pid)  # the session's own messages cannot be read back meanwhile
    try:
        member = _connect(stack, member_id)
        got: dict[bytes, int] = {}
        while len(got) < len(writes):
            packet = member.recv(timeout=15)
            assert isinstance(packet, Publish) and packet.packet_id is not None, packet
            assert packet.payload in writes, packet  # Kafka is frozen: only the group's
            assert packet.packet_id not in held, (
                f"packet id {packet.packet_id}, held for {held[packet.packet_id]!r}, was "
                f"given to {packet.payload!r}"
            )
            got[packet.payload] = packet.packet_id
            member.send(PubAck(packet.packet_id))
    finally:
        os.kill(stack.tansu_pid, signal.SIGCONT)
    again: dict[int, bytes] = {}
    while len(again) < len(own):
        packet = member.recv(timeout=20)
        assert isinstance(packet, Publish) and packet.packet_id is not None, packet
        assert packet.payload in own and packet.dup, packet  # sent before: DUP
        again[packet.packet_id] = packet.payload
        member.send(PubAck(packet.packet_id))
    assert again == held  # under the ids the client held them (MQTT-4.4.0-1)
    member.close()
