"""Group queues in Redis ($queue, persistence/queue_store.py with the group_*.lua
scripts) against a real redis-server, single and in cluster mode.

Claims: one member's claim keeps an entry from the others while its lease
holds (on Redis's clock); a lapsed lease frees it, with DUP; a give-back frees
it, with DUP if it had been sent or got with DUP; an acknowledgement removes
it for everyone; trimming leaves no claim behind.
"""

from __future__ import annotations

import asyncio

from persistence.format import StoredMessage, encode_message, group_writes_key, queue_keys
from persistence.queue_store import QueueBatch, QueueEntry, QueueStore, group_write_packed
from persistence.redis_store import RedisMessageStore

NOW = 1_800_000_000.0
LONG = 60.0  # s: a lease that does not run out during a test


def _batch(store_id: str, payloads: list[bytes], first_seq: int = 1) -> QueueBatch:
    values = [
        encode_message(
            StoredMessage("m/a", p, 1, producer=1, seq=first_seq + i, publish_time=NOW),
            queue=True,
        )
        for i, p in enumerate(payloads)
    ]
    return QueueBatch(store_id, values, 0, list(range(len(values))))


def _queues(store: RedisMessageStore, group_max: int = 0) -> QueueStore:
    return QueueStore(
        store, retention=0, max_keys=1, clock=lambda: NOW, group_retention=0, group_max=group_max
    )


def _seqs(claimed: list) -> list[tuple[int, bool]]:  # type: ignore[type-arg]
    return [(entry.seq, dup) for entry, dup in claimed]


async def test_claims_keep_entries_from_other_members_until_given_back(
    store: RedisMessageStore, cid: str
) -> None:
    q = _queues(store)
    group = f"$queue/g/{cid}/#"
    saved = await q.save(_batch(group, [b"1", b"2", b"3", b"4"]))
    assert saved.seqs == [1, 2, 3, 4] and saved.keys == ["1", "2", "3", "4"]  # no compaction
    assert _seqs(await q.claim(group, "a", 2, LONG)) == [(1, False), (2, False)]
    assert _seqs(await q.claim(group, "b", 10, LONG)) == [(3, False), (4, False)]  # a's held
    assert await q.claim(group, "c", 10, LONG) == []
    # a gives back: 1 had been sent (DUP for the next), 2 had not.
    assert await q.release(group, "a", {"1": True}) == 2
    assert _seqs(await q.claim(group, "c", 10, LONG)) == [(1, True), (2, False)]
    # An acknowledgement from any member removes the entry, even after a give-back.
    assert await q.group_ack(group, [("1", 1), ("3", 3)]) == 2
    await q.release(group, "b", {})
    await q.release(group, "c", {"2": True})
    assert _seqs(await q.claim(group, "e", 10, LONG)) == [(2, True), (4, False)]


async def test_dup_survives_a_second_give_back(store: RedisMessageStore, cid: str) -> None:
    """Found by review: a sent K went back with DUP; the next member got it with DUP and
    left before sending it. The one after must still get DUP (the feed passes the keys
    it got with DUP as well as those it sent)."""
    q = _queues(store)
    group = f"$queue/g/{cid}/#"
    await q.save(_batch(group, [b"k"]))
    await q.claim(group, "a", 1, LONG)
    await q.release(group, "a", {"1": True})
    assert _seqs(await q.claim(group, "b", 1, LONG)) == [(1, True)]
    await q.release(group, "b", {"1": True})  # got with DUP, never sent: still DUP
    assert _seqs(await q.claim(group, "c", 1, LONG)) == [(1, True)]


