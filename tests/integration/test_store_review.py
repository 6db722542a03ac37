"""Review of the values-hash layout (fleet-store, 72fbce5): the byte count a QoS 2
message leaves behind, and the session TTL an upgraded client's hash takes."""

from __future__ import annotations

import time
import uuid

import pytest

from persistence.format import SessionState, StoredMessage, client_keys, encode_message
from persistence.redis_store import RedisMessageStore


@pytest.fixture
def cid() -> str:
    return f"rev-{uuid.uuid4().hex[:12]}"


def _msg(i: int, size: int, qos: int = 2) -> StoredMessage:
    return StoredMessage(f"t/{i}", b"x" * size, qos, producer=1, seq=i + 1)


async def _bytes(store: RedisMessageStore, cid: str) -> int:
    return int(await store.redis.hget(client_keys(cid).values, "b") or 0)


async def test_a_completed_qos2_message_gives_all_its_bytes_back(
    store: RedisMessageStore, cid: str
) -> None:
    """PUBREC rewrites the entry as its 2-byte PUBREL stage; PUBCOMP then freed only
    those 2 bytes, so the count kept the payload's size while anything else stayed
    stored: with a backlog that never empties, every completed QoS 2 message
    inflated it, and the byte limit trimmed unsent messages long before the
    stored values reached it."""
    await store.save_batch(cid, [_msg(0, 500), _msg(1, 100)], partition=0)
    second = await _bytes(store, cid)
    assert await store.mark_sent(cid, [1]) == [1]
    assert await store.mark_pubrel(cid, 1)  # PUBREC
    assert await store.ack_many(cid, [1]) == 1  # PUBCOMP
    left = [r.message for r in (await store.load_page(cid, 0, 10)).records]
    assert [m.topic for m in left if m is not None] == ["t/1"]
    assert await _bytes(store, cid) < second - 400  # only message 2's bytes remain


async def test_a_completed_qos2_message_does_not_trim_below_the_byte_limit(
    store: RedisMessageStore, cid: str
) -> None:
    small = RedisMessageStore(store.redis, max_bytes=3000)
    await small.save_batch(cid, [_msg(0, 900), _msg(1, 900)], partition=0)
    for pid in (1,):
        assert await small.mark_sent(cid, [pid]) == [pid]
        assert await small.mark_pubrel(cid, pid)
        assert await small.ack_many(cid, [pid]) == 1
    # One ~950-byte message stored; two more fit under 3000 bytes.
    res = await small.save_batch(cid, [_msg(2, 900), _msg(3, 900)], partition=0)
    assert res.trimmed_ids == []


async def test_an_upgraded_disconnected_clients_hash_expires_with_its_session(
    store: RedisMessageStore, cid: str
) -> None:
    """A client of the layout before, disconnected (every key with the session's TTL):
    its values hash takes that TTL when upgraded, and a later expire refreshes it."""
    keys = client_keys(cid)
    await store.save_session(cid, SessionState(None, time.time()), ttl=100)
    value = encode_message(_msg(0, 10, qos=1), sent=True)
    await store.redis.execute_command("SET", keys.message(1), value, "PX", 100_000)
    await store.redis.execute_command("ZADD", keys.messages, 1, 1)
    await store.redis.execute_command("PEXPIRE", keys.messages, 100_000)
    records = (await store.load_page(cid, 0, 10)).records
    assert [(r.packet_id, r.sent) for r in records] == [(1, True)]
    assert 90_000 < await store.redis.pttl(keys.values) <= 100_000
    await store.expire_session(cid, 500)
    assert 490_000 < await store.redis.pttl(keys.values) <= 500_000
    await store.save_session(cid, SessionState(None, time.time()))  # reconnected
    assert await store.redis.pttl(keys.values) == -1


@pytest.mark.parametrize("meets", ["load", "mark", "purge"])
async def test_an_expired_message_gives_its_bytes_back_where_it_is_met(
    store: RedisMessageStore, cid: str, meets: str
) -> None:
    """An entry whose deadline passed is dropped where a script meets it (load_page,
    mark_sent, purge); its bytes stayed in the count, so while anything else stayed
    stored every expired message inflated it for good, and the byte limit trimmed
    unsent messages before the values stored reached it."""
    small = RedisMessageStore(store.redis, max_bytes=3000)
    expiring = StoredMessage("t/0", b"x" * 900, 1, producer=1, seq=1, expiry=time.time() + 0.3)
    await small.save_batch(cid, [expiring, _msg(1, 900, qos=1)], partition=0)
    assert await small.mark_sent(cid, [2]) == [2]  # in flight: stays through a purge
    time.sleep(0.5)  # message 1's expiry passes (a deadline, not a race)
    if meets == "load":
        assert [r.packet_id for r in (await small.load_page(cid, 0, 10)).records] == [2]
    elif meets == "mark":
        assert await small.mark_sent(cid, [1]) == []
    else:
        assert await small.purge(cid) == []
    assert await store.pending_count(cid) == 1
    # One ~950-byte message stored; two more fit under 3000 bytes.
    res = await small.save_batch(cid, [_msg(2, 900, qos=1), _msg(3, 900, qos=1)], partition=0)
    assert res.trimmed_ids == []
