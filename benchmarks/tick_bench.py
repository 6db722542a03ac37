"""What the broker's periodic tick costs with many clients connected or offline.

    python -m benchmarks.tick_bench [--connected 10000] [--offline 100000]

Fills a broker (in this process, no sockets, a fake clock) with that many
connected clients (keep-alive 60 s) and offline persistent sessions (expiry one
hour), then runs the tick every 0.5 s of fake time for 20 s and prints the
median and longest tick. A tick holds the event loop: every client of the
broker waits that long (BENCHMARKS.md, "The fleet shape").
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time

from broker.codec import encode
from broker.config import MqttSettings, Settings
from broker.connection import MQTTConnection
from broker.core import Broker
from broker.packets import Connect, Properties

TICKS = 40
TICK_INTERVAL = 0.5


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _connect(broker: Broker, client_id: str) -> MQTTConnection:
    conn = MQTTConnection(broker, "peer", on_output=lambda _c: None, on_input_flow=lambda _b: None)
    properties = Properties(session_expiry_interval=3600)
    conn.receive_data(
        encode(Connect(client_id, clean_start=False, keep_alive=60, properties=properties), 5)
    )
    conn.data_to_send()
    return conn


def measure(connected: int, offline: int) -> tuple[float, float]:
    """(median, longest) tick in seconds, after the first 30 s of fake time (the
    connect-timeout looks of the clients made at once are behind)."""
    clock = _Clock()
    mqtt = dataclasses.replace(
        MqttSettings(), max_connection_rate=0, max_connection_rate_per_source=0
    )
    broker = Broker(dataclasses.replace(Settings(), mqtt=mqtt), clock=clock)
    for i in range(offline):
        _connect(broker, f"off{i}").connection_lost()
    for i in range(connected):
        _connect(broker, f"dev{i}")
    clock.now += 30
    broker.tick()
    gc.collect()
    ticks = []
    for _ in range(TICKS):
        clock.now += TICK_INTERVAL
        start = time.perf_counter()
        broker.tick()
        ticks.append(time.perf_counter() - start)
    ticks.sort()
    return ticks[len(ticks) // 2], ticks[-1]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tick_bench")
    parser.add_argument("--connected", type=int, default=10_000)
    parser.add_argument("--offline", type=int, default=100_000)
    args = parser.parse_args()
    median, longest = measure(args.connected, args.offline)
    print(
        f"{args.connected:,} connected, {args.offline:,} offline: tick median "
        f"{median * 1e3:.2f} ms, longest {longest * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
