"""How SubscriptionTree.match() scales with unrelated subscriptions.

Run: ``python -m benchmarks.match_bench``. One topic is matched against a tree
holding the same few matching subscriptions plus 10, 10k or 100k unrelated
ones. The unrelated filters share the topic's first level, add siblings at its
second level and hang under the root's '+', so they widen exactly the nodes
match() visits. Its cost should stay flat; a linear scan with topic_matches is
timed alongside to show what the trie avoids.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

from broker.topics import SubscriptionEntry, SubscriptionTree, topic_matches

TOPIC = "devices/dev42/telemetry/temp"
MATCHING = [
    ("app", "devices/dev42/telemetry/temp"),
    ("dashboard", "devices/+/telemetry/#"),
    ("dev42-owner", "devices/dev42/#"),
    ("auditor", "#"),
    ("worker-1", "$share/workers/devices/+/telemetry/+"),
    ("worker-2", "$share/workers/devices/+/telemetry/+"),
    ("worker-3", "$share/workers/devices/+/telemetry/+"),
]
SIZES = [10, 10_000, 100_000]


def unrelated_filters(count: int) -> list[str]:
    """Filters that never match TOPIC but crowd the trie nodes it walks through."""
    shapes = [
        "devices/dev{i}x/telemetry/temp",  # siblings of "dev42"
        "devices/dev{i}x/#",
        "+/other{i}/#",  # children of the root's '+'
        "fleet/{i}/+/status",  # a separate subtree
    ]
    return [shapes[i % len(shapes)].format(i=i) for i in range(count)]


def linear_scan(filters: list[str], topic: str) -> list[str]:
    """What matching costs without an index: every filter, every time."""
    return [f for f in filters if topic_matches(f, topic)]


def best_ns_per_call(call: Callable[[], object], calls: int, repeats: int = 5) -> float:
    """The fastest of ``repeats`` runs: the least disturbed by the rest of the machine."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter_ns() - start) / calls)
    return best


def main() -> None:
    print(f"topic {TOPIC!r}; {len(MATCHING)} matching subscriptions in every tree")
    print(
        f"{'unrelated':>10} {'total subs':>10} {'build s':>8} {'match us':>9} {'vs 10':>6} "
        f"{'entries':>7} {'groups':>6} {'linear scan us':>15}"
    )
    baseline = 0.0
    for size in SIZES:
        subscriptions = [SubscriptionEntry(cid, f, qos=1) for cid, f in MATCHING]
        subscriptions += [
            SubscriptionEntry(f"client{i}", f, qos=1) for i, f in enumerate(unrelated_filters(size))
        ]
        tree = SubscriptionTree()
        start = time.perf_counter()
        for entry in subscriptions:
            tree.add(entry)
        build_s = time.perf_counter() - start

        result = tree.match(TOPIC)
        assert len(result.entries) == 4 and len(result.groups) == 1, result
        match_ns = best_ns_per_call(partial(tree.match, TOPIC), calls=20_000)
        baseline = baseline or match_ns

        filters = [entry.topic_filter for entry in subscriptions]
        linear_ns = best_ns_per_call(
            partial(linear_scan, filters, TOPIC),
            calls=max(1, 200_000 // len(filters)),
            repeats=3,
        )
        print(
            f"{size:>10,} {len(tree):>10,} {build_s:>8.2f} {match_ns / 1000:>9.2f} "
            f"{match_ns / baseline:>5.2f}x {len(result.entries):>7} {len(result.groups):>6} "
            f"{linear_ns / 1000:>15,.0f}"
        )


if __name__ == "__main__":
    main()
