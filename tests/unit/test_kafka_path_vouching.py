"""The Kafka path after a broken connection (tests/model/FINDINGS.md, finding 19).

A record acknowledged while the topic probe does not vouch for the topic is
reported only once the probe, asked afterwards, sees the topic listed and no
topic was made since. The orders of events that matter are driven here by a
producer whose answers and a probe whose replies the test releases; the
same path against a real restarted Tansu is in
tests/integration/test_kafka_path.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiokafka.partitioner import DefaultPartitioner
from aiokafka.structs import RecordMetadata

from broker.message import Delivery, Message
from broker.outflow import MemoryFeed
from broker.session import Session
from broker.stats import BrokerStats
from persistence.format import record_id
from persistence.kafka_path import KafkaPersistentPath


class Producer:
    """Hands out a future per record; the test answers them."""

    def __init__(self) -> None:
        self.sent: list[tuple[asyncio.Future[Any], int | None]] = []

    def partitions_for_topic(self, topic: str) -> set[int]:
        return {0}

    async def send(
        self, topic: str, value: bytes, key: bytes, partition: int | None
    ) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.sent.append((future, partition))
        return future

    def ack(self, i: int, offset: int) -> None:
        future, _ = self.sent[i]
        future.set_result(RecordMetadata("t", 0, None, offset, 0, None, 0))


class Probe:
    """A connection broke (it does not vouch); each answer waits for the test."""

    forgets_topics = True
    closed = False
    answered = True
    expected: int | None = None  # any size is devicemq's: the size guard stays out
    misshapen: int | None = None

    def __init__(self) -> None:
        self.vouching = False
        self.questions: asyncio.Queue[asyncio.Future[int | None]] = asyncio.Queue()

    def vouches(self) -> bool:
        return self.vouching

    async def partitions(self) -> int | None:
        answer: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        await self.questions.put(answer)
        return await answer


def _session(client_id: str) -> Session:
    stats = BrokerStats()
    return Session(client_id, 3600, 10, MemoryFeed(100, stats), stats, durable=True)


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.002)
    raise AssertionError("never happened")


class Acknowledged:
    """One QoS 2 publish through a path whose probe does not vouch, its one record
    acknowledged at offset 0, and the probe's question about it out."""

    producer: Producer
    probe: Probe
    path: KafkaPersistentPath
    accepted: list[bool]
    settled: list[bool]
    question: asyncio.Future[int | None]

    @classmethod
    async def make(cls, timeout: float) -> Acknowledged:
        self = cls()
        self.producer, self.probe = Producer(), Probe()
        self.path = KafkaPersistentPath(
            self.producer,  # type: ignore[arg-type]
            "t",
            timeout=timeout,
            probe=self.probe,  # type: ignore[arg-type]
        )
        self.accepted, self.settled = [], []
        delivery = Delivery(Message("t", b"x", 2, False), 2, False)
        self.path.submit([(_session("c"), delivery)], self.accepted.append, self.settled.append)
        await _until(lambda: len(self.producer.sent) == 1)
        self.producer.ack(0, 0)
        self.question = await self.probe.questions.get()
        return self


async def test_a_publish_failed_at_its_deadline_is_not_settled_as_taken_before_vouched() -> None:
    """Its deadline passes while the probe's answer is awaited: the publisher hears
    failure, and the record is not settled as taken (a 3.1.1 QoS 2 publisher's
    packet id would be kept and its re-send answered without routing). The topic
    is not listed: it is sent again, and settled once that copy is vouched for."""
    a = await Acknowledged.make(timeout=0.05)
    await _until(lambda: a.accepted == [False])  # the deadline, while the question is out
    assert a.settled == []
    a.question.set_result(None)  # not listed: the log was lost
    await _until(lambda: len(a.producer.sent) == 2)  # sent again
    assert a.settled == []
    a.probe.vouching = True
    a.producer.ack(1, 1)
    await _until(lambda: a.settled == [True])
    assert a.accepted == [False]


