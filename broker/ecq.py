"""The exclusive compacted queue's protocol rules ($ECQ), sans IO.

A queue belongs to one consumer client id ``{cid}``:

- a producer publishes to ``$ECQ/w/{cid}/{key}`` (the ``w`` keeps producer
  topics out of consumer subscriptions); the message is stored for the queue
  whether or not its consumer ever connected;
- only the client ``{cid}`` may subscribe, to exactly ``$ECQ/{cid}/#``, at
  QoS 1 (a built-in rule, ACL file or not);
- it receives each message as ``$ECQ/{cid}/{key}``; a newer message of a key
  replaces an older one not yet acknowledged (compaction); every message has
  the next sequence number of its queue, sent to MQTT 5 consumers as the user
  property ``seq``;
- ``rewind``: a SUBSCRIBE user property ``rewind=N`` on that subscription, or
  a publish of ``N`` (decimal) to ``$ECQ/c/{cid}/rewind`` by the consumer
  itself, re-delivers the latest value of every key with sequence >= N that
  retention kept.

A client id with ``/``, ``+`` or ``#`` in it cannot name a queue (the levels
would be ambiguous). Every other ``$ECQ/`` topic and filter is refused.
Storage and delivery are the persistent path's (persistence/queue_store.py,
persistence/queue_feed.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

PREFIX = "$ECQ/"
SEQ_PROPERTY = "seq"  # user property carrying a delivery's sequence number
REWIND_PROPERTY = "rewind"  # SUBSCRIBE user property: re-deliver from this sequence


@dataclass(slots=True, frozen=True)
class QueueWrite:
    """A producer's publish to queue ``client_id`` under ``key``."""

    client_id: str
    key: str


@dataclass(slots=True)
class QueueAddressee:
    """Whom a queued message is routed for, as the persistent path names a session:
    the queue's consumer client id; queues have no session generation."""

    client_id: str
    generation: int = 0


class TopicKind(Enum):
    PLAIN = 0  # not an $ECQ topic
    WRITE = 1  # $ECQ/w/{cid}/{key}
    REWIND = 2  # $ECQ/c/{cid}/rewind
    INVALID = 3  # any other $ECQ/ topic


def is_queue_topic(topic: str) -> bool:
    return topic.startswith(PREFIX)


def valid_client_id(client_id: str) -> bool:
    return bool(client_id) and not any(c in client_id for c in "/+#")


# Made once: classify runs on every PUBLISH, and a look-up of a member on an Enum
# class costs about 120 ns on Python 3.11 (BENCHMARKS.md, "Enum members").
_PLAIN = (TopicKind.PLAIN, "", "")


def classify(topic: str) -> tuple[TopicKind, str, str]:
    """What a PUBLISH topic is: (kind, queue client id, key)."""
    if not topic.startswith(PREFIX):
        return _PLAIN
    parts = topic.split("/", 3)
    if len(parts) == 4 and parts[1] == "w" and parts[2] and parts[3]:
        return TopicKind.WRITE, parts[2], parts[3]
    if len(parts) == 4 and parts[1] == "c" and parts[2] and parts[3] == "rewind":
        return TopicKind.REWIND, parts[2], ""
    return TopicKind.INVALID, "", ""


def consumer_filter(client_id: str) -> str:
    return f"{PREFIX}{client_id}/#"


def consumer_topic(client_id: str, key: str) -> str:
    return f"{PREFIX}{client_id}/{key}"


def key_of(client_id: str, topic: str) -> str:
    """The key of a delivery topic :func:`consumer_topic` made."""
    return topic[len(PREFIX) + len(client_id) + 1 :]


class SubscribeVerdict(Enum):
    PLAIN = 0  # not an $ECQ filter: the ordinary rules apply
    CONSUMER = 1  # the client's own queue
    REFUSED = 2  # someone else's queue, or no queue filter at all


def subscribe_verdict(client_id: str, topic_filter: str) -> SubscribeVerdict:
    """Exclusive: only ``{cid}`` subscribes to ``$ECQ/{cid}/#``; a shared
    subscription to a queue is refused too."""
    if topic_filter.startswith("$share/"):
        parts = topic_filter.split("/", 2)
        if len(parts) == 3 and parts[2].startswith(PREFIX):
            return SubscribeVerdict.REFUSED
        return SubscribeVerdict.PLAIN
    if not topic_filter.startswith(PREFIX):
        return SubscribeVerdict.PLAIN
    if valid_client_id(client_id) and topic_filter == consumer_filter(client_id):
        return SubscribeVerdict.CONSUMER
    return SubscribeVerdict.REFUSED


def parse_rewind(text: str) -> int | None:
    """A rewind's sequence number (decimal, >= 1), None if it is not one."""
    text = text.strip()
    if not text.isascii() or not text.isdigit() or len(text) > 19:
        return None
    value = int(text)
    return value if value >= 1 else None
