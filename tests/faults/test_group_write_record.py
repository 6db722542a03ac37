"""The record of a member's group writes in flight (``{cid}_ecq_group_writes``,
persistence/group_feed.py; tests/model/FINDINGS.md, finding 35) across a Redis
outage, against a real redis-server stopped and started again.

A write acknowledged by the client is done with: its record must go, even when
Redis was away as the acknowledgement came, and even when the record itself
landed only after it (the keep is tried again until Redis is back). A record
left behind is read back by the session's first connection to a restarted
broker, which sends the write again under its packet id, with DUP, although
the client acknowledged it long ago and may hold that id for another message
by then (MQTT-2.2.1-3).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from persistence.format import StoredMessage, encode_message
from persistence.group_feed import GroupQueues
from persistence.queue_store import QueueBatch, QueueEntry, QueueStore
from persistence.redis_store import RedisMessageStore
from tests.faults.conftest import RedisProcess

NOW = 1_800_000_000.0
LONG = 60.0  # s: a lease that does not run out during the test
MEMBER = "member-1"
GENERATION = 3
PACKET_ID = 7


async def _until(condition: object, timeout: float = 20.0) -> None:
    """Wait until ``condition()`` holds (a state the test drives, not a race)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.02)


class _Setup:
    def __init__(self, tmp_path: Path) -> None:
        self.redis = RedisProcess(tmp_path / "redis")
        self.redis.start()
        self.store = RedisMessageStore.from_url(self.redis.url)
        self.queues = QueueStore(
            self.store, retention=0, max_keys=1, clock=lambda: NOW, group_retention=0, group_max=0
        )
        self.groups = GroupQueues(self.queues, lease=LONG)
        self.group = "$queue/g/meters/#"

    async def claimed(self) -> QueueEntry:
        """A group write claimed by the member (then sent to it under PACKET_ID)."""
        await self.store.load_scripts()
        value = encode_message(
            StoredMessage("meters/1", b"42", 1, producer=1, seq=1, publish_time=NOW), queue=True
        )
        await self.queues.save(QueueBatch(self.group, [value], 0, [0]))
        ((entry, _),) = await self.queues.claim(self.group, "t1", 1, LONG)
        return entry

    def done_with(self) -> None:
        """The client acknowledged the write (GroupFeed.finished): its record goes."""
        self.groups.done_with(MEMBER, PACKET_ID)

    async def left_behind(self) -> dict[int, object]:
        """Every write on its way landed (Redis is up): what is still kept."""
        await asyncio.wait_for(self.groups.close(), 60)
        held = await self.queues.group_writes(MEMBER, GENERATION)
        return {packet_id: record[1] for packet_id, record in held.items()}

    async def close(self) -> None:
        await self.store.aclose()
        self.redis.stop()


async def _assert_forgotten(setup: _Setup) -> None:
    held = await setup.left_behind()
    assert held == {}, (
        f"the acknowledged write is still kept under packet id {sorted(held)}: a "
        "restarted broker would send it again under that id"
    )


async def test_a_group_write_kept_late_is_still_forgotten_once_acknowledged(
    tmp_path: Path,
) -> None:
    """Redis goes away as the member's connection closes with the write in flight:
    the keep fails and waits to try again. The member resumes on the living broker
    and acknowledges the write before Redis is back: the keep lands later, and the
    record must not outlive the acknowledgement."""
    setup = _Setup(tmp_path)
    try:
        entry = await setup.claimed()
        setup.redis.stop()
        setup.groups.keep(MEMBER, GENERATION, [(PACKET_ID, setup.group, entry)])
        await _until(lambda: setup.groups.retry.retries >= 1)
        setup.done_with()  # asked while the keep waits to be tried again
        await _until(lambda: setup.groups.retry.retries >= 3)
        setup.redis.start()
        await _assert_forgotten(setup)
    finally:
        await setup.close()


async def test_a_forget_that_fails_is_tried_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The write was kept; Redis goes away as the client acknowledges it: the record
    goes once Redis is back, not never."""
    caplog.set_level(logging.INFO, "devicemq.persistence")
    setup = _Setup(tmp_path)
    try:
        entry = await setup.claimed()
        setup.groups.keep(MEMBER, GENERATION, [(PACKET_ID, setup.group, entry)])
        await asyncio.wait_for(setup.groups.keeps_landed(MEMBER), 20)
        assert sorted(await setup.queues.group_writes(MEMBER, GENERATION)) == [PACKET_ID]
        setup.redis.stop()
        setup.done_with()
        await _until(lambda: "writing the record of the group writes" in caplog.text)
        setup.redis.start()
        await _assert_forgotten(setup)
    finally:
        await setup.close()