async def test_a_topic_made_again_during_the_question_does_not_vouch() -> None:
    """The probe finds the topic listed, but it was made again (a restore's describe,
    delete and create) after the record was acknowledged: sent again, and the
    publisher hears success only for the copy in the new topic."""
    a = await Acknowledged.make(timeout=5.0)
    a.path.hold()
    a.path.release(new_log=True)  # a restore made the topic again meanwhile
    a.question.set_result(1)  # listed: the new topic, so it asks again, after it
    (await a.probe.questions.get()).set_result(1)
    await _until(lambda: len(a.producer.sent) == 2)
    assert a.accepted == []
    a.probe.vouching = True
    a.producer.ack(1, 0)
    await _until(lambda: a.accepted == [True])


async def test_success_is_reported_once_the_probe_sees_the_topic() -> None:
    a = await Acknowledged.make(timeout=5.0)
    await asyncio.sleep(0.01)
    assert a.accepted == []  # not before the answer
    a.question.set_result(1)
    await _until(lambda: a.accepted == [True])
    assert len(a.producer.sent) == 1


class Resized(Producer):
    """A producer that knows the topic at ``known`` partitions until it reads
    the topic again (:meth:`refresh`), and then knows what Kafka lists."""

    def __init__(self, known: int) -> None:
        super().__init__()
        self.known = set(range(known))
        self.listed = known  # what Kafka lists: the test changes it

    def partitions_for_topic(self, topic: str) -> set[int]:
        return self.known

    async def refresh(self, topic: str) -> None:
        self.known = set(range(self.listed))


def _made_at_12(
    producer: Resized, probe: Probe, timeout: float, recreate: Callable[[], Any]
) -> KafkaPersistentPath:
    """A path on a Tansu (``probe``) whose topic devicemq makes with 12 partitions."""
    probe.expected = 12
    return KafkaPersistentPath(
        producer,  # type: ignore[arg-type]
        "t",
        timeout=timeout,
        probe=probe,  # type: ignore[arg-type]
        recreate_topic=recreate,
    )


async def test_nothing_is_sent_while_the_producer_knows_a_tansu_topic_at_another_size() -> None:
    """Finding 27: a record sent by a 4-partition mapping, then sent again by the
    12-partition one, came in behind its producer's later records and was skipped
    as stored. So nothing goes to a Tansu's topic the producer knows at another
    size than devicemq makes it with: the path asks, has it made again, reads it
    again, and sends by devicemq's count."""
    producer, probe = Resized(4), Probe()
    made: list[bool] = []

    async def recreate() -> None:  # the compactor's restore: the topic made at 12
        made.append(True)
        producer.listed = 12

    path = _made_at_12(producer, probe, 5.0, recreate)
    delivery = Delivery(Message("t", b"x", 1, False), 1, False)
    path.submit([(_session("c"), delivery)], [].append)
    question = await asyncio.wait_for(probe.questions.get(), 1.0)
    assert producer.sent == []
    probe.misshapen = 4
    question.set_result(None)  # Tansu's own topic: reported as not listed
    await _until(lambda: len(producer.sent) == 1)
    assert made == [True]
    expected = DefaultPartitioner()(b"c", list(range(12)), list(range(12)))
    assert producer.sent[0][1] == expected


