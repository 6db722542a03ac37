"""Micro-benchmark of the load generator's hot paths: ``python -m benchmarks.client_bench``.

Pure Python cost per message, no sockets (best of several repeats), for a
batch of 100 QoS 1 PUBLISHes with a 64-byte payload, on MQTT 3.1.1 and 5:

- ``subscriber``: ``Subscriber.data_received`` on the batch: parse, check
  (loss/duplicate/order bookkeeping), latency sample, PUBACK encoded;
- ``codec decode only``: ``broker.codec.PacketDecoder.feed`` on the same
  batch, which builds a ``Publish`` per message and does no bookkeeping:
  the fast path has to beat this to be worth having;
- ``publisher fill``: encoding 100 PUBLISHes from the pre-encoded template;
- ``publisher PUBACK``: ``Publisher.data_received`` on 100 PUBACKs.
"""

from __future__ import annotations

import asyncio
import time
import timeit
from collections.abc import Callable
from typing import cast

from broker.codec import PacketDecoder
from loadtest.client import Publisher, Stats, Subscriber

BATCH = 100
NUMBER = 200
REPEAT = 7


class _Sink:
    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.chunks.append(data)


def _ns(func: Callable[[], object]) -> float:
    return min(timeit.repeat(func, number=NUMBER, repeat=REPEAT)) / NUMBER / BATCH * 1e9


def main() -> None:
    print(f"{'path (ns per message)':<24}{'3.1.1':>8}{'5':>8}")
    rows: dict[str, list[float]] = {}
    for level in (4, 5):
        stats = Stats()
        pub = Publisher(
            0, "p", "loadtest/0000beef/p2p/17", 1, 64, 7, level, stats, 0, BATCH, bytes(64)
        )
        sink = _Sink()
        pub.transport = cast(asyncio.Transport, sink)
        pub.connected = pub.running = True

        def fill(pub: Publisher = pub) -> None:
            pub.outstanding = 0
            # The send time is real: a PUBACK's latency (now - sent) must fit the
            # histogram, which a send at 0 overflows once uptime passes ~71 min.
            pub.fill(time.monotonic_ns())

        fill()
        batch = sink.chunks[-1]
        sub = Subscriber(0, "s", "x", 1, 7, level, True, 0, stats)
        sub.transport = cast(asyncio.Transport, _Sink())
        sub.data_received(batch)  # first pass: the sequence numbers are new ones
        decoder = PacketDecoder(protocol_level=level)
        acks = b"".join(bytes((0x40, 2, 0, i + 1)) for i in range(BATCH))

        def pubacks(pub: Publisher = pub, acks: bytes = acks) -> None:
            pub.outstanding = BATCH
            pub.running = False
            pub.data_received(acks)

        rows.setdefault("subscriber", []).append(
            _ns(lambda s=sub, b=batch: s.data_received(b))  # type: ignore[misc]
        )
        rows.setdefault("codec decode only", []).append(
            _ns(lambda d=decoder, b=batch: d.feed(b))  # type: ignore[misc]
        )
        rows.setdefault("publisher fill", []).append(_ns(fill))
        rows.setdefault("publisher PUBACK", []).append(_ns(pubacks))
    for name, values in rows.items():
        print(f"{name:<24}" + "".join(f"{v:>8.0f}" for v in values))


if __name__ == "__main__":
    main()
