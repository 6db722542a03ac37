"""Counters kept by the sans-IO core; the metrics layer exports them."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

# Upper bounds (seconds) of the latency buckets; one more bucket holds the rest.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 300.0, 3600.0,
)  # fmt: skip
# Upper bounds of size buckets (messages).
SIZE_BUCKETS = (1.0, 10.0, 50.0, 100.0, 500.0, 1000.0, 5000.0, 10000.0, 65535.0)


class Histogram:
    """Bucketed observations, cheap enough for the hot path (no lock, one bisect).

    ``counts[i]`` counts values <= ``buckets[i]`` and > the bound before it;
    ``counts[-1]`` counts values above every bound. The metrics layer exports
    it as a Prometheus histogram (cumulative buckets, sum, count).
    """

    __slots__ = ("buckets", "counts", "sum")

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value


@dataclass(slots=True)
class BrokerStats:
    connections_total: int = 0
    connections_rejected: dict[str, int] = field(default_factory=dict)  # by reason name
    messages_received: list[int] = field(default_factory=lambda: [0, 0, 0])  # by QoS
    messages_sent: list[int] = field(default_factory=lambda: [0, 0, 0])  # by QoS
    bytes_received: int = 0
    bytes_sent: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # PUBLISH drops by reason
    payload_bytes_received: list[int] = field(default_factory=lambda: [0, 0, 0])  # by QoS
    payload_bytes_sent: list[int] = field(default_factory=lambda: [0, 0, 0])  # by QoS
    input_pauses: int = 0  # reading from a publisher stopped: its acknowledgements owed
    flapping_blocks: int = 0  # client IDs blocked for connecting too often (broker/blocklist.py)
    # The persistent path's outgoing side (persistence/store_feed.py)
    persisted_delivered: int = 0  # PUBLISH sends of stored messages, re-sends included
    persisted_acked: int = 0  # PUBACK / PUBCOMP removed a stored message
    persisted_undeliverable: int = 0  # expired by send time, or too large for the client
    delivery_latency: Histogram = field(default_factory=Histogram)  # publish -> first send, s
    replay_pages: Histogram = field(default_factory=lambda: Histogram(SIZE_BUCKETS))
    # Exclusive compacted queues ($ECQ, persistence/queue_feed.py)
    queue_delivered: int = 0  # PUBLISH sends of queue entries, re-sends included
    queue_acked: int = 0  # PUBACKs of queue entries

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def reject(self, reason: str) -> None:
        self.connections_rejected[reason] = self.connections_rejected.get(reason, 0) + 1
