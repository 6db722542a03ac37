"""Session expiry, clean start and message expiry on the persistent path.

Checked in Redis itself (redis-py): when a session ends, every key of the
client goes, except the generation tombstone ``{cid}_generation`` that
end_session.lua leaves (with a TTL) on purpose, so a record still in Kafka
for the ended session is not stored into a new one.
"""

from __future__ import annotations

import time

import pytest
import redis
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties as PahoProperties

from persistence.format import SESSIONS_INDEX, client_keys
from tests.faults.checker import Publisher, RawSubscriber, parse, wait_until
from tests.faults.conftest import Stack


def _client_keys(r: redis.Redis, client_id: str) -> set[str]:
    tag = client_keys(client_id).messages.removesuffix("_messages")
    return {
        k.decode() for k in r.scan_iter(match=tag.replace("{", "\\{").replace("}", "\\}") + "_*")
    }


def _stored(r: redis.Redis, client_id: str) -> int:
    return int(r.zcard(client_keys(client_id).messages))


@pytest.fixture
def rds(stack: Stack):  # type: ignore[no-untyped-def]
    client = redis.Redis(port=stack.redis.port)
    try:
        yield client
    finally:
        client.close()


def test_session_expiry_removes_session_and_keys(stack: Stack, rds: redis.Redis) -> None:
    topic = stack.topic("t")
    cid = stack.client("sub")
    sub = RawSubscriber(stack.broker.address, cid, level=5, session_expiry=2)
    pub = Publisher(stack.broker.address, stack.client("pub"), topic)
    try:
        sub.connect(subscribe=[(topic, 1)])
        sub.close()
        pub.publish(20)
        pub.stop()
        assert pub.acked == set(range(1, 21))
        wait_until(lambda: _stored(rds, cid) == 20, 10, "messages stored")
        assert rds.zscore(SESSIONS_INDEX, cid) is not None
        # 2 s of expiry, the broker's 0.5 s tick, then the delete reaches Redis. The
        # tombstone stays for a while: the generation, and the score counter (the
        # last packet id is its) that the next session counts on from (finding 18).
        keys = client_keys(cid)
        tombstone = {keys.generation, keys.last_score}
        # Two writes: the client's keys (one slot), then the installation's index
        # (another slot on Redis Cluster), so one may be seen without the other.
        wait_until(
            lambda: _client_keys(rds, cid) <= tombstone and rds.zscore(SESSIONS_INDEX, cid) is None,
            8,
            "keys gone and the session out of the index",
        )
        for key in tombstone:
            assert rds.exists(key) == 0 or rds.ttl(key) > 0, f"{key} must expire"

        connack = sub.connect()
        assert not connack.session_present
        pub.publish(3)  # the subscription went with the session
        pub.stop()
        time.sleep(0.5)
        assert sub.snapshot() == []
    finally:
        sub.close()
        pub.close()


@pytest.mark.parametrize("level", [5, 4], ids=["v5", "v311"])
def test_clean_start_wipes_stored_messages(stack: Stack, rds: redis.Redis, level: int) -> None:
    topic = stack.topic("t")
    cid = stack.client("sub")
    sub = RawSubscriber(stack.broker.address, cid, level=level)
    pub = Publisher(stack.broker.address, stack.client("pub"), topic)
    try:
        sub.connect(subscribe=[(topic, 1)])
        sub.close()
        pub.publish(20)
        pub.stop()
        wait_until(lambda: _stored(rds, cid) == 20, 10, "messages stored")

        connack = sub.connect(clean_start=True)
        assert not connack.session_present
        time.sleep(0.5)
        assert sub.snapshot() == [], "a clean start got the old session's messages"
        wait_until(lambda: _stored(rds, cid) == 0, 5, "stored messages deleted")
        message_keys = {k for k in _client_keys(rds, cid) if "_messages_" in k}
        assert not message_keys
        assert rds.exists(client_keys(cid).values) == 0  # nor their entries
        sub.close()
        if level == 4:
            return  # 3.1.1 clean session 1 leaves no session to come back to
        connack = sub.connect(clean_start=False)
        assert connack.session_present  # the new session (expiry 600), empty
        time.sleep(0.5)
        assert sub.snapshot() == []
    finally:
        sub.close()
        pub.close()


def _expiring(seconds: int) -> PahoProperties:
    p = PahoProperties(PacketTypes.PUBLISH)
    p.MessageExpiryInterval = seconds
    return p


@pytest.mark.parametrize("level", [5, 4], ids=["v5", "v311"])
def test_message_expiry_while_subscriber_offline(stack: Stack, level: int) -> None:
    topic = stack.topic("t")
    sub = RawSubscriber(stack.broker.address, stack.client("sub"), level=level)
    short = Publisher(stack.broker.address, stack.client("short"), topic, properties=_expiring(1))
    long = Publisher(stack.broker.address, stack.client("long"), topic, properties=_expiring(30))
    try:
        sub.connect(subscribe=[(topic, 1)])
        sub.close()
        for pub in (short, long):
            pub.publish(5)
            pub.stop()
            assert pub.acked == set(range(1, 6))
        time.sleep(2.2)
        assert sub.connect().session_present
        sub.wait_all([long], timeout=10)
        time.sleep(0.5)
        got = sub.snapshot()
        assert {parse(r.payload)[0] for r in got} == {long.name}, "an expired message came"
        assert [parse(r.payload)[1] for r in got] == [1, 2, 3, 4, 5]
        if level == 5:
            for r in got:
                assert r.expiry is not None and 20 <= r.expiry <= 28, r.expiry
    finally:
        sub.close()
        short.close()
        long.close()
