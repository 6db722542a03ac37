"""Group queues in Redis ($queue, persistence/queue_store.py with the group_*.lua
scripts) against a real redis-server, single and in cluster mode.

Claims: one member's claim keeps an entry from the others while its lease
holds; a lapsed lease frees it, with DUP; a give-back frees it, with DUP only
if it had been sent; an acknowledgement removes it for everyone.
"""

from __future__ import annotations

from persistence.format import StoredMessage, encode_message
from persistence.queue_store import QueueBatch, QueueStore
from persistence.redis_store import RedisMessageStore

NOW = 1_800_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def _batch(store_id: str, payloads: list[bytes], first_seq: int = 1) -> QueueBatch:
    values = [
        encode_message(
            StoredMessage("m/a", p, 1, producer=1, seq=first_seq + i, publish_time=NOW),
            queue=True,
        )
        for i, p in enumerate(payloads)
    ]
    return QueueBatch(store_id, values, 0, list(range(len(values))))


async def test_claims_keep_entries_from_other_members_until_given_back_or_lapsed(
    store: RedisMessageStore, cid: str
) -> None:
    clock = Clock()
    q = QueueStore(store, retention=0, max_keys=0, clock=clock, group_retention=3600)
    group = f"$queue/g/{cid}/#"
    saved = await q.save(_batch(group, [b"1", b"2", b"3", b"4"]))
    assert saved.seqs == [1, 2, 3, 4] and saved.keys == ["1", "2", "3", "4"]  # no compaction
    a = await q.claim(group, "a", 2, lease=10)
    assert [(e.seq, dup) for e, dup in a] == [(1, False), (2, False)]
    b = await q.claim(group, "b", 10, lease=10)
    assert [(e.seq, dup) for e, dup in b] == [(3, False), (4, False)]  # a's are held
    assert await q.claim(group, "c", 10, lease=10) == []
    # a gives back: 1 had been sent (DUP for the next), 2 had not.
    assert await q.release(group, "a", ["1"]) == 2
    c = await q.claim(group, "c", 10, lease=10)
    assert [(e.seq, dup) for e, dup in c] == [(1, True), (2, False)]
    # b's broker dies: nobody renews b's lease; c's is renewed.
    clock.now += 8
    await q.renew(group, ["c"], lease=10)
    clock.now += 3
    d = await q.claim(group, "d", 10, lease=10)
    assert [(e.seq, dup) for e, dup in d] == [(3, True), (4, True)]
    # An acknowledgement from any member removes the entry, even after a give-back.
    assert await q.group_ack(group, [("1", 1), ("3", 3)]) == 2
    assert await q.release(group, "c", ["2"]) == 1
    await q.release(group, "d", [])
    left = await q.claim(group, "e", 10, lease=10)
    assert [(e.seq, dup) for e, dup in left] == [(2, True), (4, False)]


async def test_a_renewal_does_not_bring_back_a_lapsed_token(
    store: RedisMessageStore, cid: str
) -> None:
    clock = Clock()
    q = QueueStore(store, retention=0, max_keys=0, clock=clock)
    group = f"$queue/g/{cid}/#"
    await q.save(_batch(group, [b"1"]))
    assert len(await q.claim(group, "a", 1, lease=5)) == 1
    clock.now += 6
    assert len(await q.claim(group, "b", 1, lease=5)) == 1  # a lapsed: b has it
    await q.renew(group, ["a"], lease=5)  # a's broker was only slow
    clock.now += 1
    assert await q.claim(group, "c", 1, lease=5) == []  # still b's, not a's again


async def test_the_group_limit_drops_the_oldest(store: RedisMessageStore, cid: str) -> None:
    q = QueueStore(store, retention=0, max_keys=1, clock=Clock(), group_max=3)
    group = f"$queue/g/{cid}/#"
    saved = await q.save(_batch(group, [b"1", b"2", b"3", b"4", b"5"]))
    assert [r.seq for r in saved.removed] == [1, 2]
    claimed = await q.claim(group, "a", 10, lease=5)
    assert [e.value[-1:] for e, _ in claimed] == [b"3", b"4", b"5"]
