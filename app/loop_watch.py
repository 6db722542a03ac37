"""How late the event loop runs, and how long the garbage collector stops it.

Every client of a broker process shares one event loop: whatever holds it (a
full collection walking every session's objects, a blocking call, a large
reply decoded in one go) delays every socket at once, and shows in the fleet's
latency tail. The tail can also come from outside the process: Kafka, Redis,
or a machine whose cores are busy elsewhere. These two histograms tell the two
apart (docs/metrics.md): a tail with no lag and no long collection here was not
the broker's loop.

- :attr:`LoopWatch.lag`: a timer asked every :data:`INTERVAL` seconds, observed
  by how late it fired. A callback that holds the loop for 0.3 s shows once, as
  a lag of 0.2-0.3 s; a busy but responsive loop shows lags of a few ms.
- :attr:`LoopWatch.gc_pauses`: each collection of the cyclic garbage collector,
  by generation, timed through :data:`gc.callbacks` (the loop stops for all of
  it).

The watch costs one timer every 100 ms and two clock reads per collection.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Callable
from typing import Any

from broker.stats import Histogram

INTERVAL = 0.1  # seconds between two timers asked
LAG_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
GENERATIONS = (0, 1, 2)


class LoopWatch:
    """The loop's lag and the collector's pauses, for /metrics (app/metrics.py)."""

    def __init__(
        self, interval: float = INTERVAL, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.interval = interval
        self._clock = clock
        self.lag = Histogram(LAG_BUCKETS)
        self.gc_pauses = {generation: Histogram(LAG_BUCKETS) for generation in GENERATIONS}
        self._task: asyncio.Task[None] | None = None
        self._collecting_since: float | None = None

    def start(self) -> None:
        """Watch from now on, in the running loop."""
        if self._task is not None:
            return
        gc.callbacks.append(self._on_collection)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-watch")

    async def stop(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_collection)
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        interval, clock, observe = self.interval, self._clock, self.lag.observe
        while True:
            asked = clock()
            await asyncio.sleep(interval)
            observe(max(0.0, clock() - asked - interval))

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._collecting_since = self._clock()
            return
        since, self._collecting_since = self._collecting_since, None
        pauses = self.gc_pauses.get(info.get("generation", -1))
        if since is not None and pauses is not None:
            pauses.observe(self._clock() - since)
