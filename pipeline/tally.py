"""What the audit adds up of its messages: counts per client, latency
histograms, maxima, and audit.json's summary made of them.

One tally for both audits: the batch audit's accounting tasks each tally the
messages they write (:meth:`Tally.add_messages`, sent to the driver as JSON
and merged there), the stream tallies its updates' final and open messages
(pipeline/stream.py). Latency percentiles come from log-bucket histograms
(:class:`LogHistogram`): mergeable, so a task's, an update's and a run's
add up, to within 1 %.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import orjson

from pipeline.accounting import STATUSES

__all__ = [
    "CLIENT_COLUMNS",
    "LATENCIES",
    "PERCENTILES",
    "LogHistogram",
    "Tally",
    "latency_sample",
    "summarize",
]

# per client in clients.parquet and audit.json: how many messages, of each status,
# and the deliveries after a message's first
CLIENT_COLUMNS = ("persisted", *STATUSES, "duplicates")
# delivery to any client, to one connected as the message was published, to one
# that was not (replayed from its backlog), and acknowledgement
LATENCIES = ("delivery", "delivery_live", "delivery_replay", "ack")
PERCENTILES = (0.5, 0.9, 0.99)
SAMPLE = 20_000  # latencies handed to the report's histograms


class LogHistogram:
    """Counts of values in buckets ``[RATIO**i, RATIO**(i+1))``: a quantile is
    given as its bucket's geometric middle, within 1 % of a value of that rank
    (``sqrt(1.02) - 1``). Values at or below :data:`FLOOR` (1 µs, zero,
    negative: clocks) share the lowest bucket. Merging is adding counts; a
    run of an hour needs a few thousand buckets at most."""

    RATIO = 1.02
    FLOOR = 1e-6

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}

    @classmethod
    def bucket_of(cls, value: float) -> int:
        return math.floor(math.log(max(value, cls.FLOOR)) / math.log(cls.RATIO))

    @classmethod
    def bucket_column(cls, column: Any) -> Any:
        """The same as :meth:`bucket_of`, as a Spark column."""
        from pyspark.sql import functions as F

        return F.floor(
            F.log(F.greatest(column, F.lit(cls.FLOOR))) / F.lit(math.log(cls.RATIO))
        ).cast("int")

    @classmethod
    def bucket_array(cls, values: Any) -> Any:
        """The same as :meth:`bucket_of`, of an Arrow array of doubles."""
        import pyarrow.compute as pc

        logs = pc.ln(pc.max_element_wise(values, cls.FLOOR))
        return pc.cast(pc.floor(pc.divide(logs, math.log(cls.RATIO))), "int64")

    def add(self, bucket: int, count: int = 1) -> None:
        self.counts[bucket] = self.counts.get(bucket, 0) + count

    def add_array(self, values: Any) -> None:
        """Add an Arrow array of doubles (its nulls left out)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        values = pc.drop_null(values)
        if not len(values):
            return
        grouped = (
            pa.table({"b": self.bucket_array(values)}).group_by("b").aggregate([([], "count_all")])
        )
        for b, n in zip(
            grouped.column("b").to_pylist(), grouped.column("count_all").to_pylist(), strict=True
        ):
            self.add(b, n)

    def merged(self, other: LogHistogram) -> LogHistogram:
        out = LogHistogram()
        for source in (self, other):
            for b, n in source.counts.items():
                out.add(b, n)
        return out

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def value(self, bucket: int) -> float:
        return float(self.RATIO ** (bucket + 0.5))

    def quantile(self, q: float) -> float | None:
        """The value of rank ``ceil(q * n)`` (the smallest value with at least a
        fraction q of the values at or below it), to its bucket's precision."""
        n = self.total
        if not n:
            return None
        rank = max(1, math.ceil(q * n))
        seen = 0
        for b in sorted(self.counts):
            seen += self.counts[b]
            if seen >= rank:
                return self.value(b)
        raise AssertionError("unreachable")  # pragma: no cover


