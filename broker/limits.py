"""Rate limits, sans-IO: token buckets fed by the broker's injected clock.

A :class:`TokenBucket` holds at most ``capacity`` tokens and gains ``rate``
tokens per second; an action is allowed when a whole token can be taken.
devicemq sizes every bucket to one second's worth (``capacity = rate``, at
least 1), so a client may burst up to its per-second rate and then must
keep to it. A rate of 0 means no limit (:func:`bucket_or_none`).
"""

from __future__ import annotations


class TokenBucket:
    __slots__ = ("_last", "_tokens", "capacity", "rate")

    def __init__(self, rate: float, now: float, capacity: float | None = None) -> None:
        self.rate = rate
        self.capacity = capacity if capacity is not None else max(1.0, rate)
        self._tokens = self.capacity
        self._last = now

    def take(self, now: float, tokens: float = 1.0) -> bool:
        """Take ``tokens`` if there are that many; False (and nothing taken) if not."""
        elapsed = now - self._last
        if elapsed > 0:
            self._tokens = min(self.capacity, self._tokens + elapsed * self.rate)
        self._last = now
        if self._tokens >= tokens:
            self._tokens -= tokens
            return True
        return False


def bucket_or_none(rate: float, now: float) -> TokenBucket | None:
    """A bucket for ``rate`` per second, or None when the limit is off (rate 0)."""
    return TokenBucket(rate, now) if rate > 0 else None


def topic_within_limits(topic: str, max_length: int, max_levels: int) -> bool:
    """A topic name or filter no longer than ``max_length`` UTF-8 bytes and
    ``max_levels`` levels (mqtt.max_topic_length, mqtt.max_topic_levels)."""
    n = len(topic)
    if n > max_length:
        return False
    if n * 4 > max_length and len(topic.encode()) > max_length:  # UTF-8: up to 4 bytes a char
        return False
    return topic.count("/") < max_levels
