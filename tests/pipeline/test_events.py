"""persistence/events.py without Kafka: what is encoded, batching, the bounded buffer."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path
from typing import Any

import orjson
import pytest

from persistence.events import EventLog, end_kind
from persistence.format import (
    EV_DELIVERED,
    EVENTS_LAYOUT,
    Stage,
    StoredMessage,
    StoredRecord,
    decode_event_record,
    encode_message,
    header_fields,
    partition_of,
)
from persistence.redis_store import Assigned, ClientBatch, SaveResult

DATA = Path(__file__).parent / "data"


class FakeProducer:
    """aiokafka's producer as EventLog uses it; ``partitions`` of the topic it knows
    (0: it cannot tell)."""

    def __init__(self, delay: float = 0.0, partitions: int = 12) -> None:
        self.sent: list[tuple[str, bytes | None, bytes]] = []
        self.partitions_sent: list[int | None] = []
        self.delay = delay
        self.partitions = partitions
        self.stopped = False

    async def partitions_for(self, topic: str) -> set[int]:
        if not self.partitions:
            raise KeyError(topic)
        return set(range(self.partitions))

    async def send(
        self, topic: str, value: bytes, key: bytes | None = None, partition: int | None = None
    ) -> asyncio.Future[None]:
        if self.delay:
            await asyncio.sleep(self.delay)
        self.sent.append((topic, key, value))
        self.partitions_sent.append(partition)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    async def stop(self) -> None:
        self.stopped = True

    def events(self) -> list[dict[str, Any]]:
        return [e for _t, _k, v in self.sent for e in decode_event_record(v)]


def _value(topic: str, payload: bytes, expiry: float | None = None) -> bytes:
    return encode_message(
        StoredMessage(topic=topic, payload=payload, qos=1, publish_time=100.0, expiry=expiry)
    )


def _record(pid: int, score: int, expiry: float | None = None) -> StoredRecord:
    message = StoredMessage(topic="t", payload=b"x", qos=1, expiry=expiry)
    return StoredRecord(pid, score, Stage.PUBLISH, False, message)


def test_header_fields_read_the_stored_format() -> None:
    assert header_fields(_value("a/b", b"12345", expiry=160.0)) == ("a/b", 5, 100.0, 160.0)
    assert header_fields(_value("a", b"")) == ("a", 0, 100.0, None)
    # the one-step read of the current version and the general one (version 1) agree;
    # a value too short for its header is refused
    value = _value("a/b", b"12345", expiry=160.0)
    v1 = struct.pack(">BBBddqHI", 1, 0x08, 1, 100.0, 160.0, 0, 3, 0) + b"a/b12345"
    assert header_fields(v1) == ("a/b", 5, 100.0, 160.0)
    for short in (value[:20], b""):
        with pytest.raises(ValueError):
            header_fields(short)


async def test_events_are_batched_encoded_and_in_their_clients_partition() -> None:
    producer = FakeProducer()
    log = EventLog(producer, "ev", epoch=3, default_ttl=1000, interval=0.01, clock=lambda: 500.0)
    log.start()
    batch = ClientBatch("c1", [_value("a/b", b"xyz"), _value("a/c", b"", expiry=400.0)], 2, [7, 8])
    # first stored as score 11 / id 11; second expired on arrival; id 4 trimmed
    log.stored(batch, SaveResult([Assigned(11, 11), None], [4], 0, 1, outcomes=[11, 0]))
    log.delivered("c1", _record(11, 11))
    log.acked("c1", _record(11, 11))
    log.discarded("c1", _record(12, 12, expiry=499.0))
    log.discarded("c1", _record(13, 13))  # no expiry passed: too large
    for kind in ("connected", "connected", "disconnected", "session_expired"):
        log.session("c1", kind)
    assert producer.sent == []  # nothing happens on the caller's path
    await asyncio.sleep(0.05)
    await log.close()
    assert producer.stopped and producer.partitions_sent == [partition_of("c1", 12)]
    assert [(e["ev"], e.get("pid")) for e in producer.events()] == [
        ("persisted", 11),
        ("expired", None),
        ("trimmed", None),
        ("delivered", 11),
        ("acked", 11),
        ("expired", 12),
        ("dropped", 13),
        ("connected", None),  # once: the second "connected" is a state save
        ("disconnected", None),
        ("session_expired", None),
    ]
    persisted, arrival, trimmed = producer.events()[:3]
    assert persisted == {
        "ev": "persisted", "cid": "c1", "ts": 500.0, "pid": 11, "sc": 11, "part": 2,
        "off": 7, "ep": 3, "topic": "a/b", "size": 3, "pub": 100.0, "exp": 1500.0,
    }  # fmt: skip
    assert (arrival["at"], arrival["off"], arrival["topic"]) == ("arrival", 8, "a/c")
    assert trimmed["pids"] == [4]
    assert log.written == len(producer.sent) == 1 and log.dropped == 0  # one client, one flush


async def test_a_full_buffer_drops_and_reports_a_gap() -> None:
    producer = FakeProducer()
    log = EventLog(producer, "ev", max_buffer=3, interval=60)
    for i in range(5):
        log.acked("c", _record(i + 1, i + 1))
    assert log.dropped == 2
    await log.flush()
    events = producer.events()
    assert [e["ev"] for e in events] == ["acked", "acked", "acked", "gap"]
    assert events[-1]["n"] == 2


def test_end_kind() -> None:
    class S:
        expires_at: float | None = 10.0

    assert end_kind(S(), 10.0) == "session_expired"
    assert end_kind(S(), 9.0) == "session_ended"


async def test_records_not_stored_say_why() -> None:
    """A duplicate, a record of an ended session, one over a limit full of messages in
    flight: each is an event of its own, so the audit counts none of them as lost."""
    producer = FakeProducer()
    log = EventLog(producer, "ev", epoch=4, clock=lambda: 500.0)
    values = [_value("a/b", b"1"), _value("a/b", b"2"), _value("a/b", b"3")]
    batch = ClientBatch("c1", values, 1, [20, 21, 22])
    result = SaveResult([None, None, None], [], 1, 0, [2], [1], outcomes=[-1, -2, -3])
    log.stored(batch, result)
    await log.flush()
    got = [(e["ev"], e.get("at"), e["off"], e["ep"]) for e in producer.events()]
    assert got == [
        ("duplicate", None, 20, 4),
        ("discarded", "arrival", 21, 4),
        ("trimmed", "arrival", 22, 4),
    ]


async def test_a_busy_clients_flush_is_split_under_the_record_limit() -> None:
    """Finding 7 of the persistent path: one record per client and flush outgrew
    Kafka's request size (MessageSizeTooLargeError in CI) and the events were lost."""
    from persistence.events import MAX_RECORD_BYTES

    producer = FakeProducer()
    log = EventLog(producer, "ev", clock=lambda: 500.0)
    for i in range(20_000):
        log.delivered("busy", _record(i % 65535 + 1, i + 1))
    await log.flush()
    assert len(producer.sent) > 1
    assert all(len(value) <= MAX_RECORD_BYTES for _t, _k, value in producer.sent)
    assert [e["sc"] for e in producer.events()] == list(range(1, 20_001))
    assert set(producer.partitions_sent) == {partition_of("busy", 12)} and log.dropped == 0