@dataclass
class Tally:
    """Totals over a set of messages: per client (:data:`CLIENT_COLUMNS`), and what
    the summary adds up."""

    clients: dict[str, dict[str, int]] = field(default_factory=dict)
    redelivered: int = 0  # messages delivered more than once
    live: int = 0  # delivered messages whose client was connected as they were published
    replayed: int = 0  # and whose client was not
    maxima: dict[str, float] = field(default_factory=dict)
    hists: dict[str, LogHistogram] = field(
        default_factory=lambda: {k: LogHistogram() for k in LATENCIES}
    )

    def add_client(self, cid: str, counts: dict[str, Any]) -> None:
        """Add counts of :data:`CLIENT_COLUMNS` (missing or None: 0) to ``cid``'s."""
        mine = self.clients.setdefault(cid, dict.fromkeys(CLIENT_COLUMNS, 0))
        for key in CLIENT_COLUMNS:
            mine[key] += int(counts.get(key) or 0)

    def add_maximum(self, key: str, top: float | None) -> None:
        if top is not None:
            self.maxima[key] = max(self.maxima.get(key, top), top)

    def add_row(self, row: dict[str, Any]) -> None:
        """Add a row of the stream's aggregation of one client's messages (its
        counts, ``redelivered``, ``n_live``, ``n_replay`` and ``<latency>_max``)."""
        self.add_client(row["cid"], row)
        self.redelivered += int(row["redelivered"] or 0)
        self.live += int(row["n_live"] or 0)
        self.replayed += int(row["n_replay"] or 0)
        for key in LATENCIES:
            self.add_maximum(key, row[f"{key}_max"])

    def add_messages(self, batch: Any) -> None:
        """Add an Arrow batch of messages (pipeline/accounting.py MESSAGE_SCHEMA)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        status, deliveries = batch.column("status"), batch.column("deliveries")
        extra = pc.max_element_wise(pc.subtract(deliveries, 1), 0)
        table = pa.table({"cid": batch.column("cid"), "status": status, "dup": extra})
        grouped = table.group_by(["cid", "status"]).aggregate([([], "count_all"), ("dup", "sum")])
        for cid, state, n, dup in zip(
            *(grouped.column(c).to_pylist() for c in ("cid", "status", "count_all", "dup_sum")),
            strict=True,
        ):
            self.add_client(cid, {"persisted": n, state: n, "duplicates": dup})
        self.redelivered += pc.sum(pc.greater(deliveries, 1)).as_py() or 0
        live = pc.fill_null(batch.column("live"), False)
        delivered = pc.is_valid(batch.column("delivered_ts"))
        self.live += pc.sum(pc.and_(live, delivered)).as_py() or 0
        self.replayed += pc.sum(pc.and_(pc.invert(live), delivered)).as_py() or 0
        latency = batch.column("delivery_latency")
        none = pa.nulls(len(latency), pa.float64())
        for key, values in (
            ("delivery", latency),
            ("delivery_live", pc.if_else(live, latency, none)),
            ("delivery_replay", pc.if_else(live, none, latency)),
            ("ack", batch.column("ack_latency")),
        ):
            self.add_maximum(key, pc.max(values).as_py())
            self.hists[key].add_array(values)

    def merged(self, other: Tally) -> Tally:
        out = Tally()
        for tally in (self, other):
            for cid, counts in tally.clients.items():
                out.add_client(cid, counts)
            out.redelivered += tally.redelivered
            out.live += tally.live
            out.replayed += tally.replayed
            for key, top in tally.maxima.items():
                out.add_maximum(key, top)
        for key in LATENCIES:
            out.hists[key] = self.hists[key].merged(other.hists[key])
        return out

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "clients": [[cid, counts] for cid, counts in self.clients.items()],
                "redelivered": self.redelivered,
                "live": self.live,
                "replayed": self.replayed,
                "maxima": self.maxima,
                "hists": {k: list(h.counts.items()) for k, h in self.hists.items()},
            }
        )

    @classmethod
    def from_json(cls, data: bytes) -> Tally:
        raw = orjson.loads(data)
        out = cls(redelivered=raw["redelivered"], live=raw["live"], replayed=raw["replayed"])
        for cid, counts in raw["clients"]:  # a list: a client id may be null
            out.add_client(cid, counts)
        out.maxima = dict(raw["maxima"])
        for key, counts in raw["hists"].items():
            for b, n in counts:
                out.hists[key].add(b, n)
        return out

    def client_rows(self) -> list[dict[str, Any]]:
        """One dict per client (``cid`` and :data:`CLIENT_COLUMNS`), by cid, a null first."""
        order = sorted(self.clients, key=lambda cid: (cid is not None, cid or ""))
        return [{"cid": cid, **self.clients[cid]} for cid in order]


def summarize(tally: Tally, lost: list[dict[str, Any]], gaps: int, now: float) -> dict[str, Any]:
    """audit.json's summary of ``tally``: ``lost`` the lost messages listed, ``gaps``
    the delivery events the broker dropped."""
    clients = tally.client_rows()
    totals: dict[str, int] = {"persisted": sum(c["persisted"] for c in clients)}
    for status in STATUSES:
        totals[status] = sum(c[status] for c in clients)
    totals["duplicates"] = sum(c["duplicates"] for c in clients)
    totals["redelivered_messages"] = tally.redelivered

    def percentiles(key: str) -> dict[str, float | None]:
        hist = tally.hists[key]
        top = tally.maxima.get(key)
        out: dict[str, float | None] = {}
        for q in PERCENTILES:
            value = hist.quantile(q)
            out[f"p{int(q * 100)}"] = (
                min(value, top) if value is not None and top is not None else value
            )
        out["max"] = top
        return out

    return {
        "generated_at": now,
        "totals": totals,
        "ok": totals["lost"] == 0,
        "latency_seconds": {key: percentiles(key) for key in LATENCIES},
        "latency_precision": "log buckets of ratio 1.02: percentiles within 1 %",
        "delivered": {"live": tally.live, "replayed": tally.replayed},
        "events_dropped": gaps,
        "clients": clients,
        "lost_messages": lost,
    }


def latency_sample(tally: Tally) -> list[tuple[float | None, float | None, bool]]:
    """At most :data:`SAMPLE` delivery latencies, drawn from the histograms in
    proportion (the report's charts)."""
    out: list[tuple[float | None, float | None, bool]] = []
    total = tally.hists["delivery"].total
    if not total:
        return out
    scale = min(1.0, SAMPLE / total)
    for key, live in (("delivery_live", True), ("delivery_replay", False)):
        hist = tally.hists[key]
        for b, n in sorted(hist.counts.items()):
            out.extend([(hist.value(b), None, live)] * max(1, round(n * scale)))
    return out
