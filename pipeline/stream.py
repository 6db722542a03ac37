"""``devicemq pipeline audit --stream``: the audit kept current, incrementally.

Ingestion is Structured Streaming: one query per topic, whose ``foreachBatch``
writes each micro-batch's raw Kafka rows into a directory of its own
(``OUT/stream/records/<batch id>``, likewise ``events``). An update reads only
the directories written since the last one, and deletes them once done.

An update runs :func:`pipeline.audit.audit_frames` (the batch audit's own
reconciliation, unchanged) over the NEW records plus the records still OPEN,
and over the NEW events plus the events KEPT for what is still open. A record
whose status is final (acked, expired, dropped, trimmed, purged, compacted,
discarded, duplicate) is counted into running per-client totals and latency
histograms and never looked at again; an open one (pending, in_flight, lost)
is written to ``OUT/stream/state`` with the events it can still need:

- the events naming its Kafka record (``part``, ``off``: its ``persisted``
  event gives its score, packet id, stored time and expiry), and those naming
  a record not read yet (a ``persisted`` event can reach the events' stream
  before its record reaches the records' one: the events are read last),
  unless it names a partition the records' topic does not have (an hour's run
  kept 29,016 ``persisted`` events of the current epoch naming partitions its
  re-created topic did not have, update after update; the batch audit
  ignores them too);
- the events naming its stored message (``cid``, ``sc``): its deliveries
  (their count and first time), and whatever else comes later;
- per (cid, packet id) of a kept ``persisted`` event, the last ``persisted``
  event of that id: a trim names packet ids, and resolves to the last message
  stored under that id before the trim, which may be a final one with the id
  of an open one. New trims are resolved here, against the kept and the new
  ``persisted`` events, into ``trimmed`` events naming the score (what
  ``audit_frames`` makes of them): resolved once, a trim never needs the
  older events again. An id no open message has is not kept: a trim naming
  it can only fall on a message whose status is final already;
- per client the last ``session_expired``/``session_ended`` event (only
  the latest end time is compared with a stored time);
- per client the connection events (``connected``/``disconnected``) from
  :data:`CONNECTION_HORIZON` seconds back or from the oldest open record's
  publish time, whichever is earlier, and the last one before that: the
  accounting (pipeline/accounting.py) looks for the last change before a
  publish time. A record that
  reaches Kafka more than that after its publish may get the wrong live
  flag (only the split of delivery latencies, never a status).

That is every input ``audit_frames`` reads for a record, so an open record
gets the status the batch audit would give it. A final one's is not looked at
again: an event that comes after it (an acknowledgement racing a trim, a
trim racing a purge) changes it no more, where the batch audit's order of
statuses could. Two statuses are decided without an event saying so (a stored
message gone from Redis after its expiry, or after its session ended): such a
record stays open while it was stored less than ``--grace`` ago, as its
acknowledgement's event may still come (an acknowledgement wins in the batch
audit).

The work of an update thus depends on what arrived since the last one and on
what is open, and so does the state, except what grows with the clients (a
session end and a few connection events each). Latency percentiles come from
log-bucket histograms (pipeline/tally.py) merged in the driver.

A new process, or a new topic epoch (the embedded Kafka's topic created
anew), starts over from the topics' earliest offsets: the running totals live
in this process only.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.audit import (
    STATUSES,
    AuditResult,
    audit_frames,
    lost_messages,
    stored_refs,
    write_outputs,
)
from pipeline.common import (
    EVENT_SCHEMA,
    Endpoints,
    Window,
    _in_window,
    decode_events,
    decode_records,
    read_epoch,
)
from pipeline.tally import LogHistogram, Tally, latency_sample, summarize

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["FINAL", "OPEN", "IncrementalAudit", "stream_audit"]

log = logging.getLogger("devicemq.pipeline.stream")

FINAL = ("acked", "expired", "dropped", "trimmed", "purged", "compacted", "discarded", "duplicate")
OPEN = ("pending", "in_flight", "lost")
CONNECTION_HORIZON = 600.0  # seconds of connection events kept (see the module docstring)
EVENT_COLUMNS = [c.split(" ", 1)[0] for c in EVENT_SCHEMA.split(", ")] + ["epart", "eoff", "idx"]
# Spark settings for a process that runs the stream (read as the JVM starts:
# pipeline/cli.py gives them to make_spark). Idle Python workers are not
# pooled past two per kind (each ~100-130 MB: a trial run held 14 of them), the
# status store keeps fewer finished jobs and queries (it keeps 1,000 of each
# by default: thousands of small jobs an hour), and the cleaner's GC, which
# lets Spark drop the shuffle and cache blocks of finished updates, runs every
# 2 minutes instead of 30.
SPARK_CONF = {
    "spark.driver.memory": "1g",
    "spark.python.factory.idleWorkerMaxPoolSize": "2",
    "spark.ui.retainedJobs": "100",
    "spark.ui.retainedStages": "100",
    "spark.ui.retainedTasks": "2000",
    "spark.sql.ui.retainedExecutions": "50",
    "spark.cleaner.periodicGC.interval": "2min",
}


class IncrementalAudit:
    """The state of a stream's audit between updates (one topic epoch): the
    running totals of final records in the driver, the open records and the
    events kept for them in Parquet under ``state`` (one generation per update,
    the one before deleted: no lineage grows from one update to the next)."""

    def __init__(self, spark: SparkSession, endpoints: Endpoints, state: Path, epoch: int):
        self.spark = spark
        self.endpoints = endpoints
        self.state = state
        self.epoch = epoch
        self.final = Tally()
        self.gaps = 0
        self.high: dict[int, int] = {}  # records' partition -> highest offset read
        self.generation = 0
        self.open_records = 0
        self.kept_events = 0
        self.phases: dict[str, float] = {}  # seconds of the last update's steps
        self._oldest_open: float | None = None  # publish time of the oldest open record
        self._open_cids: set[str] = set()  # clients of the open records
        # the records' topic's partitions, as the stream last saw them (None: any)
        self.partitions: set[int] | None = None
        shutil.rmtree(state, ignore_errors=True)
        state.mkdir(parents=True)

    def _generation(self, n: int) -> Path:
        return self.state / f"gen-{n:08d}"

    def _kept(self, name: str, schema: str) -> DataFrame:
        path = self._generation(self.generation) / name
        if self.generation == 0 or not path.exists():
            return self.spark.createDataFrame([], schema)
        return self.spark.read.schema(schema).parquet(str(path))

    def update(
        self,
        new_records: DataFrame,
        new_events: Any,
        *,
        window: Window,
        grace: float,
        persisted_topic: str,
    ) -> tuple[dict[str, Any], list[tuple[float | None, float | None, bool]]] | None:
        """One update: the new raw records (read), Redis, then ``new_events()``
        (raw rows, read only then). None: the topic's epoch changed meanwhile."""
        cached: list[DataFrame] = []  # let go at the end, or when an update fails
        try:
            return self._update(new_records, new_events, window, grace, persisted_topic, cached)
        finally:
            for frame in cached:
                frame.unpersist()

    def _update(
        self,
        new_records: DataFrame,
        new_events: Any,
        window: Window,
        grace: float,
        persisted_topic: str,
        cached: list[DataFrame],
    ) -> tuple[dict[str, Any], list[tuple[float | None, float | None, bool]]] | None:
        from pyspark.sql import functions as F

        spark = self.spark
        recs_schema = (
            "cid string, part int, off bigint, kts double, topic string, size int, "
            "pub double, exp double"
        )
        clock = time.monotonic()
        phases: dict[str, float] = {}

        def phase(name: str) -> None:
            nonlocal clock
            phases[name] = round(time.monotonic() - clock, 3)
            clock = time.monotonic()

        # one job reads and decodes the new records: their highest offsets (also
        # of those outside the window) and clients
        fresh = decode_records(new_records).cache()
        cached.append(fresh)
        cids = set(self._open_cids)
        for row in (
            fresh.groupBy("part")
            .agg(F.max("off").alias("high"), F.collect_set("cid").alias("cids"))
            .collect()
        ):
            self.high[int(row["part"])] = max(self.high.get(int(row["part"]), -1), row["high"])
            cids.update(row["cids"])
        recs = (
            _in_window(fresh, "pub", window).unionByName(self._kept("records", recs_schema)).cache()
        )
        cached.append(recs)
        phase("records")
        # Redis after the records and before the events (pipeline/audit.py: why)
        now = time.time()
        if read_epoch(self.endpoints, persisted_topic) != self.epoch:
            return None
        refs = self._refs(sorted(c for c in cids if c is not None))
        cached.append(refs)
        phase("redis")
        decoded = decode_events(new_events()).cache()
        cached.append(decoded)
        ev = F.col("ev")
        seen = decoded.agg(
            F.sum(F.when(ev == "gap", F.col("n"))).alias("gaps"),
            F.count(F.when((ev == "trimmed") & F.col("pids").isNotNull(), 1)).alias("trims"),
        ).collect()[0]
        self.gaps += int(seen["gaps"] or 0)
        evs = self._events(decoded, trims=bool(seen["trims"])).cache()
        cached.append(evs)
        phase("events")
        messages = audit_frames(spark, recs, evs, refs, self.epoch, now, grace)
        cached.append(messages)
        status, stored = F.col("status"), F.col("stored_ts")
        final = status.isin(*FINAL) & ~(
            status.isin("expired", "discarded") & stored.isNotNull() & (stored > now - grace)
        )
        m = messages.withColumn("final", final)
        tallies = self._tally(m)
        final_now = self.final.merged(tallies[True])
        report = final_now.merged(tallies[False])
        lost = lost_messages(m) if any(c["lost"] for c in tallies[False].clients.values()) else []
        phase("accounting")
        self._keep(recs, evs, m, now)
        self.final = final_now  # counted once the open ones are kept: a failure counts none
        self._open_cids = set(tallies[False].clients)
        phase("keeping")
        self.phases = phases
        return summarize(report, lost, self.gaps, now), latency_sample(report)

    def _refs(self, cids: list[str]) -> DataFrame:
        """What Redis holds of ``cids``, read in the driver: an update's clients
        are few next to its records, and a Python worker's job to read them cost
        more than the reading itself."""
        rows = list(stored_refs(self.endpoints, [(c,) for c in cids]))
        schema = "cid string, sc long, ref_pid int, has_value boolean"
        return self.spark.createDataFrame(rows, schema).cache()

    def _events(self, decoded: DataFrame, *, trims: bool) -> DataFrame:
        """The kept events and the new ones, the new trims resolved to the
        message they name (``trimmed`` with its score; see the module docstring);
        ``trims``: whether there are new trims naming packet ids at all."""
        from pyspark.sql import Window as W
        from pyspark.sql import functions as F

        schema = f"{EVENT_SCHEMA}, epart int, eoff bigint, idx int"
        kept = self._kept("events", schema)
        new = decoded.select(*EVENT_COLUMNS)
        if not trims:
            return kept.unionByName(new)
        ev = F.col("ev")
        by_pids = (ev == "trimmed") & F.col("pids").isNotNull()
        placed = (
            kept.unionByName(new)
            .where(ev == "persisted")
            .select(
                "cid",
                "pid",
                "epart",
                "eoff",
                "idx",
                "sc",
                F.lit(None).cast("double").alias("ts"),
                F.lit(None).cast("string").alias("at"),
                F.lit(False).alias("is_trim"),
            )
        )
        named = new.where(by_pids).select(
            "cid",
            F.explode("pids").alias("pid"),
            "epart",
            "eoff",
            "idx",
            F.lit(None).cast("long").alias("sc"),
            "ts",
            "at",
            F.lit(True).alias("is_trim"),
        )
        before = (
            W.partitionBy("cid", "pid")
            .orderBy("epart", "eoff", "idx")
            .rowsBetween(W.unboundedPreceding, W.currentRow)
        )
        resolved = (
            placed.unionByName(named)
            .withColumn("owner", F.last("sc", ignorenulls=True).over(before))
            .where(F.col("is_trim") & F.col("owner").isNotNull())
            .select(
                F.lit("trimmed").alias("ev"),
                "cid",
                "ts",
                "pid",
                F.col("owner").alias("sc"),
                "at",
                "epart",
                "eoff",
                "idx",
            )
        )
        return kept.unionByName(new.where(~by_pids)).unionByName(resolved, allowMissingColumns=True)

    def _tally(self, m: DataFrame) -> dict[bool, Tally]:
        """Per-client counts and latency histograms of the final and the open records."""
        from pyspark.sql import functions as F

        col = F.col
        delivered = col("delivered_ts").isNotNull()
        rows = (
            m.groupBy("final", "cid")
            .agg(
                F.count("*").alias("persisted"),
                *[F.sum(F.when(col("status") == s, 1).otherwise(0)).alias(s) for s in STATUSES],
                F.sum(F.greatest(col("deliveries") - 1, F.lit(0))).alias("duplicates"),
                F.sum(F.when(col("deliveries") > 1, 1).otherwise(0)).alias("redelivered"),
                F.sum(F.when(col("live") & delivered, 1).otherwise(0)).alias("n_live"),
                F.sum(F.when(~col("live") & delivered, 1).otherwise(0)).alias("n_replay"),
                F.max("delivery_latency").alias("delivery_max"),
                F.max(F.when(col("live"), col("delivery_latency"))).alias("delivery_live_max"),
                F.max(F.when(~col("live"), col("delivery_latency"))).alias("delivery_replay_max"),
                F.max("ack_latency").alias("ack_max"),
                F.min("pub").alias("oldest"),
            )
            .collect()
        )
        tallies = {True: Tally(), False: Tally()}
        self._oldest_open = None
        for row in rows:
            tallies[bool(row["final"])].add_row(row.asDict())
            if not row["final"] and row["oldest"] is not None:
                self._oldest_open = min(self._oldest_open or row["oldest"], row["oldest"])
        split = F.when(col("live"), F.lit("delivery_live")).otherwise(F.lit("delivery_replay"))
        latencies = (
            m.select(
                "final",
                F.explode(
                    F.array(
                        F.struct(F.lit("delivery").alias("k"), col("delivery_latency").alias("v")),
                        F.struct(split.alias("k"), col("delivery_latency").alias("v")),
                        F.struct(F.lit("ack").alias("k"), col("ack_latency").alias("v")),
                    )
                ).alias("x"),
            )
            .where(col("x.v").isNotNull())
            .groupBy(
                "final", col("x.k").alias("k"), LogHistogram.bucket_column(col("x.v")).alias("b")
            )
            .count()
            .collect()
        )
        for row in latencies:
            tallies[bool(row["final"])].hists[row["k"]].add(int(row["b"]), int(row["count"]))
        return tallies

    def _keep(self, recs: DataFrame, evs: DataFrame, m: DataFrame, now: float) -> None:
        """Write the open records and the events they can still need (the module
        docstring: which, and why that is enough) as the next generation."""
        from pyspark.sql import Window as W
        from pyspark.sql import functions as F

        col, ev = F.col, F.col("ev")
        spark = self.spark
        opened = m.where(~col("final"))
        target = self._generation(self.generation + 1)
        open_recs = recs.join(opened.select("part", "off"), ["part", "off"], "left_semi")
        open_recs.write.mode("overwrite").parquet(str(target / "records"))
        cutoff = now - CONNECTION_HORIZON
        if self._oldest_open is not None:
            cutoff = min(cutoff, float(self._oldest_open))
        high = spark.createDataFrame(
            [(p, o) for p, o in self.high.items()] or [(-1, -1)], "part int, high bigint"
        )
        unread_partition = (
            col("part").isin(*sorted(self.partitions))
            if self.partitions is not None
            else F.lit(True)
        )
        # open records are few: their keys go to every task (no shuffle of the events)
        open_keys = opened.select("part", "off").distinct().withColumn("is_open", F.lit(True))
        named = (
            evs.where(col("part").isNotNull() & col("off").isNotNull() & (col("ep") == self.epoch))
            .join(F.broadcast(open_keys), ["part", "off"], "left")
            .join(F.broadcast(high), ["part"], "left")
            .where(
                col("is_open").isNotNull()
                | (col("off") > col("high"))
                | (col("high").isNull() & unread_partition)
            )
            .select(*EVENT_COLUMNS)
        )
        scores = (
            named.where(ev == "persisted")
            .select("cid", "sc")
            .unionByName(opened.select("cid", "sc"))
            .where(col("sc").isNotNull())
            .distinct()
        )
        of_message = evs.where(col("sc").isNotNull()).join(scores, ["cid", "sc"], "left_semi")
        position = [col("epart").desc(), col("eoff").desc(), col("idx").desc()]
        last_placed = (
            evs.where(ev == "persisted")
            .withColumn("n", F.row_number().over(W.partitionBy("cid", "pid").orderBy(*position)))
            .where(col("n") == 1)
            .join(named.where(ev == "persisted").select("cid", "pid"), ["cid", "pid"], "left_semi")
            .select(*EVENT_COLUMNS)
        )
        ended = (
            evs.where(ev.isin("session_expired", "session_ended"))
            .withColumn(
                "n", F.row_number().over(W.partitionBy("cid").orderBy(col("ts").desc(), *position))
            )
            .where(col("n") == 1)
            .select(*EVENT_COLUMNS)
        )
        life = evs.where(ev.isin("connected", "disconnected"))
        recent = life.where(col("ts") >= cutoff)
        before = (
            life.where(col("ts") < cutoff)
            .withColumn(
                "n", F.row_number().over(W.partitionBy("cid").orderBy(col("ts").desc(), *position))
            )
            .where(col("n") == 1)
            .select(*EVENT_COLUMNS)
        )
        kept = (
            named.unionByName(of_message.select(*EVENT_COLUMNS))
            .unionByName(last_placed)
            .unionByName(ended)
            .unionByName(recent.select(*EVENT_COLUMNS))
            .unionByName(before)
            .dropDuplicates(["epart", "eoff", "idx", "ev", "sc", "pid"])
        )
        kept.write.mode("overwrite").parquet(str(target / "events"))
        previous = self._generation(self.generation)
        self.generation += 1
        shutil.rmtree(previous, ignore_errors=True)
        self.open_records = _rows(target / "records")
        self.kept_events = _rows(target / "events")


