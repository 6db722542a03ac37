"""Exclusive compacted queues in Redis (persistence/queue_store.py and its Lua
scripts) against a real redis-server, single and in cluster mode.

Compaction, sequence numbers, records read twice, acknowledgements that race
a newer value, retention, the key limit and rewinds: each as the scripts do
it, atomically, in the queue's one slot.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from redis.asyncio import Redis
from redis.crc import key_slot

from persistence.format import StoredMessage, encode_message, queue_keys
from persistence.queue_store import (
    DUPLICATE,
    KEY_LIMIT,
    RETENTION,
    QueueBatch,
    QueueStore,
)
from persistence.redis_store import ClientBatch, LostWrites, RedisMessageStore

NOW = 1_800_000_000.0


def value(cid: str, key: str, payload: bytes, *, producer: int = 1, seq: int = 0,
          published: float = NOW) -> bytes:  # fmt: skip
    return encode_message(
        StoredMessage(
            f"$ECQ/{cid}/{key}", payload, 1, producer=producer, seq=seq, publish_time=published
        )
    )


def batch(cid: str, writes: Sequence[tuple[str, bytes]], *, first_seq: int = 1,
          producer: int = 1, published: float = NOW) -> QueueBatch:  # fmt: skip
    values = [
        value(cid, key, payload, producer=producer, seq=first_seq + i, published=published)
        for i, (key, payload) in enumerate(writes)
    ]
    return QueueBatch(cid, values, 0, list(range(len(values))))


def queues(store: RedisMessageStore, *, retention: float = 3600, max_keys: int = 0) -> QueueStore:
    return QueueStore(store, retention=retention, max_keys=max_keys, clock=lambda: NOW)


async def test_a_newer_value_replaces_the_unacknowledged_one_and_numbers_go_on(
    store: RedisMessageStore, cid: str
) -> None:
    q = queues(store)
    saved = await q.save(batch(cid, [("a", b"1"), ("b", b"2"), ("a", b"3")]))
    assert saved.seqs == [1, 2, 3]
    assert saved.replaced == [0, 0, 1]  # a=1 replaced before it was acknowledged
    entries, last = await q.load(cid, 0, 100)
    assert [(e.key, e.seq) for e in entries] == [("b", 2), ("a", 3)]
    assert last == 3
    info = await q.info(cid)
    assert (info.pending, info.keys, info.last_seq, info.oldest_pending_seq) == (2, 2, 3, 2)


async def test_a_record_read_twice_is_stored_once(store: RedisMessageStore, cid: str) -> None:
    q = queues(store)
    first = batch(cid, [("a", b"1"), ("b", b"2")])
    assert (await q.save(first)).seqs == [1, 2]
    again = await q.save(first)  # the consumer read the same records again
    assert again.seqs == [DUPLICATE, DUPLICATE]
    assert again.duplicates == 2 and again.saved == 0
    other = await q.save(batch(cid, [("a", b"x")], producer=2))  # another broker's record 1
    assert other.seqs == [3]


async def test_an_acknowledgement_of_a_replaced_value_leaves_the_newer_one(
    store: RedisMessageStore, cid: str
) -> None:
    q = queues(store)
    await q.save(batch(cid, [("a", b"old")]))
    await q.save(batch(cid, [("a", b"new")], first_seq=2))  # while "old" was in flight
    assert await q.ack(cid, [("a", 1, 0)]) == 0  # "old" acknowledged: "new" still pending
    entries, _ = await q.load(cid, 0, 100)
    assert [(e.key, e.seq, e.value[-3:]) for e in entries] == [("a", 2, b"new")]
    assert await q.ack(cid, [("a", 2, 0)]) == 1
    assert (await q.load(cid, 0, 100))[0] == []
    assert (await q.info(cid)).acked_seq == 2


async def test_a_late_acknowledgement_leaves_the_record_another_entry_has_under_its_id(
    store: RedisMessageStore, cid: str
) -> None:
    """Found by review: an acknowledgement that waited for Redis (a session that
    has ended since) must not remove the record a later session wrote under the same
    packet id for another entry; a restarted broker would not send that one again
    under its id."""
    q = queues(store)
    await q.save(batch(cid, [("a", b"1"), ("b", b"2")]))
    entries, _ = await q.load(cid, 0, 100)
    b_entry = next(e for e in entries if e.key == "b")
    await q.record_inflight(cid, 2, [(5, b_entry)])  # the later session's, under id 5
    await q.ack(cid, [("a", 1, 5)])  # the earlier session's "a", once under id 5
    inflight = queue_keys(cid).inflight
    assert sorted(await store.redis.hkeys(inflight)) == [b"5", b"gen"]
    await q.ack(cid, [("b", 2, 5)])
    assert await store.redis.hkeys(inflight) == [b"gen"]


async def test_retention_and_the_key_limit_take_the_oldest(
    store: RedisMessageStore, cid: str
) -> None:
    q = queues(store, retention=60, max_keys=2)
    late = await q.save(batch(cid, [("old", b"1")], published=NOW - 120))
    assert [(r.key, r.why, r.pending) for r in late.removed] == [("old", RETENTION, True)]
    saved = await q.save(batch(cid, [("a", b"2"), ("b", b"3"), ("c", b"4")], first_seq=2))
    assert [(r.key, r.why, r.pending) for r in saved.removed] == [("a", KEY_LIMIT, True)]
    entries, _ = await q.load(cid, 0, 100)
    assert [e.key for e in entries] == ["b", "c"]


async def test_a_rewind_makes_the_latest_of_every_kept_key_pending_again(
    store: RedisMessageStore, cid: str
) -> None:
    q = queues(store)
    writes = [(f"k{i}", b"v%d" % i) for i in range(2500)]  # more than one rewind chunk
    await q.save(batch(cid, writes))
    await q.save(batch(cid, [("k0", b"again")], first_seq=2501))  # k0 -> seq 2501
    everything, _ = await q.load(cid, 0, 5000)
    await q.ack(cid, [(e.key, e.seq, 0) for e in everything])
    assert (await q.info(cid)).pending == 0
    assert await q.rewind(cid, 2000) == 502  # k1999..k2499 (seq 2000..2500) and k0 (2501)
    entries, _ = await q.load(cid, 0, 5000)
    assert [e.seq for e in entries] == list(range(2000, 2502))
    assert entries[-1].key == "k0" and entries[-1].value.endswith(b"again")
    assert await q.rewind(cid, 2000) == 0  # pending already: nothing changes


def test_a_queues_keys_share_one_cluster_slot_with_its_clients() -> None:
    keys = queue_keys("device-1")
    assert len({key_slot(k.encode()) for k in keys}) == 1
    assert key_slot(keys.pending.encode()) == key_slot(b"{device-1}_messages")


async def test_nothing_is_stored_once_redis_lost_acknowledged_saves(
    store: RedisMessageStore, cid: str
) -> None:
    """With ``persistence.redis_wait`` the store counts what Redis acknowledged; a
    queue save finding the count gone back stores nothing (a later record stored
    first would make the lost ones look read twice: finding 25). On a cluster the
    scripts see one slot: no guard, the fence alone sees a loss."""
    counting = RedisMessageStore(store.redis, wait="replicas", wait_timeout_ms=10)
    q = queues(counting)
    if not isinstance(store.redis, Redis):
        assert counting.loss_guard() is None
        return
    await counting.save_many([ClientBatch(f"{cid}-c", [], 0)])
    assert counting.loss_guard() is not None
    await counting.wait_durable()  # the fence: the counter is 1 and acknowledged
    assert (await q.save(batch(cid, [("a", b"1")]))).seqs == [1]
    key, floor = counting.loss_guard()  # type: ignore[misc]
    assert floor >= 1
    await store.redis.delete(key)  # Redis lost its last writes (a failover, say)
    with pytest.raises(LostWrites):
        await q.save(batch(cid, [("b", b"2")], first_seq=2))
    entries, _ = await q.load(cid, 0, 100)
    assert [e.key for e in entries] == ["a"]
    assert counting.lost_writes == 1
    assert (await q.save(batch(cid, [("b", b"2")], first_seq=2))).seqs == [2]  # counted anew


async def test_a_lost_queue_save_shows_as_the_counter_going_back(
    store: RedisMessageStore, cid: str
) -> None:
    """A queue save counts the store's counter up (queue_save.lua): lost with the
    master's last writes after the last fence, it shows at the next fence and the
    next save, and a re-read stores it again (a review found it unseen: its Kafka
    offset was committed and the record lost for good)."""
    from persistence.redis_store import LOST

    counting = RedisMessageStore(store.redis, wait="replicas", wait_timeout_ms=10)
    q = queues(counting)
    if not isinstance(store.redis, Redis):
        return  # a cluster's scripts see one slot: no guard (see the test above)
    await counting.wait_durable()  # a fence: the counter is acknowledged
    key, before = counting.loss_guard()  # type: ignore[misc]
    assert (await q.save(batch(cid, [("a", b"1")]))).seqs == [1]
    assert counting.loss_guard()[1] > before  # type: ignore[index]
    # The failover: the new master has the counter as it was, and not "a".
    await store.redis.set(key, before)
    await store.redis.delete(*queue_keys(cid))
    with pytest.raises(LostWrites):  # the next save, before anything is stored
        await q.save(batch(cid, [("b", b"2")], first_seq=2))
    # Kafka read again from the committed offset: "a" is stored, not skipped as seen.
    assert (await q.save(batch(cid, [("a", b"1")]))).seqs == [1]
    # And the fence: the same loss again, seen by the commit's wait.
    await store.redis.set(key, before)
    assert await counting.wait_durable() == LOST
