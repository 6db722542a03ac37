"""Byte limits of $ECQ queues and group queue stores, their purge and the expiry of
unused group stores (persistence/lua/queue_save.lua, queue_purge.lua, group_ack.lua;
persistence/group_feed.py GroupQueues.sweep) against a real redis-server, single
and in cluster mode.

An $ECQ write over ``ecq.max_bytes`` is refused once the acknowledged entries
(kept for a rewind) made no room; a group store over ``group_queues.max_bytes``
loses its oldest entries. The byte count follows every write, acknowledgement,
trim and purge.
"""

from __future__ import annotations

from redis.crc import key_slot

from persistence.format import StoredMessage, encode_message, queue_keys
from persistence.group_feed import GroupQueues
from persistence.queue_store import BYTE_LIMIT, QUEUES_KEY, REFUSED, QueueBatch, QueueStore
from persistence.redis_store import RedisMessageStore

NOW = 1_800_000_000.0
KIB = 1024


def _values(topic: str, payloads: list[bytes], first_seq: int, queue: bool) -> list[bytes]:
    return [
        encode_message(
            StoredMessage(topic, p, 1, producer=1, seq=first_seq + i, publish_time=NOW),
            queue=queue,
        )
        for i, p in enumerate(payloads)
    ]


def _ecq(cid: str, writes: list[tuple[str, bytes]], first_seq: int = 1) -> QueueBatch:
    values = [
        _values(f"$ECQ/{cid}/{key}", [payload], first_seq + i, False)[0]
        for i, (key, payload) in enumerate(writes)
    ]
    return QueueBatch(cid, values, 0, list(range(len(values))))


def _group(store_id: str, payloads: list[bytes], first_seq: int = 1) -> QueueBatch:
    values = _values("m/a", payloads, first_seq, True)
    return QueueBatch(store_id, values, 0, list(range(len(values))))


def _store(store: RedisMessageStore, max_bytes: int = 0, group_max_bytes: int = 0) -> QueueStore:
    return QueueStore(
        store,
        retention=0,
        max_keys=0,
        clock=lambda: NOW,
        max_bytes=max_bytes,
        group_max_bytes=group_max_bytes,
    )


async def test_an_ecq_write_over_the_byte_limit_is_refused_and_nothing_pending_is_lost(
    store: RedisMessageStore, cid: str
) -> None:
    q = _store(store, max_bytes=10 * KIB)
    saved = await q.save(_ecq(cid, [(f"k{i}", b"x" * (3 * KIB)) for i in range(5)]))
    assert saved.seqs == [1, 2, 3, REFUSED, REFUSED]  # three fit in 10 KiB, with headers
    assert saved.refused == 2 and saved.removed == []
    info = await q.info(cid)
    assert info.pending == 3 and info.bytes == saved.bytes <= 10 * KIB
    assert await q.is_full(cid)
    # Read again from Kafka, a refused record stays refused: a duplicate now.
    again = await q.save(_ecq(cid, [(f"k{i}", b"x" * (3 * KIB)) for i in range(5)]))
    assert again.saved == 0 and (await q.info(cid)).bytes == info.bytes
    # A smaller value of a key that is there replaces it: compaction frees room.
    smaller = await q.save(_ecq(cid, [("k0", b"y")], first_seq=6))
    assert smaller.seqs == [4] and (await q.info(cid)).bytes < info.bytes
    assert not await q.is_full(cid)  # a write fitted: the mark is gone


async def test_acknowledged_entries_make_room_before_a_write_is_refused(
    store: RedisMessageStore, cid: str
) -> None:
    q = _store(store, max_bytes=10 * KIB)
    await q.save(_ecq(cid, [(f"k{i}", b"x" * (3 * KIB)) for i in range(3)]))
    await q.ack(cid, [("k0", 1, 0), ("k1", 2, 0)])  # kept for a rewind only
    saved = await q.save(_ecq(cid, [("k3", b"z" * (3 * KIB)), ("k4", b"z" * (3 * KIB))], 4))
    assert saved.seqs == [4, 5]
    assert [(r.key, r.pending, r.why) for r in saved.removed] == [
        ("k0", False, BYTE_LIMIT),
        ("k1", False, BYTE_LIMIT),
    ]
    more = await q.save(_ecq(cid, [("k5", b"z" * (3 * KIB))], 6))
    assert more.seqs == [REFUSED]  # only pending entries left: k2, k3, k4
    entries, _ = await q.load(cid, 0, 100)
    assert [e.key for e in entries] == ["k2", "k3", "k4"]


