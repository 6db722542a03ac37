"""Durable shared-group queues ($queue), sans IO.

``$queue/{group}/{filter}`` is a shared subscription whose messages are kept
once for the group, not once per member (``$share`` picks a member when a
message is routed, and an offline member keeps its share waiting for it):

- a message matching ``{filter}`` (published at QoS 1 or 2) is stored once
  for the group while the group has members, whether or not one is online;
- it goes to one member that is online and has room in its window, at QoS 1;
- a member that leaves (its connection closes, it unsubscribes, its session
  ends) gives back what it had not acknowledged: another member gets it, with
  DUP if it had been sent (MQTT 5 section 4.8.2 lets a shared subscription's
  message go to another member when its member's connection breaks);
- a member whose broker died keeps its claims only until their lease runs out.

Order is per member, as MQTT shared subscriptions allow, none across members.
QoS 0 messages are not queued (their publisher asked for at most once): a
group with only ``$queue`` members does not get them. Storage and delivery
are the persistent path's (persistence/group_feed.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.topics import QUEUE_PREFIX as PREFIX


def split(topic_filter: str) -> tuple[str, str] | None:
    """(group, inner filter) of a ``$queue/{group}/{filter}`` filter, None if it is
    not one (validity is :func:`broker.topics.is_valid_topic_filter`'s)."""
    if not topic_filter.startswith(PREFIX):
        return None
    group, slash, inner = topic_filter[len(PREFIX) :].partition("/")
    if not group or not slash or not inner:
        return None
    return group, inner


def is_group_filter(topic_filter: str) -> bool:
    return topic_filter.startswith(PREFIX)


def is_group_store(store_id: str) -> bool:
    """A queue store named by a group's filter (an $ECQ queue is named by a client id,
    which cannot contain ``/``)."""
    return store_id.startswith(PREFIX)


@dataclass(slots=True, frozen=True)
class GroupTarget:
    """A group a message is routed to, as the router names a session: the store is
    named by the subscription's filter as members send it, ``$queue/{group}/{filter}``
    (one store per group and filter). Stored through Kafka like a queue record."""

    client_id: str
    generation: int = 0
    durable: bool = True
    queue: bool = True  # a queue record (persistence/format.py FLAG_QUEUE)
    retained_sender: None = None  # the router's session interface: no retained messages