async def test_an_operators_purge_and_writes_are_events() -> None:
    """app/admin.py: one ``purged`` event per message (the audit's ``purged``), and one
    ``admin`` event per write, with its action and detail."""
    producer = FakeProducer()
    log = EventLog(producer, "ev", clock=lambda: 500.0)
    log.purged("c1", 7, 70)
    log.admin("c1", "purge", {"purged": 1})
    log.admin("", "block", {"kind": "address", "value": "10.0.0.0/8"})
    await log.flush()
    assert producer.events() == [
        {"ev": "purged", "cid": "c1", "ts": 500.0, "pid": 7, "sc": 70},
        {"ev": "admin", "cid": "c1", "ts": 500.0, "action": "purge", "detail": {"purged": 1}},
        {
            "ev": "admin",
            "cid": "",
            "ts": 500.0,
            "action": "block",
            "detail": {"kind": "address", "value": "10.0.0.0/8"},
        },
    ]


async def test_a_fleets_flush_is_a_record_per_partition_not_per_client() -> None:
    """The fleet shape: 2,000 devices a message each. A flush writes one record per
    partition of the topic (each client's events in its client id's partition, in
    order), not one per client: the send was the broker's largest cost
    (BENCHMARKS.md, "The fleet shape")."""
    producer = FakeProducer(partitions=12)
    log = EventLog(producer, "ev", clock=lambda: 500.0)
    clients = [f"dev-{i}" for i in range(2000)]
    for i, cid in enumerate(clients):
        log.delivered(cid, _record(1, i + 1))
        log.acked(cid, _record(1, i + 1))
    await log.flush()
    assert len(producer.sent) == 12 and log.written == 12
    seen: dict[str, list[str]] = {}
    for (_t, key, value), partition in zip(producer.sent, producer.partitions_sent, strict=True):
        assert key is None
        for event in decode_event_record(value):
            assert partition_of(event["cid"], 12) == partition
            seen.setdefault(event["cid"], []).append(event["ev"])
    assert seen == {cid: ["delivered", "acked"] for cid in clients}


