"""A Kafka source for Spark on PySpark's Python Data Source API.

There is no Spark Kafka connector jar on a development machine, so this
source reads Kafka with a plain Python client (aiokafka) inside the Spark
workers, one Spark partition per Kafka partition::

    from pipeline.kafka_source import KafkaSource
    spark.dataSource.register(KafkaSource)
    df = (spark.read.format("devicemq-kafka")
          .option("bootstrap", "127.0.0.1:9092").option("topic", "devicemq.events")
          .option("startingOffsets", "earliest").option("endingOffsets", "latest")
          .load())

and as a stream, ``spark.readStream.format("devicemq-kafka")`` with the same
options (``endingOffsets`` ignored; ``maxOffsetsPerTrigger`` caps a micro-batch).

The schema is the connector's core: ``key`` and ``value`` (binary),
``topic``, ``partition``, ``offset``, ``timestamp``; with option ``table``
(``records``, ``events`` or ``folded``: the events with a message's folded into
one row, the audit's) each fetch is decoded into that pipeline table instead
(pipeline/decoding.py); ``recordsPerPartition`` cuts a Kafka partition
into Spark partitions of that many records at most (a batch read). Offsets
are given like the connector's: ``earliest``, ``latest``, or JSON
``{"<topic>": {"0": 23, "1": -2}}`` (-2 earliest, -1 latest; partitions left
out start at earliest, or end at latest).

"latest" is found by fetching, not by ``end_offsets``: Tansu (the embedded
broker) answers ListOffsets with a count of record batches, so the high
watermark is taken from a fetch response instead, which is right on Tansu and
on Apache Kafka alike. :func:`read_topic` picks this source or, where the
official connector is on the classpath (``source="connector"``), Spark's own
``format("kafka")``, and returns the same columns either way.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows

from persistence.kafka_security import PLAINTEXT, KafkaSecurity, from_options

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

__all__ = [
    "FORMAT",
    "SCHEMA",
    "KafkaSource",
    "OffsetRange",
    "latest_offsets",
    "read_range",
    "read_topic",
    "resolve_offsets",
]

FORMAT = "devicemq-kafka"
SCHEMA = "key binary, value binary, topic string, partition int, offset bigint, timestamp timestamp"
EARLIEST, LATEST = -2, -1
FETCH_RECORDS = 5000  # records per fetch inside a worker
SPLIT = 50_000  # records per Spark partition at most (a batch read)
# option table: decoded as read (pipeline/decoding.py); "folded": the events with a
# message's folded into one row (the audit's)
TABLES = ("records", "events", "folded")
PROBE_TIMEOUT = 5.0  # seconds to learn a partition's high watermark


@dataclass(frozen=True, slots=True)
class OffsetRange(InputPartition):
    """One Kafka partition's records ``[start, end)``: one Spark partition."""

    bootstrap: str
    topic: str
    partition: int
    start: int
    end: int
    security: KafkaSecurity = PLAINTEXT  # TLS, SASL (persistence/kafka_security.py)


def _consumer(bootstrap: str, security: KafkaSecurity) -> AIOKafkaConsumer:
    """The one place the source makes a Kafka client."""
    from aiokafka import AIOKafkaConsumer

    return AIOKafkaConsumer(
        **security.aiokafka(),
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=50,
        max_partition_fetch_bytes=8 * 1024 * 1024,
    )


# ---------------------------------------------------------------------------
# Offsets (driver side)
# ---------------------------------------------------------------------------


