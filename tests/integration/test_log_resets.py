"""Announced Kafka log resets (persistence/consumer.py, LogResets) on a real Redis
and on Redis Cluster: a consumer re-reads a partition for another's announcement,
never for the one it made itself after re-reading that partition already; the
Kafka path's announcements (a producer saw the reset) are news to it too."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from persistence.consumer import LogResets
from persistence.format import resets_key
from persistence.redis_store import RedisMessageStore


async def _announce(resets: LogResets, partitions: set[int], *, reread: bool = True) -> None:
    resets.announce(partitions, reread=reread)
    await resets._writer.drain()


async def test_a_consumer_rewinds_for_resets_others_announced_not_its_own(
    store: RedisMessageStore,
) -> None:
    topic = f"resets-{uuid.uuid4().hex}"
    mine, other = LogResets(store.redis, topic), LogResets(store.redis, topic)
    known, epoch = await mine.read()
    assert (known, epoch) == ({}, 0)

    # A compaction's new log, announced by the consumer that already reads it from 0.
    await _announce(mine, {0, 1})
    counts, epoch = await mine.read()
    assert counts == {0: 1, 1: 1} and epoch == 1
    assert mine.announced_by_others(known, counts) == set()
    assert other.announced_by_others(known, counts) == {0, 1}

    # Another replica's reset of partition 1, then one of this consumer's own on
    # both: partition 1 moved twice, once by the other, so it is read again.
    known = counts
    await _announce(other, {1})
    await _announce(mine, {0, 1})
    counts, epoch = await mine.read()
    assert counts == {0: 2, 1: 3} and epoch == 3
    assert mine.announced_by_others(known, counts) == {1}

    # The Kafka path of this same process saw partition 2 go back (an acknowledgement
    # at an offset used before): its consumer has not re-read it, so it must.
    known = counts
    await _announce(mine, {2}, reread=False)
    counts, _ = await mine.read()
    assert mine.announced_by_others(known, counts) == {2}

    # Both in one write: the consumer re-read partition 0, the Kafka path saw it too.
    known = counts
    mine.announce({0}, reread=True)
    mine.announce({0}, reread=False)
    await mine._writer.drain()
    counts, _ = await mine.read()
    assert counts[0] == known[0] + 1
    assert mine.announced_by_others(known, counts) == {0}


async def test_a_count_seen_again_after_redis_lost_it_is_news(
    store: RedisMessageStore,
) -> None:
    """A count is not unique over time: Redis may lose an acknowledged increment
    (a restart without the last second of writes). This process's own step to
    k+1, once seen, says nothing about another's later step to k+1."""
    topic = f"resets-{uuid.uuid4().hex}"
    mine, other = LogResets(store.redis, topic), LogResets(store.redis, topic)
    known, _ = await mine.read()
    await _announce(mine, {0})
    counts, _ = await mine.read()
    assert mine.announced_by_others(known, counts) == set()
    # Redis loses the increment: the count is back where it was.
    await store.redis.hset(resets_key(topic), "0", 0)
    known, (counts, _) = counts, await mine.read()
    assert mine.announced_by_others(known, counts) == {0}  # went down: re-read anyway
    # Another replica's reset takes the count to the value this process had made.
    await _announce(other, {0}, reread=False)
    known, (counts, _) = counts, await mine.read()
    assert counts == {0: 1}
    assert mine.announced_by_others(known, counts) == {0}


async def test_a_claim_made_before_a_reassignment_is_news_after_it(
    store: RedisMessageStore,
) -> None:
    """The consumer announced partition 0 as re-read, then lost and got the
    partition back (its position now comes from a committed offset): its own
    announcement, heard after that, is a reason to read the partition again."""
    topic = f"resets-{uuid.uuid4().hex}"
    mine = LogResets(store.redis, topic)
    known, _ = await mine.read()
    mine.announce({0}, reread=True)
    mine.disown(0)  # revoked and assigned again before the write landed
    await mine._writer.drain()
    counts, _ = await mine.read()
    assert mine.announced_by_others(known, counts) == {0}


