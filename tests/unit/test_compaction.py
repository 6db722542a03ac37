"""KafkaCompactor's hold: it empties the topic only once the consumer stored
everything, waits for a lagging consumer up to its limit, and always releases
the publishers. The Kafka path and consumer are stand-ins with the three calls
the compactor makes; the real ones run in tests/e2e/test_embedded_kafka_compaction.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from persistence.compaction import KafkaCompactor


class Path:
    def __init__(self) -> None:
        self.held = False
        self.releases: list[bool] = []
        self.produced: dict[int, int] = {0: 9}

    def hold(self) -> None:
        self.held = True

    def nothing_out(self) -> bool:
        return True

    def release(self, new_log: bool) -> None:
        self.held = False
        self.releases.append(new_log)


class Consumer:
    def __init__(self, catches_up_after: float | None) -> None:
        self.catches_up_after = catches_up_after  # seconds into the hold; None: never
        self.started: float | None = None
        self.recreated = 0

    def records_held(self) -> int:
        return 10

    async def caught_up(self, produced: dict[int, int], partitions: int) -> bool:
        now = asyncio.get_running_loop().time()
        if self.started is None:
            self.started = now
        return self.catches_up_after is not None and now - self.started >= self.catches_up_after

    def log_recreated(self) -> None:
        self.recreated += 1


def _compactor(path: Path, consumer: Consumer, replaced: list[int]) -> KafkaCompactor:
    async def replace() -> None:
        assert path.held, "the topic is replaced only while publishers are held"
        replaced.append(1)

    stand_in: Any = (path, consumer)
    return KafkaCompactor(stand_in[0], stand_in[1], 1, replace, threshold=5, hold_limit=0.3)


def test_a_consumer_that_catches_up_within_the_hold_gets_the_topic_emptied() -> None:
    path, consumer, replaced = Path(), Consumer(catches_up_after=0.1), []
    compactor = _compactor(path, consumer, replaced)
    assert asyncio.run(compactor.compact())
    assert replaced == [1] and consumer.recreated == 1
    assert path.releases == [True] and not path.held
    assert compactor.stats.compactions == 1 and compactor.stats.records_dropped == 10


def test_a_consumer_that_does_not_catch_up_keeps_the_topic_and_publishers_go_on() -> None:
    path, consumer, replaced = Path(), Consumer(catches_up_after=None), []
    compactor = _compactor(path, consumer, replaced)
    assert not asyncio.run(compactor.compact())
    assert replaced == [] and consumer.recreated == 0
    assert path.releases == [False] and not path.held
    assert compactor.stats.deferred == 1


def test_a_failed_replace_releases_the_publishers() -> None:
    path, consumer = Path(), Consumer(catches_up_after=0.0)

    async def broken() -> None:
        raise OSError("kafka went away")

    stand_in: Any = (path, consumer)
    compactor = KafkaCompactor(stand_in[0], stand_in[1], 1, broken, threshold=5, hold_limit=0.3)
    with pytest.raises(OSError):
        asyncio.run(compactor.compact())
    assert path.releases == [False] and not path.held
