"""One owner's stores together in Redis, single and in cluster mode (issue 45, the last
bullet): the owners' queue index beside the claims and ``ecq.max_queues_per_owner``
under replicas racing (persistence/owner_store.py), and the tally of
``auth.max_bytes_per_owner`` reading the stores' byte counters
(persistence/owner_tally.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

from broker.config import (
    AuthSettings,
    EcqSettings,
    GroupQueueSettings,
    PersistenceSettings,
    Settings,
)
from broker.core import Broker
from broker.ownership import QUEUE, Claim
from broker.topics import SubscriptionEntry
from persistence.format import client_keys, queue_keys
from persistence.owner_store import RedisOwners
from persistence.owner_tally import OwnerTally
from persistence.redis_store import RedisMessageStore


async def _claim(owners: RedisOwners, name: str, owner: str, most: int | None) -> Claim | None:
    answer: asyncio.Future[Claim | None] = asyncio.get_running_loop().create_future()
    owners.claim(QUEUE, name, owner, 0, answer.set_result, most)
    return await answer


async def test_replicas_claiming_at_once_never_pass_max_queues_per_owner(
    store: RedisMessageStore, cid: str
) -> None:
    """Two owners' stores (two RedisOwners: two replicas) claim 12 new queues of one
    owner at once with a limit of 5: exactly 5 are granted, and the rest hold no
    claim; a queue held is granted again whatever the count."""
    owner = f"eve-{cid}"
    replicas = [RedisOwners(store), RedisOwners(store)]
    names = [f"{cid}-{i}" for i in range(12)]
    answers = await asyncio.gather(
        *(_claim(replicas[i % 2], name, owner, 5) for i, name in enumerate(names))
    )
    granted = [n for n, a in zip(names, answers, strict=True) if a == Claim(True)]
    assert len(granted) == 5
    assert all(a == Claim(False, quota=True) for a in answers if a != Claim(True))
    assert await replicas[0].queues_of(owner) == set(granted)
    for name in set(names) - set(granted):
        assert await replicas[1].holder(QUEUE, name) is None  # taken back, or never made
    assert await _claim(replicas[1], granted[0], owner, 5) == Claim(True)
    assert await _claim(replicas[1], granted[0], owner, 0) == Claim(True)  # held: no new
    # an admin gives one to another owner: the counts follow
    assert await replicas[0].assign(QUEUE, granted[0], f"bob-{cid}", 0) == owner
    assert await _claim(replicas[0], names[-1] + "-new", owner, 5) == Claim(True)
    assert len(await replicas[0].queues_of(owner)) == 5


def _broker(limit: int) -> Broker:
    """A broker whose stores are each 100 bytes at most: an owner with 3 of them could
    hold 300, so a budget of 250 reads it and one of 300 does not."""
    return Broker(
        dataclasses.replace(
            Settings(),
            auth=AuthSettings(max_bytes_per_owner=limit),
            persistence=PersistenceSettings(max_bytes_per_client=100),
            ecq=EcqSettings(max_bytes=100),
            group_queues=GroupQueueSettings(max_bytes=100),
        )
    )


def _tally(store: RedisMessageStore, broker: Broker) -> OwnerTally:
    return OwnerTally(store, broker.settings, broker.budget, broker.stores_by_owner)


def _session(broker: Broker, client_id: str, owner: str, *filters: str) -> None:
    entries = [SubscriptionEntry(client_id, f, 1) for f in filters]
    session = broker.restore_session(client_id, 600, entries, None)
    broker.bind_owner(session, owner)


async def test_the_tally_sums_an_owners_sessions_queues_and_groups(
    store: RedisMessageStore, cid: str
) -> None:
    eve, bob = f"eve-{cid}", f"bob-{cid}"
    group = f"$queue/g-{cid}/t/#"
    broker = _broker(250)
    _session(broker, f"{cid}-e1", eve, group)
    _session(broker, f"{cid}-e2", eve, group)  # the group counts once for her
    _session(broker, f"{cid}-b1", bob, group)  # one store: never read
    owners = RedisOwners(store)
    assert await _claim(owners, f"{cid}-q", eve, None) == Claim(True)
    redis = store.redis
    await redis.hset(client_keys(f"{cid}-e1").values, "b", 90)
    await redis.hset(client_keys(f"{cid}-e2").values, "b", 80)
    await redis.hset(client_keys(f"{cid}-b1").values, "b", 100)
    await redis.set(queue_keys(f"{cid}-q").bytes, 70)
    await redis.set(queue_keys(group).bytes, 20)
    tally = _tally(store, broker)
    await tally.once()
    budget = broker.budget
    usage = budget.usage[eve]
    assert (usage.session_bytes, usage.queue_bytes, usage.group_bytes) == (170, 70, 20)
    assert (usage.sessions, usage.queues, usage.groups) == (2, 1, 1)
    assert budget.over == {eve} and budget.over_queues == {f"{cid}-q"}
    assert bob not in budget.usage  # could not pass: not read
    await redis.hset(client_keys(f"{cid}-e1").values, "b", 0)  # delivered meanwhile
    await tally.once()
    assert not budget.over and budget.usage[eve].total == 170
    relaxed = _broker(300)  # her 3 stores could hold 300: she is not read
    _session(relaxed, f"{cid}-e1", eve, group)
    await _tally(store, relaxed).once()
    assert eve not in relaxed.budget.usage


async def test_a_tally_of_10000_sessions_of_one_owner_is_bounded(
    store: RedisMessageStore,
) -> None:
    """The cost stated in SECURITY.md: 10,000 persistent sessions of one owner (a fleet
    under one user name), each with a byte counter, read in pipelines of 1,000."""
    owner = f"fleet-{uuid.uuid4().hex[:8]}"
    broker = _broker(250)
    ids = [f"{owner}-{i}" for i in range(10_000)]
    for client_id in ids:
        _session(broker, client_id, owner)
    pipe = store.redis.pipeline(transaction=False)
    for client_id in ids:
        pipe.hset(client_keys(client_id).values, "b", 1)
    await pipe.execute()
    tally = _tally(store, broker)
    started = time.perf_counter()
    await tally.once()
    took = time.perf_counter() - started
    assert broker.budget.usage[owner].session_bytes == 10_000
    assert broker.budget.over == {owner}
    print(f"tally of 10,000 sessions of one owner: {took * 1000:.0f} ms")
    assert took < 10.0  # generous on a shared machine; the number is printed