def _rows(directory: Path) -> int:
    """Rows of the Parquet files under ``directory``, from their footers (no Spark job)."""
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f).metadata.num_rows for f in directory.glob("*.parquet"))


# ---------------------------------------------------------------------------
# Ingestion and the loop
# ---------------------------------------------------------------------------


def _trigger(interval: float) -> float:
    """Seconds between the ingesting queries' micro-batches: a third of the
    update interval, at most 10 s (an update waits for the next micro-batch
    twice, for the records and for the events: at the update's own interval
    that wait was up to two intervals; more often, the micro-batches' own
    cost, a planning and a job each, took a share of the cores)."""
    return max(0.5, min(interval / 3, 10.0))


def _batches(directory: Path) -> list[Path]:
    """The micro-batches written completely (``_SUCCESS``) under ``directory``."""
    if not directory.exists():
        return []
    return sorted(d for d in directory.iterdir() if (d / "_SUCCESS").exists())


def _read(spark: SparkSession, paths: Iterable[Path]) -> DataFrame:
    from pipeline.kafka_source import SCHEMA

    names = [str(p) for p in paths]
    if not names:
        return spark.createDataFrame([], SCHEMA)
    return spark.read.schema(SCHEMA).parquet(*names)


def _sink(directory: Path) -> Any:
    def write(batch: DataFrame, batch_id: int) -> None:
        batch.write.mode("overwrite").parquet(str(directory / f"{batch_id:012d}"))

    return write


