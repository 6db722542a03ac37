"""Retained messages (spec 3.3.1.3): the last retained message per topic."""

from __future__ import annotations

from collections.abc import Callable

from broker.message import Message
from broker.topics import topic_matches


class RetainedStore:
    def __init__(self) -> None:
        self._by_topic: dict[str, Message] = {}
        # persistence.enabled: every change is also written to Redis (persistence/retained.py)
        self.on_change: Callable[[Message], None] | None = None

    def __len__(self) -> int:
        return len(self._by_topic)

    def store(self, message: Message) -> None:
        """Keep ``message``; an empty payload deletes the topic's message (MQTT-3.3.1-6)."""
        self.replace(message.topic, message if message.payload else None)
        if self.on_change is not None:
            self.on_change(message)

    def topics(self) -> list[str]:
        return list(self._by_topic)

    def replace(self, topic: str, message: Message | None) -> None:
        """Set or delete ``topic``'s message as loaded or learned from elsewhere."""
        if message is not None:
            self._by_topic[topic] = message
        else:
            self._by_topic.pop(topic, None)

    def matching(self, topic_filter: str, now: float) -> list[Message]:
        """Unexpired retained messages for a new subscription, dropping expired ones."""
        if "+" not in topic_filter and "#" not in topic_filter:
            found = self._by_topic.get(topic_filter)
            candidates = [found] if found is not None else []
        else:
            candidates = [m for t, m in self._by_topic.items() if topic_matches(topic_filter, t)]
        live = []
        for message in candidates:
            if message.expired(now):
                del self._by_topic[message.topic]
            else:
                live.append(message)
        return live
