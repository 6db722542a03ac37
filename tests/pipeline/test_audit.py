"""The audit on real Spark against a real broker's Kafka and Redis: exact counts, then a loss."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from app import cli
from persistence.format import client_keys
from pipeline.audit import STATUSES, run_audit, write_outputs
from pipeline.common import Window
from tests.pipeline.conftest import ACKED_EACH, ACKERS, EXPECTED, Workload

PERSISTED, EVENTS = "devicemq.device.persisted", "devicemq.events"


def _audit(spark: Any, workload: Workload) -> Any:
    return run_audit(
        spark,
        workload.endpoints,
        persisted_topic=PERSISTED,
        events_topic=EVENTS,
        window=Window(),
    )


def _check_totals(totals: dict[str, int], **changes: int) -> None:
    want = {**EXPECTED, **changes}
    assert {k: totals[k] for k in want} == want


def test_the_jvm_keeps_room_for_a_long_sessions_code(spark: Any) -> None:
    # C1 only (pipeline/common.py JIT) got the 48 MB code cache of a JVM without
    # tiers: a test session filled it and the JVM died mid-query.
    jvm = spark.sparkContext._jvm
    bean = jvm.java.lang.management.ManagementFactory.getPlatformMXBean(
        jvm.java.lang.Class.forName("com.sun.management.HotSpotDiagnosticMXBean")
    )
    assert bean.getVMOption("TieredStopAtLevel").getValue() == "1"
    assert int(bean.getVMOption("ReservedCodeCacheSize").getValue()) >= 256 * 1024 * 1024


def test_workload_ran(workload: Workload) -> None:
    assert workload.received == dict.fromkeys(ACKERS, ACKED_EACH)


def _app_topic(bootstrap: str) -> None:
    """An APPLICATION session's topic (persistence/application_feed.py), as a broker
    with application.client_ids makes one."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    from persistence.application_feed import app_topic

    async def create() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(app_topic("backend-audit"), 1, 1)])
        finally:
            await admin.close()

    asyncio.run(create())


def test_audit_finds_the_known_counts(spark: Any, workload: Workload, tmp_path: Path) -> None:
    _app_topic(workload.endpoints.bootstrap)
    result = _audit(spark, workload)
    # said plainly: APPLICATION sessions are not in the persisted topic, nor in the events
    left_out = result.summary["not_accounted"]
    assert left_out["application_session_topics"] >= 1, left_out
    assert left_out["text"].startswith("APPLICATION sessions are not accounted for")
    _check_totals(result.summary["totals"])
    assert result.summary["ok"] and result.summary["lost_messages"] == []
    clients = {c["cid"]: c for c in result.summary["clients"]}
    assert clients["hoarder"]["trimmed"] == 5 and clients["hoarder"]["pending"] == 10
    assert clients["sleeper"]["pending"] == 3 and clients["expirer"]["expired"] == 4
    assert clients["dupper"]["duplicates"] == 2 and clients["dupper"]["acked"] == 2
    latency = result.summary["latency_seconds"]
    assert 0 <= latency["delivery"]["p50"] <= latency["ack"]["p99"] < 30
    # the ackers were connected as their messages were published: live deliveries
    assert result.summary["delivered"]["live"] >= ACKED_EACH * len(ACKERS)
    assert latency["delivery_live"]["p50"] is not None

    path = write_outputs(result, tmp_path)
    assert json.loads(path.read_text())["totals"]["lost"] == 0
    html = (tmp_path / "audit.html").read_text()
    assert "data:image/png;base64," in html and "No message lost" in html
    assert "APPLICATION sessions are not accounted for" in html
    messages = spark.read.parquet(str(tmp_path / "messages.parquet"))
    assert messages.count() == EXPECTED["persisted"]
    assert spark.read.parquet(str(tmp_path / "clients.parquet")).count() == 6


def test_events_folded_as_read_account_as_the_events_one_by_one(
    spark: Any, workload: Workload
) -> None:
    # run_audit reads the events folded per message (pipeline/decoding.py
    # folded_batch); the stream and the connector give them one by one
    from pipeline.audit import audit_frames, redis_refs
    from pipeline.common import events, read_epoch, records

    recs = records(spark, workload.endpoints, PERSISTED, Window()).cache()
    refs = redis_refs(spark, workload.endpoints, recs.select("cid").distinct()).cache()
    folded = events(spark, workload.endpoints, EVENTS, folded=True).cache()
    one_by_one = events(spark, workload.endpoints, EVENTS).cache()
    assert folded.count() < one_by_one.count()
    now, epoch = time.time(), read_epoch(workload.endpoints, PERSISTED)
    got = [audit_frames(spark, recs, e, refs, epoch, now, 30.0) for e in (folded, one_by_one)]
    assert got[0].count() == got[1].count() == EXPECTED["persisted"]
    assert got[0].exceptAll(got[1]).count() == 0 and got[1].exceptAll(got[0]).count() == 0