async def _bounds(
    bootstrap: str, topic: str, security: KafkaSecurity, only: int | None = None
) -> dict[int, tuple[int, int]]:
    """partition -> (earliest, latest) of ``topic`` (of partition ``only`` alone, when
    given and the topic has it); latest from fetch high watermarks."""
    from aiokafka import TopicPartition

    consumer = _consumer(bootstrap, security)
    await consumer.start()
    try:
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            await consumer.topics()  # refresh metadata once
            partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            raise ValueError(f"kafka topic {topic!r} does not exist at {bootstrap}")
        if only is not None:
            partitions = {only} & partitions
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        beginning = await consumer.beginning_offsets(tps)
        # A lower bound on Tansu (it counts batches), exact on Kafka: a valid fetch position.
        guess = await consumer.end_offsets(tps)
        consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, max(beginning[tp], guess[tp] - 1))
        deadline = time.monotonic() + PROBE_TIMEOUT
        while any(consumer.highwater(tp) is None for tp in tps):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no fetch answer for {topic} from {bootstrap}")
            await consumer.getmany(timeout_ms=100, max_records=1)
        return {tp.partition: (beginning[tp], int(consumer.highwater(tp))) for tp in tps}
    finally:
        await consumer.stop()


def latest_offsets(
    bootstrap: str, topic: str, security: KafkaSecurity = PLAINTEXT, only: int | None = None
) -> dict[int, tuple[int, int]]:
    """partition -> (earliest, latest offset + 1) of ``topic``, read from the broker
    (of partition ``only`` alone, when given)."""
    return asyncio.run(_bounds(bootstrap, topic, security, only))