class AwayProbe(Probe):
    """A Tansu's probe whose questions fail (Kafka away), counted."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    async def partitions(self) -> int | None:
        self.asked += 1
        raise ConnectionError("kafka away")


async def test_a_publish_held_by_the_size_check_fails_at_its_deadline_unsent() -> None:
    """The size check holds what the producer would send by a size not devicemq's;
    Kafka away, it holds on: the publisher hears failure at its deadline (it waited
    for no answer at all), nothing of it is ever sent, and Kafka is asked less and
    less often meanwhile (0.05 s doubling to 1 s: 7 looks in 2 s, 40 at a fixed
    0.05 s)."""
    producer, probe = Resized(4), AwayProbe()
    path = _made_at_12(producer, probe, 2.0, lambda: asyncio.sleep(0))
    accepted: list[bool] = []
    settled: list[bool] = []
    delivery = Delivery(Message("t", b"x", 1, False), 1, False)
    path.submit([(_session("c"), delivery)], accepted.append, settled.append)
    for _ in range(200):
        if accepted:
            break
        await asyncio.sleep(0.025)
    assert accepted == [False] and settled == [False]
    assert producer.sent == []
    assert probe.asked <= 10


class Recording(Producer):
    """Keeps each record's seq in the order handed over; the send of record
    ``wait_at`` waits until the test lets it go (a full batch in aiokafka)."""

    def __init__(self, wait_at: int) -> None:
        super().__init__()
        self.seqs: list[int] = []
        self.wait_at = wait_at
        self.waiting = asyncio.Event()
        self.go = asyncio.Event()

    async def send(
        self, topic: str, value: bytes, key: bytes, partition: int | None
    ) -> asyncio.Future[Any]:
        if len(self.seqs) == self.wait_at:
            self.waiting.set()
            await self.go.wait()
        self.seqs.append(record_id(value).seq)
        return await super().send(topic, value, key, partition)


def _stored_through_one_partition(seqs: list[int]) -> list[int]:
    """What the store keeps of one producer's records reaching one partition in
    this order: a seq at or below the last one stored is skipped as stored
    (persistence/redis_store.py, "Idempotent save")."""
    stored: list[int] = []
    for seq in seqs:
        if not stored or seq > stored[-1]:
            stored.append(seq)
    return stored


def _restoring(producer: Producer, timeout: float) -> tuple[KafkaPersistentPath, asyncio.Event]:
    """A single broker's path whose lost topic is made again when the test sets the
    event, as the compactor's restore does: publishers held, then a new log."""
    made = asyncio.Event()

    async def restore() -> None:
        path.hold()
        await made.wait()
        path.release(new_log=True)

    path = KafkaPersistentPath(
        producer,  # type: ignore[arg-type]
        "t",
        timeout=timeout,
        recreate_topic=restore,
    )
    return path, made


async def test_a_batch_being_handed_over_stops_at_a_log_reset() -> None:
    """Three publishes handed to the producer in one batch, the second one's send
    waiting (a full batch), when the first is acknowledged at an offset used
    before (the log went back): all three are to be sent again, in order, once
    the topic is made again (tests/model/FINDINGS.md, finding 29). Before, the
    third was handed over anyway, into the log that went back, and the reset's
    callback failed on it (it had no round yet), the resend half done; and the
    second's waiting send, counted for the new attempt, left a record out for
    ever (no compaction could find nothing out again)."""
    producer = Recording(wait_at=2)
    path, made = _restoring(producer, timeout=5.0)
    accepted: list[list[bool]] = [[] for _ in range(4)]

    def publish(i: int) -> None:
        delivery = Delivery(Message("t", b"%d" % i, 1, False), 1, False)
        path.submit([(_session("c"), delivery)], accepted[i].append)

    publish(0)
    await _until(lambda: len(producer.sent) == 1)
    producer.ack(0, 0)  # offset 0 of the log
    await _until(lambda: accepted[0] == [True])
    for i in (1, 2, 3):
        publish(i)  # one batch
    await producer.waiting.wait()  # the first is handed over, the second's send waits
    producer.ack(1, 0)  # offset 0 again: the log went back
    producer.go.set()
    await asyncio.sleep(0.01)
    # Nothing more goes into the log that went back: the second's send was under way.
    # (Before, the third went; and the reset's callback failed on it, never handed.)
    assert len(producer.sent) == 3, producer.seqs
    made.set()
    await _until(lambda: len(producer.sent) == 6)
    again = producer.seqs[3:]
    assert again == sorted(again) and _stored_through_one_partition(again) == again
    for i in range(3, 6):
        producer.ack(i, i - 3)
    await _until(lambda: accepted[1:] == [[True], [True], [True]])
    assert path.nothing_out()