async def test_a_producer_that_cannot_tell_the_partitions_gets_a_record_per_client() -> None:
    producer = FakeProducer(partitions=0)
    log = EventLog(producer, "ev", clock=lambda: 500.0)
    for cid in ("a", "b"):
        log.acked(cid, _record(1, 1))
    await log.flush()
    assert [k for _t, k, _v in producer.sent] == [b"a", b"b"]
    assert producer.partitions_sent == [None, None]


async def test_a_record_is_positional_events_after_its_layout() -> None:
    """persistence/format.py "Delivery event record": the layout number, then an array
    per event, its layout's number first; no field names, no kind strings."""
    producer = FakeProducer(partitions=1)
    log = EventLog(producer, "ev", clock=lambda: 500.5)
    record = _record(11, 1011)
    record.sent = True
    log.delivered("c1", record)
    log.acked("c4", _record(3, 3))
    await log.flush()
    [(_t, _k, value)] = producer.sent
    assert orjson.loads(value) == [EVENTS_LAYOUT, [EV_DELIVERED, "c1", 500.5, 11, 1011, True],
                                   [2, "c4", 500.5, 3, 3]]  # fmt: skip
    assert b'"ev"' not in value and b"acked" not in value


async def test_the_same_calls_give_the_events_the_broker_wrote_before() -> None:
    """The keyed records of the code before (a7dfed5, tests/pipeline/event_calls.py,
    every kind and variant of event) and the positional ones of today for the same
    calls are the same records of the same events, in the same order."""
    from tests.pipeline.event_calls import calls

    keyed = orjson.loads((DATA / "events_keyed.json").read_bytes())
    for partitions in (12, 0):
        got = [
            [p, k.decode() if k is not None else None, decode_event_record(v)]
            for p, k, v in await calls(partitions)
        ]
        assert got == keyed[str(partitions)]
        assert all(orjson.loads(v)[0] == EVENTS_LAYOUT for _p, _k, v in await calls(partitions))

    # one partition (the embedded Kafka of a single broker): one record, and each
    # client's events as in the records of twelve
    def by_client(sent: list[tuple[int | None, bytes | None, bytes]]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        for _p, _k, value in sent:
            for event in decode_event_record(value):
                out.setdefault(event["cid"], []).append(event)
        return out

    single = await calls(1)
    assert [p for p, _k, _v in single] == [0, None]  # the events, then the gap's record
    assert by_client(single) == by_client(await calls(12))
    # and a keyed record is read as it was written
    for _p, _k, events in keyed["12"]:
        assert decode_event_record(orjson.dumps(events)) == events


def test_a_record_that_is_not_one_gives_no_event() -> None:
    assert decode_event_record(b"{}") == [] and decode_event_record(b"[]") == []
    # a layout this code does not know, or a non-array, is skipped (as a non-object was)
    assert decode_event_record(orjson.dumps([2, [999, "c", 1.0], "x", [2, "c", 1.0, 4, 5]])) == [
        {"ev": "acked", "cid": "c", "ts": 1.0, "pid": 4, "sc": 5}
    ]
