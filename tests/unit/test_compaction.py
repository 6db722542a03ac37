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
        self.batches_sent = 3

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


def test_batches_past_their_threshold_empty_a_topic_of_few_records() -> None:
    """A fetch from Tansu's memory store looks at every batch it holds: at a message a
    second per client, 10,000 batches held a record or two each, and the record
    threshold alone let fetches slow to seconds (BENCHMARKS.md, "The fleet shape")."""
    path, consumer = Path(), Consumer(catches_up_after=0.0)

    async def replace() -> None:
        pass

    stand_in: Any = (path, consumer)
    compactor = KafkaCompactor(
        stand_in[0], stand_in[1], 1, replace, threshold=100, hold_limit=0.3, batch_threshold=5
    )
    path.batches_sent = 4
    assert not compactor.due()  # 10 records of 100, 4 batches of 5
    path.batches_sent = 5
    assert compactor.due()
    compactor.batch_threshold = 0
    assert not compactor.due()  # records only
    compactor.threshold = 0
    compactor.batch_threshold = 5
    assert not compactor.due()  # 0: never, whatever the batches


def test_a_failed_replace_releases_the_publishers() -> None:
    path, consumer = Path(), Consumer(catches_up_after=0.0)

    async def broken() -> None:
        raise OSError("kafka went away")

    stand_in: Any = (path, consumer)
    compactor = KafkaCompactor(stand_in[0], stand_in[1], 1, broken, threshold=5, hold_limit=0.3)
    with pytest.raises(OSError):
        asyncio.run(compactor.compact())
    assert path.releases == [False] and not path.held


# -- a topic Kafka lost (finding 17) ---------------------------------------------------


class LostTopicConsumer(Consumer):
    def __init__(self, stores_after: float | None) -> None:
        super().__init__(catches_up_after=None)
        self.stores_after = stores_after  # seconds after reading from the start; None: never
        self.read_again: list[float] = []
        self.listed = 1  # the partitions of the topic it reads
        self.partitions_read: list[int] = []  # asked to read the topic's partitions

    async def read_partitions(self, partitions: int) -> None:
        self.partitions_read.append(partitions)

    def read_from_start(self) -> None:
        self.read_again.append(asyncio.get_running_loop().time())

    def commit_again(self) -> None:
        self.commits_again = True

    def stored_to_end(self, since: float, partitions: int) -> bool:
        assert partitions == self.listed
        now = asyncio.get_running_loop().time()
        return self.stores_after is not None and now - self.read_again[0] >= self.stores_after

    async def durable(self) -> bool:
        return True


def _restorer(
    path: Path,
    consumer: Consumer,
    replaced: list[int],
    listed: list[int | None],
    clock: Any = None,
) -> KafkaCompactor:
    async def replace() -> None:
        assert path.held, "the topic is made again only while publishers are held"
        replaced.append(1)

    class Probe:
        forgets_topics = True  # a Tansu
        misshapen: int | None = None  # what the real one sets for a topic Tansu made

        async def partitions(self) -> int | None:
            return listed[0]

    path.topic = "t"  # type: ignore[attr-defined]
    stand_in: Any = (path, consumer, Probe())
    extra = {"clock": clock} if clock is not None else {}
    return KafkaCompactor(
        stand_in[0], stand_in[1], 1, replace, 0, hold_limit=0.3, probe=stand_in[2], **extra
    )


def test_only_a_topic_kafka_does_not_list_is_lost() -> None:
    """Listed with another partition count than configured: kept (an operator's, on
    a Kafka that keeps topics; the probe itself reports a Tansu's own as not listed,
    tests/integration/test_kafka_path.py); not listed: lost."""
    path, consumer, replaced = Path(), LostTopicConsumer(0.0), []
    listed: list[int | None] = [6]
    compactor = _restorer(path, consumer, replaced, listed)
    assert not asyncio.run(compactor.topic_lost())
    listed[0] = None
    assert asyncio.run(compactor.topic_lost())


def test_a_topic_tansu_made_at_its_own_size_is_restored_reading_what_it_lists() -> None:
    """Finding 26: the probe reports a topic a Tansu made at its default size as not
    listed (``misshapen``); the restore waits until the consumer stored every
    partition that topic has (4 here, not the configured 1), then makes it again."""
    path, consumer, replaced = Path(), LostTopicConsumer(0.0), []
    listed: list[int | None] = [None]
    compactor = _restorer(path, consumer, replaced, listed)
    compactor._probe.misshapen = 4  # type: ignore[union-attr]
    assert asyncio.run(compactor.topic_lost())
    assert compactor._listed == 4