def _parse_spec(spec: str, topic: str, default: int) -> dict[int, int] | int:
    text = spec.strip()
    if text.lower() == "earliest":
        return EARLIEST
    if text.lower() == "latest":
        return LATEST
    try:
        doc = json.loads(text)
    except ValueError:
        raise ValueError(f"offsets must be earliest, latest or JSON, not {spec!r}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"offsets JSON must be an object, not {spec!r}")
    per = doc.get(topic, {})
    return {int(p): int(o) for p, o in per.items()} if per else default


def resolve_offsets(
    bounds: dict[int, tuple[int, int]], spec: str, topic: str, default: int
) -> dict[int, int]:
    """partition -> concrete offset for an offsets option (``earliest``/``latest``/JSON)."""
    parsed = _parse_spec(spec, topic, default)
    out: dict[int, int] = {}
    for partition, (low, high) in bounds.items():
        want = parsed if isinstance(parsed, int) else parsed.get(partition, default)
        if want == EARLIEST:
            out[partition] = low
        elif want == LATEST:
            out[partition] = high
        else:
            out[partition] = min(max(want, low), high)
    return out


# ---------------------------------------------------------------------------
# Reading one range (worker side)
# ---------------------------------------------------------------------------


def arrow_schema() -> Any:
    """:data:`SCHEMA` as Arrow types, as Spark checks a data source's batches against."""
    import pyarrow as pa

    return pa.schema(
        [
            ("key", pa.binary()),
            ("value", pa.binary()),
            ("topic", pa.string()),
            ("partition", pa.int32()),
            ("offset", pa.int64()),
            ("timestamp", pa.timestamp("us", tz="UTC")),
        ]
    )


def read_range(part: OffsetRange) -> Iterator[Any]:
    """The records of one partition's range, in offset order, as Arrow record batches
    of :data:`SCHEMA`: one per fetch, built column by column (Spark takes them as
    they are; rows as tuples it would convert one value at a time, which cost more
    than reading them from Kafka)."""
    import pyarrow as pa

    schema = arrow_schema()
    for keys, values, offsets, stamps in _chunks(part):
        n = len(offsets)
        yield pa.RecordBatch.from_arrays(
            [
                pa.array(keys, pa.binary()),
                pa.array(values, pa.binary()),
                pa.array([part.topic] * n, pa.string()),
                pa.array([part.partition] * n, pa.int32()),
                pa.array(offsets, pa.int64()),
                # Kafka's milliseconds as Spark's microseconds
                pa.array([ms * 1000 for ms in stamps], pa.int64()).cast(schema.field(5).type),
            ],
            schema=schema,
        )


def read_decoded(part: OffsetRange, table: str) -> Iterator[Any]:
    """The records of one partition's range decoded into a pipeline table as they are
    fetched (``table``: ``records`` or ``events``, pipeline/decoding.py), in one
    pass: no raw batch goes to the JVM and back to Python to be decoded."""
    from pipeline.decoding import event_batch, folded_batch, record_batch

    for keys, values, offsets, stamps in _chunks(part):
        partitions = [part.partition] * len(offsets)
        if table == "records":
            yield record_batch(keys, values, partitions, offsets, [ms / 1000 for ms in stamps])
        elif table == "folded":
            yield folded_batch(values, partitions, offsets)
        else:
            yield event_batch(values, partitions, offsets)


def _chunks(part: OffsetRange) -> Iterator[Chunk]:
    """The fetches of ``part``, stepped one at a time by this (synchronous) iterator:
    aiokafka needs a running loop for every call."""
    if part.end <= part.start:
        return
    loop = asyncio.new_event_loop()
    chunks = _fetch(part)
    try:
        while True:
            try:
                yield loop.run_until_complete(anext(chunks))
            except StopAsyncIteration:
                return
    finally:
        loop.run_until_complete(chunks.aclose())
        loop.close()


Chunk = tuple[list[bytes | None], list[bytes | None], list[int], list[int]]


async def _fetch(part: OffsetRange) -> AsyncGenerator[Chunk, None]:
    """(keys, values, offsets, timestamps in ms) of each fetch of ``part``."""
    from aiokafka import TopicPartition

    consumer = _consumer(part.bootstrap, part.security)
    await consumer.start()
    try:
        tp = TopicPartition(part.topic, part.partition)
        consumer.assign([tp])
        consumer.seek(tp, part.start)
        position = part.start
        idle_since = time.monotonic()
        while position < part.end:
            batches = await consumer.getmany(tp, timeout_ms=200, max_records=FETCH_RECORDS)
            records = batches.get(tp, [])
            if not records:
                if time.monotonic() - idle_since > 30:
                    raise TimeoutError(
                        f"{part.topic}[{part.partition}]: no records at {position} "
                        f"(range ends at {part.end})"
                    )
                continue
            idle_since = time.monotonic()
            past_end = records[-1].offset >= part.end
            if past_end:
                records = [r for r in records if r.offset < part.end]
            if records:
                position = records[-1].offset + 1
                yield (
                    [r.key for r in records],
                    [r.value for r in records],
                    [r.offset for r in records],
                    [r.timestamp for r in records],
                )
            if past_end:
                return
    finally:
        await consumer.stop()


# ---------------------------------------------------------------------------
# The data source
# ---------------------------------------------------------------------------


def _table_schema(table: str | None) -> str:
    """The schema of option ``table``: none, the raw rows (:data:`SCHEMA`)."""
    from pipeline.decoding import EVENT_COLUMNS, FOLDED_COLUMNS, RECORD_SCHEMA

    if table is None:
        return SCHEMA
    if table not in TABLES:
        raise ValueError(f"option table must be {' or '.join(TABLES)}, not {table!r}")
    return {"records": RECORD_SCHEMA, "folded": FOLDED_COLUMNS}.get(table, EVENT_COLUMNS)


def _option(options: Any, *names: str, default: str | None = None) -> str:
    for name in names:
        value = options.get(name)
        if value:
            return str(value)
    if default is None:
        raise ValueError(f"option {names[0]!r} is required")
    return default


class KafkaSource(DataSource):
    """``format("devicemq-kafka")``: options ``bootstrap``, ``topic``,
    ``startingOffsets``, ``endingOffsets``, ``maxOffsetsPerTrigger``.

    The connector's names ``kafka.bootstrap.servers`` and ``subscribe`` work too.
    A secured Kafka's settings come as :meth:`KafkaSecurity.as_options` gives them
    (``kafka.security.protocol``, ``kafka.sasl.password.file``, ...).
    """

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        return _table_schema(self.options.get("table"))

    def _target(self) -> tuple[str, str, KafkaSecurity]:
        bootstrap = _option(self.options, "bootstrap", "kafka.bootstrap.servers")
        topic = _option(self.options, "topic", "subscribe")
        return bootstrap, topic, from_options(self.options)

    def reader(self, schema: StructType) -> DataSourceReader:
        bootstrap, topic, security = self._target()
        return _BatchReader(
            bootstrap,
            topic,
            security,
            _option(self.options, "startingOffsets", default="earliest"),
            _option(self.options, "endingOffsets", default="latest"),
            self.options.get("table"),
            int(self.options.get("recordsPerPartition") or SPLIT),
        )

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        bootstrap, topic, security = self._target()
        limit = self.options.get("maxOffsetsPerTrigger")
        return _StreamReader(
            bootstrap,
            topic,
            security,
            _option(self.options, "startingOffsets", default="earliest"),
            int(limit) if limit else None,
            self.options.get("table"),
        )


class _BatchReader(DataSourceReader):
    def __init__(
        self,
        bootstrap: str,
        topic: str,
        security: KafkaSecurity,
        starting: str,
        ending: str,
        table: str | None,
        split: int = SPLIT,
    ) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.security = security
        _table_schema(table)  # an unknown table fails here, once
        self.table = table
        if split < 1:
            raise ValueError(f"option recordsPerPartition must be at least 1, not {split}")
        self.split = split
        bounds = latest_offsets(bootstrap, topic, security)
        self.start = resolve_offsets(bounds, starting, topic, EARLIEST)
        self.end = resolve_offsets(bounds, ending, topic, LATEST)

    def partitions(self) -> Sequence[InputPartition]:
        """One Spark partition per ``recordsPerPartition`` records of a Kafka partition
        at most: two cores read one busy partition no faster than one, but its two
        halves twice as fast."""
        return [
            OffsetRange(
                self.bootstrap,
                self.topic,
                p,
                low,
                min(low + self.split, self.end[p]),
                self.security,
            )
            for p in sorted(self.start)
            for low in range(self.start[p], self.end[p], self.split)
        ] or [OffsetRange(self.bootstrap, self.topic, 0, 0, 0, self.security)]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, OffsetRange)
        if self.table is None:
            return read_range(partition)
        return read_decoded(partition, self.table)