async def test_two_own_announcements_between_two_looks_are_no_news(
    store: RedisMessageStore,
) -> None:
    """Two compactions within one look's interval (a second): both steps are this
    consumer's own, made after it re-read the partition; hearing them back together
    is no reason to read the new log again (CI saw it: 'was reset: reading it from
    its start' after the third of three compactions a second apart)."""
    topic = f"resets-{uuid.uuid4().hex}"
    mine, other = LogResets(store.redis, topic), LogResets(store.redis, topic)
    known, _ = await mine.read()
    await _announce(mine, {0, 1})
    await _announce(mine, {0, 1})
    counts, _ = await mine.read()
    assert counts == {0: 2, 1: 2}
    assert mine.announced_by_others(known, counts) == set()
    # Two own steps and one of another's between two looks: news.
    known = counts
    await _announce(mine, {0})
    await _announce(other, {0})
    await _announce(mine, {0})
    counts, _ = await mine.read()
    assert counts == {0: 5, 1: 2}
    assert mine.announced_by_others(known, counts) == {0}


async def test_an_own_step_read_back_after_a_later_look_stays_no_news(
    store: RedisMessageStore,
) -> None:
    """A look whose read was answered before this process's write landed (another's
    step visible, the own one not yet) keeps the own step for the next look."""
    topic = f"resets-{uuid.uuid4().hex}"
    mine, other = LogResets(store.redis, topic), LogResets(store.redis, topic)
    known, _ = await mine.read()
    await _announce(other, {0})
    stale, _ = await mine.read()  # {0: 1}: read before the own write below landed
    await _announce(mine, {0})
    assert mine.announced_by_others(known, stale) == {0}
    counts, _ = await mine.read()
    assert counts == {0: 2}
    assert mine.announced_by_others(stale, counts) == set()


async def test_the_epoch_counts_every_announcement_even_two_in_one_write(
    store: RedisMessageStore,
) -> None:
    """A consumer counts its own epoch up by one per announcement of an emptied topic
    (persistence/consumer.py ``log_recreated``); Redis must count the same, also when
    two announcements go out in one write, and not for an announcement of nothing
    (a review found the consumer ahead of Redis: after a restart its events would
    have reused an epoch)."""
    topic = f"resets-{uuid.uuid4().hex}"
    mine = LogResets(store.redis, topic)
    mine.announce({0, 1}, reread=True)
    mine.announce({0}, reread=True)  # before the first landed: one write
    mine.announce(set(), reread=True)
    await mine._writer.drain()
    _, epoch = await mine.read()
    assert epoch == 2


class _AnswersHeld:
    """A real Redis client whose first pipeline, once armed, is applied by Redis but
    answered to its caller only when ``release`` is set: the order a loaded event
    loop can give (another task's read answered first)."""

    def __init__(self, redis: Any) -> None:
        self._redis = redis
        self.armed = False
        self.applied = asyncio.Event()
        self.release = asyncio.Event()

    def pipeline(self, transaction: bool = False) -> Any:
        return _HeldPipeline(self, self._redis.pipeline(transaction=transaction))


class _HeldPipeline:
    def __init__(self, owner: _AnswersHeld, pipe: Any) -> None:
        self._owner, self._pipe = owner, pipe

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)

    async def execute(self) -> Any:
        owner, held = self._owner, self._owner.armed
        owner.armed = False
        answer = await self._pipe.execute()
        if held:
            owner.applied.set()
            await owner.release.wait()
        return answer


async def test_a_look_while_an_own_announcement_is_unanswered_is_no_news(
    store: RedisMessageStore,
) -> None:
    """The consumer that emptied the topic announced it; Redis applied the write,
    and a look's read was answered before the write's answer came back. That step
    is this consumer's own: no reason to read the new log a second time (CI saw
    'was reset: reading it from its start' after a compaction)."""
    topic = f"resets-{uuid.uuid4().hex}"
    held = _AnswersHeld(store.redis)
    mine, other = LogResets(held, topic), LogResets(store.redis, topic)
    known, _ = await mine.read()
    held.armed = True
    mine.announce({0}, reread=True)
    await asyncio.wait_for(held.applied.wait(), 5)
    assert (await other.read())[0] == {0: 1}  # applied, not answered yet
    look = await mine.look()
    assert look is None or mine.announced_by_others(known, look[0]) == set()
    held.release.set()
    await mine._writer.drain()
    look = await mine.look()
    assert look is not None
    assert mine.announced_by_others(known, look[0]) == set()
    assert other.announced_by_others(known, look[0]) == {0}