async def test_dup_survives_a_give_back_decided_before_its_claim_landed(
    store: RedisMessageStore, cid: str
) -> None:
    """Finding 34 (tests/model/FINDINGS.md): a member's connection closed while its claim
    was on its way. The feed gave back everything of that token with nothing marked DUP
    (it held nothing yet); the claim then landed, taking entries another member had
    sent, and the give-back ran after it. The next member got them without DUP. A
    claim keeps "seen before" with it, so a give-back that does not list the key
    leaves it seen."""
    q = _queues(store)
    group = f"$queue/g/{cid}/#"
    await q.save(_batch(group, [b"1", b"2"]))
    assert _seqs(await q.claim(group, "a", 1, LONG)) == [(1, False)]
    await q.release(group, "a", {"1": True})  # a sent 1 and left
    # b's claim lands (1 with DUP), then b's give-back decided before it ran.
    assert _seqs(await q.claim(group, "b", 10, LONG)) == [(1, True), (2, False)]
    assert await q.release(group, "b", {}) == 2
    assert _seqs(await q.claim(group, "c", 10, LONG)) == [(1, True), (2, False)]
    # The same with only that key given back (a member that may not take it).
    await q.release(group, "c", {"1": False}, everything=False)
    assert _seqs(await q.claim(group, "d", 10, LONG)) == [(1, True)]
    # A lapsed token's claim is seen as well, and stays so through the next one.
    await q.save(_batch(group, [b"3"], first_seq=3))
    assert _seqs(await q.claim(group, "e", 1, 0.2)) == [(3, False)]
    await asyncio.sleep(0.4)  # e's lease runs out (its broker died after sending 3)
    assert _seqs(await q.claim(group, "f", 10, LONG)) == [(3, True)]
    await q.release(group, "f", {})
    assert _seqs(await q.claim(group, "g", 10, LONG)) == [(3, True)]


async def test_a_lapsed_lease_frees_its_claims_and_a_renewal_keeps_them(
    store: RedisMessageStore, cid: str
) -> None:
    q = _queues(store)
    group = f"$queue/g/{cid}/#"
    await q.save(_batch(group, [b"1", b"2"]))
    assert len(await q.claim(group, "a", 1, 0.3)) == 1
    assert len(await q.claim(group, "b", 1, 0.3)) == 1
    assert await q.renew(group, ["a"], LONG) == 1  # a's broker renews; b's died
    await asyncio.sleep(0.6)  # longer than b's lease, by Redis's clock too
    assert _seqs(await q.claim(group, "c", 10, LONG)) == [(2, True)]  # b's lapsed: DUP
    assert await q.renew(group, ["b"], 0.3) == 0  # a lapsed token stays gone


async def test_a_declined_entry_is_skipped_by_that_member_only(
    store: RedisMessageStore, cid: str
) -> None:
    q = _queues(store)
    group = f"$queue/g/{cid}/#"
    await q.save(_batch(group, [b"big", b"small"]))
    assert _seqs(await q.claim(group, "a", 2, LONG)) == [(1, False), (2, False)]
    assert await q.release(group, "a", {"1": False}, everything=False) == 1
    assert await q.claim(group, "a", 2, LONG, skip=["1"]) == []  # 2 is a's still
    assert _seqs(await q.claim(group, "b", 2, LONG)) == [(1, False)]


async def test_free_entries_behind_thousands_held_are_claimed(
    store: RedisMessageStore, cid: str
) -> None:
    """Found by review: 5,000 entries held at the head stalled every other member."""
    q = _queues(store)
    group = f"$queue/g/{cid}/#"
    for first in range(1, 5501, 500):
        await q.save(_batch(group, [b"x"] * 500, first_seq=first))
    assert len(await q.claim(group, "a", 5000, LONG)) == 5000
    assert len(await q.claim(group, "b", 1000, LONG)) == 500


async def test_trimmed_entries_leave_no_claims(store: RedisMessageStore, cid: str) -> None:
    q = _queues(store, group_max=3)
    group = f"$queue/g/{cid}/#"
    await q.save(_batch(group, [b"1", b"2", b"3"]))
    await q.claim(group, "a", 3, LONG)
    saved = await q.save(_batch(group, [b"4", b"5"], first_seq=4))
    assert [r.seq for r in saved.removed] == [1, 2]  # the oldest leave first
    claims = await store.redis.hkeys(queue_keys(group).claims)
    assert sorted(k.decode() if isinstance(k, bytes) else k for k in claims) == ["3"]


def _records(held: list[tuple[int, str, QueueEntry]]) -> list[bytes | int]:
    ops: list[bytes | int] = []
    for packet_id, store_id, entry in held:
        ops += [b"+", packet_id, group_write_packed(store_id, entry)]
    return ops