def _copy_events_as_before(bootstrap: str, topic: str) -> None:
    """``topic``: the events topic's records, partition for partition, the first half
    of each partition's as the broker wrote them before the positional layout (keyed
    objects, persistence/format.py "Delivery event record"), the rest as they are:
    history, then a broker upgraded."""
    import orjson
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    from persistence.format import EVENTS_LAYOUT, decode_event_record

    async def copy() -> None:
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, auto_offset_reset="earliest")
        await consumer.start()
        try:
            partitions = sorted(consumer.partitions_for_topic(EVENTS) or ())
            tps = [TopicPartition(EVENTS, p) for p in partitions]
            consumer.assign(tps)
            ends = await consumer.end_offsets(tps)
            records: dict[int, list[bytes]] = {p: [] for p in partitions}
            while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
                for tp, got in (await consumer.getmany(timeout_ms=2000)).items():
                    records[tp.partition] += [r.value for r in got if r.value is not None]
        finally:
            await consumer.stop()
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, len(partitions), 1)])
        finally:
            await admin.close()
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
        await producer.start()
        try:
            kept = 0
            for partition, values in records.items():
                for i, value in enumerate(values):
                    if i < len(values) // 2:
                        assert orjson.loads(value)[0] == EVENTS_LAYOUT
                        value = orjson.dumps(decode_event_record(value))
                    else:
                        kept += 1
                    await producer.send_and_wait(topic, value, partition=partition)
            assert kept and sum(map(len, records.values())) > kept  # both layouts
        finally:
            await producer.stop()

    asyncio.run(copy())


def test_events_written_before_the_positional_layout_are_read_as_before(
    spark: Any, workload: Workload
) -> None:
    # the audit reads history: an events topic whose older records are the keyed
    # objects of the broker before, the newer ones positional, accounts exactly
    # as the topic of the positional records alone
    mixed = "devicemq.events.upgraded"
    _copy_events_as_before(workload.endpoints.bootstrap, mixed)
    got = [
        run_audit(
            spark, workload.endpoints, persisted_topic=PERSISTED, events_topic=topic,
            window=Window(),
        ).summary
        for topic in (EVENTS, mixed)
    ]  # fmt: skip
    _check_totals(got[1]["totals"])
    for part in ("totals", "clients", "lost_messages", "latency_seconds", "delivered"):
        assert got[1][part] == got[0][part], part


def test_the_messages_written_by_the_tasks_are_the_ones_kept_in_spark(
    spark: Any, workload: Workload, tmp_path: Path
) -> None:
    # run_audit's tasks write messages.parquet as they account, and tally them
    # (account_into); the stream keeps them in Spark (audit_frames): the same rows,
    # and the same counts as Spark SQL's grouping of them
    from pyspark.sql import functions as F

    from pipeline.audit import _accounting_input, account_into, audit_frames, redis_refs
    from pipeline.common import events, read_epoch, records

    recs = records(spark, workload.endpoints, PERSISTED, Window()).cache()
    refs = redis_refs(spark, workload.endpoints, recs.select("cid").distinct()).cache()
    # not cached, as run_audit gives them; with a gap of 7 events the broker dropped
    evs = events(spark, workload.endpoints, EVENTS, folded=True)
    gap = {"ev": "gap", "cid": "", "n": 7, "epart": 0, "eoff": 0, "idx": 0}
    evs = evs.unionByName(spark.createDataFrame([gap], evs.schema))
    now, epoch = time.time(), read_epoch(workload.endpoints, PERSISTED)
    written = tmp_path / "messages.parquet"
    written.mkdir()
    (written / "part-00099.parquet").write_bytes(b"an earlier audit's")  # replaced whole
    rows = recs.count() + evs.count() + refs.count()
    tally, taken = account_into(spark, recs, evs, refs, epoch, now, 30.0, written, rows)
    kept = audit_frames(spark, recs, evs, refs, epoch, now, 30.0)
    messages = spark.read.parquet(str(written))
    assert messages.count() == kept.count() == EXPECTED["persisted"]
    assert messages.exceptAll(kept).count() == 0 and kept.exceptAll(messages).count() == 0
    counts = [F.sum(F.when(F.col("status") == s, 1).otherwise(0)).alias(s) for s in STATUSES]
    grouped = kept.groupBy("cid").agg(
        F.count("*").alias("persisted"),
        *counts,
        F.sum(F.greatest(F.col("deliveries") - 1, F.lit(0))).alias("duplicates"),
    )
    assert tally.client_rows() == [row.asDict() for row in grouped.orderBy("cid").collect()]
    assert tally.redelivered == kept.where("deliveries > 1").count()
    # what the tasks took in, counted by them
    inputs = _accounting_input(spark, recs, evs, refs, rows).groupBy("kind").count().collect()
    kinds = {row["kind"]: row["count"] for row in inputs}
    assert taken == {"records": kinds[0], "events": kinds[1], "refs": kinds.get(2, 0), "gaps": 7}
    # a file per task, named by its partition (a task run again writes the same one)
    names = sorted(path.name for path in written.iterdir())
    assert names == [f"part-{i:05d}.parquet" for i in range(len(names))]


