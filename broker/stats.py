"""Counters kept by the sans-IO core; the metrics layer exports them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class BrokerStats:
    connections_total: int = 0
    connections_rejected: dict[str, int] = field(default_factory=dict)  # by reason name
    messages_received: list[int] = field(default_factory=lambda: [0, 0, 0])  # by QoS
    messages_sent: list[int] = field(default_factory=lambda: [0, 0, 0])  # by QoS
    bytes_received: int = 0
    bytes_sent: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # PUBLISH drops by reason

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def reject(self, reason: str) -> None:
        self.connections_rejected[reason] = self.connections_rejected.get(reason, 0) + 1