class _StreamReader(DataSourceStreamReader):
    """Offsets are ``{"<partition>": next offset}``; one Spark partition per Kafka one."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        security: KafkaSecurity,
        starting: str,
        max_per_trigger: int | None,
        table: str | None = None,
    ):
        self.bootstrap = bootstrap
        self.topic = topic
        self.security = security
        self.starting = starting
        self.max_per_trigger = max_per_trigger
        _table_schema(table)  # an unknown table fails here, once
        self.table = table

    def initialOffset(self) -> dict[str, int]:
        bounds = latest_offsets(self.bootstrap, self.topic, self.security)
        start = resolve_offsets(bounds, self.starting, self.topic, EARLIEST)
        return {str(p): o for p, o in start.items()}

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.max_per_trigger:
            return ReadMaxRows(self.max_per_trigger)
        return ReadAllAvailable()

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:
        bounds = latest_offsets(self.bootstrap, self.topic, self.security)
        end = {str(p): high for p, (_low, high) in bounds.items()}
        for p, offset in start.items():
            end.setdefault(p, offset)
        if isinstance(limit, ReadMaxRows):
            end = _capped(start, end, limit.max_rows)
        return end

    def reportLatestOffset(self) -> dict[str, int] | None:
        bounds = latest_offsets(self.bootstrap, self.topic, self.security)
        return {str(p): high for p, (_low, high) in bounds.items()}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        return [
            OffsetRange(self.bootstrap, self.topic, int(p), start.get(p, 0), e, self.security)
            for p, e in sorted(end.items(), key=lambda kv: int(kv[0]))
            if e > start.get(p, 0)
        ]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, OffsetRange)
        return read_range(partition) if self.table is None else read_decoded(partition, self.table)

    def commit(self, end: dict[str, int]) -> None:
        pass  # Spark's checkpoint holds the offsets; nothing to tell Kafka


def _capped(start: dict[str, int], end: dict[str, int], budget: int) -> dict[str, int]:
    """At most ``budget`` records past ``start``, shared round-robin over partitions."""
    out = {p: start.get(p, e) for p, e in end.items()}
    budget = max(budget, 1)
    while budget > 0:
        open_parts = [p for p in end if out[p] < end[p]]
        if not open_parts:
            break
        share = max(budget // len(open_parts), 1)
        for p in open_parts:
            take = min(share, end[p] - out[p], budget)
            out[p] += take
            budget -= take
            if budget == 0:
                break
    return out


# ---------------------------------------------------------------------------
# Picking a source
# ---------------------------------------------------------------------------

_registered: set[int] = set()


def register(spark: SparkSession) -> None:
    """Register :class:`KafkaSource` with ``spark`` (once per session)."""
    if id(spark) not in _registered:
        spark.dataSource.register(KafkaSource)
        _registered.add(id(spark))


def read_topic(
    spark: SparkSession,
    bootstrap: str,
    topic: str,
    *,
    source: str = "python",
    starting: str = "earliest",
    ending: str = "latest",
    security: KafkaSecurity = PLAINTEXT,
    options: dict[str, str] | None = None,
) -> DataFrame:
    """A batch DataFrame of :data:`SCHEMA` over ``topic`` (the python source: more
    ``options`` of :class:`KafkaSource`, e.g. ``table``).

    ``source="python"`` uses :class:`KafkaSource`; ``"connector"`` uses the
    official Spark Kafka connector (``spark-sql-kafka`` on the classpath, as on
    a real cluster) and selects the same columns. ``security``: a Kafka with TLS
    or SASL (the python source only: the connector takes its own JAAS settings).
    """
    if source == "connector":
        if security != PLAINTEXT:
            raise ValueError(
                "the connector source reads a plaintext Kafka only here: use source python "
                "for persistence.kafka_security_protocol " + security.protocol
            )
        df = (
            spark.read.format("kafka")
            .option("kafka.bootstrap.servers", bootstrap)
            .option("subscribe", topic)
            .option("startingOffsets", starting)
            .option("endingOffsets", ending)
            .load()
        )
        return df.select("key", "value", "topic", "partition", "offset", "timestamp")
    if source != "python":
        raise ValueError(f"unknown source {source!r}: python or connector")
    register(spark)
    return (
        spark.read.format(FORMAT)
        .option("bootstrap", bootstrap)
        .option("topic", topic)
        .option("startingOffsets", starting)
        .option("endingOffsets", ending)
        .options(**security.as_options())
        .options(**(options or {}))
        .load()
    )


def read_table(
    spark: SparkSession,
    bootstrap: str,
    topic: str,
    table: str,
    *,
    source: str = "python",
    starting: str = "earliest",
    ending: str = "latest",
    security: KafkaSecurity = PLAINTEXT,
    split: int = SPLIT,
) -> DataFrame:
    """``topic`` decoded into a pipeline table, ``records``, ``events`` or ``folded``
    (pipeline/decoding.py), as a batch DataFrame; a Spark partition reads ``split``
    records at most.

    The python source decodes each fetch as it comes, in the task that fetched
    it: no raw row goes to the JVM and back to a Python worker to be decoded.
    The connector's rows are decoded by Arrow UDFs (pipeline/common.py); its
    ``folded`` is the ``events`` table, nothing folded (the audit's accounting
    takes either).
    """
    if table not in TABLES:
        raise ValueError(f"unknown table {table!r}: {' or '.join(TABLES)}")
    decoded = {"table": table, "recordsPerPartition": str(split)} if source == "python" else {}
    df = read_topic(
        spark,
        bootstrap,
        topic,
        source=source,
        starting=starting,
        ending=ending,
        security=security,
        options=decoded,
    )
    if decoded:
        return df
    from pipeline.common import decode_events, decode_records

    return decode_records(df) if table == "records" else decode_events(df)
