"""Who holds a client ID and who consumes a queue, sans IO (SECURITY.md "Client IDs
and queues belong to their owner").

Two things are bound to an *owner* (:meth:`Broker.identity_of
<broker.core.Broker.identity_of>`: the session owner of ``auth.session_owner``,
else the authenticated user name; None for an anonymous client):

- a client ID, by ``auth.client_id_owner``: ``username`` (the ID must be the
  user name, or match ``auth.client_id_pattern``: :func:`client_id_allowed`),
  ``first`` (the first owner to connect with it holds it until an admin
  releases it or it goes unused for ``auth.client_id_release_after``), or
  ``off`` (only a live session is owned, ``auth.session_owner``);
- an ``$ECQ`` queue (broker/ecq.py), always: the owner of its first consumer,
  until an admin gives it to another or clears it.

A claim is a small record kept where the replicas share it (Redis,
persistence/owner_store.py) or, without persistence, in :class:`MemoryOwners`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

CLIENT_ID = "client_id"  # the kinds of thing claimed
QUEUE = "queue"

MAX_TRACKED = 1_000_000  # claims MemoryOwners keeps at most (then the oldest go)


@dataclass(frozen=True, slots=True)
class Claim:
    """The answer to a claim: ``granted``, or refused because ``holder`` holds it
    (None when granted), or because the owner may hold no more (``quota``: a queue
    claim's ``most``)."""

    granted: bool
    holder: str | None = None
    quota: bool = False


# Called with the answer, or None if the store could not be reached.
ClaimDone = Callable[[Claim | None], None]


class Owners(Protocol):
    """Where claims are kept (Redis for every replica, or this process's memory).

    ``ttl``: seconds a claim lasts after its last use (0: until released).
    ``owner`` None asks without claiming: granted only if nobody holds it.
    ``most`` (queues only): how many queues the owner may hold with this one if it is
    new to it (None: no limit; 0: no new one); one over it: ``Claim(False, quota=True)``.
    Each owner's queues are indexed beside the claims (:meth:`queues_of`).
    """

    def claim(
        self,
        kind: str,
        name: str,
        owner: str | None,
        ttl: float,
        done: ClaimDone,
        most: int | None = None,
    ) -> None: ...

    async def queues_of(self, owner: str) -> set[str]:
        """The $ECQ queues ``owner`` holds."""

    async def holder(self, kind: str, name: str) -> tuple[str, float | None] | None:
        """(owner, seconds left, None: no deadline), or None: nobody holds it."""

    async def assign(self, kind: str, name: str, owner: str | None, ttl: float) -> str | None:
        """Give it to ``owner`` (None: release it); returns who held it before."""


def client_id_allowed(client_id: str, username: str | None, patterns: Sequence[str]) -> bool:
    """``auth.client_id_owner: username``: a client ID is its user's name, or matches
    one of ``patterns`` (``auth.client_id_pattern``), where ``%u`` is the user name
    and ``*`` any run of characters (``%u-*``: ``alice-1``, ``alice-kitchen``).
    An anonymous client, or a user name holding ``*``, matches no pattern."""
    if username is None:
        return False
    if client_id == username:
        return True
    if "*" in username:
        return False  # "%u-*" must not become a wider pattern for user "*"
    return any(_pattern(p, username).fullmatch(client_id) for p in patterns)


def _pattern(pattern: str, username: str) -> re.Pattern[str]:
    parts = []
    for piece in re.split(r"(%u|\*)", pattern):
        if piece == "%u":
            parts.append(re.escape(username))
        elif piece == "*":
            parts.append(".*")
        else:
            parts.append(re.escape(piece))
    return re.compile("".join(parts), re.S)


def parse_patterns(text: str) -> tuple[str, ...]:
    """``auth.client_id_pattern``: comma-separated patterns, each naming ``%u``."""
    return tuple(p.strip() for p in text.split(",") if p.strip())


class MemoryOwners:
    """Claims in this process's memory: a broker without persistence (gone at restart).

    Bounded by :data:`MAX_TRACKED`: past it, claims that ran out go first, then the
    oldest."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._held: dict[tuple[str, str], tuple[str, float | None]] = {}
        self._queues: dict[str, set[str]] = {}  # owner -> the queues it holds

    def _current(self, key: tuple[str, str]) -> tuple[str, float | None] | None:
        held = self._held.get(key)
        if held is not None and held[1] is not None and held[1] <= self._clock():
            self._drop(key)
            return None
        return held

    def claim(
        self,
        kind: str,
        name: str,
        owner: str | None,
        ttl: float,
        done: ClaimDone,
        most: int | None = None,
    ) -> None:
        key = (kind, name)
        held = self._current(key)
        if held is not None and held[0] != owner:
            done(Claim(False, held[0]))
            return
        if (
            held is None
            and kind == QUEUE
            and owner is not None
            and most is not None
            and len(self._queues.get(owner, ())) >= most
        ):
            done(Claim(False, quota=True))
            return
        if owner is not None:
            self._keep(key, owner, ttl)
        done(Claim(True))

    async def queues_of(self, owner: str) -> set[str]:
        return set(self._queues.get(owner, ()))

    def _keep(self, key: tuple[str, str], owner: str, ttl: float) -> None:
        self._drop(key)  # the newest last: the oldest go first when full
        self._held[key] = (owner, self._clock() + ttl if ttl else None)
        if key[0] == QUEUE:
            self._queues.setdefault(owner, set()).add(key[1])
        if len(self._held) > MAX_TRACKED:
            now = self._clock()
            for k in [k for k, (_, until) in self._held.items() if until and until <= now]:
                self._drop(k)
            while len(self._held) > MAX_TRACKED:
                self._drop(next(iter(self._held)))

    def _drop(self, key: tuple[str, str]) -> None:
        held = self._held.pop(key, None)
        if held is not None and key[0] == QUEUE:
            queues = self._queues.get(held[0])
            if queues is not None:
                queues.discard(key[1])
                if not queues:
                    del self._queues[held[0]]

    async def holder(self, kind: str, name: str) -> tuple[str, float | None] | None:
        held = self._current((kind, name))
        if held is None:
            return None
        return held[0], None if held[1] is None else held[1] - self._clock()

    async def assign(self, kind: str, name: str, owner: str | None, ttl: float) -> str | None:
        key = (kind, name)
        held = self._current(key)
        if owner is None:
            self._drop(key)
        else:
            self._keep(key, owner, ttl)
        return held[0] if held is not None else None
