"""What the queue scenarios (``ecq``, ``group-queue``) share: an MQTT 5
connection through the broker's own codec, the drain after the load, the
latency summary, and the report (text, JSON, exit status)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

from broker.codec import PacketDecoder, encode
from broker.packets import ConnAck, Connect, Disconnect, Properties

__all__ = ["Conn", "drain", "latency_summary", "run_reported"]


class Conn(asyncio.Protocol):
    """One MQTT 5 connection through the project's codec."""

    def __init__(self, client_id: str) -> None:
        self.client_id = client_id
        self.transport: asyncio.Transport | None = None
        self.decoder = PacketDecoder(protocol_level=5)
        self.waiter: asyncio.Future[object] | None = None
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def open(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        await loop.create_connection(lambda: self, host, port)
        connack = await self.request(
            Connect(
                self.client_id,
                protocol_level=5,
                clean_start=True,
                keep_alive=600,
                properties=Properties(receive_maximum=65535),
            )
        )
        if not isinstance(connack, ConnAck) or connack.reason_code:
            raise RuntimeError(f"{self.client_id}: CONNECT refused: {connack!r}")

    async def request(self, packet: Any) -> object:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(encode(packet, 5))
        return await asyncio.wait_for(self.waiter, 30)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)

    def data_received(self, data: bytes) -> None:
        for packet in self.decoder.feed(data):
            self.packet(packet)

    def packet(self, packet: object) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(packet)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.write(encode(Disconnect(), 5))
            self.transport.close()


async def drain(pending: Callable[[], bool], seconds: float) -> float:
    """Wait while ``pending()`` holds, at most ``seconds``; return the wait."""
    started = time.monotonic()
    while pending() and time.monotonic() - started < seconds:
        await asyncio.sleep(0.05)
    return time.monotonic() - started


def latency_summary(latencies: list[float]) -> dict[str, float | None]:
    """p50, p99 and max of ``latencies`` (seconds); None for each when empty."""
    ordered = sorted(latencies)

    def pct(p: float) -> float | None:
        if not ordered:
            return None
        return round(ordered[min(len(ordered) - 1, int(p * len(ordered)))], 4)

    return {"p50": pct(0.5), "p99": pct(0.99), "max": ordered[-1] if ordered else None}


def run_reported(
    config: Any,
    run: Callable[[Any], Coroutine[Any, Any, dict[str, Any]]],
    fmt: Callable[[dict[str, Any]], str],
    json_path: str | None,
    ok: Callable[[dict[str, Any]], bool],
) -> int:
    """Check ``config`` (exit 2), run it (exit 1 on a connection error), print the
    result and write it as JSON; exit 0 if ``ok(result)``."""
    try:
        config.check()
    except ValueError as e:
        print(f"loadtest: error: {e}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(run(config))
    except (RuntimeError, OSError, TimeoutError) as e:
        print(f"loadtest: error: {e}", file=sys.stderr)
        return 1
    print(fmt(result))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if ok(result) else 1