async def test_records_and_forgets_of_a_packet_id_apply_in_the_order_asked(
    store: RedisMessageStore, cid: str
) -> None:
    """Finding 43: a member's records and forgets go in one call per round. A write
    taken, never sent, and taken again under the same id: record, forget, record
    leaves the last record; an id given to another write after an acknowledgement:
    forget, record leaves the new one."""
    q = _queues(store)
    g1 = f"$queue/a/{cid}/#"
    await q.save(_batch(g1, [b"1", b"2"]))
    (e1, _), (e2, _) = await q.claim(g1, "t1", 2, LONG)
    p1, p2 = group_write_packed(g1, e1), group_write_packed(g1, e2)
    await q.write_group_writes(cid, 7, [b"+", 3, p1, b"-", 3, p1, b"+", 3, p1])
    assert {pid: e for pid, (_, e, _) in (await q.group_writes(cid, 7)).items()} == {3: e1}
    await q.write_group_writes(cid, 7, [b"-", 3, p1, b"+", 3, p2, b"-", 3, p1])
    assert {pid: e for pid, (_, e, _) in (await q.group_writes(cid, 7)).items()} == {3: e2}
    await q.write_group_writes(cid, None, [b"-", 3, p2])  # forgets alone: no generation
    assert await q.group_writes(cid, 7) == {}


async def test_a_members_group_writes_are_kept_with_its_session_by_generation(
    store: RedisMessageStore, cid: str
) -> None:
    """Finding 35: what a persistent member left with in flight, packet id -> (group
    store, entry), read back by that session only; forgotten once done with."""
    q = _queues(store)
    g1, g2 = f"$queue/a/{cid}/#", f"$queue/b/{cid}/#"
    await q.save(_batch(g1, [b"1", b"2"]))
    await q.save(_batch(g2, [b"3"]))
    (e1, _), (e2, _) = await q.claim(g1, "t1", 2, LONG)
    ((e3, _),) = await q.claim(g2, "t2", 1, LONG)
    await q.write_group_writes(cid, 7, _records([(4, g1, e1), (5, g1, e2), (9, g2, e3)]))
    kept = await q.group_writes(cid, 7)
    assert {pid: (s, e) for pid, (s, e, _) in kept.items()} == {
        4: (g1, e1),
        5: (g1, e2),
        9: (g2, e3),
    }
    await q.write_group_writes(cid, None, [b"-", 5, kept[5][2], b"-", 9, kept[4][2]])  # 9: not its
    assert sorted(await q.group_writes(cid, 7)) == [4, 9]
    await q.write_group_writes(cid, 6, _records([(1, g1, e1)]))  # a late write of an ended session
    assert sorted(await q.group_writes(cid, 7)) == [4, 9]
    await q.end_group_writes(cid, 6)  # an older session's end leaves this one's
    assert sorted(await q.group_writes(cid, 7)) == [4, 9]
    assert await q.group_writes(cid, 6) == {}  # an older session's copy: nothing for it ...
    assert sorted(await q.group_writes(cid, 7)) == [4, 9]  # ... and the record stays
    assert await q.group_writes(cid, 8) == {}  # a later session: the old record goes
    assert await store.redis.exists(group_writes_key(cid)) == 0
    await q.write_group_writes(cid, 8, _records([(2, g2, e3)]))
    await q.end_group_writes(cid, 8)
    assert await q.group_writes(cid, 8) == {}


async def test_a_group_write_record_it_cannot_read_is_passed_over(
    store: RedisMessageStore, cid: str
) -> None:
    """A field this version did not write (another version's packing, a damaged
    value, a packet id out of range) is left out, and the rest is read: raised,
    the session's first connection would read it again forever, its outflow
    giving nothing meanwhile (persistence/device_persistence.py
    ``_restore_group_writes``)."""
    q = _queues(store)
    g1 = f"$queue/a/{cid}/#"
    await q.save(_batch(g1, [b"1"]))
    ((e1, _),) = await q.claim(g1, "t1", 1, LONG)
    await q.write_group_writes(cid, 7, _records([(4, g1, e1)]))
    key = group_writes_key(cid)
    await store.redis.hset(key, "5", b"\x00")  # too short for its own header
    await store.redis.hset(key, "x", b"")  # not a packet id
    await store.redis.hset(key, "70000", (await store.redis.hget(key, "4")) or b"")
    kept = await q.group_writes(cid, 7)
    assert {pid: (s, e) for pid, (s, e, _) in kept.items()} == {4: (g1, e1)}
