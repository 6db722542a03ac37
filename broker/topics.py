"""Topic names, topic filters and the subscription tree (MQTT 5.0 spec 4.7, 4.8.2).

Sans-IO and synchronous: plain data structures the session layer drives.
Validation answers yes/no; the caller picks the reason code (0x8F/0x90) or
closes the connection, because that choice depends on the packet and the
protocol version.

The tree is a trie keyed by topic level. ``match()`` walks only the exact,
``+`` and ``#`` children at each level, so its cost depends on the topic's
depth and the subscriptions that match it, never on unrelated subscriptions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

SHARE_PREFIX = "$share/"
QUEUE_PREFIX = "$queue/"  # a durable group queue (broker/group_queue.py)

_MAX_UTF8_BYTES = 65535
# A code point is at most 4 bytes in UTF-8: shorter strings cannot exceed the limit.
_MAX_CHARS_WITHOUT_ENCODING = _MAX_UTF8_BYTES // 4


def _is_valid_topic_string(value: str) -> bool:
    """Rules shared by topic names and filters.

    At least one character [MQTT-4.7.3-1], no U+0000 [MQTT-4.7.3-2], at most
    65535 bytes as UTF-8 [MQTT-4.7.3-3]. Well-formed UTF-8 is the codec's rule.
    """
    if not value or "\x00" in value:
        return False
    return (
        len(value) <= _MAX_CHARS_WITHOUT_ENCODING
        or len(value.encode("utf-8", "surrogatepass")) <= _MAX_UTF8_BYTES
    )


def is_valid_topic_name(name: str) -> bool:
    """A PUBLISH topic: a valid topic string without wildcards [MQTT-3.3.2-2]."""
    return _is_valid_topic_string(name) and "+" not in name and "#" not in name


def _has_valid_wildcards(filter: str) -> bool:
    """``#`` only as the last level [MQTT-4.7.1-1], ``+`` only as a whole level [MQTT-4.7.1-2]."""
    levels = filter.split("/")
    last = len(levels) - 1
    for depth, level in enumerate(levels):
        if level == "#":
            if depth != last:
                return False
        elif level != "+" and ("+" in level or "#" in level):
            return False
    return True


def is_valid_topic_filter(filter: str) -> bool:
    """A SUBSCRIBE/UNSUBSCRIBE topic filter, plain or shared.

    A shared filter is ``$share/{ShareName}/{filter}``: the ShareName is at
    least one character [MQTT-4.8.2-1], has no ``/``, ``+`` or ``#`` and is
    followed by ``/`` and a topic filter [MQTT-4.8.2-2].
    """
    if not _is_valid_topic_string(filter):
        return False
    prefix = _group_prefix(filter)
    if prefix is None:
        return _has_valid_wildcards(filter)
    share_name, slash, inner = filter[len(prefix) :].partition("/")
    if not share_name or "+" in share_name or "#" in share_name or not slash or not inner:
        return False
    return _has_valid_wildcards(inner)


def is_sys_topic(topic: str) -> bool:
    """A ``$SYS`` topic, by Mosquitto's test (``strncmp(topic, "$SYS", 4)``): only the
    broker publishes there (broker/sys_topics.py, ``Authorizer.can_publish``)."""
    return topic.startswith("$SYS")


def _group_prefix(filter: str) -> str | None:
    if filter.startswith(SHARE_PREFIX):
        return SHARE_PREFIX
    if filter.startswith(QUEUE_PREFIX):
        return QUEUE_PREFIX
    return None


def parse_shared(filter: str) -> tuple[str | None, str]:
    """Split a valid filter into (ShareName, inner filter); ShareName is None if not shared.

    A durable group queue, ``$queue/{group}/{filter}`` (broker/group_queue.py), is a
    shared group too: its name is ``$queue/{group}``, which no ShareName can be.
    """
    if filter.startswith(SHARE_PREFIX):
        share_name, _, inner = filter[len(SHARE_PREFIX) :].partition("/")
        return share_name, inner
    if filter.startswith(QUEUE_PREFIX):
        group, _, inner = filter[len(QUEUE_PREFIX) :].partition("/")
        return QUEUE_PREFIX + group, inner
    return None, filter


