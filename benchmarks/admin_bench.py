"""What the admin API's listings cost the broker's event loop with many sessions.

    python -m benchmarks.admin_bench [--sessions 1000000]

Fills a broker (in this process, no sockets) with that many sessions and times
``GET /api/v1/sessions`` (a first page, a client-ID prefix, a cursor halfway)
and ``GET /api/v1/subscriptions`` through ``AdminApi.handle``: the whole
request, and the longest the loop was held at once (a task that yields in a
loop measures the gaps). The MQTT clients of a replica wait that long.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import time

from app.admin import AdminApi
from app.http import Request
from broker.config import Settings
from broker.core import Broker
from broker.outflow import MemoryFeed
from broker.session import Session


def _fill(broker: Broker, count: int) -> None:
    """Sessions in a random order, as clients connect (a sorted dict would flatter
    a sort: Timsort is linear on sorted input)."""
    order = list(range(count))
    random.Random(1).shuffle(order)
    for i in order:
        cid = f"dev-{i:07d}"
        broker.sessions[cid] = Session(cid, 0, 1, MemoryFeed(1, broker.stats), broker.stats)


async def measure_request(api: AdminApi, request: Request) -> tuple[float, float, int]:
    """(seconds ``request`` took, the longest event-loop step meanwhile, the loop's
    turns meanwhile): a ticker task notes every turn while the API answers."""
    holds: list[float] = []
    done = False

    async def ticker() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0)
            now = time.perf_counter()
            holds.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    holds.clear()
    start = time.perf_counter()
    await api.handle(request)
    took = time.perf_counter() - start
    done = True
    await task
    return took, max(holds, default=took), len(holds)


async def _measure(api: AdminApi, path: str, query: dict[str, str]) -> tuple[float, float]:
    """(seconds for the request, longest loop hold in seconds)."""
    took, hold, _turns = await measure_request(
        api, Request("GET", path, query, {}, b"", "127.0.0.1")
    )
    return took, hold


async def _run(count: int) -> None:
    settings = Settings()
    broker = Broker(settings)
    _fill(broker, count)
    gc.collect()
    gc.freeze()  # the sessions are long-lived: no collection walks them meanwhile
    api = AdminApi(settings, broker, "bench", token=None)
    cases = [
        ("/api/v1/sessions", {"limit": "100"}),
        ("/api/v1/sessions", {"limit": "100", "client_id": "dev-00999"}),
        ("/api/v1/sessions", {"limit": "100", "cursor": f"dev-{count // 2:07d}"}),
        ("/api/v1/subscriptions", {}),
    ]
    print(f"{count:,} sessions")
    for path, query in cases:
        took, hold = await _measure(api, path, query)
        print(f"  {path} {query}: {took * 1000:.0f} ms, longest loop hold {hold * 1000:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=1_000_000)
    args = parser.parse_args()
    asyncio.run(_run(args.sessions))


if __name__ == "__main__":
    main()
