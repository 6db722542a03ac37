"""``devicemq pipeline JOB`` (also ``python -m pipeline JOB``): the PySpark jobs.

    devicemq pipeline audit   [--data-dir DIR | --bootstrap HOST:PORT --redis URL]
                              [--since T] [--until T] [--out DIR] [--master URL]
                              [--source python|connector] [--grace S]
                              [--stream [--interval S] [--max-iterations N]]
    devicemq pipeline traffic [same connection and window options] [--levels N]

Exit status: 0 done (audit: nothing lost), 1 the audit found lost messages,
2 usage error or unreachable services.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["add_arguments", "main", "run"]

log = logging.getLogger("devicemq.pipeline")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", choices=("audit", "traffic"), help="which job to run")
    where = p.add_argument_group("where the data is")
    where.add_argument(
        "--data-dir", metavar="DIR", help="use the embedded Kafka and Redis of a data dir (./data)"
    )
    where.add_argument("--bootstrap", metavar="HOST:PORT", help="Kafka bootstrap servers")
    where.add_argument("--redis", metavar="URL", help="Redis URL, e.g. redis://host:6379/0")
    where.add_argument("--redis-cluster", action="store_true", help="--redis names a cluster node")
    where.add_argument("--config", metavar="FILE", help="devicemq YAML settings, for topic names")
    p.add_argument("--since", metavar="TIME", help="only messages published at or after TIME")
    p.add_argument("--until", metavar="TIME", help="only messages published before TIME")
    p.add_argument("--out", metavar="DIR", default="pipeline-out", help="output directory")
    p.add_argument("--master", default="local[*]", help="Spark master URL (default local[*])")
    p.add_argument(
        "--source",
        choices=("python", "connector"),
        default="python",
        help="python: the Python Kafka data source; connector: Spark's Kafka connector",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="audit: seconds a record may wait to be stored before it counts as lost",
    )
    p.add_argument(
        "--stream", action="store_true", help="audit: keep running, update every interval"
    )
    p.add_argument("--interval", type=float, default=30.0, help="--stream: seconds between updates")
    p.add_argument("--max-iterations", type=int, metavar="N", help="--stream: stop after N updates")
    p.add_argument("--levels", type=int, default=3, help="traffic: topic levels to break down")


def run(args: argparse.Namespace) -> int:
    from broker.config import ConfigError, load_settings
    from persistence import kafka_security, redis_security
    from persistence.kafka_security import PLAINTEXT
    from pipeline.class_archive import ClassArchive
    from pipeline.common import (
        PipelineError,
        Progress,
        Window,
        make_spark,
        parse_time,
        resolve_endpoints,
    )

    try:
        settings = load_settings(args.config)
        endpoints = resolve_endpoints(
            args.data_dir or (None if args.bootstrap else settings.data_dir),
            args.bootstrap,
            args.redis,
            args.redis_cluster,
            # --bootstrap is reached as the brokers reach it (persistence.kafka_*)
            kafka_security.from_settings(settings.persistence) if args.bootstrap else PLAINTEXT,
            # --redis too (persistence.redis_*: TLS, an ACL user, Sentinels)
            redis_security.connect_options(settings.persistence, args.redis) if args.redis else {},
            redis_security.sentinels(settings.persistence, args.redis) if args.redis else None,
        )
        window = Window(parse_time(args.since), parse_time(args.until))
    except (PipelineError, ConfigError) as error:
        print(f"devicemq pipeline: error: {error}", file=sys.stderr)
        return 2
    persisted_topic, events_topic = settings.persistence.topic, settings.events.topic
    out = Path(args.out)
    from pyspark.sql import SparkSession

    owned = SparkSession.getActiveSession() is None  # else: a caller's session (tests)
    conf: dict[str, str] = {}
    if args.stream and args.job == "audit":
        from pipeline.stream import SPARK_CONF as conf
    progress = Progress()
    progress.say(f"{args.job}: starting Spark ({args.master})")
    archive = ClassArchive.here() if owned else None
    spark = make_spark(
        args.master, f"devicemq-{args.job}", archive.java_options if archive else "", conf
    )
    try:
        if args.job == "traffic":
            from pipeline.traffic import run_traffic

            summary = run_traffic(
                spark,
                endpoints,
                window=window,
                out=out,
                source=args.source,
                levels=args.levels,
                persisted_topic=persisted_topic,
                events_topic=events_topic,
                progress=progress,
            )
            progress.say("done")
            print(json.dumps(summary["totals"]))
            print(f"report: {out / 'traffic.html'}")
            return 0
        from pipeline.audit import run_audit, write_outputs
        from pipeline.stream import stream_audit

        if args.stream:
            summary = stream_audit(
                spark,
                endpoints,
                window=window,
                out=out,
                interval=args.interval,
                max_iterations=args.max_iterations,
                grace=args.grace,
                on_summary=lambda s: print(json.dumps(s["totals"]), flush=True),
                persisted_topic=persisted_topic,
                events_topic=events_topic,
            )
        else:
            result = run_audit(
                spark,
                endpoints,
                window=window,
                source=args.source,
                grace=args.grace,
                persisted_topic=persisted_topic,
                events_topic=events_topic,
                progress=progress,
                # moved into place with the other outputs: a failed audit leaves
                # the last one's messages.parquet beside its audit.json
                messages_dir=out / ".messages.parquet.partial",
            )
            write_outputs(result, out)
            progress.say("done")
            summary = result.summary
            print(json.dumps(summary["totals"]))
        print(f"report: {out / 'audit.html'}")
        return 1 if summary and summary["totals"]["lost"] else 0
    finally:
        if owned:
            spark.stop()
            if archive is not None:
                from pyspark import SparkContext

                archive.finish(SparkContext, progress.say)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline", description="devicemq PySpark jobs: audit, traffic"
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run(args)
