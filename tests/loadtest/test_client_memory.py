"""The load tool's publishers stay small, and reuse packet ids only once free."""

from __future__ import annotations

import asyncio
import tracemalloc
from typing import cast

from loadtest.client import NS, Publisher, Stats


class _Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)


def _publisher(inflight: int = 10, limit: int = 0) -> Publisher:
    p = Publisher(0, "p", "t/0", 1, 62, 1, 4, Stats(), 0.0, inflight, bytes(64))
    p.limit = limit
    return p


def _pids(data: bytes) -> list[int]:
    """Packet ids of the QoS 1 PUBLISHes in ``data`` (topic "t/0", 62 B payloads)."""
    size = 2 + 2 + 3 + 2 + 62
    return [int.from_bytes(data[i + 7 : i + 9], "big") for i in range(0, len(data), size)]


def test_a_thousand_publishers_hold_less_than_ten_megabytes() -> None:
    """Two lists of 65,536 packet-id slots per publisher were a megabyte each: 4 GB
    of loader at 4,000 pairs. The slots are now as many as the window."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        publishers = [_publisher() for _ in range(1000)]
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(publishers) == 1000
    assert used < 10_000_000, used


def test_a_packet_id_is_reused_only_after_its_acknowledgement() -> None:
    async def run() -> None:
        p = _publisher(inflight=3, limit=5)
        transport = _Transport()
        p.transport = cast(asyncio.Transport, transport)
        p.connected = True
        p.start(0)
        first = _pids(b"".join(transport.written))
        assert first == [1, 2, 3]
        transport.written.clear()
        p.data_received(b"\x40\x02\x00\x02")  # PUBACK 2, out of order
        assert _pids(b"".join(transport.written)) == [2]  # the only free id
        transport.written.clear()
        p.data_received(b"\x40\x02\x00\x03\x40\x02\x00\x01")  # PUBACK 3, 1
        # the limit: 5 messages in all, the fifth takes a freed id
        assert _pids(b"".join(transport.written)) == [3]
        assert p.sent == 5 and p.outstanding == 2
        assert p.acked_count == 3 and bytes(p.acked) == b"\x01\x01\x01\x00\x00"
        p.data_received(b"\x40\x02\x00\x01")  # PUBACK 1 again: not in flight, ignored
        assert p.outstanding == 2 and p.acked_count == 3 and list(p._free_pids) == [1]

    asyncio.run(run())


def test_a_throttled_publisher_waits_for_its_phase() -> None:
    """A publisher at 1 msg/s starting 0.5 s from now sends nothing until then (its
    first message went at once: every publisher's first message in one burst)."""

    async def run() -> None:
        p = Publisher(0, "p", "t/0", 1, 62, 1, 4, Stats(), 1.0, 10, bytes(64))
        transport = _Transport()
        p.transport = cast(asyncio.Transport, transport)
        p.connected = True
        start = 10 * NS
        p.start_ns, p.running = start, True
        p.fill(start - NS // 2)
        assert p.sent == 0 and transport.written == []
        p.fill(start)
        assert p.sent == 1
        assert p.next_due() == start + NS
        p.fill(start + NS - 1)
        assert p.sent == 1
        p.fill(start + NS)
        assert p.sent == 2

    asyncio.run(run())