async def test_a_group_store_over_its_byte_limit_loses_its_oldest_and_acks_free_bytes(
    store: RedisMessageStore, cid: str
) -> None:
    q = _store(store, group_max_bytes=10 * KIB)
    group = f"$queue/g/{cid}/#"
    saved = await q.save(_group(group, [b"a" * (3 * KIB)] * 5))
    assert saved.seqs == [1, 2, 3, 4, 5]
    assert [(r.key, r.why, r.pending) for r in saved.removed] == [
        ("1", BYTE_LIMIT, True),
        ("2", BYTE_LIMIT, True),
    ]
    info = await q.info(group)
    assert info.pending == 3 and info.bytes == saved.bytes <= 10 * KIB
    too_large = await q.save(_group(group, [b"b" * (11 * KIB)], 6))
    assert too_large.seqs == [REFUSED]  # larger than the limit on its own
    assert await q.group_ack(group, [("3", 3)]) == 1
    assert (await q.info(group)).bytes < info.bytes


async def test_a_purge_empties_a_queue_and_its_numbers_go_on(
    store: RedisMessageStore, cid: str
) -> None:
    q = _store(store)
    await q.save(_ecq(cid, [("a", b"1" * 100), ("b", b"2" * 100)]))
    await q.ack(cid, [("a", 1, 0)])
    assert cid in await q.queue_ids(100_000)
    purged = await q.purge(cid)
    assert (purged.entries, purged.pending) == (2, [("b", 2)]) and purged.bytes > 200
    info = await q.info(cid)
    assert (info.pending, info.keys, info.bytes, info.last_seq) == (0, 0, 0, 2)
    assert cid not in await q.queue_ids(100_000)
    assert (await q.save(_ecq(cid, [("c", b"3")], first_seq=3))).seqs == [3]


async def test_the_new_keys_share_the_queues_slot(cid: str) -> None:
    keys = queue_keys(f"$queue/g/{cid}/#")
    assert len({key_slot(k.encode()) for k in keys}) == 1


async def test_a_group_store_without_members_expires_after_its_time(
    store: RedisMessageStore, cid: str
) -> None:
    q = _store(store)
    kept, unused = f"$queue/kept/{cid}", f"$queue/unused/{cid}"
    await q.save(_group(kept, [b"1"]))
    await q.save(_group(unused, [b"1", b"2"]))
    groups = GroupQueues(q, lease=15.0)
    members = {kept}
    # First look: the one without members is marked, nothing is deleted yet.
    assert await groups.sweep(members.__contains__, 100, now=NOW) == []
    assert (await q.group_store_ids())[unused] == NOW
    assert await groups.sweep(members.__contains__, 100, now=NOW + 99) == []
    # A member came back meanwhile: the mark is cleared, the time starts again.
    members.add(unused)
    await groups.sweep(members.__contains__, 100, now=NOW + 99.5)
    assert (await q.group_store_ids())[unused] == 0
    members.discard(unused)
    await groups.sweep(members.__contains__, 100, now=NOW + 100)
    assert await groups.sweep(members.__contains__, 100, now=NOW + 200) == [unused]
    assert (await q.info(unused)).last_seq == 0  # nothing of it is left
    left = await q.group_store_ids()
    assert unused not in left and kept in left
    assert (await q.info(kept)).pending == 1


async def test_no_more_queues_than_max_queues_are_started(
    store: RedisMessageStore, cid: str
) -> None:
    held = int(await store.redis.scard(QUEUES_KEY))  # other tests' queues on this Redis
    q = QueueStore(store, retention=0, max_keys=0, clock=lambda: NOW, max_queues=held + 1)
    assert (await q.save(_ecq(f"{cid}-a", [("k", b"1")]))).seqs == [1]
    refused = await q.save(_ecq(f"{cid}-b", [("k", b"1"), ("l", b"2")]))
    assert refused.seqs == [REFUSED, REFUSED] and refused.refused == 2
    assert await q.is_full(f"{cid}-b") and (await q.info(f"{cid}-b")).keys == 0
    assert (await q.save(_ecq(f"{cid}-a", [("k2", b"3")], 2))).seqs == [2]  # one it holds
    group = await q.save(_group(f"$queue/g/{cid}", [b"1"]))  # group stores are not counted
    assert group.seqs == [1]
    await q.purge(f"{cid}-a")  # a purged queue leaves room for another
    assert (await q.save(_ecq(f"{cid}-c", [("k", b"1")]))).seqs == [1]


async def test_what_retention_takes_is_room_for_a_write_to_a_full_queue(
    store: RedisMessageStore, cid: str
) -> None:
    """A queue full of unacknowledged entries no consumer came for takes writes again
    once they are past retention."""
    now = [NOW]
    q = QueueStore(store, retention=60, max_keys=0, clock=lambda: now[0], max_bytes=10 * KIB)
    await q.save(_ecq(cid, [(f"k{i}", b"x" * (3 * KIB)) for i in range(3)]))
    assert (await q.save(_ecq(cid, [("k3", b"x" * (3 * KIB))], 4))).seqs == [REFUSED]
    now[0] = NOW + 61
    message = StoredMessage(
        f"$ECQ/{cid}/k4", b"y" * (3 * KIB), 1, producer=1, seq=5, publish_time=now[0]
    )
    later = [encode_message(message)]
    saved = await q.save(QueueBatch(cid, later, 0, [0]))
    assert saved.seqs == [4] and {r.key for r in saved.removed} == {"k0", "k1", "k2"}