def test_cli_since_window(
    spark: Any, workload: Workload, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `devicemq pipeline audit`, in-process: it reuses the test's SparkSession.
    # Everything was published before --since: the window is empty, nothing lost.
    argv = ["pipeline", "audit", "--bootstrap", workload.endpoints.bootstrap]
    argv += ["--redis", workload.endpoints.redis_url, "--out", str(tmp_path)]
    assert cli.main([*argv, "--since", "2999-01-01T00:00:00"]) == 0
    totals = json.loads((tmp_path / "audit.json").read_text())["totals"]
    assert totals["persisted"] == 0 and totals["lost"] == 0
    # its own progress lines, on stderr: what it read, how many, when
    said = [line.split("] ", 1)[1] for line in capsys.readouterr().err.splitlines()]
    assert "read devicemq.device.persisted: 0 records" in said
    assert any(line.startswith("read devicemq.events: ") for line in said)
    assert said[-1] == "done"


def test_a_message_removed_behind_the_brokers_back_is_lost(
    spark: Any, workload: Workload, tmp_path: Path
) -> None:
    keys = client_keys("sleeper")
    redis = Redis.from_url(workload.endpoints.redis_url)
    [(member, score)] = redis.zrange(keys.messages, 0, 0, withscores=True)
    pid = int(member)
    value = redis.hget(keys.values, pid)
    assert redis.zrem(keys.messages, member) == 1
    assert redis.hdel(keys.values, pid) == 1
    try:
        _the_deleted_message_is_lost(spark, workload, tmp_path, pid)
    finally:  # the session's later tests (the stream's too) audit the workload as it was
        redis.zadd(keys.messages, {member: score})
        redis.hset(keys.values, pid, value)
        redis.close()


def _the_deleted_message_is_lost(spark: Any, workload: Workload, tmp_path: Path, pid: int) -> None:
    argv = ["pipeline", "audit", "--bootstrap", workload.endpoints.bootstrap]
    argv += ["--redis", workload.endpoints.redis_url, "--out", str(tmp_path)]
    # no grace: a message gone from Redis within --grace of being stored is in
    # flight, and the workload may be younger than that when this test runs
    argv += ["--grace", "0"]
    assert cli.main(argv) == 1  # lost messages: exit status 1
    summary = json.loads((tmp_path / "audit.json").read_text())
    _check_totals(summary["totals"], lost=1, pending=EXPECTED["pending"] - 1)
    assert not summary["ok"]
    [lost] = summary["lost_messages"]
    assert (lost["cid"], lost["pid"], lost["reason"]) == ("sleeper", pid, "missing from redis")
    assert "LOST" in (tmp_path / "audit.html").read_text()
    lost_rows = spark.read.parquet(str(tmp_path / "messages.parquet")).where("status = 'lost'")
    assert [r["pid"] for r in lost_rows.collect()] == [pid]


def _messages(
    spark: Any, records: int, events: list[dict[str, Any]], pubs: list[float] | None = None
) -> dict[int, Any]:
    """The audit's row of each of ``records`` records of client ``c`` (partition 0,
    offsets 0.., published at ``pubs``, else at 10), given ``events`` (epoch 3, in
    order): offset -> row."""
    from pipeline.audit import audit_frames
    from pipeline.common import EVENT_SCHEMA

    epoch, now = 3, 1000.0
    times = pubs or [10.0] * records
    recs = spark.createDataFrame(
        [("c", 0, off, times[off], "t", 1, times[off], None) for off in range(records)],
        "cid string, part int, off long, kts double, topic string, size int, pub double, "
        "exp double",
    )
    names = [f.split()[0] for f in EVENT_SCHEMA.split(", ")]
    rows = []
    for i, fields in enumerate(events):
        row = {"cid": "c", "ts": 20.0, "part": 0, "ep": epoch, **fields}
        rows.append((*(row.get(n) for n in names), 0, i, 0))
    evs = spark.createDataFrame(rows, f"{EVENT_SCHEMA}, epart int, eoff long, idx int")
    refs = spark.createDataFrame([], "cid string, sc long, ref_pid int, has_value boolean")
    messages = audit_frames(spark, recs, evs, refs, epoch, now, grace=30.0)
    return {r["off"]: r for r in messages.collect()}


def _statuses(spark: Any, records: int, events: list[dict[str, Any]]) -> dict[int, str]:
    return {off: row["status"] for off, row in _messages(spark, records, events).items()}


def test_records_not_stored_for_a_reason_are_not_lost(spark: Any) -> None:
    """A record produced twice, one routed for a session that had ended, one over a
    limit full of messages in flight: the events say why, none is ``lost``; a record
    with no event at all is."""
    got = _statuses(
        spark,
        5,
        [
            {"ev": "persisted", "off": 0, "pid": 1, "sc": 1, "exp": 2000.0},
            {"ev": "acked", "pid": 1, "sc": 1, "pids": []},  # an empty list: still an event
            {"ev": "duplicate", "off": 1},
            {"ev": "discarded", "at": "arrival", "off": 2},
            {"ev": "trimmed", "at": "arrival", "off": 3},
        ],
    )
    assert got == {0: "acked", 1: "duplicate", 2: "discarded", 3: "trimmed", 4: "lost"}


def test_messages_an_operator_purged_are_purged_not_lost(spark: Any) -> None:
    """The admin API's purge writes a ``purged`` event per message (app/admin.py):
    those are accounted for; a stored message gone without one is still lost."""
    persisted = [
        {"ev": "persisted", "off": i, "pid": i + 1, "sc": i + 1, "exp": 2000.0} for i in range(3)
    ]
    purged = [{"ev": "purged", "pid": 1, "sc": 1}, {"ev": "purged", "pid": 2, "sc": 2}]
    got = _statuses(spark, 3, [*persisted, *purged])
    assert got == {0: "purged", 1: "purged", 2: "lost"}


def test_deliveries_to_connected_clients_are_told_from_replays(spark: Any) -> None:
    """A message published while its client was connected is delivered live; one
    published while it was away is replayed, and its latency is mostly the absence
    (a run with offline subscribers had its histogram dominated by those)."""

    def stored(i: int, pub: float, delivered: float) -> list[dict[str, Any]]:
        return [
            {"ev": "persisted", "off": i, "pid": i + 1, "sc": i + 1, "exp": 2000.0, "ts": pub},
            {"ev": "delivered", "pid": i + 1, "sc": i + 1, "ts": delivered},
        ]

    events = [
        {"ev": "connected", "ts": 5.0},
        *stored(0, 10.0, 10.0),  # connected: live
        {"ev": "disconnected", "ts": 20.0},
        *stored(1, 25.0, 300.0),  # away: replayed when it came back
        {"ev": "connected", "ts": 300.0},
        *stored(2, 400.0, 400.0),  # connected again: live
    ]
    rows = _messages(spark, 3, events, pubs=[10.0, 25.0, 400.0])
    assert {off: row["live"] for off, row in rows.items()} == {0: True, 1: False, 2: True}
    assert rows[1]["delivery_latency"] == 275.0


def test_a_message_gone_from_redis_within_grace_of_being_stored_is_in_flight(
    spark: Any,
) -> None:
    """Redis is read before the events: a message stored, then acknowledged (gone
    from Redis) just before that read may have its ``acked`` event still on its way
    to Kafka. Stored within ``--grace`` of the Redis read (now = 1000, grace 30),
    it is in flight; stored earlier and gone with no event saying why, it is lost."""
    got = _statuses(
        spark,
        2,
        [
            {"ev": "persisted", "off": 0, "pid": 1, "sc": 1, "ts": 990.0},
            {"ev": "persisted", "off": 1, "pid": 2, "sc": 2, "ts": 960.0},
        ],
    )
    assert got == {0: "in_flight", 1: "lost"}


def test_a_large_backlog_read_by_the_workers_is_the_drivers_read(
    spark: Any, workload: Workload, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline import audit

    cids = spark.createDataFrame(
        [(c,) for c in ("sleeper", "hoarder", "expirer", "nobody")], "cid string"
    )
    by_driver = audit.redis_refs(spark, workload.endpoints, cids)
    monkeypatch.setattr(audit, "DRIVER_REFS", 0)  # every backlog counts as large
    by_workers = audit.redis_refs(spark, workload.endpoints, cids)
    assert by_driver.dtypes == by_workers.dtypes
    assert by_driver.count() == by_workers.count() >= 10  # hoarder's 10 at least
    assert by_driver.exceptAll(by_workers).count() == 0 == by_workers.exceptAll(by_driver).count()