async def test_records_sent_again_keep_their_publish_order() -> None:
    """A publish failed at its deadline with its records still out, a later one in a
    round of its own, then the log goes back: both are sent again, the earlier
    first. It was put behind the later one (the rounds' came first), and the
    store, given the later seq first, would skip the earlier as stored."""
    producer = Recording(wait_at=-1)
    path, made = _restoring(producer, timeout=0.2)
    settled: list[bool] = []

    def publish(*clients: str) -> list[bool]:
        accepted: list[bool] = []
        deliveries = [
            (_session(c), Delivery(Message("t", b"x", 1, False), 1, False)) for c in clients
        ]
        path.submit(deliveries, accepted.append, settled.append)
        return accepted

    first = publish("c")
    await _until(lambda: len(producer.sent) == 1)
    producer.ack(0, 5)
    await _until(lambda: first == [True])
    earlier = publish("c", "d")  # two records; no answer before its deadline
    await _until(lambda: earlier == [False])
    later = publish("c")
    await _until(lambda: len(producer.sent) == 4)
    producer.ack(1, 1)  # one of the earlier's records, at an offset below 5: went back
    made.set()
    await _until(lambda: len(producer.sent) == 7)
    again = producer.seqs[4:]
    assert again == sorted(again), f"sent again in the order {again}"
    for i in range(4, 7):
        producer.ack(i, i - 4)
    await _until(lambda: later == [True] and settled == [True])


async def test_a_record_taken_into_a_log_that_went_back_is_sent_again_after_its_deadline() -> None:
    """A publish whose deadline passed (its publisher heard failure) with its one
    record still out; that record is then acknowledged at an offset used before.
    It is in the log that went back: sent again, and settled once that copy is
    taken. Before, nothing of it counted as out any more: never sent again, never
    settled (a 3.1.1 QoS 2 publisher's packet id kept for ever)."""
    producer = Recording(wait_at=-1)
    path, made = _restoring(producer, timeout=0.2)
    accepted: list[bool] = []
    settled: list[bool] = []
    delivery = Delivery(Message("t", b"x", 1, False), 1, False)
    path.submit([(_session("c"), delivery)], [].append)
    await _until(lambda: len(producer.sent) == 1)
    producer.ack(0, 5)
    path.submit([(_session("c"), delivery)], accepted.append, settled.append)
    await _until(lambda: accepted == [False])  # its deadline, the record still out
    producer.ack(1, 3)  # below 5: the log went back
    made.set()
    await _until(lambda: len(producer.sent) == 3)
    assert producer.seqs[2] == producer.seqs[1]
    assert settled == []
    producer.ack(2, 0)
    await _until(lambda: settled == [True])
    assert path.nothing_out()


async def test_a_send_that_waited_across_a_log_reset_leaves_nothing_out() -> None:
    """As above, with every deadline passed while the second's send waits (a Kafka
    restarting): all three are sent again as riders, settled once taken, and
    nothing is left out. Before, the waiting send was counted for the attempt
    after the reset: its publish never settled, and no compaction or restore
    could find nothing out (they waited out their limits instead)."""
    producer = Recording(wait_at=2)
    path, made = _restoring(producer, timeout=0.2)
    accepted: list[list[bool]] = [[] for _ in range(4)]
    settled: list[bool] = []

    def publish(i: int) -> None:
        delivery = Delivery(Message("t", b"%d" % i, 1, False), 1, False)
        path.submit([(_session("c"), delivery)], accepted[i].append, settled.append)

    publish(0)
    await _until(lambda: len(producer.sent) == 1)
    producer.ack(0, 0)
    await _until(lambda: accepted[0] == [True])
    for i in (1, 2, 3):
        publish(i)
    await producer.waiting.wait()
    await _until(lambda: accepted[1:] == [[False], [False], [False]])  # their deadline
    producer.ack(1, 0)  # the log went back
    producer.go.set()
    await asyncio.sleep(0.01)
    made.set()
    await _until(lambda: len(producer.sent) == 6)
    assert producer.seqs[3:] == sorted(producer.seqs[3:])
    for i in range(3, 6):
        producer.ack(i, i - 3)
    await _until(lambda: len(settled) == 3)
    assert settled == [True, True, True]
    assert path.nothing_out()
