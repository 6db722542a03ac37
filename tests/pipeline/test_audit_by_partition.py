"""The audit of co-partitioned topics, a Kafka partition per task (pipeline/audit.py
``account_by_partition``), against the shuffle by client, on the real workload's
Tansu, Redis and Spark; and the topics it must not take for co-partitioned."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline import audit
from pipeline.common import Window, events, read_epoch, records
from pipeline.kafka_source import OffsetRange, latest_offsets, read_range
from pipeline.tally import summarize
from tests.pipeline.conftest import EXPECTED, Workload

PERSISTED, EVENTS = "devicemq.device.persisted", "devicemq.events"


def _copy(bootstrap: str, source: str, target: str, partitions: int, shift: int) -> None:
    """``source``'s records into a new topic ``target`` of ``partitions`` partitions,
    each of partition p's records, in order, into partition (p + shift) % partitions."""
    from aiokafka import AIOKafkaProducer

    from persistence.kafka_path import replace_topic

    moved = []
    for p, (low, high) in latest_offsets(bootstrap, source).items():
        for batch in read_range(OffsetRange(bootstrap, source, p, low, high)):
            rows = batch.to_pydict()
            to = (p + shift) % partitions
            moved += [(to, k, v) for k, v in zip(rows["key"], rows["value"], strict=True)]

    async def copy() -> None:
        await replace_topic(bootstrap, target, partitions)
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
        await producer.start()
        try:
            for to, key, value in moved:
                await (await producer.send(target, value, key=key, partition=to))
        finally:
            await producer.stop()

    asyncio.run(copy())


def _audited(spark: Any, workload: Workload, events_topic: str) -> Any:
    return audit.run_audit(
        spark,
        workload.endpoints,
        persisted_topic=PERSISTED,
        events_topic=events_topic,
        window=Window(),
    )


def test_a_partition_per_task_accounts_as_the_shuffle_by_client(
    spark: Any, workload: Workload, tmp_path: Path
) -> None:
    parts = audit.copartitioned(workload.endpoints, PERSISTED, EVENTS)
    assert parts is not None and len(parts) > 1
    assert [p.partition for p in parts] == list(range(len(parts)))
    epoch = read_epoch(workload.endpoints, PERSISTED)
    by_partition = audit.account_by_partition(
        spark, workload.endpoints, parts, EVENTS, Window(), epoch, 30.0, tmp_path / "a"
    )
    assert by_partition is not None
    recs = records(spark, workload.endpoints, PERSISTED, Window()).cache()
    refs = audit.redis_refs(spark, workload.endpoints, recs.select("cid").distinct()).cache()
    evs = events(spark, workload.endpoints, EVENTS, folded=True)
    rows = recs.count() + refs.count() + evs.count()
    by_shuffle = audit.account_into(
        spark, recs, evs, refs, epoch, time.time(), 30.0, tmp_path / "b", rows
    )
    (tally, taken), (tally_s, taken_s) = by_partition, by_shuffle
    assert tally.client_rows() == tally_s.client_rows()
    # the summary (totals, per client, latency percentiles): the same
    assert summarize(tally, [], 0, 0.0) == summarize(tally_s, [], 0, 0.0)
    assert (taken["records"], taken["refs"]) == (taken_s["records"], taken_s["refs"])
    assert taken["records"] == EXPECTED["persisted"]
    a = spark.read.parquet(str(tmp_path / "a"))
    b = spark.read.parquet(str(tmp_path / "b"))
    assert a.count() == b.count() == EXPECTED["persisted"]
    assert a.exceptAll(b).count() == 0 == b.exceptAll(a).count()
    # a file per Kafka partition: its task's
    assert sorted(f.name for f in (tmp_path / "a").iterdir()) == [
        f"part-{p:05d}.parquet" for p in range(len(parts))
    ]


def test_events_outside_their_clients_partition_are_accounted_by_the_shuffle(
    spark: Any, workload: Workload, caplog: pytest.LogCaptureFixture
) -> None:
    # as many partitions, but each client's events one partition further on: read a
    # partition at a time, its records would meet other clients' events (all lost)
    count = len(latest_offsets(workload.endpoints.bootstrap, EVENTS))
    _copy(workload.endpoints.bootstrap, EVENTS, "moved.events", count, shift=1)
    parts = audit.copartitioned(workload.endpoints, PERSISTED, "moved.events")
    assert parts is not None  # the counts alone do not tell
    result = _audited(spark, workload, "moved.events")
    totals = result.summary["totals"]
    assert {k: totals[k] for k in EXPECTED} == EXPECTED
    assert "not in their key's partition" in caplog.text


