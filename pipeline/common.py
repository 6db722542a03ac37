"""What every pipeline job shares: endpoints, the Spark session, the two topics as tables.

Tables (Spark DataFrames):

- :func:`records`: the records of ``devicemq.device.persisted`` (one per
  persistent delivery a publisher was acknowledged for), with the subscriber
  (``cid``), Kafka ``part``/``off``, the message's ``topic``, payload
  ``size``, publish time ``pub`` and expiry ``exp`` (decoded from the stored
  message header, persistence/format.py);
- :func:`events`: the delivery events of ``devicemq.events``
  (persistence/events.py), one column per field, plus the event's own
  position ``epart``/``eoff``/``idx`` (Kafka partition and offset of its
  record, index in the record: one client's events are in one partition, in
  that order).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from persistence.kafka_security import PLAINTEXT, KafkaSecurity
from persistence.redis_security import Sentinels
from pipeline.decoding import EVENT_COLUMNS, EVENT_SCHEMA, RECORD_SCHEMA

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = [
    "EVENT_COLUMNS",
    "EVENT_SCHEMA",
    "RECORD_SCHEMA",
    "Endpoints",
    "Window",
    "events",
    "make_spark",
    "read_epoch",
    "records",
    "resolve_endpoints",
]


# C1 only: a job of a few seconds is mostly a cold JVM compiling Spark's code; the
# full JIT's later, faster code does not pay for its compiling. C1 alone gets the
# code cache of a JVM without tiers, 48 MB, which a session of a few hundred
# queries filled: the JIT stopped, then the JVM died ("Out of space in CodeCache").
JIT = "-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=256m"


@dataclass(frozen=True, slots=True)
class Endpoints:
    bootstrap: str
    redis_url: str
    redis_cluster: bool = False
    kafka_security: KafkaSecurity = PLAINTEXT  # TLS, SASL of --bootstrap
    # TLS, ACL user, Sentinels of --redis (persistence.redis_*: persistence/redis_security.py)
    redis_connect: dict[str, Any] = field(default_factory=dict)
    redis_sentinels: Sentinels | None = None


@dataclass(frozen=True, slots=True)
class Window:
    """``--since``/``--until`` as epoch seconds (None: open)."""

    since: float | None = None
    until: float | None = None


class PipelineError(Exception):
    """A problem the operator can fix (one line, exit status 2)."""


def resolve_endpoints(
    data_dir: str | None,
    bootstrap: str | None,
    redis_url: str | None,
    cluster: bool = False,
    kafka_security: KafkaSecurity = PLAINTEXT,
    redis_connect: dict[str, Any] | None = None,
    redis_sentinels: Sentinels | None = None,
) -> Endpoints:
    """``--bootstrap``/``--redis`` (reached with ``kafka_security``), else the embedded
    services of ``--data-dir`` (plaintext on loopback)."""
    if bootstrap or redis_url:
        if not (bootstrap and redis_url):
            raise PipelineError("give both --bootstrap and --redis, or --data-dir")
        return Endpoints(
            bootstrap, redis_url, cluster, kafka_security, redis_connect or {}, redis_sentinels
        )
    from app.embedded_services import HOST, EmbeddedServices

    directory = Path(data_dir or "./data")
    services = EmbeddedServices(directory)
    ports = {s.name: s for s in services.status()}
    redis, kafka = ports.get("redis"), ports.get("kafka")
    if redis is None or kafka is None or not (redis.responding and kafka.responding):
        raise PipelineError(
            f"the embedded Redis and Kafka of {directory} are not running "
            "(start `devicemq run --data-dir DIR`, or give --bootstrap and --redis)"
        )
    assert redis.port is not None  # responding
    # With the password of the data dir (services/redis.password): Redis asks for it.
    return Endpoints(f"{HOST}:{kafka.port}", services.redis_url(redis.port))


def parse_time(text: str | None) -> float | None:
    """ISO 8601 (``2026-01-01T12:00``, local time unless it has an offset) or epoch seconds."""
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise PipelineError(f"not a time: {text!r} (ISO 8601 or epoch seconds)") from None


class Progress:
    """The jobs' own progress lines on stderr: what is read, how many records, and
    the time since the start (``devicemq pipeline: [  12.3 s] ...``)."""

    def __init__(self, stream: Any = None, *, quiet: bool = False) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._quiet = quiet
        self._start = time.monotonic()

    @classmethod
    def silent(cls) -> Progress:
        """One that says nothing (a job run from code, the stream's updates)."""
        return cls(quiet=True)

    def say(self, text: str) -> None:
        if self._quiet:
            return
        elapsed = time.monotonic() - self._start
        print(f"devicemq pipeline: [{elapsed:6.1f} s] {text}", file=self._stream, flush=True)

    def read(self, topic: str, frame: DataFrame, rows: str = "records") -> int:
        """Count ``frame`` (cached: the count is its read, done once) and say so,
        its rows called ``rows``; returns the count."""
        self.say(f"reading {topic} ...")
        count = frame.count()
        self.say(f"read {topic}: {count:,} {rows}")
        return count


def make_spark(
    master: str = "local[*]",
    app: str = "devicemq-pipeline",
    java_options: str = "",
    conf: dict[str, str] | None = None,
) -> SparkSession:
    """A Spark session whose Python workers run this interpreter (and see this package);
    ``java_options`` for the driver's JVM (pipeline/class_archive.py), ``conf`` more
    Spark settings (the stream's, pipeline/stream.py)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    root = str(Path(__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH", "")
    if root not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, path) if p)
    from pyspark.sql import SparkSession

    builder = SparkSession.builder
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    return (
        builder.master(master)
        .appName(app)
        .config("spark.ui.enabled", "false")
        # Spark's console bars ([Stage 2:=>  (3 + 2) / 12]) go to stderr: only to a
        # terminal, never into a log; Progress says what happens instead.
        .config("spark.ui.showConsoleProgress", "true" if sys.stderr.isatty() else "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.extraJavaOptions", f"{JIT} {java_options}".strip())
        .config("spark.sql.shuffle.partitions", os.environ.get("DEVICEMQ_SHUFFLE_PARTITIONS", "8"))
        .config("spark.executorEnv.PYTHONPATH", os.environ["PYTHONPATH"])
        .getOrCreate()
    )


def read_epoch(endpoints: Endpoints, topic: str) -> int:
    """How many times devicemq created ``topic`` (persistence/device_persistence.py's epoch)."""
    client = _redis(endpoints)
    try:
        value = client.get(f"devicemq:epoch:{topic}")
    finally:
        client.close()
    return int(value or 0)


def _redis(endpoints: Endpoints) -> Any:
    from persistence.redis_security import blocking_client

    return blocking_client(
        endpoints.redis_url,
        endpoints.redis_connect,
        endpoints.redis_sentinels,
        cluster=endpoints.redis_cluster,
    )


def decode_records(raw: DataFrame) -> DataFrame:
    """Raw Kafka rows of the persisted topic (another source's, or kept in Parquet by
    the stream) -> :data:`RECORD_SCHEMA`; the Python source decodes as it reads."""
    from pyspark.sql import functions as F

    from pipeline.decoding import header_structs

    header = _arrow_udf(header_structs, "topic string, size int, pub double, exp double")
    return raw.select(
        F.col("key").cast("string").alias("cid"),
        F.col("partition").alias("part"),
        F.col("offset").alias("off"),
        (F.col("timestamp").cast("double")).alias("kts"),
        header(F.col("value")).alias("h"),
    ).select("cid", "part", "off", "kts", "h.*")


def decode_events(raw: DataFrame) -> DataFrame:
    """Raw Kafka rows of the events topic -> one row per event (:data:`EVENT_COLUMNS`),
    as :func:`decode_records`: the JSON arrays read by Python's orjson in an
    Arrow UDF (Spark's ``from_json`` took more CPU than anything else in the
    audit), exploded in the JVM."""
    from pyspark.sql import functions as F

    from pipeline.decoding import event_lists

    parse = _arrow_udf(event_lists, f"array<struct<{EVENT_SCHEMA}>>")
    lists = raw.select(
        parse(F.col("value")).alias("a"),
        F.col("partition").alias("epart"),
        F.col("offset").alias("eoff"),
    )
    return lists.select("epart", "eoff", F.posexplode("a").alias("idx", "e")).select(
        "e.*", "epart", "eoff", "idx"
    )


def _arrow_udf(function: Any, returns: str) -> Any:
    import warnings

    from pyspark.sql.pandas.functions import ArrowUDFType, arrow_udf

    with warnings.catch_warnings():  # "type hints preferred": pyarrow is imported lazily
        warnings.simplefilter("ignore", UserWarning)
        return arrow_udf(function, returns, ArrowUDFType.SCALAR)


def records(
    spark: SparkSession, endpoints: Endpoints, topic: str, window: Window, source: str = "python"
) -> DataFrame:
    """The persisted topic's records published in ``window`` (:data:`RECORD_SCHEMA`)."""
    from pipeline.kafka_source import read_table

    df = read_table(
        spark,
        endpoints.bootstrap,
        topic,
        "records",
        source=source,
        security=endpoints.kafka_security,
    )
    return _in_window(df, "pub", window)


def events(
    spark: SparkSession,
    endpoints: Endpoints,
    topic: str,
    source: str = "python",
    *,
    folded: bool = False,
) -> DataFrame:
    """The delivery events (:data:`EVENT_COLUMNS`); ``folded``: with the events of a
    message folded into one row where the source can (pipeline/decoding.py
    ``folded_batch``)."""
    from pipeline.kafka_source import read_table

    return read_table(
        spark,
        endpoints.bootstrap,
        topic,
        "folded" if folded else "events",
        source=source,
        security=endpoints.kafka_security,
    )


def arrow_in_window(batch: Any, column: str, window: Window) -> Any:
    """:func:`_in_window` of an Arrow batch (rows whose ``column`` is null go too)."""
    import pyarrow.compute as pc

    keep = None
    if window.since is not None:
        keep = pc.greater_equal(batch.column(column), window.since)
    if window.until is not None:
        before = pc.less(batch.column(column), window.until)
        keep = before if keep is None else pc.and_(keep, before)
    return batch if keep is None else batch.filter(keep)


def _in_window(df: DataFrame, column: str, window: Window) -> DataFrame:
    from pyspark.sql import functions as F

    if window.since is not None:
        df = df.where(F.col(column) >= window.since)
    if window.until is not None:
        df = df.where(F.col(column) < window.until)
    return df
