"""The audit of co-partitioned topics, a Kafka partition per task (pipeline/audit.py
``account_by_partition``), against the shuffle by client, on the real workload's
Tansu, Redis and Spark; and the topics it must not take for co-partitioned."""

from __future__ import annotations

import asyncio
import io
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline import audit
from pipeline.common import Progress, Window, events, read_epoch, records
from pipeline.kafka_source import OffsetRange, latest_offsets, read_range
from pipeline.tally import summarize
from tests.pipeline.conftest import EXPECTED, Workload

PERSISTED, EVENTS = "devicemq.device.persisted", "devicemq.events"


def _copy(
    bootstrap: str,
    source: str,
    target: str,
    partitions: int,
    shift: int,
    more: tuple[tuple[int, bytes, bytes], ...] = (),
) -> None:
    """``source``'s records into a new topic ``target`` of ``partitions`` partitions,
    each of partition p's records, in order, into partition (p + shift) % partitions;
    then ``more`` records (partition, key, value)."""
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
            for to, key, value in [*moved, *more]:
                await (await producer.send(target, value, key=key, partition=to))
        finally:
            await producer.stop()

    asyncio.run(copy())


def _audited(spark: Any, workload: Workload, events_topic: str, **options: Any) -> Any:
    return audit.run_audit(
        spark,
        workload.endpoints,
        persisted_topic=PERSISTED,
        events_topic=events_topic,
        window=Window(),
        **options,
    )


def _partitions(workload: Workload) -> int:
    return len(latest_offsets(workload.endpoints.bootstrap, EVENTS))