class StreamStopped(RuntimeError):
    """An ingesting query stopped (e.g. its topic was emptied under it)."""


class TopicRecreated(RuntimeError):
    """The persisted topic was created anew (a new epoch) while an update waited."""


# The Python process Spark runs a streaming query's Python data source in.
STREAM_RUNNER = "pyspark.sql.streaming.python_streaming_source_runner"


class _Quiet:
    """A Java ``Thread.UncaughtExceptionHandler`` (through the Py4J callback server
    that ``foreachBatch`` runs): an ended monitor thread prints no stack trace."""

    def uncaughtException(self, thread: Any, error: Any) -> None:  # Java names it
        pass

    class Java:
        implements = ["java.lang.Thread$UncaughtExceptionHandler"]


def runner_monitors(spark: SparkSession) -> list[Any]:
    """The JVM threads watching the idle workers of a streaming Python source's runner.

    Spark (4.x) makes a worker factory for each streaming query's Python source
    as the query starts, and the factory starts a thread ("Idle Worker Monitor
    for <python>") that loops forever: the query's stop stops the factory's
    worker and leaves the thread. The stream starts its queries again at each
    new epoch (every few minutes on the embedded Kafka, whose topic is emptied):
    the JVM's threads grew by two each time (BENCHMARKS.md, "`--stream` for an
    hour, again"). The factory is found by reflection (Scala's ``$outer``)."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    found = []
    for thread in jvm.java.lang.Thread.getAllStackTraces().keySet().toArray():
        if not str(thread.getName()).startswith("Idle Worker Monitor for "):
            continue
        try:
            outer = thread.getClass().getDeclaredField("$outer")
            outer.setAccessible(True)
            factory = outer.get(thread)
            module = factory.getClass().getDeclaredField("workerModule")
            module.setAccessible(True)
            if module.get(factory) == STREAM_RUNNER:
                found.append(thread)
        except Exception as error:  # another Spark's insides: that thread is left alone
            log.debug("cannot tell what a python worker monitor watches: %s", error)
    return found


def end_runner_monitors(spark: SparkSession) -> int:
    """End every streaming source runner's monitor thread while no streaming query
    of the session runs (each is then a stopped query's). It sleeps between its
    looks: interrupted, it ends. Returns how many were ended; never raises (a
    thread left is a leak, not a reason to stop the stream)."""
    from pyspark.java_gateway import ensure_callback_server_started

    try:
        if spark.streams.active:
            return 0
        threads = runner_monitors(spark)
        if threads:
            ensure_callback_server_started(spark.sparkContext._gateway)  # type: ignore[no-untyped-call]
        quiet = _Quiet()
        for thread in threads:
            thread.setUncaughtExceptionHandler(quiet)
            thread.interrupt()
        return len(threads)
    except Exception as error:  # the JVM gone, say: what stopped the stream says why
        log.warning("ending the stopped queries' monitor threads failed: %s", error)
        return 0


RESTARTS = 3  # times in a row a stopped query is restarted before the stream gives up
EPOCH_LOOK = 1.0  # seconds between two looks at the epoch while catching up


def _catch_up(
    query: Any,
    endpoints: Endpoints,
    topic: str,
    recreated: Callable[[], bool] = lambda: False,
) -> dict[int, tuple[int, int]]:
    """Wait until ``query`` has written every record ``topic`` held when called;
    returns what it held (partition -> (low, high)).

    Not ``processAllAvailable``: that waits until no new record comes, which
    under load never happens. Raises :class:`TopicRecreated` once ``recreated``
    says so: the ends it waits for were the old topic's, which the new one's
    offsets may never reach (an hour's run stalled so at the first emptying of
    the embedded topic that came during a wait)."""
    from pipeline.kafka_source import latest_offsets

    bounds = latest_offsets(endpoints.bootstrap, topic, endpoints.kafka_security)
    looked = time.monotonic()
    while True:
        error = query.exception()
        if error is not None or not query.isActive:
            raise StreamStopped(f"the stream of {topic} stopped: {error}")
        done = _offsets_written(query.lastProgress)
        if all(high <= low or done.get(p, -1) >= high for p, (low, high) in bounds.items()):
            return bounds
        if time.monotonic() - looked >= EPOCH_LOOK:
            looked = time.monotonic()
            if recreated():
                raise TopicRecreated(f"{topic}: the persisted topic was created anew")
        time.sleep(0.1)


def _offsets_written(progress: Any) -> dict[int, int]:
    """partition -> next offset, from a streaming query's last progress (None: none yet)."""
    if not progress or not progress.get("sources"):
        return {}
    end = progress["sources"][0].get("endOffset")
    if isinstance(end, str):
        end = json.loads(end)
    return {int(p): int(o) for p, o in (end or {}).items()}


def stream_audit(
    spark: SparkSession,
    endpoints: Endpoints,
    *,
    persisted_topic: str,
    events_topic: str,
    window: Window,
    out: Path,
    interval: float,
    max_iterations: int | None,
    grace: float = 30.0,
    on_summary: Any = None,
) -> dict[str, Any]:
    """Ingest both topics with Structured Streaming into per-batch Parquet under
    ``out/stream``; every ``interval`` seconds account for what is new and still
    open (:class:`IncrementalAudit`) and rewrite audit.json/html.

    Each update waits until the records' stream has taken in what Kafka held as
    it began (:func:`_catch_up`), reads Redis, then waits for the events' stream
    likewise: the order of the batch audit. A query that stopped is started
    again from its checkpoint (its failed micro-batch is read again), or, when
    the topic's epoch changed, everything starts over. Stops after
    ``max_iterations`` (None: runs until killed)."""
    from pipeline.kafka_source import FORMAT, register

    register(spark)
    base = out / "stream"
    queries: list[Any] = []

    def launch() -> None:
        """Both queries, from their checkpoints (none yet: the earliest offsets)."""
        for query in queries:
            query.stop()
        queries.clear()
        end_runner_monitors(spark)
        for name, topic in (("records", persisted_topic), ("events", events_topic)):
            stream = (
                spark.readStream.format(FORMAT)
                .option("bootstrap", endpoints.bootstrap)
                .option("topic", topic)
                .option("startingOffsets", "earliest")
                .options(**endpoints.kafka_security.as_options())
                .load()
            )
            queries.append(
                stream.writeStream.foreachBatch(_sink(base / name))
                .option("checkpointLocation", str(base / f"{name}.checkpoint"))
                .trigger(processingTime=f"{_trigger(interval)} seconds")
                .start()
            )

    def start(epoch: int) -> IncrementalAudit:
        """Both queries from the topics' earliest offsets, and a new state."""
        for query in queries:
            query.stop()
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        launch()
        return IncrementalAudit(spark, endpoints, base / "state", epoch)

    epoch = read_epoch(endpoints, persisted_topic)
    audit = start(epoch)
    summary: dict[str, Any] = {}
    iteration = 0
    stopped = 0
    try:
        while max_iterations is None or iteration < max_iterations:
            started = time.monotonic()
            now_epoch = read_epoch(endpoints, persisted_topic)
            if now_epoch != epoch:
                epoch = now_epoch
                audit = start(epoch)
            record_batches: list[Path] = []
            event_batches: list[Path] = []

            def recreated(epoch: int = epoch) -> bool:
                return read_epoch(endpoints, persisted_topic) != epoch

            def new_events(batches: list[Path] = event_batches) -> DataFrame:
                _catch_up(queries[1], endpoints, events_topic, recreated)  # after Redis
                batches.extend(_batches(base / "events"))
                return _read(spark, batches)

            try:
                audit.partitions = set(_catch_up(queries[0], endpoints, persisted_topic, recreated))
                record_batches.extend(_batches(base / "records"))
                done = audit.update(
                    _read(spark, record_batches),
                    new_events,
                    window=window,
                    grace=grace,
                    persisted_topic=persisted_topic,
                )
            except TopicRecreated:
                continue  # the loop starts over with the new epoch
            except StreamStopped as error:
                stopped += 1
                if stopped > RESTARTS:
                    raise
                log.warning("%s: starting it again", error)
                if read_epoch(endpoints, persisted_topic) == epoch:
                    launch()  # else the loop starts over with the new epoch
                continue
            stopped = 0
            if done is None:
                continue  # the topic was created anew while it was read: start over
            for batch in (*record_batches, *event_batches):
                shutil.rmtree(batch, ignore_errors=True)
            summary, sample = done
            iteration += 1
            summary["window"] = {"since": window.since, "until": window.until}
            summary["topics"] = {
                "persisted": persisted_topic,
                "events": events_topic,
                "epoch": epoch,
            }
            summary["stream"] = {
                "iteration": iteration,
                "interval": interval,
                "seconds": round(time.monotonic() - started, 3),
                "new_record_batches": len(record_batches),
                "new_event_batches": len(event_batches),
                "open_records": audit.open_records,
                "kept_events": audit.kept_events,
                "phases": audit.phases,
            }
            write_outputs(AuditResult(summary, None, None, sample), out, tables=False)  # type: ignore[arg-type]
            if on_summary is not None:
                on_summary(summary)
            log.info(
                "audit iteration %d: %.1f s, %d open records, %d kept events: %s",
                iteration,
                summary["stream"]["seconds"],
                audit.open_records,
                audit.kept_events,
                summary["totals"],
            )
            if max_iterations is not None and iteration >= max_iterations:
                break
            time.sleep(max(0.0, interval - (time.monotonic() - started)))
    finally:
        for query in queries:
            query.stop()
        end_runner_monitors(spark)
    return summary
