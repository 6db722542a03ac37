"""pipeline/decoding.py: the two topics' records as tables, without Spark; and with
Spark, that the Python source's tables (decoded as it reads) are row for row what
the Arrow UDFs give over the raw rows of the same topics (the connector's way)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pytest

from persistence.format import StoredMessage, encode_message
from pipeline.common import decode_events, decode_records
from pipeline.decoding import (
    EVENT_SCHEMA,
    event_batch,
    event_lists,
    folded_batch,
    record_batch,
)
from pipeline.kafka_source import latest_offsets, read_table, read_topic
from tests.pipeline.conftest import Workload


def _stored(topic: str, payload: bytes, expiry: float | None = None) -> bytes:
    return encode_message(
        StoredMessage(topic=topic, payload=payload, qos=1, publish_time=100.0, expiry=expiry)
    )


def test_a_record_is_its_client_position_and_stored_header() -> None:
    batch = record_batch(
        [b"c1", b"c2", None],
        [_stored("a/b", b"xyz", expiry=160.0), b"\x99 not a stored message", None],
        [3, 3, 3],
        [10, 11, 12],
        [1.5, 2.5, None],
    ).to_pylist()
    assert batch[0] == {
        "cid": "c1",
        "part": 3,
        "off": 10,
        "kts": 1.5,
        "topic": "a/b",
        "size": 3,
        "pub": 100.0,
        "exp": 160.0,
    }
    # not a stored message, no value: the record stays, its header is null
    assert [(r["cid"], r["off"], r["topic"], r["pub"]) for r in batch[1:]] == [
        ("c2", 11, None, None),
        (None, 12, None, None),
    ]


def test_events_are_one_row_each_in_record_order() -> None:
    first = [
        {"ev": "persisted", "cid": "c", "ts": 1, "sc": 7, "pid": 1},
        {"ev": "acked", "cid": "c", "ts": 2.5, "sc": 7},
    ]
    second = [{"ev": "trimmed", "cid": "d", "ts": 3.0, "pids": [1, 2], "extra": "left out"}]
    values = [
        orjson.dumps(first),
        b"{not json",
        orjson.dumps({"ev": "an object, not an array"}),
        orjson.dumps([1, "two", None]),  # no objects: no events
        None,
        orjson.dumps(second),
    ]
    rows = event_batch(values, [0, 0, 0, 0, 0, 1], [5, 6, 7, 8, 9, 4]).to_pylist()
    got = [
        (r["ev"], r["cid"], r["ts"], r["sc"], r["pids"], r["epart"], r["eoff"], r["idx"])
        for r in rows
    ]
    assert got == [
        ("persisted", "c", 1.0, 7, None, 0, 5, 0),
        ("acked", "c", 2.5, 7, None, 0, 5, 1),
        ("trimmed", "d", 3.0, None, [1, 2], 1, 4, 0),
    ]


def test_a_field_of_another_type_fails_rather_than_counting_around_it() -> None:
    with pytest.raises((pa.ArrowInvalid, pa.ArrowTypeError, TypeError)):
        event_batch([orjson.dumps([{"ev": "acked", "sc": "seven"}])], [0], [0])


def test_a_fetchs_events_of_one_message_fold_into_its_persisted_row() -> None:
    first = [
        {"ev": "persisted", "cid": "c", "ts": 1.0, "sc": 7, "pid": 1, "part": 0, "off": 3},
        {"ev": "delivered", "cid": "c", "ts": 2.0, "sc": 7, "pid": 1},
        {"ev": "acked", "cid": "c", "ts": 3.0, "sc": 7},
        {"ev": "delivered", "cid": "c", "ts": 1.5, "sc": 9},  # stored in an earlier fetch
    ]
    second = [
        {"ev": "delivered", "cid": "c", "ts": 4.0, "sc": 7},  # a duplicate delivery
        {"ev": "trimmed", "cid": "c", "ts": 5.0, "pids": [1]},  # by packet id: as it is
        {"ev": "expired", "cid": "c", "ts": 6.0, "part": 0, "off": 4, "at": "arrival"},
        {"ev": "expired", "cid": "c", "ts": 6.5, "sc": 9, "at": "delivery"},
        {"ev": "expired", "cid": "c", "ts": 6.6, "sc": 9, "at": "arrival", "off": 5},  # as is
        {"ev": "trimmed", "cid": "d", "ts": 7.0, "sc": -3},  # a queue's key limit
        {"ev": "connected", "cid": "c", "ts": 8.0},
    ]
    rows = folded_batch([orjson.dumps(first), orjson.dumps(second)], [0, 0], [10, 11]).to_pylist()
    got = {(r["ev"], r["cid"], r["sc"]): r for r in rows}
    assert len(rows) == len(got) == 7
    stored = got[("persisted", "c", 7)]
    assert (stored["acked"], stored["delivered"], stored["deliveries"], stored["marks"]) == (
        3.0,
        2.0,
        2,
        0,
    )
    assert (stored["pid"], stored["off"], stored["eoff"], stored["idx"]) == (1, 3, 10, 0)
    earlier = got[("message", "c", 9)]
    assert (earlier["delivered"], earlier["deliveries"], earlier["marks"]) == (1.5, 1, 1)
    assert (earlier["eoff"], earlier["idx"]) == (10, 3)  # where its first event was
    assert got[("message", "d", -3)]["marks"] == 4
    assert got[("trimmed", "c", None)]["pids"] == [1]
    assert got[("expired", "c", None)]["at"] == "arrival"
    assert (got[("expired", "c", 9)]["off"], got[("expired", "c", 9)]["deliveries"]) == (5, None)
    assert got[("connected", "c", None)]["deliveries"] is None  # no facts: not a message


def test_a_fact_before_its_persisted_event_in_a_fetch_gets_a_row_of_its_own() -> None:
    # the persisted event after it keeps its own row, without facts: the
    # accounting adds the two up as it adds up rows of two fetches
    events = [
        {"ev": "acked", "cid": "c", "ts": 3.0, "sc": 7},
        {"ev": "persisted", "cid": "c", "ts": 1.0, "sc": 7, "pid": 1, "off": 3},
        {"ev": "delivered", "cid": "c", "ts": 2.0, "sc": 7},
    ]
    rows = folded_batch([orjson.dumps(events)], [0], [10]).to_pylist()
    facts = ("ev", "acked", "delivered", "deliveries", "marks", "idx")
    assert [tuple(r[k] for k in facts) for r in rows] == [
        ("message", 3.0, 2.0, 1, 0, 0),
        ("persisted", None, None, None, None, 1),
    ]


def test_an_events_own_fields_named_as_facts_are_not_taken_for_them() -> None:
    # the fold writes facts and positions into the events' dicts: what an event
    # brings under those names is not a fact (the broker writes none of them)
    events = [
        {"ev": "persisted", "cid": "c", "ts": 1.0, "sc": 7, "pid": 1, "off": 3, "acked": 0.5},
        {"ev": "acked", "cid": "c", "ts": 3.0, "sc": 7},  # only acked: no delivery
        {"ev": "persisted", "cid": "c", "ts": 1.0, "sc": 8, "pid": 2, "off": 4, "marks": 1},
        {"ev": "connected", "cid": "c", "ts": 2.0, "deliveries": 9, "eoff": 99},
    ]
    rows = folded_batch([orjson.dumps(events)], [2], [10]).to_pylist()
    facts = ("sc", "acked", "deliveries", "marks", "epart", "eoff", "idx")
    assert [tuple(r[k] for k in facts) for r in rows] == [
        (7, 3.0, 0, 0, 2, 10, 0),
        (8, None, None, None, 2, 10, 2),
        (None, None, None, None, 2, 10, 3),
    ]


def test_the_udf_lists_hold_the_same_events_per_record() -> None:
    values = [
        orjson.dumps([{"ev": "a", "ts": 1}, {"ev": "b", "ts": 2}]),
        b"[]",
        b"x",
        orjson.dumps([{"ev": "c"}]),
    ]
    lists = event_lists(pa.array(values, pa.binary())).to_pylist()
    names = [f.split(" ")[0] for f in EVENT_SCHEMA.split(", ")]
    assert [[e["ev"] for e in events] for events in lists] == [["a", "b"], [], [], ["c"]]
    assert all(set(e) == set(names) for events in lists for e in events)


def test_the_records_of_before_and_the_positional_ones_give_the_same_tables() -> None:
    """Keyed records (the broker before, tests/pipeline/data/events_keyed.json) and the
    positional records of today for the same calls: the same rows, folded or not, and
    the same lists from the connector's UDF, each layout apart and in one fetch."""
    import asyncio

    from tests.pipeline.event_calls import calls

    keyed = orjson.loads((Path(__file__).parent / "data" / "events_keyed.json").read_bytes())
    before = [orjson.dumps(events) for _p, _k, events in keyed["12"]]
    now = [value for _p, _k, value in asyncio.run(calls(12))]
    assert len(before) == len(now) > 1 and before != now
    parts, offsets = [p for p, _k, _e in keyed["12"]], list(range(len(now)))
    for decode in (event_batch, folded_batch):
        rows = decode(now, parts, offsets).to_pylist()
        assert decode(before, parts, offsets).to_pylist() == rows
        assert {r["ev"] for r in rows} >= {"persisted", "admin", "gap", "trimmed"}
        # history then an upgraded broker, in one fetch
        mixed = before[:2] + now[2:]
        assert decode(mixed, parts, offsets).to_pylist() == rows
    assert (
        event_lists(pa.array(before, pa.binary())).to_pylist()
        == event_lists(pa.array(now, pa.binary())).to_pylist()
    )


