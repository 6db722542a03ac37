"""``devicemq pipeline audit``: prove every persisted message is accounted for.

The base is the persisted topic itself: each record of
``devicemq.device.persisted`` is a delivery a publisher was acknowledged for.
Each record gets exactly one status, first match wins:

``acked``      the client acknowledged it (PUBACK / PUBCOMP)
``expired``    expired before it was stored (``at=arrival``), at delivery, or
               in Redis (not stored any more and its expiry has passed)
``dropped``    larger than the client's Maximum Packet Size: never deliverable
``trimmed``    removed by the per-client limit
``purged``     removed by an operator (the admin API's backlog purge)
``compacted``  a queue entry ($ECQ) replaced by a newer value of its key
               before it was acknowledged: its consumer gets the newer one
``pending``    still stored in Redis: the ``{cid}_messages`` sorted set holds
               its score and its ``{cid}_values`` entry is live (a
               queue entry: ``{cid}_ecq_pending`` holds its sequence number)
``discarded``  its session ended (expired or clean start) after it was stored,
               or before it arrived (routed for a session that had ended)
``duplicate``  a second record of a message stored from another (a produce
               request Kafka took twice): delivered as that one
``in_flight``  not stored yet, and younger than ``--grace`` seconds; or stored
               less than ``--grace`` seconds before Redis was read and gone
               from it with no event saying why yet (the event of its
               acknowledgement may still be on its way to Kafka)
``lost``       none of these

A stored message is identified by (client, score) (a queue entry's score
is its sequence number negated, persistence/events.py): acks, deliveries and
expiries carry the score; a trim names packet ids, resolved to the last
message stored under that id before the trim (events of one client are in
one partition, in order). Duplicate deliveries are deliveries of a message
after its first; latencies are first delivery and acknowledgement minus the
publish time, delivery also apart for messages whose client was connected as
they were published and for those replayed from the backlog; percentiles come
from log-bucket histograms, within 1 % (pipeline/tally.py, the stream's too).

The order of the reads matters on a running broker: the records first, then
Redis, then the events. A message gone from Redis was gone before the events
were read, so the event saying why (its acknowledgement, written by the broker
just after) is read too, but for the last moments before the Redis read:
``--grace`` covers those. Read the other way round, every message
acknowledged in between would count as lost.

APPLICATION sessions (docs/application-sessions.md) are not accounted for,
and the audit says so (``not_accounted`` in ``audit.json``, a line of its
output and of ``audit.html``, with how many of their topics Kafka lists): it
reads the persisted topic and the delivery events, and an APPLICATION
session's messages are in a topic of its own (``devicemq.app.<client>``), each
session's position is one committed offset per partition in Redis, and its
deliveries write no delivery events (that is their point: no per-message
write). Their lag is in ``/metrics``, ``$SYS`` and the admin API.

Outputs in ``--out``: ``messages.parquet`` (one row per record, its status
and times), ``clients.parquet`` (status counts per client), ``audit.json``
(``totals``, latency percentiles, per-client counts, the lost messages) and
``audit.html``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.accounting import STATUSES, TAKEN_IN
from pipeline.common import (
    Endpoints,
    Progress,
    Window,
    decode_events,
    decode_records,
    read_epoch,
)
from pipeline.tally import CLIENT_COLUMNS, Tally, latency_sample, summarize

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from pipeline.kafka_source import OffsetRange

__all__ = [
    "STATUSES",
    "AuditResult",
    "account_into",
    "audit_frames",
    "lost_messages",
    "run_audit",
    "write_outputs",
]

log = logging.getLogger("devicemq.pipeline.audit")

PERCENTILE_NAMES = ("p50", "p90", "p99", "max")
LOST_LISTED = 100  # lost messages named in audit.json
ROWS_PER_TASK = 250_000  # records, events and refs accounted for by one task at most
# a record of the events topic is one client's flush: 22 rows folded at full load,
# 67 one by one (--source connector: its tasks then hold about twice as many rows)
EVENT_ROWS_PER_RECORD = 32
# fields of an event the audit does not read (the traffic job does): left out
UNREAD_EVENT_FIELDS = ("topic", "size", "pub", "dup")


@dataclass
class AuditResult:
    summary: dict[str, Any]
    # read from messages_dir (:func:`account_into`)
    messages: DataFrame
    # an Arrow table of CLIENT_SCHEMA
    clients: Any
    # (first delivery latency, ack latency or None, live): the report's histograms' data,
    # from the tally's (pipeline/tally.py latency_sample: bucket middles, no ack)
    latencies: list[tuple[float | None, float | None, bool]] = field(default_factory=list)
    cached: list[DataFrame] = field(default_factory=list)
    messages_dir: Path | None = None
    # the directory of messages_dir when the caller gave none: removed with it
    scratch: tempfile.TemporaryDirectory[str] | None = None

    def release(self) -> None:
        """Let Spark drop the frames this audit cached (the stream audits again and
        again in one session: kept, they would fill its memory)."""
        for frame in self.cached:
            frame.unpersist()
        if self.scratch is not None:
            self.scratch.cleanup()


# ---------------------------------------------------------------------------
# Redis: what is still stored
# ---------------------------------------------------------------------------


def stored_refs(endpoints: Endpoints, cids: Iterable[Any]) -> Iterator[tuple[Any, ...]]:
    """(cid, score, packet id, value present) for every ref of every client given, and
    (cid, -seq, 0, True) for every pending entry of the queue it consumes."""
    from persistence.format import client_keys, entry_live, queue_keys
    from persistence.redis_security import blocking_client

    client = blocking_client(
        endpoints.redis_url,
        endpoints.redis_connect,
        endpoints.redis_sentinels,
        cluster=endpoints.redis_cluster,
    )
    try:
        todo = [row[0] for row in cids]
        for start in range(0, len(todo), 200):
            chunk = todo[start : start + 200]
            pipe = client.pipeline(transaction=False)
            for cid in chunk:
                pipe.zrange(client_keys(cid).messages, 0, -1, withscores=True)
                pipe.zrange(queue_keys(cid).pending, 0, -1, withscores=True)
            replies = pipe.execute()
            sets = replies[0::2]
            for cid, entries in zip(chunk, replies[1::2], strict=True):
                for _key, seq in entries:
                    yield cid, -int(seq), 0, True
            pipe = client.pipeline(transaction=False)
            refs: list[tuple[str, int, int]] = []
            for cid, members in zip(chunk, sets, strict=True):
                keys = client_keys(cid)
                for member, score in members:
                    pid = int(member)
                    refs.append((cid, int(score), pid))
                    pipe.hget(keys.values, pid)
                    pipe.exists(keys.message(pid))  # the layout before the values hash
            present = pipe.execute() if refs else []
            now_ms = time.time() * 1000
            for (cid, score, pid), entry, old in zip(
                refs, present[0::2], present[1::2], strict=True
            ):
                yield cid, score, pid, entry_live(entry, now_ms) or bool(old)
    finally:
        client.close()


REFS_SCHEMA = "cid string, sc long, ref_pid int, has_value boolean"
DRIVER_REFS = 200_000  # a backlog this small is read by the driver, a larger one by the workers


def redis_refs(spark: SparkSession, endpoints: Endpoints, cids: DataFrame) -> DataFrame:
    """The stored refs of ``cids`` (a one-column DataFrame).

    Counted first (two ZCARDs per client, pipelined): up to :data:`DRIVER_REFS`
    they are read here and handed to Spark as one Arrow table, which took a
    tenth of the time of a Python job on the workers (its start, its pickled
    rows); a larger backlog is read by the workers, a share of the clients each.
    """

    todo = [row[0] for row in cids.collect()]
    if _backlog(endpoints, todo) > DRIVER_REFS:
        slices = max(1, min(len(todo) // 200, spark.sparkContext.defaultParallelism * 4))
        rows = spark.sparkContext.parallelize(todo, slices).mapPartitions(
            lambda part: stored_refs(endpoints, ((cid,) for cid in part))
        )
        return spark.createDataFrame(rows, REFS_SCHEMA)
    return spark.createDataFrame(refs_table(stored_refs(endpoints, ((cid,) for cid in todo))))


def refs_table(refs: Iterable[tuple[Any, ...]]) -> Any:
    """:func:`stored_refs`' rows as an Arrow table of :data:`REFS_SCHEMA`."""
    import pyarrow as pa

    found = list(refs)
    cid, sc, pid, there = zip(*found, strict=True) if found else ((), (), (), ())
    return pa.table(
        {
            "cid": pa.array(cid, pa.string()),
            "sc": pa.array(sc, pa.int64()),
            "ref_pid": pa.array(pid, pa.int32()),
            "has_value": pa.array(there, pa.bool_()),
        }
    )