def test_the_consumer_reads_the_partitions_of_a_topic_made_again_at_another_size() -> None:
    """Finding 27: a topic Tansu made at 4 partitions, made again at the configured
    count, keeps its name; aiokafka's consumer learns the new count only at its
    next metadata refresh (5 minutes) and reads none of the partitions it does not
    know meanwhile. It is told to read them when the restore begins (to be assigned
    what the misshapen topic has) and once the topic is made."""
    path, consumer, replaced = Path(), LostTopicConsumer(0.0), []
    consumer.listed = 4
    compactor = _restorer(path, consumer, replaced, [None])
    compactor._probe.misshapen = 4  # type: ignore[union-attr]
    assert asyncio.run(compactor.restore_when_lost())
    assert replaced == [1] and consumer.partitions_read == [4, 1]
    assert compactor._listed == 1


def test_a_lost_topic_is_made_again_once_everything_is_stored() -> None:
    path, consumer, replaced = Path(), LostTopicConsumer(stores_after=0.1), []
    compactor = _restorer(path, consumer, replaced, [None])
    assert asyncio.run(compactor.restore())
    assert len(consumer.read_again) == 1 and replaced == [1] and consumer.recreated == 1
    assert path.releases == [True] and not path.held
    assert compactor.stats.topics_restored == 1 and compactor.stats.restores_incomplete == 0


def test_a_lost_topic_waits_for_its_records_then_is_made_anyway() -> None:
    """Not stored within the hold: tried again (publishers released meanwhile); past
    GIVE_UP_AFTER the topic is made anyway and counted as incomplete."""
    from persistence.compaction import GIVE_UP_AFTER

    now = [0.0]
    path, consumer, replaced = Path(), LostTopicConsumer(stores_after=None), []

    def clock() -> float:
        now[0] += 0.05
        return now[0]

    compactor = _restorer(path, consumer, replaced, [None], clock)

    async def twice() -> tuple[bool, bool]:
        first = await compactor.restore()
        now[0] += GIVE_UP_AFTER
        return first, await compactor.restore()

    first, second = asyncio.run(twice())
    assert not first and second
    assert len(consumer.read_again) == 1  # once per loss, not per try
    assert path.releases == [False, True] and replaced == [1]
    assert compactor.stats.restores_incomplete == 1 and compactor.stats.topics_restored == 1


def test_the_kafka_path_waits_for_the_restore_of_a_lost_topic() -> None:
    """After a log reset the path sends nothing until Kafka lists the topic: at once
    when it does, after the restore (stored, then made again) when it does not."""
    path, consumer, replaced = Path(), LostTopicConsumer(stores_after=0.05), []
    listed: list[int | None] = [1]
    compactor = _restorer(path, consumer, replaced, listed)
    asyncio.run(compactor.restore_when_lost())
    assert replaced == [] and consumer.read_again == [] and path.releases == []
    listed[0] = None
    asyncio.run(compactor.restore_when_lost())
    assert replaced == [1] and len(consumer.read_again) == 1 and path.releases == [True]


def test_an_apache_kafka_topic_is_never_restored_only_created_by_the_path() -> None:
    """Only a Kafka that forgets topics (Tansu) loses one under a running broker; an
    operator's deleted topic is not replaced behind their back."""
    path, consumer, replaced = Path(), LostTopicConsumer(stores_after=0.0), []
    compactor = _restorer(path, consumer, replaced, [None])
    compactor._probe.forgets_topics = False  # type: ignore[union-attr]
    assert not asyncio.run(compactor.topic_lost())
    assert not asyncio.run(compactor.restore_when_lost())
    assert replaced == [] and consumer.read_again == [] and path.releases == []


def test_a_topic_listed_again_by_itself_ends_the_restore_and_commits_resume() -> None:
    path, consumer, replaced = Path(), LostTopicConsumer(stores_after=None), []
    listed: list[int | None] = [None]
    compactor = _restorer(path, consumer, replaced, listed)
    assert not asyncio.run(compactor.restore())  # not stored within the hold
    listed[0] = 1
    assert not asyncio.run(compactor.topic_lost())
    assert getattr(consumer, "commits_again", False) and replaced == []
    listed[0] = None  # lost again later: read from the start again, anew
    asyncio.run(compactor.restore())
    assert len(consumer.read_again) == 2
