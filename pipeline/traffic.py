"""``devicemq pipeline traffic``: where persistent traffic goes.

Over the records of ``devicemq.device.persisted`` (one per delivery to a
persistent session, so a message fanned out to three subscribers counts
three times) and the delivery events:

- ``topic_levels``: messages and bytes per topic prefix, for the first
  ``--levels`` levels (``plant``, ``plant/line1``, ...);
- ``clients``: messages and bytes per subscriber client;
- ``minutes``: messages and bytes per minute (publish time);
- ``topics``: the top talkers, full topic names by messages;
- ``sizes``: payload size distribution (power-of-two buckets);
- ``backlog``: per client and minute, messages stored and not yet acknowledged,
  expired, dropped or trimmed (from the events; expiries inside Redis are not
  events, so a backlog of expiring messages only shrinks in the audit).

Outputs in ``--out``: one Parquet table each, ``traffic.json`` and ``traffic.html``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.common import (
    Endpoints,
    Progress,
    Window,
    _in_window,
    events,
    records,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["run_traffic", "traffic_frames"]

TOP = 10


def traffic_frames(recs: DataFrame, evs: DataFrame, levels: int) -> dict[str, DataFrame]:
    from pyspark.sql import Window as W
    from pyspark.sql import functions as F

    volume = [F.count("*").alias("messages"), F.sum("size").alias("bytes")]
    parts = F.split(F.col("topic"), "/")
    by_level = [
        recs.where(F.size(parts) >= level)
        .select(
            F.lit(level).alias("level"),
            F.array_join(F.slice(parts, 1, level), "/").alias("prefix"),
            "size",
        )
        .groupBy("level", "prefix")
        .agg(*volume)
        for level in range(1, levels + 1)
    ]
    topic_levels = by_level[0]
    for frame in by_level[1:]:
        topic_levels = topic_levels.unionByName(frame)
    minute = F.from_unixtime(F.floor(F.col("pub") / 60) * 60).cast("timestamp")
    bucket = F.when(F.col("size") <= 0, F.lit(0)).otherwise(
        F.pow(F.lit(2), F.ceil(F.log2(F.col("size")))).cast("long")
    )
    # Backlog, per message rather than per event, so that a repeated event (a
    # re-delivery acked twice) or a missing one (a save whose reply was lost
    # is not reported as persisted) cannot skew it: a stored message counts
    # +1 at its first event, -1 when it first leaves (ack, expiry at
    # delivery, too large); trims take away their count of packet ids.
    ev = F.col("ev")
    leaving = ev.isin("acked", "dropped") | ((ev == "expired") & (F.col("at") == "delivery"))
    keyed = evs.where((F.col("cid") != "") & F.col("sc").isNotNull())
    entered = (
        keyed.where((ev == "persisted") | leaving)
        .groupBy("cid", "sc")
        .agg(F.min("ts").alias("ts"))
        .select("cid", "ts", F.lit(1).alias("d"))
    )
    left = (
        keyed.where(leaving)
        .groupBy("cid", "sc")
        .agg(F.min("ts").alias("ts"))
        .select("cid", "ts", F.lit(-1).alias("d"))
    )
    trims = evs.where((ev == "trimmed") & (F.col("cid") != "")).select(
        "cid", "ts", (-F.size("pids")).alias("d")
    )
    per_minute = (
        entered.unionByName(left)
        .unionByName(trims)
        .select("cid", F.from_unixtime(F.floor(F.col("ts") / 60) * 60).alias("m"), "d")
        .groupBy("cid", "m")
        .agg(F.sum("d").alias("change"))
    )
    running = W.partitionBy("cid").orderBy("m").rowsBetween(W.unboundedPreceding, W.currentRow)
    backlog = per_minute.select(
        "cid",
        F.col("m").cast("timestamp").alias("minute"),
        "change",
        F.sum("change").over(running).alias("backlog"),
    )
    return {
        "topic_levels": topic_levels.orderBy("level", F.desc("messages")),
        "clients": recs.groupBy("cid").agg(*volume).orderBy(F.desc("messages")),
        "minutes": recs.select(minute.alias("minute"), "size")
        .groupBy("minute")
        .agg(*volume)
        .orderBy("minute"),
        "topics": recs.groupBy("topic").agg(*volume).orderBy(F.desc("messages")),
        "sizes": recs.select(bucket.alias("up_to_bytes"))
        .groupBy("up_to_bytes")
        .count()
        .withColumnRenamed("count", "messages")
        .orderBy("up_to_bytes"),
        "backlog": backlog.orderBy("cid", "minute"),
    }


def run_traffic(
    spark: SparkSession,
    endpoints: Endpoints,
    *,
    persisted_topic: str,
    events_topic: str,
    window: Window,
    out: Path,
    source: str = "python",
    levels: int = 3,
    progress: Progress | None = None,
) -> dict[str, Any]:
    from pyspark.sql import functions as F

    recs = records(spark, endpoints, persisted_topic, window, source).cache()
    evs = _in_window(events(spark, endpoints, events_topic, source), "ts", window).cache()
    if progress is not None:
        progress.read(persisted_topic, recs)
        progress.read(events_topic, evs)
    frames = traffic_frames(recs, evs, levels)
    out.mkdir(parents=True, exist_ok=True)
    for name, frame in frames.items():
        frame.write.mode("overwrite").parquet(str(out / f"{name}.parquet"))
    totals = recs.agg(F.count("*").alias("messages"), F.sum("size").alias("bytes")).collect()[0]
    sizes = recs.agg(F.percentile_approx("size", [0.5, 0.9, 0.99]).alias("p"), F.max("size"))
    size_p = sizes.collect()[0]
    rows = {
        name: [r.asDict() for r in frame.limit(1000).collect()] for name, frame in frames.items()
    }
    summary: dict[str, Any] = {
        "generated_at": time.time(),
        "window": {"since": window.since, "until": window.until},
        "totals": {"messages": int(totals["messages"]), "bytes": int(totals["bytes"] or 0)},
        "payload_size": dict(zip(("p50", "p90", "p99"), size_p[0] or [], strict=False))
        | {"max": size_p[1]},
        "top_topics": rows["topics"][:TOP],
        "top_clients": rows["clients"][:TOP],
        "topic_levels": rows["topic_levels"],
        "minutes": rows["minutes"],
        "sizes": rows["sizes"],
    }
    if progress is not None:
        progress.say("tables written; drawing the report ...")
    (out / "traffic.json").write_text(json.dumps(summary, indent=2, default=str))
    _html(summary, rows, out / "traffic.html")
    return summary


def _html(summary: dict[str, Any], rows: dict[str, list[dict[str, Any]]], path: Path) -> None:
    from pipeline.report import Report, figure, plot_over_time

    report = Report("devicemq traffic")
    t = summary["totals"]
    report.paragraph(
        f"{t['messages']} messages to persistent sessions, {t['bytes']} payload bytes."
    )
    if rows["minutes"]:
        fig, ax = figure()
        minutes = rows["minutes"]
        counts = (None, [r["minute"] for r in minutes], [r["messages"] for r in minutes])
        plot_over_time(ax, [counts], step=False)
        ax.set_ylabel("messages / minute")
        report.figure(fig, "Messages per minute")
    report.heading("Top talkers (topics)")
    report.table(["topic", "messages", "bytes"], [list(r.values()) for r in rows["topics"][:TOP]])
    report.heading("Top clients (subscribers)")
    report.table(["client", "messages", "bytes"], [list(r.values()) for r in rows["clients"][:TOP]])
    report.heading("Topic levels")
    report.table(
        ["level", "prefix", "messages", "bytes"], [list(r.values()) for r in rows["topic_levels"]]
    )
    if rows["sizes"]:
        fig, ax = figure()
        ax.bar(
            [str(r["up_to_bytes"]) for r in rows["sizes"]], [r["messages"] for r in rows["sizes"]]
        )
        ax.set_xlabel("payload size up to (bytes)")
        ax.set_ylabel("messages")
        report.figure(fig, "Payload size distribution")
    backlog: dict[str, tuple[list[Any], list[int]]] = {}
    for r in rows["backlog"]:
        xs, ys = backlog.setdefault(r["cid"], ([], []))
        xs.append(r["minute"])
        ys.append(r["backlog"])
    if backlog:
        fig, ax = figure()
        biggest = sorted(backlog, key=lambda c: -max(backlog[c][1]))[:TOP]
        plot_over_time(ax, [(cid, *backlog[cid]) for cid in biggest], step=True)
        ax.set_ylabel("stored, not yet settled")
        ax.legend(fontsize="small")
        report.figure(fig, "Backlog per client (largest)")
    report.write(path)
