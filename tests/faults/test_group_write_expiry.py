"""The record of a member's group writes in flight (``{cid}_ecq_group_writes``;
tests/model/FINDINGS.md, finding 35), and of the entries of its own queue
($ECQ) in flight (``{cid}_ecq_inflight``), goes with its session, also when the
session expired while no broker held it: a restarted broker ends such sessions
as it restores the others (persistence/session_store.py), and nothing else ever
reads that record again (a later session of the client ID starts clean). Left
behind, it would keep up to a window of message values in Redis for good.
"""

from __future__ import annotations

import math
import time

import pytest
import redis

from broker.packets import ConnAck, Properties, PubAck, Publish, SubAck, Subscribe, Subscription
from persistence.format import SESSIONS_INDEX, client_keys, group_writes_key, queue_keys
from tests.e2e.clients import Raw
from tests.faults.checker import wait_until
from tests.faults.conftest import Stack

EXPIRY = 2  # s: the member's session expires while the broker is down


@pytest.mark.parametrize("queue", ["group", "ecq"])
def test_what_a_session_held_from_queues_goes_when_it_expires_while_no_broker_holds_it(
    stack_factory: callable,  # type: ignore[valid-type]
    queue: str,
) -> None:
    stack: Stack = stack_factory({"group_queues.lease": 2.0})
    member_id = stack.client("member")
    if queue == "group":
        topic = stack.topic("g")
        group = f"$queue/g/{topic}"
        kept = group_writes_key(member_id)
    else:
        topic, group = f"$ECQ/w/{member_id}/k", f"$ECQ/{member_id}/#"
        kept = queue_keys(member_id).inflight

    member = Raw(stack.broker)
    connack = member.connect(
        member_id, clean_start=False, properties=Properties(session_expiry_interval=EXPIRY)
    )
    assert isinstance(connack, ConnAck) and connack.reason_code == 0, connack
    member.send(Subscribe(1, [Subscription(group, 1)]))
    assert isinstance(member.recv(), SubAck)
    with Raw(stack.broker) as producer:
        producer.connect(stack.client("producer"))
        producer.send(Publish(topic, b"write", 1, packet_id=1))
        assert isinstance(producer.recv(), PubAck)
    write = member.recv(timeout=10)
    assert isinstance(write, Publish) and write.payload == b"write", write
    member.close()  # abruptly, the write held: kept with the session

    with redis.Redis.from_url(stack.redis.url) as client:
        wait_until(lambda: client.hexists(kept, str(write.packet_id)), 10, "the group write kept")
        # Its expiry counts from the disconnect, saved before the broker goes.
        wait_until(
            lambda: not math.isinf(client.zscore(SESSIONS_INDEX, member_id) or math.inf),
            10,
            "the session saved disconnected",
        )
        stack.broker.terminate()
        deadline = client.zscore(SESSIONS_INDEX, member_id)
        assert deadline is not None
        while time.time() <= deadline + 0.5:  # the session's expiry passes, no broker up
            time.sleep(0.1)
        stack.broker.start()
        # The restarted broker ends the expired session (its record goes) ...
        wait_until(
            lambda: not client.exists(client_keys(member_id).session),
            20,
            "the expired session ended",
        )
        wait_until(
            lambda: client.zscore(SESSIONS_INDEX, member_id) is None, 20, "the session unindexed"
        )
        # ... and what it kept goes with it.
        assert not client.exists(kept), f"{kept} outlived its session: {client.hgetall(kept)!r}"
