"""Rate limits, sans-IO: token buckets fed by the broker's injected clock.

A :class:`TokenBucket` holds at most ``capacity`` tokens and gains ``rate``
tokens per second; an action is allowed when a whole token can be taken.
devicemq sizes every bucket to one second's worth (``capacity = rate``, at
least 1), so a client may burst up to its per-second rate and then must
keep to it. A rate of 0 means no limit (:func:`bucket_or_none`).
"""

from __future__ import annotations

import ipaddress
import logging
from collections import OrderedDict
from typing import Any


class TokenBucket:
    __slots__ = ("_last", "_tokens", "capacity", "rate")

    def __init__(self, rate: float, now: float, capacity: float | None = None) -> None:
        self.rate = rate
        self.capacity = capacity if capacity is not None else max(1.0, rate)
        self._tokens = self.capacity
        self._last = now

    def available(self, now: float) -> float:
        """Tokens in the bucket now (refilled up to ``now``)."""
        elapsed = now - self._last
        if elapsed > 0:
            self._tokens = min(self.capacity, self._tokens + elapsed * self.rate)
        self._last = now
        return self._tokens

    def spend(self, tokens: float) -> None:
        """Take ``tokens`` that were already used (may leave the bucket in debt)."""
        self._tokens -= tokens

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


def is_loopback(address: str) -> bool:
    """An IP address of this host (127.0.0.0/8, ::1, IPv4-mapped too); False for
    anything that is not an IP address."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def source_key(host: str) -> str:
    """Who a connection comes from, for per-source limits.

    An IPv4 address as it is (also when written IPv4-mapped, ``::ffff:a.b.c.d``);
    an IPv6 address by its /64, the block one host or one customer usually holds
    (an attacker with one /64 has 2^64 addresses). Anything else (a Unix socket,
    a test's peer label) as given.
    """
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class SourceBuckets:
    """A :class:`TokenBucket` of ``rate`` per source (see :func:`source_key`).

    At most ``max_sources`` buckets are kept, least recently used dropped first:
    a dropped bucket comes back full, which helps only an attacker who already
    has that many addresses.
    """

    __slots__ = ("_buckets", "max_sources", "rate")

    def __init__(self, rate: float, max_sources: int = 65_536) -> None:
        self.rate = rate
        self.max_sources = max_sources
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, source: str, now: float, tokens: float = 1.0) -> bool:
        buckets = self._buckets
        bucket = buckets.get(source)
        if bucket is None:
            bucket = buckets[source] = TokenBucket(self.rate, now)
            if len(buckets) > self.max_sources:
                buckets.popitem(last=False)
        else:
            buckets.move_to_end(source)
        return bucket.take(now, tokens)


class LogLimiter:
    """Log lines of one kind (refused CONNECTs, ...) at a bounded rate.

    A flood must not turn into a flood of log lines, which cost the event loop
    and the disk as much as the attack; nor may it go unseen. Up to ``burst``
    lines pass at once and ``rate`` a second after that; the lines over it are
    counted, and the next line that passes (or :meth:`flush`, from the broker's
    periodic tick) says how many were left out. The counters the metrics export
    count every event, logged or not.
    """

    __slots__ = ("_bucket", "_logger", "suppressed", "what")

    def __init__(
        self, logger: logging.Logger, what: str, rate: float = 5.0, burst: float = 20.0
    ) -> None:
        self._logger = logger
        self.what = what  # "connection refusals": names the lines left out
        self._bucket = TokenBucket(rate, 0.0, burst)  # starts full
        self.suppressed = 0

    def log(self, now: float, level: int, msg: str, *args: Any) -> None:
        if not self._bucket.take(now):
            self.suppressed += 1
            return
        if self.suppressed:
            msg += " (%d more %s not logged before this one: rate limit)"
            args = (*args, self.suppressed, self.what)
            self.suppressed = 0
        self._logger.log(level, msg, *args)

    def flush(self, now: float) -> None:
        """Report lines left out, if any, once the rate allows a line again."""
        if self.suppressed and self._bucket.take(now):
            self._logger.warning(
                "%d %s not logged (rate limit; every one is counted in the metrics)",
                self.suppressed,
                self.what,
            )
            self.suppressed = 0


def topic_within_limits(topic: str, max_length: int, max_levels: int) -> bool:
    """A topic name or filter no longer than ``max_length`` UTF-8 bytes and
    ``max_levels`` levels (mqtt.max_topic_length, mqtt.max_topic_levels)."""
    n = len(topic)
    if n > max_length:
        return False
    if n * 4 > max_length and len(topic.encode()) > max_length:  # UTF-8: up to 4 bytes a char
        return False
    return topic.count("/") < max_levels