def _halfway(spark: Any, workload: Workload) -> Window:
    """A window from the middle of the records' publish times: it cuts clients' records."""
    recs = records(spark, workload.endpoints, PERSISTED, Window())
    pubs = sorted(row["pub"] for row in recs.select("pub").collect())
    return Window(since=pubs[len(pubs) // 2])


@pytest.mark.parametrize("cut", [False, True], ids=["all", "window"])
def test_a_partition_per_task_accounts_as_the_shuffle_by_client(
    spark: Any, workload: Workload, tmp_path: Path, cut: bool
) -> None:
    window = _halfway(spark, workload) if cut else Window()
    parts = audit.copartitioned(workload.endpoints, PERSISTED, EVENTS, cores=2)
    assert parts is not None and len(parts) > 1
    assert [p.partition for p in parts] == list(range(len(parts)))
    by_partition = audit.account_by_partition(
        spark, workload.endpoints, parts, EVENTS, window, 30.0, tmp_path / "a"
    )
    assert by_partition is not None
    tally, taken, epoch, _ = by_partition
    assert epoch == read_epoch(workload.endpoints, PERSISTED)
    recs = records(spark, workload.endpoints, PERSISTED, window).cache()
    refs = audit.redis_refs(spark, workload.endpoints, recs.select("cid").distinct()).cache()
    evs = events(spark, workload.endpoints, EVENTS, folded=True)
    rows = recs.count() + refs.count() + evs.count()
    tally_s, taken_s = audit.account_into(
        spark, recs, evs, refs, epoch, time.time(), 30.0, tmp_path / "b", rows
    )
    assert tally.client_rows() == tally_s.client_rows()
    # the summary (totals, per client, latency percentiles): the same
    assert summarize(tally, [], 0, 0.0) == summarize(tally_s, [], 0, 0.0)
    assert (taken["records"], taken["refs"]) == (taken_s["records"], taken_s["refs"])
    persisted = taken["records"]
    if cut:
        assert 0 < persisted < EXPECTED["persisted"]
    else:
        assert persisted == EXPECTED["persisted"]
    a = spark.read.parquet(str(tmp_path / "a"))
    b = spark.read.parquet(str(tmp_path / "b"))
    assert a.count() == b.count() == persisted
    assert a.exceptAll(b).count() == 0 == b.exceptAll(a).count()
    # a file per Kafka partition: its task's
    assert sorted(f.name for f in (tmp_path / "a").iterdir()) == [
        f"part-{p:05d}.parquet" for p in range(len(parts))
    ]


def test_events_the_broker_dropped_are_counted_by_partition(spark: Any, workload: Workload) -> None:
    import orjson

    from persistence.format import partition_of

    count = _partitions(workload)
    gap = orjson.dumps([{"ev": "gap", "cid": "", "ts": time.time(), "n": 7}])
    more = ((partition_of("", count), b"", gap),)
    _copy(workload.endpoints.bootstrap, EVENTS, "gapped.events", count, shift=0, more=more)
    said = io.StringIO()
    result = _audited(spark, workload, "gapped.events", progress=Progress(said))
    # by partition: the shuffle's own line (its events read apart) is not said
    assert "a task per partition" in said.getvalue()
    assert "accounting for every record" not in said.getvalue()
    assert result.summary["events_dropped"] == 7
    totals = result.summary["totals"]
    assert {k: totals[k] for k in EXPECTED} == EXPECTED


def test_events_outside_their_clients_partition_are_accounted_by_the_shuffle(
    spark: Any, workload: Workload, tmp_path: Path
) -> None:
    # as many partitions, but each client's events one partition further on: read a
    # partition at a time, its records would meet other clients' events (all lost)
    _copy(workload.endpoints.bootstrap, EVENTS, "moved.events", _partitions(workload), shift=1)
    assert audit.copartitioned(workload.endpoints, PERSISTED, "moved.events", 2) is not None
    written = tmp_path / "messages.parquet"
    said = io.StringIO()
    result = _audited(
        spark, workload, "moved.events", messages_dir=written, progress=Progress(said)
    )
    totals = result.summary["totals"]
    assert {k: totals[k] for k in EXPECTED} == EXPECTED
    # begun by partition, accounted for by the shuffle
    assert "a task per partition" in said.getvalue()
    assert "reading moved.events and accounting for every record" in said.getvalue()
    # the shuffle's files only (the tasks that gave up wrote none)
    assert spark.read.parquet(str(written)).count() == EXPECTED["persisted"]


def test_topics_of_other_counts_few_or_large_partitions_are_not_co_partitioned(
    spark: Any, workload: Workload, monkeypatch: pytest.MonkeyPatch
) -> None:
    count = _partitions(workload)
    _copy(workload.endpoints.bootstrap, EVENTS, "fewer.events", count - 1, shift=-1)
    endpoints = workload.endpoints
    assert audit.copartitioned(endpoints, PERSISTED, "fewer.events", cores=2) is None
    assert audit.copartitioned(endpoints, PERSISTED, "no.such.topic", cores=2) is None
    result = _audited(spark, workload, "fewer.events")  # the shuffle reads any layout
    totals = result.summary["totals"]
    assert {k: totals[k] for k in EXPECTED} == EXPECTED
    # fewer partitions than cores would leave cores idle
    assert audit.copartitioned(endpoints, PERSISTED, EVENTS, cores=count) is not None
    assert audit.copartitioned(endpoints, PERSISTED, EVENTS, cores=count + 1) is None
    # a partition over what a task holds goes to the shuffle too
    recs = latest_offsets(endpoints.bootstrap, PERSISTED)
    evs = latest_offsets(endpoints.bootstrap, EVENTS)
    largest = max(
        recs[p][1] - recs[p][0] + audit.EVENT_ROWS_PER_RECORD * (evs[p][1] - evs[p][0])
        for p in recs
    )
    monkeypatch.setattr(audit, "PARTITION_ROWS", largest - 1)
    assert audit.copartitioned(endpoints, PERSISTED, EVENTS, cores=2) is None
    monkeypatch.setattr(audit, "PARTITION_ROWS", largest)
    assert audit.copartitioned(endpoints, PERSISTED, EVENTS, cores=2) is not None


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