def topic_matches(filter: str, topic: str) -> bool:
    """Whether a valid filter matches a valid topic name (spec 4.7).

    The reference for the tree and the matcher for retained messages. A shared
    filter matches as its inner filter. No normalisation [MQTT-4.7.3-4].
    """
    _, filter = parse_shared(filter)
    # Wildcards in the first level do not match topics starting with '$' [MQTT-4.7.2-1].
    if topic.startswith("$") and filter[0] in "+#":
        return False
    filter_levels = filter.split("/")
    topic_levels = topic.split("/")
    for depth, level in enumerate(filter_levels):
        if level == "#":  # this level, if present, and every level below it
            return True
        if depth == len(topic_levels) or (level != "+" and level != topic_levels[depth]):
            return False
    return len(filter_levels) == len(topic_levels)


@dataclass(slots=True)
class SubscriptionEntry:
    """One client's subscription to one filter, with its SUBSCRIBE options."""

    client_id: str
    topic_filter: str  # as the client sent it, with the "$share/{name}/" prefix if shared
    qos: int
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0
    subscription_id: int | None = None
    share_group: str | None = None  # set by SubscriptionTree.add()


@dataclass(slots=True)
class SharedGroup:
    """The members of ``$share/{name}/{topic_filter}``: each message goes to one of them."""

    name: str
    topic_filter: str  # without the "$share/{name}/" prefix
    # A durable group queue ($queue/{group}/{filter}): stored once for the group,
    # never given to a member when routed (broker/group_queue.py).
    queue: bool = False
    members: list[SubscriptionEntry] = field(default_factory=list)  # insertion order
    _next: int = field(
        default=0, init=False, repr=False, compare=False
    )  # index of the member whose turn it is

    def pick(
        self,
        is_available: Callable[[str], bool],
        may_receive: Callable[[str], bool] | None = None,
    ) -> SubscriptionEntry | None:
        """The next member in round robin that may receive the message and is available.

        ``may_receive`` (the ACL's read decision for this message's topic) rules
        members out: a member the ACL keeps from the topic is skipped, never
        chosen and then dropped, so the message goes to a member that may read
        it (issue 19). Among the members that may, the first available one in
        turn gets it; if none is available, the first of them in turn still
        does (its session may queue it) so the group does not drop it. None
        only when no member may receive the message.
        """
        count = len(self.members)
        if not count:
            return None
        start = self._next % count
        chosen = None
        for offset in range(count):
            index = (start + offset) % count
            client_id = self.members[index].client_id
            if may_receive is not None and not may_receive(client_id):
                continue
            if is_available(client_id):
                chosen = index
                break
            if chosen is None:
                chosen = index
        if chosen is None:
            return None
        self._next = chosen + 1
        return self.members[chosen]

    def _put(self, entry: SubscriptionEntry) -> bool:
        """Add a member, or replace the client's entry in place; True if it is new."""
        for index, member in enumerate(self.members):
            if member.client_id == entry.client_id:
                self.members[index] = entry
                return False
        self.members.append(entry)
        return True

    def _discard(self, client_id: str) -> bool:
        """Remove the client's member, keeping whose turn it is; True if it was there."""
        for index, member in enumerate(self.members):
            if member.client_id == client_id:
                del self.members[index]
                if index < self._next:
                    self._next -= 1
                return True
        return False


@dataclass(slots=True)
class Match:
    """What a topic matched: plain entries (one client may appear more than once,
    for overlapping filters; the caller merges them) and shared groups."""

    entries: list[SubscriptionEntry]
    groups: list[SharedGroup]


class _Node:
    """One topic level: the subscriptions whose filter ends here, and the next levels.

    The wildcard children have their own slots because match() visits them at
    every level: an attribute read is cheaper than a dict lookup.
    """

    __slots__ = ("children", "entries", "groups", "multi", "single")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}  # literal levels
        self.single: _Node | None = None  # '+'
        self.multi: _Node | None = None  # '#'
        self.entries: dict[str, SubscriptionEntry] = {}  # by client_id: one per client per filter
        self.groups: dict[str, SharedGroup] = {}  # by share name

    def child(self, level: str) -> _Node | None:
        if level == "+":
            return self.single
        if level == "#":
            return self.multi
        return self.children.get(level)

    def add_child(self, level: str) -> _Node:
        child = _Node()
        if level == "+":
            self.single = child
        elif level == "#":
            self.multi = child
        else:
            self.children[level] = child
        return child

    def drop_child(self, level: str) -> None:
        if level == "+":
            self.single = None
        elif level == "#":
            self.multi = None
        else:
            del self.children[level]

    def is_empty(self) -> bool:
        return (
            not (self.children or self.entries or self.groups)
            and self.single is None
            and self.multi is None
        )


# Topics whose match is remembered until the subscriptions change (SubscriptionTree.match);
# when full, the memory starts over.
MATCH_CACHE_SIZE = 4096


