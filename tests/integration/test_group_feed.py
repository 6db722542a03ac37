"""A member's share of a group queue (persistence/group_feed.py: GroupFeed and
GroupQueues) against a real redis-server, with a stand-in for its outflow.

Found by review (round 2), each failing on the code before its fix: what a
member declined on one connection it may take on the next; a failed claim
gives back what the member took and may still send, with DUP; a member with
more entries it may not take than it can remember stops claiming instead of
claiming and declining them over and over; a lapsed lease is not revived.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

import persistence.group_feed as group_feed
from broker.stats import BrokerStats
from persistence.group_feed import GroupFeed, GroupQueues
from persistence.queue_store import LeaseLapsed, QueueStore
from persistence.redis_store import RedisMessageStore
from tests.integration.test_group_store import LONG, _batch, _queues, _seqs


class Outflow:
    """What a GroupFeed asks of its outflow; ``decline_all``: every entry taken is one
    the member may not take."""

    max_inflight = 10
    connection = object()
    restoring_groups = False  # not reading back group writes held before a restart

    def __init__(self, feed: GroupFeed, decline_all: bool = False) -> None:
        self.feed = feed
        self.decline_all = decline_all
        self.inflight: dict[int, Any] = {}
        feed.outflow = self  # type: ignore[assignment]

    def room(self) -> int:
        return 10

    def pump(self) -> None:
        if self.decline_all:
            for item in self.feed.take(10):
                self.feed.decline(item)


def _member(q: QueueStore, group: str, member: str) -> tuple[GroupQueues, GroupFeed]:
    groups = GroupQueues(q, LONG)
    return groups, GroupFeed(group, member, groups, BrokerStats(), clock=lambda: 0.0)


async def _holding_one(q: QueueStore, group: str) -> tuple[GroupQueues, GroupFeed, Any]:
    """Member "a" of a group holding one entry "k", taken from its feed (not sent)."""
    await q.save(_batch(group, [b"k"]))
    groups, feed = _member(q, group, "a")
    Outflow(feed)
    feed.restart()
    assert await _until(lambda: feed.queued() == 1)
    (item,) = feed.take(1)
    return groups, feed, item


async def _until(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    for _ in range(int(timeout / 0.02)):
        if condition():
            return True
        await asyncio.sleep(0.02)
    return condition()


async def test_what_a_member_declined_it_may_take_on_its_next_connection(
    store: RedisMessageStore, cid: str
) -> None:
    """K was too large for the first connection's Maximum Packet Size; the next one
    may take it (it stayed skipped for good, and nobody else was there)."""
    q = _queues(store)
    group = f"$queue/g/{cid}/#"
    groups, feed, item = await _holding_one(q, group)
    feed.decline(item)
    feed.discard()  # the connection closes
    await groups.flush()
    feed.restart()  # a new one, with a larger Maximum Packet Size
    try:
        assert await _until(lambda: feed.queued() == 1)
    finally:
        feed.discard()
        await groups.close()


async def test_a_failed_claim_gives_back_what_was_taken_with_dup(
    store: RedisMessageStore, cid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A took K (not sent yet: behind the session's marks); a claim fails, its token
    changes and the old one's claims go back. A may still send K, so whoever gets it
    next must get it with DUP."""
    q = _queues(store)
    group = f"$queue/g/{cid}/#"
    groups, feed, item = await _holding_one(q, group)
    real, calls = q.claim, 0

    async def failing_once(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionError("the answer was lost")
        return await real(*args, **kwargs)

    monkeypatch.setattr(q, "claim", failing_once)
    token = feed.token
    feed.poke()
    assert await _until(lambda: feed.token != token)
    await groups.close()  # the give-back has landed
    monkeypatch.setattr(q, "claim", real)
    again = _seqs(await q.claim(group, "b", 10, LONG)) + [(e.seq, d) for e, d in feed._buffer]
    try:
        assert not item.sent
        assert again in ([(1, True)], [])  # with DUP, or A skips it: A holds it in flight
    finally:
        feed.discard()
        await groups.close()


async def test_a_member_that_may_take_nothing_stops_claiming(
    store: RedisMessageStore, cid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More entries it may not take than it remembers (2 here, 1,000 in production),
    and no other member: it claimed and declined them in a loop, ~2,000 claims/s."""
    monkeypatch.setattr(group_feed, "MAX_DECLINED", 2)
    q = _queues(store)
    group = f"$queue/g/{cid}/#"
    await q.save(_batch(group, [b"1", b"2", b"3"]))
    groups, feed = _member(q, group, "a")
    real, calls = q.claim, 0

    async def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return await real(*args, **kwargs)

    monkeypatch.setattr(q, "claim", counting)
    Outflow(feed, decline_all=True)
    feed.restart()
    await asyncio.sleep(1.0)
    feed.discard()
    await groups.close()
    assert calls < 10


async def test_a_lapsed_token_is_not_revived_by_its_next_claim(
    store: RedisMessageStore, cid: str
) -> None:
    """Its claims may be another member's now (with DUP) while its buffer still holds
    copies without DUP: the member must start over under a new token."""
    q = _queues(store)
    group = f"$queue/g/{cid}/#"
    await q.save(_batch(group, [b"1", b"2"]))
    assert len(await q.claim(group, "a", 1, 0.2)) == 1
    await asyncio.sleep(0.4)  # a's broker did not renew it
    assert _seqs(await q.claim(group, "b", 1, LONG)) == [(1, True)]
    with pytest.raises(LeaseLapsed):
        await q.claim(group, "a", 1, LONG, fresh=False)
    assert len(await q.claim(group, "a2", 1, LONG)) == 1  # a new token goes on


async def test_a_give_back_that_runs_after_a_claim_on_its_way_keeps_dup(
    store: RedisMessageStore, cid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 34 (tests/model/FINDINGS.md, seed 6103): A sent K and left (K free, with
    DUP). B's connection opened, its feed claimed, and the connection closed before
    the claim answered: the feed gave back everything of its token, listing nothing
    (it held nothing yet). Here the claim lands first, then that give-back, then the
    one of what the late claim brought: the order the model checker saw. The next
    member must get K with DUP (it got it without)."""
    q = _queues(store)
    group = f"$queue/g/{cid}/#"
    await q.save(_batch(group, [b"k"]))
    assert _seqs(await q.claim(group, "a", 1, LONG)) == [(1, False)]
    await q.release(group, "a", {"1": True})  # A sent it and left
    groups, feed = _member(q, group, "b")
    Outflow(feed)
    real_claim, real_release = q.claim, q.release
    claimed, gave_back = asyncio.Event(), asyncio.Event()
    order: list[str] = []

    async def claim(*args: Any, **kwargs: Any) -> Any:
        try:
            return await real_claim(*args, **kwargs)
        finally:
            order.append("claim")
            claimed.set()

    async def release(*args: Any, everything: bool = True, **kwargs: Any) -> Any:
        if everything:
            await claimed.wait()  # B's give-back runs after its claim landed
        else:
            await gave_back.wait()  # what the late claim brought goes back last
        try:
            return await real_release(*args, everything=everything, **kwargs)
        finally:
            order.append(f"release everything={everything}")
            if everything:
                gave_back.set()

    monkeypatch.setattr(q, "claim", claim)
    monkeypatch.setattr(q, "release", release)
    feed.restart()  # B connects: its claim is on its way
    feed.discard()  # and its connection closes before the answer
    await groups.close()
    assert order == ["claim", "release everything=True", "release everything=False"]
    assert _seqs(await real_claim(group, "c", 10, LONG)) == [(1, True)]


async def test_a_write_whose_connection_ended_before_its_record_landed_is_forgotten_in_order(
    store: RedisMessageStore, cid: str
) -> None:
    """Finding 43: a persistent member's write waits for its record (slow here); its
    connection ends meanwhile (Outflow.left calls ``never_sent``: tests/unit/
    test_outflow_side.py), and the forget's first try fails. The record lands
    first, then the forget, and waiting for the member's records covers both: a
    record another replica writes for the id once told so stays."""
    q = _queues(store)
    group = f"$queue/g/{cid}/#"
    member = f"m-{cid}"
    generation = 1_700_000_000_000_000
    await q.save(_batch(group, [b"k"]))
    calls = 0
    write = q.write_group_writes

    async def slow_then_failing(client_id: str, gen: int | None, ops: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            await asyncio.sleep(0.2)  # the record is on its way as the connection ends
        elif calls == 2:
            raise ConnectionError("the forget's first try fails")
        await write(client_id, gen, ops)

    q.write_group_writes = slow_then_failing  # type: ignore[method-assign]
    groups = GroupQueues(q, LONG)
    groups.retry = group_feed.Retry("test", first=0.05)
    feed = GroupFeed(group, member, groups, BrokerStats(), clock=lambda: 0.0, generation=generation)
    outflow = Outflow(feed)
    feed.restart()
    assert await _until(lambda: feed.queued() == 1)
    (item,) = feed.take(1)
    assert not item.marked  # a persistent member's write goes out once recorded
    item.packet_id, item.side = 1, feed
    outflow.inflight[1] = item
    marked: list[Any] = []
    feed.mark([item], marked.append)
    await asyncio.sleep(0.05)  # the record's write has begun
    del outflow.inflight[1]
    feed.never_sent(item)  # the connection ended (Outflow.left)
    await asyncio.wait_for(groups.keeps_landed(member), 10)  # then "kept" to the other
    assert marked == [[1]]  # the record landed first, then the forget
    assert await q.group_writes(member, generation) == {}
    # The other replica gets the write (given back) and records it under id 1 for its
    # connection: the same record, byte for byte, as the one forgotten.
    again = group_feed.group_write_packed(group, item.ref)
    await write(member, generation, [b"+", 1, again])
    await asyncio.wait_for(groups.close(), 10)
    assert sorted(await q.group_writes(member, generation)) == [1]