def test_topics_of_other_counts_or_too_large_partitions_are_not_co_partitioned(
    spark: Any, workload: Workload, monkeypatch: pytest.MonkeyPatch
) -> None:
    count = len(latest_offsets(workload.endpoints.bootstrap, EVENTS))
    _copy(workload.endpoints.bootstrap, EVENTS, "fewer.events", count - 1, shift=-1)
    assert audit.copartitioned(workload.endpoints, PERSISTED, "fewer.events") is None
    assert audit.copartitioned(workload.endpoints, PERSISTED, "no.such.topic") is None
    result = _audited(spark, workload, "fewer.events")  # the shuffle reads any layout
    totals = result.summary["totals"]
    assert {k: totals[k] for k in EXPECTED} == EXPECTED
    # a partition over what a task holds goes to the shuffle too
    largest = max(
        h - lo for lo, h in latest_offsets(workload.endpoints.bootstrap, PERSISTED).values()
    )
    monkeypatch.setattr(audit, "PARTITION_RECORDS", largest - 1)
    assert audit.copartitioned(workload.endpoints, PERSISTED, EVENTS) is None
    monkeypatch.setattr(audit, "PARTITION_RECORDS", largest)
    assert audit.copartitioned(workload.endpoints, PERSISTED, EVENTS) is not None


def test_a_tasks_input_is_the_rows_spark_gives_the_shuffle(spark: Any) -> None:
    # pipeline/accounting.py input_table (Arrow, in the task) and pipeline/audit.py
    # _accounting_input (Spark) write one rule twice: events read, trims by packet id
    import pyarrow as pa

    from pipeline.accounting import EVENT, INPUT_SCHEMA, RECORD, REF, input_table
    from pipeline.decoding import FOLDED_COLUMNS, RECORD_SCHEMA, arrow_schema

    base = {"cid": "c", "ts": 5.0, "ep": 1, "epart": 0, "eoff": 3}
    events = [
        {**base, "ev": "persisted", "pid": 1, "sc": 11, "part": 0, "off": 0, "idx": 0},
        {**base, "ev": "trimmed", "pids": [2, 3], "idx": 1},  # one event per id
        {**base, "ev": "trimmed", "pids": [], "pid": 7, "idx": 2},  # stays one event
        {**base, "ev": "trimmed", "at": "arrival", "part": 0, "off": 1, "idx": 3},
        {**base, "ev": "admin", "idx": 4},  # not read by the audit
        {**base, "ev": "message", "sc": 11, "acked": 6.0, "deliveries": 1, "marks": 0, "idx": 5},
        {"ev": "gap", "cid": "", "n": 7, "epart": 0, "eoff": 4, "idx": 0},
    ]
    evs = pa.RecordBatch.from_struct_array(
        pa.array(events, pa.struct(list(arrow_schema(FOLDED_COLUMNS))))
    )
    recs = pa.RecordBatch.from_pylist(
        [{"cid": "c", "part": 0, "off": 0, "kts": 1.0, "topic": "t", "size": 3, "pub": 1.0}],
        schema=arrow_schema(RECORD_SCHEMA),
    )
    refs = pa.RecordBatch.from_pylist(
        [{"cid": "c", "sc": 11, "ref_pid": 1, "has_value": True}],
        schema=pa.schema(
            [
                ("cid", pa.string()),
                ("sc", pa.int64()),
                ("ref_pid", pa.int32()),
                ("has_value", pa.bool_()),
            ]
        ),
    )
    in_task = pa.concat_tables(
        [input_table(RECORD, recs), input_table(EVENT, evs), input_table(REF, refs)]
    )
    assert in_task.schema == arrow_schema(INPUT_SCHEMA)
    frames = [spark.createDataFrame(pa.Table.from_batches([b])) for b in (recs, evs, refs)]
    by_spark = audit._accounting_input(spark, frames[0], frames[1], frames[2], 10).toArrow()
    key = [(name, "ascending") for name in ("kind", "idx", "pid")]
    assert in_task.sort_by(key).to_pylist() == by_spark.sort_by(key).to_pylist()
    read = [(r["ev"], r["pid"]) for r in in_task.to_pylist() if r["kind"] == EVENT]
    want = [("gap", None), ("message", None), ("persisted", 1), ("trimmed", None)]
    want += [("trimmed", 2), ("trimmed", 3), ("trimmed", 7)]
    assert sorted(read, key=str) == sorted(want, key=str)
