"""app/loop_watch.py: the event loop's lag and the collector's pauses, as /metrics shows them."""

from __future__ import annotations

import asyncio
import gc
import re
import time

from app.loop_watch import LoopWatch
from app.metrics import MetricsServer
from broker.config import MetricsSettings
from broker.stats import Histogram
from tests.conftest import free_port
from tests.deploy.test_metrics_server import get

HOLD = 0.3  # seconds a callback holds the loop


def _above(histogram: Histogram, bound: float) -> int:
    """Observations larger than ``bound`` (one of the histogram's bounds)."""
    start = histogram.buckets.index(bound) + 1
    return sum(histogram.counts[start:])


async def test_a_callback_that_holds_the_loop_shows_as_lag() -> None:
    watch = LoopWatch(interval=0.05)
    watch.start()
    try:
        await asyncio.sleep(0.2)
        late, lag = _above(watch.lag, 0.1), watch.lag.sum
        # A timer of the watch's is due within 0.05 s and cannot fire before the
        # hold ends: one sample at least HOLD - 0.05 late, however busy the machine.
        asyncio.get_running_loop().call_soon(time.sleep, HOLD)
        await asyncio.sleep(HOLD + 0.1)
        assert _above(watch.lag, 0.1) >= late + 1
        assert watch.lag.sum - lag >= HOLD - 0.05 - 0.01
    finally:
        await watch.stop()


async def test_a_full_collection_is_timed_by_its_generation() -> None:
    watch = LoopWatch()
    watch.start()
    try:
        before = sum(watch.gc_pauses[2].counts)
        gc.collect(2)
        assert sum(watch.gc_pauses[2].counts) == before + 1
        assert watch.gc_pauses[2].sum > 0
    finally:
        await watch.stop()
    gc.collect(2)  # stopped: no longer counted
    assert sum(watch.gc_pauses[2].counts) == before + 1


async def test_metrics_export_lag_and_collections() -> None:
    server = MetricsServer(MetricsSettings(enabled=True, host="127.0.0.1", port=free_port()))
    await server.start()
    try:
        asyncio.get_running_loop().call_soon(time.sleep, HOLD)
        await asyncio.sleep(HOLD + 0.2)
        gc.collect(2)
        status, text = await get(server.port, "/metrics")
        assert status == 200
        held = re.search(r'^devicemq_event_loop_lag_seconds_bucket\{le="0\.1"\} (\S+)$', text, re.M)
        total = re.search(r"^devicemq_event_loop_lag_seconds_count (\S+)$", text, re.M)
        assert held and total and float(total.group(1)) - float(held.group(1)) >= 1
        full = re.search(r'^devicemq_gc_pause_seconds_count\{generation="2"\} (\S+)$', text, re.M)
        assert full and float(full.group(1)) >= 1
        assert 'devicemq_gc_pause_seconds_count{generation="0"}' in text
    finally:
        await server.stop()
    assert server.loop_watch._task is None
