"""The pipeline's HTML reports, rendered in headless Chromium: every chart has data
drawn (the report's own count of data points, and an image the browser decoded),
and charts over time have their axis fitted to the data, for a window of one
minute and one of hours (synthetic rows: no Spark, no broker)."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path
from typing import Any, cast

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from pipeline import audit, traffic
from pipeline.audit import STATUSES, AuditResult

START = 1_795_600_000.0  # epoch seconds, a minute boundary


def _minute(i: int) -> dt.datetime:
    """As PySpark gives a timestamp: a naive datetime in this process's local time."""
    return dt.datetime.fromtimestamp(START + 60 * i)


def _traffic_rows(minutes: int) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    rows: dict[str, list[dict[str, Any]]] = {
        "minutes": [
            {"minute": _minute(i), "messages": 100 + i % 7, "bytes": 6400} for i in range(minutes)
        ],
        "topics": [{"topic": "t/1", "messages": 100, "bytes": 6400}],
        "clients": [{"cid": "c1", "messages": 100, "bytes": 6400}],
        "topic_levels": [{"level": 1, "prefix": "t", "messages": 100, "bytes": 6400}],
        "sizes": [{"up_to_bytes": 64, "messages": 100}],
        "backlog": [
            {"cid": cid, "minute": _minute(i), "backlog": (i * 3) % 11}
            for cid in ("c1", "c2")
            for i in range(minutes)
        ],
    }
    summary = {"totals": {"messages": 100 * minutes, "bytes": 6400 * minutes}}
    return summary, rows


def _figures(driver: WebDriver, path: Path) -> list[dict[str, Any]]:
    driver.get(path.as_uri())
    found = []
    for figure in driver.find_elements(By.TAG_NAME, "figure"):
        img = figure.find_element(By.TAG_NAME, "img")
        found.append(
            {
                "caption": figure.text,
                "points": int(figure.get_attribute("data-points") or 0),
                "x_from": figure.get_attribute("data-x-from"),
                "x_to": figure.get_attribute("data-x-to"),
                "decoded": driver.execute_script("return arguments[0].naturalWidth", img),
            }
        )
    return found


@pytest.mark.parametrize("minutes", [1, 2, 6 * 60], ids=["one-minute", "two-minutes", "six-hours"])
def test_every_traffic_chart_is_drawn_with_its_time_axis_fitted(
    chromium: WebDriver, tmp_path: Path, minutes: int
) -> None:
    """One point was drawn as a line of nothing on an axis spanning 2025-2029."""
    summary, rows = _traffic_rows(minutes)
    path = tmp_path / "traffic.html"
    traffic._html(summary, rows, path)
    figures = _figures(chromium, path)
    captions = [f["caption"] for f in figures]
    assert captions == [
        "Messages per minute",
        "Payload size distribution",
        "Backlog per client (largest)",
    ]
    for f in figures:
        assert f["points"] > 0 and f["decoded"] > 0, f
    data_span = 60 * (minutes - 1)
    pad = max(data_span * 0.05, 30)
    for f in (figures[0], figures[2]):
        low, high = float(f["x_from"]), float(f["x_to"])
        assert low == pytest.approx(START - pad, abs=1), f
        assert high == pytest.approx(START + data_span + pad, abs=1), f
    assert figures[0]["points"] == minutes
    assert figures[2]["points"] == 2 * minutes


def test_every_audit_chart_is_drawn(chromium: WebDriver, tmp_path: Path) -> None:
    totals = dict.fromkeys(STATUSES, 0) | {"acked": 95, "pending": 4, "purged": 1}
    latency = {"p50": 0.01, "p90": 0.02, "p99": 0.05, "max": 0.1}
    summary = {
        "generated_at": time.time(),
        "topics": {"persisted": "devicemq.device.persisted", "epoch": 1, "events": "ev"},
        "totals": totals,
        "events_dropped": 0,
        "latency_seconds": {"delivery": latency, "ack": latency},
        "clients": [],
        "lost_messages": [],
    }
    latencies: list[tuple[float | None, float | None, bool]]
    latencies = [(0.001 * i, 0.002 * i, i % 4 != 0) for i in range(100)]
    result = AuditResult(summary, cast(Any, None), cast(Any, None), latencies)
    path = tmp_path / "audit.html"
    audit._html(result, path)
    figures = _figures(chromium, path)
    assert [f["caption"] for f in figures] == [
        "Persisted messages by status",
        "Publish to first delivery, clients connected",
        "Publish to first delivery, replayed from the backlog",
    ]
    for f in figures:
        assert f["points"] > 0 and f["decoded"] > 0, f