def test_a_positional_event_of_the_wrong_length_fails() -> None:
    short = orjson.dumps([2, [2, "c", 1.0, 4]])  # acked without its score
    long = orjson.dumps([2, [1, "c", 1.0, 4, 5, False, "more"]])
    for value in (short, long):
        for decode in (event_batch, folded_batch):
            with pytest.raises(ValueError):
                decode([value], [0], [0])


def test_the_sources_tables_equal_the_udfs_over_the_raw_rows(
    spark: Any, workload: Workload
) -> None:
    endpoints = workload.endpoints
    for topic, table, decode in (
        ("devicemq.device.persisted", "records", decode_records),
        ("devicemq.events", "events", decode_events),
    ):
        # both up to the same offsets, whatever else the session writes meanwhile
        ending = json.dumps(
            {
                topic: {
                    str(p): high
                    for p, (_low, high) in latest_offsets(endpoints.bootstrap, topic).items()
                }
            }
        )
        # a Spark partition per 7 records at most: the split ranges join up exactly
        read = read_table(spark, endpoints.bootstrap, topic, table, split=7, ending=ending)
        assert read.rdd.getNumPartitions() > 1, table
        raw = decode(read_topic(spark, endpoints.bootstrap, topic, ending=ending))
        assert read.dtypes == raw.dtypes, table
        assert read.count() == raw.count() > 0, table
        assert read.exceptAll(raw).count() == 0 and raw.exceptAll(read).count() == 0, table


def test_a_stream_decodes_as_it_reads_too(spark: Any, workload: Workload, tmp_path: Path) -> None:
    from pipeline.kafka_source import FORMAT, register

    register(spark)
    topic = "devicemq.device.persisted"
    stream = (
        spark.readStream.format(FORMAT)
        .option("bootstrap", workload.endpoints.bootstrap)
        .option("topic", topic)
        .option("table", "records")
        .load()
    )
    query = (
        stream.writeStream.format("parquet")
        .option("path", str(tmp_path / "records"))
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(120)
    assert query.exception() is None
    streamed = spark.read.parquet(str(tmp_path / "records"))
    read = read_table(spark, workload.endpoints.bootstrap, topic, "records")  # after: holds it all
    assert streamed.dtypes == read.dtypes
    assert streamed.count() > 0 and streamed.exceptAll(read).count() == 0
