"""The traffic job over the same workload: volumes per topic level, client, minute, size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.common import Window
from pipeline.traffic import run_traffic
from tests.pipeline.conftest import ACKED_EACH, ACKERS, EXPECTED, HOARDED, Workload


def test_traffic_tables_and_report(spark: Any, workload: Workload, tmp_path: Path) -> None:
    summary = run_traffic(
        spark,
        workload.endpoints,
        persisted_topic="devicemq.device.persisted",
        events_topic="devicemq.events",
        window=Window(),
        out=tmp_path,
        levels=2,
    )
    assert summary["totals"]["messages"] == EXPECTED["persisted"]
    # payload bytes: ackers 10..29 bytes each, sleeper 3x100, expirer 4x5, hoarder 15x1000, dup 2x1
    acker_bytes = sum(10 + i for i in range(ACKED_EACH)) * len(ACKERS)
    assert summary["totals"]["bytes"] == acker_bytes + 300 + 20 + HOARDED * 1000 + 2

    levels = {(r["level"], r["prefix"]): r["messages"] for r in summary["topic_levels"]}
    assert levels[(1, "audit")] == EXPECTED["persisted"]
    assert levels[(2, "audit/all")] == ACKED_EACH * len(ACKERS)
    assert levels[(2, "audit/trim")] == HOARDED
    clients = {r["cid"]: r["messages"] for r in summary["top_clients"]}
    assert clients["hoarder"] == HOARDED and clients["acker-1"] == ACKED_EACH
    assert summary["top_topics"][0]["topic"].startswith("audit/all/device")
    assert sum(r["messages"] for r in summary["sizes"]) == EXPECTED["persisted"]
    assert sum(r["messages"] for r in summary["minutes"]) == EXPECTED["persisted"]

    backlog = spark.read.parquet(str(tmp_path / "backlog.parquet"))
    last = {r["cid"]: r["backlog"] for r in backlog.orderBy("minute").collect()}
    # What is still stored at the end (expiries inside Redis are not events).
    assert last["sleeper"] == 3 and last["hoarder"] == 10 and last["acker-1"] == 0
    for name in ("topic_levels", "clients", "minutes", "topics", "sizes", "backlog"):
        assert (tmp_path / f"{name}.parquet").is_dir()
    assert json.loads((tmp_path / "traffic.json").read_text())["totals"] == summary["totals"]
    assert "data:image/png;base64," in (tmp_path / "traffic.html").read_text()