class SubscriptionTree:
    """All subscriptions of the broker, indexed for matching topic names."""

    __slots__ = ("_cache", "_count", "_root")

    def __init__(self) -> None:
        self._root = _Node()
        self._count = 0
        # topic -> its Match, for topics published again: any add or remove empties it
        self._cache: dict[str, Match] = {}

    def __len__(self) -> int:
        """Number of subscriptions; each shared group member counts as one."""
        return self._count

    def add(self, entry: SubscriptionEntry) -> bool:
        """Add a subscription; False if it replaced the client's one for the same filter.

        The same filter replaces the old subscription [MQTT-3.8.4-3] in its
        place, so re-subscribing does not disturb a shared group's round robin.
        """
        if not is_valid_topic_filter(entry.topic_filter):
            raise ValueError(f"invalid topic filter {entry.topic_filter!r}")
        self._cache.clear()
        share_name, filter = parse_shared(entry.topic_filter)
        entry.share_group = share_name
        node = self._root
        for level in filter.split("/"):
            node = node.child(level) or node.add_child(level)
        if share_name is None:
            is_new = entry.client_id not in node.entries
            node.entries[entry.client_id] = entry
        else:
            group = node.groups.get(share_name)
            if group is None:
                queue = share_name.startswith(QUEUE_PREFIX)
                group = node.groups[share_name] = SharedGroup(share_name, filter, queue)
            is_new = group._put(entry)
        if is_new:
            self._count += 1
        return is_new

    def remove(self, client_id: str, topic_filter: str) -> bool:
        """Remove the client's subscription to ``topic_filter`` as sent; True if it existed.

        Levels and groups left empty are pruned, so the tree only holds live filters.
        """
        self._cache.clear()
        share_name, filter = parse_shared(topic_filter)
        levels = filter.split("/")
        path = [self._root]
        for level in levels:
            child = path[-1].child(level)
            if child is None:
                return False
            path.append(child)
        node = path[-1]
        if share_name is None:
            if node.entries.pop(client_id, None) is None:
                return False
        else:
            group = node.groups.get(share_name)
            if group is None or not group._discard(client_id):
                return False
            if not group.members:
                del node.groups[share_name]
        self._count -= 1
        for depth in range(len(levels), 0, -1):
            if not path[depth].is_empty():
                break
            path[depth - 1].drop_child(levels[depth - 1])
        return True

    def has_group(self, topic_filter: str) -> bool:
        """Does the shared group (or group queue) ``topic_filter`` names have members?"""
        share_name, filter = parse_shared(topic_filter)
        node: _Node | None = self._root
        for level in filter.split("/"):
            node = node.child(level) if node is not None else None
        return share_name is not None and node is not None and share_name in node.groups

    def match(self, topic: str) -> Match:
        """Every subscription matching a valid topic name (spec 4.7).

        The same topic matched again, with no subscription added or removed since,
        gets the same :class:`Match` (no walk of the tree per message): the caller
        reads it and never changes it.
        """
        cache = self._cache
        cached = cache.get(topic)
        if cached is not None:
            return cached
        result = Match([], [])
        levels = topic.split("/")
        if topic.startswith("$"):
            # Skip the root's '+' and '#' children [MQTT-4.7.2-1].
            node = self._root.children.get(levels[0])
            if node is not None:
                _collect(node, levels, 1, result)
        else:
            _collect(self._root, levels, 0, result)
        if len(cache) >= MATCH_CACHE_SIZE:
            cache.clear()
        cache[topic] = result
        return result


def _collect(node: _Node, levels: list[str], depth: int, result: Match) -> None:
    """Add what matches ``levels[depth:]`` below ``node`` to ``result``.

    Loops down the exact child and recurses only into '+' branches, so a topic
    with no wildcard subscriptions on its path costs one dict lookup per level.
    """
    count = len(levels)
    while True:
        # '#' matches the remaining levels, and also none of them ("a/#" matches "a").
        multi = node.multi
        if multi is not None:
            if multi.entries:
                result.entries.extend(multi.entries.values())
            if multi.groups:
                result.groups.extend(multi.groups.values())
        if depth == count:
            if node.entries:
                result.entries.extend(node.entries.values())
            if node.groups:
                result.groups.extend(node.groups.values())
            return
        if node.single is not None:
            _collect(node.single, levels, depth + 1, result)
        exact = node.children.get(levels[depth])
        if exact is None:
            return
        node = exact
        depth += 1