def _backlog(endpoints: Endpoints, cids: list[str]) -> int:
    """How many refs and queue entries ``cids`` have stored (ZCARD)."""
    from persistence.format import client_keys, queue_keys
    from pipeline.common import _redis

    client = _redis(endpoints)
    try:
        total = 0
        for start in range(0, len(cids), 1000):
            pipe = client.pipeline(transaction=False)
            for cid in cids[start : start + 1000]:
                pipe.zcard(client_keys(cid).messages)
                pipe.zcard(queue_keys(cid).pending)
            total += sum(int(n) for n in pipe.execute())
        return total
    finally:
        client.close()


# ---------------------------------------------------------------------------
# The reconciliation
# ---------------------------------------------------------------------------


def _accounting_input(
    spark: SparkSession, recs: DataFrame, evs: DataFrame, refs: DataFrame, rows: int
) -> DataFrame:
    """Records, events and Redis refs as one table of :data:`INPUT_SCHEMA`
    (pipeline/accounting.py), in tasks sized for about ``rows`` rows in all.

    Every join of the audit is within one client, so the three go together
    into one table, are shuffled once by client, and each partition's clients
    are accounted for in Python. The plan of Spark SQL joins, groupings and
    windows before it shuffled a row per message nine times (BENCHMARKS.md
    "The audit, accounted per client"). ``evs`` may hold the events one by
    one or folded per message (pipeline/decoding.py ``folded_batch``): the
    accounting adds up either.
    """
    from pyspark.sql import functions as F

    from pipeline.accounting import EVENT, INPUT_SCHEMA, READ_EVENTS, RECORD, REF

    def kind(value: int, frame: DataFrame) -> DataFrame:
        """``frame`` as rows of INPUT_SCHEMA: its fields, the others null (events
        given one by one have no folded facts, records no event fields)."""
        have = set(frame.columns)
        return frame.select(
            F.lit(value).alias("kind"),
            *(
                F.col(name) if name in have else F.lit(None).cast(ddl).alias(name)
                for name, ddl in input_types[1:]
            ),
        )

    input_types = [tuple(c.split(" ", 1)) for c in INPUT_SCHEMA.split(", ")]

    # a trim naming packet ids as one event per id (pipeline/accounting.py: why)
    # (an event with an empty list stays one event: explode([]) would drop it)
    by_pids = (F.col("ev") == "trimmed") & (F.size(F.col("pids")) > 0)
    each_pid = F.explode(F.when(by_pids, F.col("pids")).otherwise(F.array(F.col("pid"))))
    events = evs.where(F.col("ev").isin(*READ_EVENTS)).withColumn("pid", each_pid)
    inputs = kind(RECORD, recs).unionByName(kind(EVENT, events)).unionByName(kind(REF, refs))
    # at most ~ROWS_PER_TASK rows per task (a task holds its clients' rows in Python),
    # in rounds that keep every core busy (5 tasks on 2 cores: the last round on one)
    cores = spark.sparkContext.defaultParallelism
    tasks = cores * max(2, -(-rows // (ROWS_PER_TASK * cores)))
    return inputs.repartition(tasks, "cid")


def audit_frames(
    spark: SparkSession,
    recs: DataFrame,
    evs: DataFrame,
    refs: DataFrame,
    epoch: int,
    now: float,
    grace: float,
) -> DataFrame:
    """The messages (pipeline/accounting.py MESSAGE_SCHEMA) of decoded records,
    decoded events and Redis refs (read at ``now``, after the records and
    before the events, all three cached: they are counted to size the tasks),
    as a cached DataFrame: the stream's form (the batch audit writes its
    messages as it accounts for them, :func:`account_into`)."""
    from pipeline.accounting import MESSAGE_SCHEMA, account_batches

    rows = recs.count() + evs.count() + refs.count()
    return (
        _accounting_input(spark, recs, evs, refs, rows)
        .mapInArrow(lambda batches: account_batches(batches, epoch, now, grace), MESSAGE_SCHEMA)
        .cache()
    )


# clients.parquet: status counts per client
CLIENT_SCHEMA = ", ".join(["cid string", *(f"{name} long" for name in CLIENT_COLUMNS)])
# what an accounting task returns: one row, its tally (pipeline/tally.py, JSON) and
# what it took in (pipeline/accounting.py TAKEN_IN)
_TASK_SCHEMA = ", ".join(["tally binary", *(f"{name} long" for name in TAKEN_IN)])


def _written(target: str, messages: Iterable[Any]) -> Tally:
    """Write a Spark task's message batches (MESSAGE_SCHEMA) into ``target`` as one
    Parquet file, named by the task's partition, and return their tally."""
    import os

    import pyarrow.parquet as pq
    from pyspark import TaskContext

    from pipeline.accounting import MESSAGE_SCHEMA
    from pipeline.decoding import arrow_schema

    task = TaskContext.get()
    assert task is not None
    name = f"part-{task.partitionId():05d}.parquet"
    # one partial file per attempt: two attempts of a task never write one file
    partial = os.path.join(target, f".{name}.{task.taskAttemptId()}.partial")
    mine = Tally()
    with pq.ParquetWriter(partial, arrow_schema(MESSAGE_SCHEMA)) as writer:
        for batch in messages:
            writer.write_batch(batch)
            mine.add_messages(batch)
    os.replace(partial, os.path.join(target, name))
    return mine


def account_into(
    spark: SparkSession,
    recs: DataFrame,
    evs: DataFrame,
    refs: DataFrame,
    epoch: int,
    now: float,
    grace: float,
    directory: Path,
    rows: int,
) -> tuple[Tally, dict[str, int]]:
    """As :func:`audit_frames`, the messages written to ``directory`` as Parquet by
    the tasks that account for them (one file per partition, by pyarrow); returns
    what the tasks tallied of them (pipeline/tally.py: counts per client,
    latency histograms) and what they took in (pipeline/accounting.py
    ``TAKEN_IN``). ``rows``: about how many rows the three inputs have (the
    tasks' size).

    The summary needs no Spark job over the messages after this one (but the
    listing of lost ones, when there are): each task tallies the messages it
    writes and returns its tally in the row of its result (exact once per task,
    unlike an accumulator: a task run again would add twice), and the driver
    adds them up. ``evs`` is read once, by this job,
    so it need not be cached: its rows and the events the broker dropped are
    counted by the tasks too.

    Handed back to Spark, the messages cost more than their accounting: Arrow
    to rows, rows to the cache, the cache to Spark's Parquet writer
    (BENCHMARKS.md "The audit: messages written and tallied by the tasks"). A file is named
    by its partition and renamed into place whole, so a task run again writes
    the same file again and a reader never sees half of one (Spark skips names
    starting with a dot). Like Spark's own writer, the tasks need ``directory``
    on a file system every worker shares (and the driver: it lists the lost
    messages from there).
    """
    from pipeline.accounting import account_batches

    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    target = str(directory)

    def account(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        from pipeline.decoding import arrow_schema

        taken: dict[str, int] = {}
        mine = _written(target, account_batches(batches, epoch, now, grace, taken))
        row = (mine.to_json(), *(taken[n] for n in TAKEN_IN))
        yield pa.RecordBatch.from_struct_array(
            pa.array([row], pa.struct(list(arrow_schema(_TASK_SCHEMA))))
        )

    inputs = _accounting_input(spark, recs, evs, refs, rows)
    tally, taken = Tally(), dict.fromkeys(TAKEN_IN, 0)
    for row in inputs.mapInArrow(account, _TASK_SCHEMA).toArrow().to_pylist():
        tally = tally.merged(Tally.from_json(row["tally"]))
        for name in TAKEN_IN:
            taken[name] += row[name]
    return tally, taken


# ---------------------------------------------------------------------------
# Co-partitioned topics: a Kafka partition accounted for by one task
# ---------------------------------------------------------------------------

# rows (records, and the events' as _event_rows estimates them) of one partition at
# most for one task: it holds them in Python, twice as many as a shuffle's task
# (ROWS_PER_TASK) as it holds no other; a larger partition goes through the shuffle
PARTITION_ROWS = 2 * ROWS_PER_TASK


def copartitioned(
    endpoints: Endpoints, persisted_topic: str, events_topic: str, cores: int
) -> list[OffsetRange] | None:
    """The persisted topic's partitions, as ranges to read, when the events topic has
    as many, at least ``cores`` (fewer would leave cores idle), and none holds
    over :data:`PARTITION_ROWS`; else None.

    Both topics are keyed by the client (the subscriber, the events' ``cid``)
    with Kafka's default partitioner (persistence/kafka_path.py,
    persistence/events.py), so at one partition count a client's records and
    events are in partitions of one number. Each task of :func:`account_by_partition`
    then reads them side by side and nothing is shuffled. Whether every row
    really is in its client's partition is checked by the tasks (a topic
    could have been made at another count, or grown): see there."""
    from pipeline.kafka_source import OffsetRange, latest_offsets

    security = endpoints.kafka_security
    try:
        bounds = latest_offsets(endpoints.bootstrap, persisted_topic, security)
        events = latest_offsets(endpoints.bootstrap, events_topic, security)
    except ValueError:  # a topic missing: the shuffle's reads say so
        return None
    if set(bounds) != set(events) or set(bounds) != set(range(len(bounds))):
        return None
    if len(bounds) < cores:
        return None
    for p, (low, high) in bounds.items():
        event_records = events[p][1] - events[p][0]
        if high - low + EVENT_ROWS_PER_RECORD * event_records > PARTITION_ROWS:
            return None
    return [
        OffsetRange(endpoints.bootstrap, persisted_topic, p, low, high, security)
        for p, (low, high) in sorted(bounds.items())
    ]


def _account_partition(
    endpoints: Endpoints,
    events_topic: str,
    part: OffsetRange,
    count: int,
    window: Window,
    grace: float,
    target: str,
) -> dict[str, Any]:
    """One Kafka partition's records, its clients' refs and the partition's events,
    read in the audit's order (records, Redis, events: the module's docstring)
    and accounted for in this task; its messages written into ``target``
    (:func:`_written`). Returns the tally, what was taken in (TAKEN_IN), the
    topic's epoch and the time Redis was read; or, as soon as a client is found
    outside the partition of its key at ``count`` partitions, or the events
    topic has no such partition any more, ``{"placed": False}`` (then the topics
    are not co-partitioned: the driver audits with the shuffle)."""
    import pyarrow.compute as pc

    from persistence.format import partition_of
    from pipeline.accounting import EVENT, RECORD, REF, account_batches, input_table
    from pipeline.common import arrow_in_window
    from pipeline.kafka_source import OffsetRange, latest_offsets, read_decoded

    home: set[str] = set()
    elsewhere = {"placed": False}

    def placed(cids: Any) -> bool:
        for cid in pc.unique(cids).to_pylist():
            if cid not in home:
                # a gap (the events the broker dropped) has no client: any partition
                if cid is None or (cid != "" and partition_of(cid, count) != part.partition):
                    return False
                home.add(cid)
        return True

    tables = []
    for batch in read_decoded(part, "records"):
        table = input_table(RECORD, arrow_in_window(batch, "pub", window))
        if not placed(table.column("cid")):
            return elsewhere
        tables.append(table)
    # Redis after the records (the epoch too: the topic's, as they were read)
    epoch = read_epoch(endpoints, part.topic)
    now = time.time()
    for refs in refs_table(stored_refs(endpoints, ((cid,) for cid in home))).to_batches():
        tables.append(input_table(REF, refs))
    # the events' end found now, after Redis was read
    bounds = latest_offsets(
        endpoints.bootstrap, events_topic, endpoints.kafka_security, part.partition
    )
    if part.partition not in bounds:  # made again at another count since copartitioned()
        return elsewhere
    low, high = bounds[part.partition]
    events = OffsetRange(
        endpoints.bootstrap, events_topic, part.partition, low, high, endpoints.kafka_security
    )
    for batch in read_decoded(events, "folded"):
        table = input_table(EVENT, batch)
        if not placed(table.column("cid")):
            return elsewhere
        tables.append(table)
    taken: dict[str, int] = {}
    batches = (b for table in tables for b in table.to_batches())
    tally = _written(target, account_batches(batches, epoch, now, grace, taken))
    return {"placed": True, "tally": tally.to_json(), "taken": taken, "epoch": epoch, "now": now}


def account_by_partition(
    spark: SparkSession,
    endpoints: Endpoints,
    parts: list[OffsetRange],
    events_topic: str,
    window: Window,
    grace: float,
    directory: Path,
) -> tuple[Tally, dict[str, int], int, float] | None:
    """As :func:`account_into`, for co-partitioned topics (:func:`copartitioned`):
    one Spark task per Kafka partition reads its records, refs and events and
    accounts for them (:func:`_account_partition`), and no row goes through
    Spark's JVM: the shuffle path's records cache, event shuffle and the Arrow
    exchange with the accounting's Python cost more than the accounting itself
    (BENCHMARKS.md "The audit, a Kafka partition per task"). Returns the tally,
    what was taken in, the topic's epoch and when Redis was first read; None
    when a task found a client outside its key's partition (the topics are not
    co-partitioned) or the topic's epoch changed between tasks (it was made
    again during the audit)."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    target, count = str(directory), len(parts)

    def task(plans: Iterable[OffsetRange]) -> Iterator[dict[str, Any]]:
        for part in plans:
            yield _account_partition(endpoints, events_topic, part, count, window, grace, target)

    results = spark.sparkContext.parallelize(parts, count).mapPartitions(task).collect()
    if not all(r["placed"] for r in results):
        log.warning(
            "clients of %s or %s are not in the partition of their key: "
            "accounted for with a shuffle by client",
            parts[0].topic,
            events_topic,
        )
        return None
    epochs = {r["epoch"] for r in results}
    if len(epochs) > 1:
        log.warning(
            "%s was made again during the audit (epochs %s): accounted for with a shuffle",
            parts[0].topic,
            sorted(epochs),
        )
        return None
    tally, taken = Tally(), dict.fromkeys(TAKEN_IN, 0)
    for row in results:
        tally = tally.merged(Tally.from_json(row["tally"]))
        for name in TAKEN_IN:
            taken[name] += row["taken"][name]
    return tally, taken, epochs.pop(), min(r["now"] for r in results)


def _event_rows(
    endpoints: Endpoints, topic: str, raw_events: Callable[[], DataFrame] | None
) -> int:
    """About how many rows the events will be, at most (to size the accounting's
    tasks: it reads them once, uncounted): :data:`EVENT_ROWS_PER_RECORD` per
    record of ``topic`` (its offsets), none when the events are given."""
    from pipeline.kafka_source import latest_offsets

    if raw_events is not None:
        return 0
    bounds = latest_offsets(endpoints.bootstrap, topic, endpoints.kafka_security)
    return EVENT_ROWS_PER_RECORD * sum(high - low for low, high in bounds.values())


def lost_messages(messages: DataFrame) -> list[dict[str, Any]]:
    """The first :data:`LOST_LISTED` lost messages (audit.json's ``lost_messages``)."""
    from pyspark.sql import functions as F

    return [
        {k: row[k] for k in ("cid", "pid", "sc", "part", "off", "topic", "pub", "reason")}
        for row in messages.where(F.col("status") == "lost")
        .orderBy("cid", "part", "off")
        .limit(LOST_LISTED)
        .collect()
    ]


def run_audit(
    spark: SparkSession,
    endpoints: Endpoints,
    *,
    persisted_topic: str,
    events_topic: str,
    window: Window,
    source: str = "python",
    grace: float = 30.0,
    raw_records: DataFrame | None = None,
    raw_events: Callable[[], DataFrame] | None = None,
    progress: Progress | None = None,
    messages_dir: Path | None = None,
) -> AuditResult:
    """The audit over the topics (or over raw Kafka rows given, e.g. by the stream:
    ``raw_events`` is called after Redis is read); with ``progress``, what it
    reads and does is said on the way. Its messages are written to
    ``messages_dir`` (Parquet), else to a directory of its own, removed by
    :meth:`AuditResult.release` or when the result is collected."""
    import pyarrow as pa

    from pipeline.accounting import MESSAGE_SCHEMA
    from pipeline.decoding import arrow_schema

    progress = progress or Progress.silent()
    scratch = None
    if messages_dir is None:
        scratch = tempfile.TemporaryDirectory(prefix="devicemq-audit-")
        messages_dir = Path(scratch.name) / "messages.parquet"
    cached: list[DataFrame] = []
    done = None
    parts = None
    if source == "python" and raw_records is None and raw_events is None:
        cores = spark.sparkContext.defaultParallelism
        parts = copartitioned(endpoints, persisted_topic, events_topic, cores)
    if parts is not None:
        progress.say(
            f"reading {persisted_topic}, Redis and {events_topic}: "
            f"a task per partition ({len(parts)}) ..."
        )
        done = account_by_partition(
            spark, endpoints, parts, events_topic, window, grace, messages_dir
        )
        if done is not None:
            progress.say(f"read {persisted_topic}: {done[1]['records']:,} records")
            progress.say(f"read Redis: {done[1]['refs']:,} stored messages of the records' clients")
    if done is None:
        done, cached = _audit_by_shuffle(
            spark,
            endpoints,
            persisted_topic,
            events_topic,
            window,
            source,
            grace,
            raw_records,
            raw_events,
            progress,
            messages_dir,
        )
    tally, taken, epoch, now = done
    progress.say(
        f"read {events_topic}: {taken['events']:,} rows of the events the audit reads "
        "(a message's events folded into one)"
    )
    # its files named: Spark warns of a directory whose name starts with a dot (the
    # command's, beside the last audit's outputs) that it ignores it, and reads it
    files = sorted(str(f) for f in messages_dir.glob("part-*.parquet"))
    messages = spark.read.schema(MESSAGE_SCHEMA).parquet(*(files or [str(messages_dir)]))
    lost = lost_messages(messages) if any(c["lost"] for c in tally.clients.values()) else []
    summary = summarize(tally, lost, taken["gaps"], now)
    progress.say(f"accounted for: {summary['totals']}")
    summary["window"] = {"since": window.since, "until": window.until}
    summary["topics"] = {"persisted": persisted_topic, "events": events_topic, "epoch": epoch}
    summary["not_accounted"] = not_accounted(endpoints)
    progress.say(summary["not_accounted"]["text"])
    clients = pa.Table.from_pylist(tally.client_rows(), schema=arrow_schema(CLIENT_SCHEMA))
    return AuditResult(
        summary,
        messages,
        clients,
        latency_sample(tally),
        cached=cached,
        messages_dir=messages_dir,
        scratch=scratch,
    )


NOT_ACCOUNTED = (
    "APPLICATION sessions are not accounted for: their messages are in topics of their "
    "own ({prefix}*), not in the persisted topic, and their deliveries write no delivery "
    "events; their lag is in /metrics, $SYS and the admin API "
    "(docs/application-sessions.md)"
)


def not_accounted(endpoints: Endpoints) -> dict[str, Any]:
    """What the audit leaves out: APPLICATION sessions, and how many topics of theirs
    Kafka lists now (None: it could not be asked)."""
    from persistence.format import APP_TOPIC_PREFIX

    try:
        topics = asyncio.run(asyncio.wait_for(_app_topics(endpoints), 10.0))
    except Exception as error:  # the audit's own result stands; the count is unknown
        log.warning("listing the APPLICATION sessions' topics failed: %s", error)
        count = None
    else:
        count = len(topics)
    text = NOT_ACCOUNTED.format(prefix=APP_TOPIC_PREFIX)
    if count is not None:
        text = f"{text}; Kafka lists {count} such topic(s)"
    return {"application_session_topics": count, "text": text}


async def _app_topics(endpoints: Endpoints) -> list[str]:
    from aiokafka import AIOKafkaConsumer

    from persistence.format import APP_TOPIC_PREFIX

    consumer = AIOKafkaConsumer(
        bootstrap_servers=endpoints.bootstrap, **endpoints.kafka_security.aiokafka()
    )
    await consumer.start()
    try:
        return sorted(t for t in await consumer.topics() if t.startswith(APP_TOPIC_PREFIX))
    finally:
        await consumer.stop()


def _audit_by_shuffle(
    spark: SparkSession,
    endpoints: Endpoints,
    persisted_topic: str,
    events_topic: str,
    window: Window,
    source: str,
    grace: float,
    raw_records: DataFrame | None,
    raw_events: Callable[[], DataFrame] | None,
    progress: Progress,
    messages_dir: Path,
) -> tuple[tuple[Tally, dict[str, int], int, float], list[DataFrame]]:
    """The audit's reads and accounting with one shuffle by client (:func:`account_into`),
    for topics that are not co-partitioned or rows given: what
    :func:`account_by_partition` returns, and the frames cached (records, refs)."""
    from pipeline.common import _in_window, events, records

    if raw_records is None:
        recs = records(spark, endpoints, persisted_topic, window, source)
    else:
        recs = _in_window(decode_records(raw_records), "pub", window)
    recs = recs.cache()
    read = progress.read(persisted_topic, recs)
    # Redis after the records and before the events (the module's docstring: why)
    now = time.time()
    epoch = read_epoch(endpoints, persisted_topic)
    refs = redis_refs(spark, endpoints, recs.select("cid").distinct()).cache()
    stored = refs.count()
    progress.say(f"read Redis: {stored:,} stored messages of the records' clients")
    if raw_events is None:
        evs = events(spark, endpoints, events_topic, source, folded=True)
    else:
        evs = decode_events(raw_events())
    # read once, as the accounting takes them in (account_into: not cached)
    evs = evs.drop(*UNREAD_EVENT_FIELDS)
    progress.say(f"reading {events_topic} and accounting for every record ...")
    rows = read + stored + max(read, _event_rows(endpoints, events_topic, raw_events))
    tally, taken = account_into(spark, recs, evs, refs, epoch, now, grace, messages_dir, rows)
    return (tally, taken, epoch, now), [recs, refs]


def write_outputs(result: AuditResult, out: Path, *, tables: bool = True) -> Path:
    """Parquet tables, audit.json and audit.html under ``out``; returns audit.json's path."""
    out.mkdir(parents=True, exist_ok=True)
    # the report is drawn here while Spark writes the tables: one waits on the other otherwise
    with ThreadPoolExecutor(1) as drawing:
        html = drawing.submit(_html, result, out / "audit.html")
        if tables:
            _write_tables(result, out)
        html.result()
    path = out / "audit.json"
    tmp = out / "audit.json.tmp"
    tmp.write_text(json.dumps(result.summary, indent=2, default=str))
    tmp.replace(path)  # readers never see half a summary
    return path


def _write_tables(result: AuditResult, out: Path) -> None:
    """messages.parquet (moved from beside it, else copied, unless the audit wrote it
    there) and clients.parquet, each a directory as Spark writes them."""
    import pyarrow.parquet as pq

    messages = out / "messages.parquet"
    written = result.messages_dir
    if written is not None and written.resolve() != messages.resolve():
        shutil.rmtree(messages, ignore_errors=True)
        if written.parent.resolve() == out.resolve():  # the audit's, beside: moved in whole
            written.rename(messages)
            result.messages_dir = messages
            result.messages = result.messages.sparkSession.read.parquet(str(messages))
        else:
            shutil.copytree(written, messages)
    clients = out / "clients.parquet"
    shutil.rmtree(clients, ignore_errors=True)
    clients.mkdir()
    pq.write_table(result.clients, clients / "part-00000.parquet")


def _html(result: AuditResult, path: Path) -> None:
    from pipeline.report import Report, figure

    s = result.summary
    totals = s["totals"]
    report = Report("devicemq delivery audit")
    report.paragraph(
        f"Generated {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(s['generated_at']))}; "
        f"topics {s['topics']['persisted']} (epoch {s['topics']['epoch']}) and "
        f"{s['topics']['events']}."
    )
    if totals["lost"]:
        report.paragraph(f"{totals['lost']} message(s) LOST: see the table below.", warn=True)
    else:
        report.paragraph("No message lost: every persisted message is accounted for.")
    if s["events_dropped"]:
        report.paragraph(
            f"{s['events_dropped']} delivery events were dropped by the broker (Kafka too "
            "slow): statuses may be wrong for some messages.",
            warn=True,
        )
    if "not_accounted" in s:
        report.paragraph(s["not_accounted"]["text"] + ".")
    report.heading("Totals")
    report.table(["status", "messages"], list(totals.items()))
    fig, ax = figure()
    names = [k for k in STATUSES if totals[k]]
    ax.bar(names, [totals[k] for k in names], color="#4c72b0")
    ax.set_ylabel("messages")
    report.figure(fig, "Persisted messages by status")
    report.heading("End-to-end latency (seconds after publish)")
    lat = s["latency_seconds"]
    rows = [
        ("delivery", "delivery, all"),
        ("delivery_live", "delivery, client connected"),
        ("delivery_replay", "delivery, replayed"),
        ("ack", "acknowledgement"),
    ]
    report.table(
        ["", "p50", "p90", "p99", "max"],
        [[name, *(lat[k][p] for p in PERCENTILE_NAMES)] for k, name in rows if k in lat],
    )
    report.paragraph(
        "Connected: the client was connected as the message was published, so its "
        "latency is the persistent path's own. Replayed: it was not, and the message "
        "waited in its backlog until it came back; that latency is mostly its absence."
    )
    for live, caption, color in (
        (True, "Publish to first delivery, clients connected", "#55a868"),
        (False, "Publish to first delivery, replayed from the backlog", "#c44e52"),
    ):
        delivery = [d for d, _a, on in result.latencies if d is not None and on is live]
        if delivery:
            fig, ax = figure()
            ax.hist([d * 1000 for d in delivery], bins=50, color=color)
            ax.set_xlabel("first delivery latency (ms)")
            ax.set_ylabel("messages")
            report.figure(fig, caption)
    report.heading("Per client")
    cols = ["cid", "persisted", *STATUSES, "duplicates"]
    report.table(cols, [[c.get(k) for k in cols] for c in s["clients"]])
    if s["lost_messages"]:
        report.heading("Lost messages")
        lost_cols = ["cid", "pid", "sc", "part", "off", "topic", "reason"]
        report.table(lost_cols, [[m[k] for k in lost_cols] for m in s["lost_messages"]])
    report.write(path)
