"""What the audits add up of their messages (pipeline/tally.py), without Spark."""

from __future__ import annotations

import math
from typing import Any

import pyarrow as pa
import pytest

from pipeline.accounting import MESSAGE_SCHEMA
from pipeline.decoding import arrow_schema
from pipeline.tally import LogHistogram, Tally, latency_sample, summarize


def message(cid: str | None, status: str, **fields: Any) -> dict[str, Any]:
    return {"cid": cid, "status": status, "deliveries": 0, "live": False, **fields}


def delivered(cid: str, latency: float, live: bool, deliveries: int = 1) -> dict[str, Any]:
    return message(
        cid,
        "acked",
        delivered_ts=100.0 + latency,
        delivery_latency=latency,
        ack_latency=latency * 2,
        deliveries=deliveries,
        live=live,
    )


ROWS = [
    delivered("a", 0.010, live=True),
    delivered("a", 0.020, live=True, deliveries=3),
    delivered("b", 5.0, live=False),
    message("b", "pending"),
    message(None, "lost"),  # a record with no key: a client of its own
]


def tally_of(rows: list[dict[str, Any]]) -> Tally:
    tally = Tally()
    tally.add_messages(pa.RecordBatch.from_pylist(rows, schema=arrow_schema(MESSAGE_SCHEMA)))
    return tally


def test_a_batch_of_messages_is_counted_per_client_with_its_latencies() -> None:
    tally = tally_of(ROWS)
    rows = tally.client_rows()
    assert [r["cid"] for r in rows] == [None, "a", "b"]  # a null first, as Spark orders
    assert (rows[1]["persisted"], rows[1]["acked"], rows[1]["duplicates"]) == (2, 2, 2)
    assert (rows[2]["acked"], rows[2]["pending"], rows[0]["lost"]) == (1, 1, 1)
    assert (tally.redelivered, tally.live, tally.replayed) == (1, 2, 1)
    assert tally.maxima == {
        "delivery": 5.0,
        "delivery_live": 0.020,
        "delivery_replay": 5.0,
        "ack": 10.0,
    }
    assert tally.hists["delivery"].total == 3 and tally.hists["delivery_replay"].total == 1
    p50 = tally.hists["delivery_live"].quantile(0.5)
    assert p50 == pytest.approx(0.010, rel=0.01)
    assert LogHistogram.bucket_of(0.010) in tally.hists["delivery_live"].counts


def test_tallies_of_parts_add_up_to_the_tally_of_the_whole_through_json() -> None:
    whole = tally_of(ROWS)
    parts = [Tally.from_json(tally_of(part).to_json()) for part in (ROWS[:2], ROWS[2:])]
    again = parts[0].merged(parts[1])
    assert again.client_rows() == whole.client_rows()
    assert (again.redelivered, again.live, again.replayed) == (1, 2, 1)
    assert again.maxima == whole.maxima
    assert {k: h.counts for k, h in again.hists.items()} == {
        k: h.counts for k, h in whole.hists.items()
    }


def test_the_summary_of_a_tally() -> None:
    summary = summarize(tally_of(ROWS), [], gaps=4, now=1.0)
    assert summary["totals"]["persisted"] == 5 and summary["totals"]["lost"] == 1
    assert not summary["ok"] and summary["events_dropped"] == 4
    live = summary["latency_seconds"]["delivery_live"]
    assert live["max"] == 0.020 and live["p99"] == pytest.approx(0.020, rel=0.01)
    # a percentile below the maximum: its bucket's middle, within 1 %
    assert live["p50"] == pytest.approx(0.010, rel=0.01) and live["p50"] < 0.0105
    assert summary["delivered"] == {"live": 2, "replayed": 1}
    sample = latency_sample(tally_of(ROWS))
    assert sorted(live for _d, _a, live in sample) == [False, True, True]
    assert all(math.isfinite(d) for d, _a, _l in sample if d is not None)


def test_the_streams_rows_add_up_as_a_batch_of_the_same_messages() -> None:
    # the stream groups its messages with Spark SQL into one row per client
    row = {"cid": "a", "persisted": 2, "acked": 2, "duplicates": 2, "redelivered": 1}
    row |= {"n_live": 2, "n_replay": 0, "delivery_max": 0.020, "delivery_live_max": 0.020}
    row |= {"delivery_replay_max": None, "ack_max": 0.040}
    streamed = Tally()
    streamed.add_row(row)
    batch = tally_of(ROWS[:2])
    assert streamed.client_rows() == batch.client_rows()
    assert (streamed.redelivered, streamed.live, streamed.replayed) == (1, 2, 0)
    assert streamed.maxima == batch.maxima


@pytest.mark.parametrize("value", [0.0, -3.0, 1e-6, 1e-3, 1.02**10, 0.5, 7.25, 3600.0])
def test_a_value_falls_in_the_same_bucket_in_python_and_arrow_terms(value: float) -> None:
    # the tasks bucket with Arrow; Spark SQL's terms (the stream's) are checked
    # in tests/pipeline/test_stream.py, beside a Spark session
    want = [LogHistogram.bucket_of(value)]
    assert LogHistogram.bucket_array(pa.array([value])).to_pylist() == want
