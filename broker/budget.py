"""What one owner may hold in stored messages, sans IO (SECURITY.md "One owner's
stores, together").

An *owner* (:meth:`Broker.identity_of <broker.core.Broker.identity_of>`) holds
stores: its persistent sessions' backlogs, the ``$ECQ`` queues it claimed
(broker/ownership.py) and the group queues (``$queue/...``) its sessions are
members of. Each store has its own byte limit; ``auth.max_bytes_per_owner``
bounds their sum. It is *measured*, not reserved: a tally every
``auth.owner_tally_interval`` seconds (persistence/owner_tally.py) reads the
stores' byte counters, only of the owners whose stores could pass the budget
(:func:`could_pass`), and hands the result to :meth:`OwnerBudget.settle`. Until
a later tally finds an owner under it, the broker refuses it new stores and
stores nothing more for it; the checks on the way of a message are set
lookups (:attr:`OwnerBudget.over`, :attr:`OwnerBudget.over_queues`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass

log = logging.getLogger("devicemq.budget")

# The stores an owner holds, as counted in OwnerBudget.refusals (store, limit).
SESSION, QUEUE, GROUP = "session", "queue", "group"
BYTES_LIMIT = "max_bytes_per_owner"  # auth.max_bytes_per_owner
QUEUES_LIMIT = "max_queues_per_owner"  # ecq.max_queues_per_owner


@dataclass(frozen=True, slots=True)
class Usage:
    """Bytes of stored messages one owner holds, by kind of store, and how many."""

    session_bytes: int = 0
    queue_bytes: int = 0
    group_bytes: int = 0
    sessions: int = 0
    queues: int = 0
    groups: int = 0

    @property
    def total(self) -> int:
        return self.session_bytes + self.queue_bytes + self.group_bytes


def could_pass(
    budget: int,
    counts: tuple[int, int, int],
    limits: tuple[int, int, int],
) -> bool:
    """Could ``counts`` stores (sessions, queues, groups), each filled to its own limit
    (``persistence.max_bytes_per_client``, ``ecq.max_bytes``,
    ``group_queues.max_bytes``; 0: unbounded), hold more than ``budget`` bytes? Only
    such an owner needs reading."""
    most = 0
    for count, limit in zip(counts, limits, strict=True):
        if count and not limit:
            return True
        most += count * limit
    return most > budget


class OwnerBudget:
    """The owners over ``auth.max_bytes_per_owner`` as the last tally found them.

    :attr:`over` and :attr:`over_queues` are frozensets, replaced whole by
    :meth:`settle`: empty (falsy) while nobody is over, so the routing pays one
    truth test per stored delivery."""

    __slots__ = ("limit", "over", "over_queues", "read", "refusals", "seconds", "usage")

    def __init__(self, limit: int) -> None:
        self.limit = limit  # 0: no budget
        self.over: frozenset[str] = frozenset()
        self.over_queues: frozenset[str] = frozenset()  # the $ECQ queues of those owners
        self.usage: dict[str, Usage] = {}  # of the owners the last tally read
        self.read = 0  # owners the last tally read
        self.seconds = 0.0  # how long the last tally took
        self.refusals: dict[tuple[str, str], int] = {}  # (store, limit) -> count

    def refused(self, store: str, limit: str) -> None:
        """Count one refusal (a new store, or a message not stored) by ``limit``."""
        key = (store, limit)
        self.refusals[key] = self.refusals.get(key, 0) + 1

    def settle(self, usage: Mapping[str, Usage], queues: Mapping[str, Collection[str]]) -> None:
        """A tally read ``usage`` (owners it did not read could not pass the budget);
        ``queues``: each owner's $ECQ queues. Each owner that went over or back under
        is logged once."""
        limit = self.limit
        over = (
            frozenset(owner for owner, u in usage.items() if u.total > limit)
            if limit
            else frozenset()
        )
        for owner in sorted(over - self.over):
            u = usage[owner]
            log.warning(
                "owner %r holds %d bytes of stored messages (%d sessions, %d queues, %d group "
                "queues), over auth.max_bytes_per_owner (%d): its new stores are refused and "
                "nothing more is stored for it until it is under",
                owner,
                u.total,
                u.sessions,
                u.queues,
                u.groups,
                limit,
            )
        for owner in sorted(self.over - over):
            held = usage.get(owner)
            log.info(
                "owner %r is under auth.max_bytes_per_owner again (%d bytes)",
                owner,
                held.total if held is not None else 0,
            )
        self.usage = dict(usage)
        self.read = len(usage)
        self.over = over
        self.over_queues = frozenset(q for owner in over for q in queues.get(owner, ()))
