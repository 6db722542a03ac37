"""Topic validation, matching and the subscription tree (MQTT 5.0 spec 4.7, 4.8.2)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.topics import (
    MATCH_CACHE_SIZE,
    SHARE_PREFIX,
    SharedGroup,
    SubscriptionEntry,
    SubscriptionTree,
    is_valid_topic_filter,
    is_valid_topic_name,
    parse_shared,
    topic_matches,
)

# --- Topic names ------------------------------------------------------------


@pytest.mark.parametrize("name", ["a", "a/b", "/", "//", "/a", "a/", "a//b", "$SYS/x", " ", "é/ü"])
def test_valid_topic_names(name: str) -> None:
    assert is_valid_topic_name(name)


@pytest.mark.parametrize(
    ("name", "rule"),
    [
        ("", "MQTT-4.7.3-1"),
        ("a\x00b", "MQTT-4.7.3-2"),
        ("a/+", "MQTT-3.3.2-2"),
        ("a/#", "MQTT-3.3.2-2"),
        ("a+b", "MQTT-3.3.2-2"),
        ("a#", "MQTT-3.3.2-2"),
    ],
)
def test_invalid_topic_names(name: str, rule: str) -> None:
    assert not is_valid_topic_name(name), rule


def test_length_limit_counts_utf8_bytes() -> None:
    """MQTT-4.7.3-3: at most 65535 bytes once encoded, not 65535 characters."""
    assert is_valid_topic_name("a" * 65535)
    assert not is_valid_topic_name("a" * 65536)
    assert is_valid_topic_name("é" * 32767)  # 65534 bytes
    assert not is_valid_topic_name("é" * 32768)  # 65536 bytes, fewer characters than the limit
    assert not is_valid_topic_filter("€" * 21846)  # 65538 bytes


# --- Topic filters ----------------------------------------------------------


@pytest.mark.parametrize(
    "filter",
    [
        "a",
        "#",
        "+",
        "a/#",
        "a/+/b",
        "+/+",
        "/+",
        "+/",
        "/#",
        "a//#",
        "$SYS/#",
        "$share",  # not shared: no '/' after the prefix word
        "$sharex/a",
        "$share/g/a/b",
        "$share/g/#",
        "$share/g/+/x",
        "$share/g//",
        "$share/g/$share/h/a",
    ],
)
def test_valid_topic_filters(filter: str) -> None:
    assert is_valid_topic_filter(filter)


@pytest.mark.parametrize(
    ("filter", "rule"),
    [
        ("", "MQTT-4.7.3-1"),
        ("a/\x00", "MQTT-4.7.3-2"),
        ("a/#/b", "MQTT-4.7.1-1"),
        ("#/a", "MQTT-4.7.1-1"),
        ("a#", "MQTT-4.7.1-1"),
        ("a/b#", "MQTT-4.7.1-1"),
        ("##", "MQTT-4.7.1-1"),
        ("a+", "MQTT-4.7.1-2"),
        ("a/+b/c", "MQTT-4.7.1-2"),
        ("++", "MQTT-4.7.1-2"),
        ("$share/", "MQTT-4.8.2-1"),
        ("$share//x", "MQTT-4.8.2-1"),
        ("$share/g", "MQTT-4.8.2-2"),
        ("$share/g/", "MQTT-4.8.2-2"),
        ("$share/g+/a", "MQTT-4.8.2-2"),
        ("$share/+/a", "MQTT-4.8.2-2"),
        ("$share/#/a", "MQTT-4.8.2-2"),
        ("$share/g/a/#/b", "MQTT-4.7.1-1"),
        ("$share/g/a+", "MQTT-4.7.1-2"),
    ],
)
def test_invalid_topic_filters(filter: str, rule: str) -> None:
    assert not is_valid_topic_filter(filter), rule


@pytest.mark.parametrize(
    ("filter", "expected"),
    [
        ("$share/g/a/b", ("g", "a/b")),
        ("$share/group-1/#", ("group-1", "#")),
        ("$share/g//", ("g", "/")),
        ("a/b", (None, "a/b")),
        ("$share", (None, "$share")),
        ("$SYS/#", (None, "$SYS/#")),
    ],
)
def test_parse_shared(filter: str, expected: tuple[str | None, str]) -> None:
    assert parse_shared(filter) == expected


# --- Matching a single pair -------------------------------------------------

MATCHES = [
    ("a", "a"),
    ("a/b", "a/b"),
    ("+", "a"),
    ("+", ""),  # not a valid topic, but '+' does match an empty level
    ("a/+", "a/b"),
    ("a/+", "a/"),  # '+' matches an empty level
    ("+/+", "/a"),
    ("/+", "/a"),
    ("a//b", "a//b"),
    ("a/+/b", "a//b"),
    ("#", "a"),
    ("#", "a/b/c"),
    ("#", "/"),
    ("a/#", "a"),  # '#' includes the parent level (spec 4.7.1.2)
    ("a/#", "a/b"),
    ("a/#", "a/b/c"),
    ("a/#", "a/"),
    ("a/+/#", "a/b"),
    ("+/#", "a"),
    ("$SYS/#", "$SYS/x"),
    ("$SYS/#", "$SYS"),
    ("$SYS/+", "$SYS/x"),
    ("$SYS/x", "$SYS/x"),
    ("$share/g/a/+", "a/b"),  # a shared filter matches as its inner filter
]

NON_MATCHES = [
    ("a", "b"),
    ("a", "A"),  # no normalisation [MQTT-4.7.3-4]
    ("a", "a/"),
    ("a", "/a"),
    ("a/b", "a"),
    ("+", "a/b"),
    ("+", "/a"),
    ("a/+", "a"),
    ("a/+", "a/b/c"),
    ("a/+/b", "a/b"),
    ("a/#", "b"),
    ("a/#", "ab"),
    ("a/b/#", "a"),
    ("#", "$SYS"),  # MQTT-4.7.2-1
    ("#", "$SYS/x"),  # MQTT-4.7.2-1
    ("+/x", "$SYS/x"),  # MQTT-4.7.2-1
    ("+", "$"),  # MQTT-4.7.2-1
    ("$share/g/#", "$SYS/x"),  # MQTT-4.7.2-1 applies to the inner filter
    ("$share/g/a", "$share/g/a"),
]


@pytest.mark.parametrize(("filter", "topic"), MATCHES)
def test_topic_matches(filter: str, topic: str) -> None:
    assert topic_matches(filter, topic)


@pytest.mark.parametrize(("filter", "topic"), NON_MATCHES)
def test_topic_does_not_match(filter: str, topic: str) -> None:
    assert not topic_matches(filter, topic)


@pytest.mark.parametrize(("filter", "topic"), MATCHES + NON_MATCHES)
def test_tree_agrees_with_topic_matches(filter: str, topic: str) -> None:
    tree = SubscriptionTree()
    tree.add(SubscriptionEntry("c", filter, qos=0))
    match = tree.match(topic)
    found = len(match.entries) + sum(len(group.members) for group in match.groups)
    assert found == topic_matches(filter, topic)


# --- The tree: add, replace, remove ----------------------------------------


def entry(client_id: str, filter: str, qos: int = 0) -> SubscriptionEntry:
    return SubscriptionEntry(client_id, filter, qos)


def matched(tree: SubscriptionTree, topic: str) -> list[tuple[str, str]]:
    return sorted((e.client_id, e.topic_filter) for e in tree.match(topic).entries)


def test_add_and_match_overlapping_filters() -> None:
    tree = SubscriptionTree()
    for filter in ["a/b", "a/+", "a/#", "#", "+/b", "a/c"]:
        assert tree.add(entry("c1", filter))
    assert tree.add(entry("c2", "a/b"))
    assert len(tree) == 7
    assert matched(tree, "a/b") == [
        ("c1", "#"),
        ("c1", "+/b"),
        ("c1", "a/#"),
        ("c1", "a/+"),
        ("c1", "a/b"),
        ("c2", "a/b"),
    ]
    assert tree.match("x/y").groups == []
    assert matched(tree, "x/y") == [("c1", "#")]


def test_add_same_filter_replaces_subscription() -> None:
    """MQTT-3.8.4-3: the same filter from the same client replaces the subscription."""
    tree = SubscriptionTree()
    assert tree.add(entry("c1", "a/+", qos=0))
    assert not tree.add(entry("c1", "a/+", qos=2))
    assert len(tree) == 1
    [only] = tree.match("a/b").entries
    assert only.qos == 2


def test_add_rejects_invalid_filter() -> None:
    with pytest.raises(ValueError):
        SubscriptionTree().add(entry("c1", "a/#/b"))


def test_add_sets_share_group() -> None:
    tree = SubscriptionTree()
    plain, shared = entry("c1", "a"), entry("c1", "$share/g/a")
    tree.add(plain)
    tree.add(shared)
    assert plain.share_group is None
    assert shared.share_group == "g"
    assert len(tree) == 2


def test_remove() -> None:
    tree = SubscriptionTree()
    tree.add(entry("c1", "a/+"))
    tree.add(entry("c2", "a/+"))
    assert not tree.remove("c3", "a/+")
    assert not tree.remove("c1", "a/b")
    assert not tree.remove("c1", "a")  # a prefix node of a live filter
    assert tree.remove("c1", "a/+")
    assert not tree.remove("c1", "a/+")
    assert matched(tree, "a/x") == [("c2", "a/+")]
    assert len(tree) == 1


def node_count(tree: SubscriptionTree) -> int:
    count, stack = 0, [tree._root]
    while stack:
        node = stack.pop()
        count += 1
        stack += node.children.values()
        stack += [child for child in (node.single, node.multi) if child is not None]
    return count


def test_remove_prunes_empty_levels_and_groups() -> None:
    tree = SubscriptionTree()
    filters = ["a/b/c", "a/b/#", "a//+", "$share/g/a/b/c", "$share/h/+", "#"]
    for filter in filters:
        tree.add(entry("c1", filter))
    tree.add(entry("c2", "a/b"))
    for filter in filters:
        assert tree.remove("c1", filter)
    assert list(tree._root.children) == ["a"]
    assert node_count(tree) == 3  # the root, "a" and "a/b"
    assert tree.remove("c2", "a/b")
    assert len(tree) == 0
    assert tree._root.is_empty()
    assert tree.match("a/b/c") == tree.match("x")


# --- The '$' rule in the tree ----------------------------------------------


def test_dollar_topics_skip_leading_wildcards() -> None:
    """MQTT-4.7.2-1, and "$SYS/#" still matches "$SYS/x" (spec 4.7.2)."""
    tree = SubscriptionTree()
    for filter in ["#", "+/x", "+/+", "$SYS/#", "$SYS/+", "$share/g/#", "$share/g/$SYS/x"]:
        tree.add(entry("c1", filter))
    assert matched(tree, "$SYS/x") == [("c1", "$SYS/#"), ("c1", "$SYS/+")]
    assert [group.name for group in tree.match("$SYS/x").groups] == ["g"]
    assert [group.topic_filter for group in tree.match("$SYS/x").groups] == ["$SYS/x"]
    assert matched(tree, "SYS/x") == [("c1", "#"), ("c1", "+/+"), ("c1", "+/x")]


# --- Shared groups ----------------------------------------------------------


def always(_: str) -> bool:
    return True


def test_shared_group_is_matched_once_with_all_members() -> None:
    tree = SubscriptionTree()
    for client in ["c1", "c2", "c3"]:
        tree.add(entry(client, "$share/g/a/+"))
    tree.add(entry("c1", "$share/h/a/+"))
    tree.add(entry("c4", "a/+"))
    match = tree.match("a/b")
    assert [(e.client_id, e.topic_filter) for e in match.entries] == [("c4", "a/+")]
    assert sorted(group.name for group in match.groups) == ["g", "h"]
    [g] = [group for group in match.groups if group.name == "g"]
    assert g.topic_filter == "a/+"
    assert [m.client_id for m in g.members] == ["c1", "c2", "c3"]
    assert len(tree) == 5


def group_of(*clients: str) -> SharedGroup:
    group = SharedGroup("g", "a")
    for client in clients:
        group._put(entry(client, "$share/g/a"))
    return group


def picks(group: SharedGroup, count: int, available: set[str] | None = None) -> list[str]:
    def is_available(client_id: str) -> bool:
        return available is None or client_id in available

    chosen = [group.pick(is_available) for _ in range(count)]
    return [c.client_id for c in chosen if c is not None]


def test_pick_round_robin() -> None:
    group = group_of("c1", "c2", "c3")
    assert picks(group, 7) == ["c1", "c2", "c3", "c1", "c2", "c3", "c1"]


def test_pick_empty_group() -> None:
    assert SharedGroup("g", "a").pick(always) is None


def test_pick_skips_unavailable_members() -> None:
    group = group_of("c1", "c2", "c3")
    assert picks(group, 4, available={"c1", "c3"}) == ["c1", "c3", "c1", "c3"]


def test_pick_without_available_members_still_round_robins() -> None:
    """Nobody online: the message still goes to the member whose turn it is, to be queued."""
    group = group_of("c1", "c2", "c3")
    assert picks(group, 4, available=set()) == ["c1", "c2", "c3", "c1"]


def test_pick_calls_is_available_only_until_a_member_is_found() -> None:
    group = group_of("c1", "c2", "c3")
    asked: list[str] = []

    def is_available(client_id: str) -> bool:
        asked.append(client_id)
        return True

    group.pick(is_available)
    assert asked == ["c1"]


def test_pick_only_among_members_that_may_receive() -> None:
    """Issue 19: a member the ACL keeps from the topic is skipped, not picked and dropped."""
    group = group_of("c1", "c2", "c3")
    allowed = {"c1", "c3"}
    chosen = [group.pick(always, allowed.__contains__) for _ in range(4)]
    assert [c.client_id for c in chosen if c is not None] == ["c1", "c3", "c1", "c3"]
    # Allowed but offline members still come before nobody; offline-but-allowed
    # beats online-but-denied.
    got = group.pick(lambda cid: cid == "c2", lambda cid: cid == "c3")
    assert got is not None and got.client_id == "c3"
    assert group.pick(always, lambda cid: False) is None


def test_replacing_a_member_keeps_its_turn() -> None:
    tree = SubscriptionTree()
    for client in ["c1", "c2", "c3"]:
        tree.add(entry(client, "$share/g/a"))
    [group] = tree.match("a").groups
    assert picks(group, 1) == ["c1"]
    assert not tree.add(entry("c2", "$share/g/a", qos=1))
    assert [m.client_id for m in group.members] == ["c1", "c2", "c3"]
    chosen = group.pick(always)
    assert chosen is not None
    assert (chosen.client_id, chosen.qos) == ("c2", 1)
    assert len(tree) == 3


@pytest.mark.parametrize(
    ("removed", "expected"),
    [
        ("c1", ["c2", "c3", "c2"]),  # before the cursor: c2 is still next
        ("c2", ["c3", "c1", "c3"]),  # the next member itself: its successor is next
        ("c3", ["c2", "c1", "c2"]),
    ],
)
def test_removing_a_member_keeps_round_robin(removed: str, expected: list[str]) -> None:
    tree = SubscriptionTree()
    for client in ["c1", "c2", "c3"]:
        tree.add(entry(client, "$share/g/a"))
    [group] = tree.match("a").groups
    assert picks(group, 1) == ["c1"]
    assert tree.remove(removed, "$share/g/a")
    assert picks(group, 3) == expected


def test_removing_the_last_member_removes_the_group() -> None:
    tree = SubscriptionTree()
    tree.add(entry("c1", "$share/g/a"))
    tree.add(entry("c2", "$share/h/a"))
    assert not tree.remove("c1", "$share/h/a")
    assert not tree.remove("c1", "a")
    assert tree.remove("c1", "$share/g/a")
    assert [group.name for group in tree.match("a").groups] == ["h"]
    assert tree.remove("c2", "$share/h/a")
    assert tree.match("a").groups == []
    assert tree._root.is_empty()


# --- Property: the tree agrees with topic_matches --------------------------

# Few levels, few depths: random filters and topics must match often to test anything.
FIRST_LEVELS = ["a", "", "$SYS"]
LEVELS = ["a", "b", ""]


@st.composite
def topic_names(draw: st.DrawFn) -> str:
    first = draw(st.sampled_from(FIRST_LEVELS))
    return "/".join([first, *draw(st.lists(st.sampled_from(LEVELS), max_size=2))]) or "a"


@st.composite
def topic_filters(draw: st.DrawFn) -> str:
    levels = draw(st.lists(st.sampled_from([*LEVELS, "+"]), max_size=3))
    if draw(st.booleans()) and levels:  # '$' matters in the first level only [MQTT-4.7.2-1]
        levels[0] = draw(st.sampled_from([*FIRST_LEVELS, "+"]))
    if not "/".join(levels) or draw(st.booleans()):
        levels.append("#")
    filter = "/".join(levels)
    if draw(st.integers(0, 3)) == 0:
        filter = f"{SHARE_PREFIX}{draw(st.sampled_from(['g', 'h']))}/{filter}"
    return filter


# (kind, client, filter, n): "add" or "remove" (client, filter), or "unsubscribe" the n-th
# live subscription, because a random filter is rarely one that was added.
operations = st.lists(
    st.tuples(
        st.sampled_from(["add", "remove", "unsubscribe"]),
        st.sampled_from(["c1", "c2", "c3"]),
        topic_filters(),
        st.integers(0, 1000),
    ),
    min_size=4,
    max_size=40,
)


def _matches_like_the_model(
    tree: SubscriptionTree, model: dict[tuple[str, str], int], topic: str
) -> None:
    match = tree.match(topic)
    found = [(e.client_id, e.topic_filter, e.qos) for e in match.entries]
    for group in match.groups:
        assert group.members, "empty groups are pruned"
        for member in group.members:
            assert member.share_group == group.name
            assert member.topic_filter == f"{SHARE_PREFIX}{group.name}/{group.topic_filter}"
            found.append((member.client_id, member.topic_filter, member.qos))
    expected = [
        (client_id, filter, qos)
        for (client_id, filter), qos in model.items()
        if topic_matches(filter, topic)
    ]
    assert sorted(found) == sorted(expected)


@settings(max_examples=400, deadline=None)
@given(operations, st.lists(topic_names(), min_size=1, max_size=8))
def test_tree_matches_like_topic_matches(
    ops: list[tuple[str, str, str, int]], topics: list[str]
) -> None:
    tree = SubscriptionTree()
    model: dict[tuple[str, str], int] = {}  # (client_id, filter) -> qos of the latest add
    for step, (kind, client_id, filter, n) in enumerate(ops):
        if kind == "unsubscribe" and model:
            client_id, filter = list(model)[n % len(model)]
        key = (client_id, filter)
        assert is_valid_topic_filter(filter)
        if kind == "add":
            is_new = key not in model
            assert tree.add(SubscriptionEntry(client_id, filter, qos=step % 3)) == is_new
            model[key] = step % 3
        else:
            assert tree.remove(client_id, filter) == (key in model)
            model.pop(key, None)
        assert len(tree) == len(model)
        # Matched after every change: a match remembered before it must not come back.
        for topic in topics:
            _matches_like_the_model(tree, model, topic)

    for topic in topics:
        _matches_like_the_model(tree, model, topic)

    for client_id, filter in list(model):
        assert tree.remove(client_id, filter)
    assert len(tree) == 0
    assert tree._root.is_empty()


def test_has_group_tells_whether_a_group_queue_or_shared_group_has_members() -> None:
    tree = SubscriptionTree()
    tree.add(entry("w1", "$queue/billing/meter/+/reading"))
    tree.add(entry("w2", "$queue/billing/meter/+/reading"))
    tree.add(entry("p", "meter/+/reading"))
    assert tree.has_group("$queue/billing/meter/+/reading")
    assert not tree.has_group("$queue/other/meter/+/reading")
    assert not tree.has_group("meter/+/reading")  # a plain filter names no group
    assert not tree.has_group("$queue/billing/meter/#")
    tree.remove("w1", "$queue/billing/meter/+/reading")
    assert tree.has_group("$queue/billing/meter/+/reading")
    tree.remove("w2", "$queue/billing/meter/+/reading")
    assert not tree.has_group("$queue/billing/meter/+/reading")  # the last one left


def test_a_remembered_match_gives_way_to_every_change() -> None:
    """A topic's match is remembered (no walk per message) until a subscription is added,
    replaced or removed."""
    tree = SubscriptionTree()
    tree.add(entry("c1", "a/+", qos=0))
    first = tree.match("a/b")
    assert tree.match("a/b") is first  # remembered
    tree.add(entry("c2", "a/#"))
    assert matched(tree, "a/b") == [("c1", "a/+"), ("c2", "a/#")]
    tree.add(entry("c1", "a/+", qos=2))  # replaced: the new entry, not the remembered one
    assert {e.client_id: e.qos for e in tree.match("a/b").entries} == {"c1": 2, "c2": 0}
    tree.remove("c2", "a/#")
    assert matched(tree, "a/b") == [("c1", "a/+")]
    tree.add(entry("c3", "$share/g/a/b"))
    assert [g.name for g in tree.match("a/b").groups] == ["g"]


def test_the_remembered_matches_are_bounded() -> None:
    tree = SubscriptionTree()
    tree.add(entry("c1", "t/#"))
    for i in range(MATCH_CACHE_SIZE * 2 + 1):
        assert matched(tree, f"t/{i}") == [("c1", "t/#")]
        assert len(tree._cache) <= MATCH_CACHE_SIZE
