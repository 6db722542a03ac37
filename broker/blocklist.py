"""The block list and flapping detection, sans IO: which CONNECTs are refused
before any password work (``Banned``, 0x8A).

An entry blocks by client ID, username, IP address or CIDR network, or a
client-ID regular expression, until an optional deadline (epoch seconds). The
list itself is plain data: where it is kept (Redis, shared by replicas, under
``persistence/blocklist_store.py``; memory without persistence) and how a new
entry reaches every replica is the edge's business. The broker asks
:meth:`BlockList.match` at every CONNECT and, when an entry is added, closes
the open connections it matches (``Broker.enforce_block``).

:class:`FlapDetector` counts one client ID's CONNECTs in a sliding window
(``flapping.max_connects`` within ``flapping.window`` seconds, as EMQX's
flapping detection): past the limit the client is blocked for
``flapping.ban_time``. Each replica counts the CONNECTs it sees; the entry it
then adds is shared like any other.
"""

from __future__ import annotations

import ipaddress
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import re2

KINDS = ("client_id", "username", "address", "client_id_regex")
MAX_REGEX_LENGTH = 512  # a pattern is matched at every CONNECT: keep it small
MAX_TRACKED = 100_000  # client IDs the flapping detector remembers at most

# Patterns run in RE2, in time linear in the client ID: a Python ``re`` pattern
# such as ``([a-z0-9]+-?)+`` takes seconds on a 25-character ID made to fail it,
# and the ID is the client's to choose. RE2 has no back-references or lookaround.
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False


class _Pattern(Protocol):
    def fullmatch(self, text: str) -> object: ...


class BadEntry(ValueError):
    """An entry that cannot be kept: ``field`` names what is wrong with it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class BlockEntry:
    """One entry. ``key`` (``kind:value``) names it; adding an entry with the same
    key replaces the older one."""

    kind: str
    value: str
    reason: str = ""
    until: float | None = None  # epoch seconds; None: until removed
    created: float = 0.0
    by: str = "admin"  # "admin" or "flapping"
    _pattern: _Pattern | ipaddress.IPv4Network | ipaddress.IPv6Network | None = field(
        default=None, compare=False, repr=False
    )

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.value}"

    def expired(self, now: float) -> bool:
        return self.until is not None and now >= self.until

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "value": self.value,
            "reason": self.reason,
            "until": self.until,
            "created": self.created,
            "by": self.by,
        }

    def matches(self, client_id: str, username: str | None, address: str) -> bool:
        kind = self.kind
        if kind == "client_id":
            return client_id == self.value
        if kind == "username":
            return username is not None and username == self.value
        network = self._pattern
        if kind == "client_id_regex":
            assert network is not None and not isinstance(network, _NETWORKS)
            return network.fullmatch(client_id) is not None
        assert isinstance(network, _NETWORKS)
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:  # a Unix socket or an unknown peer: no address to match
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return ip.version == network.version and ip in network


def make_entry(
    kind: object,
    value: object,
    *,
    reason: object = "",
    until: object = None,
    created: float = 0.0,
    by: str = "admin",
) -> BlockEntry:
    """A checked entry from untrusted input (the admin API, Redis); raises
    :class:`BadEntry` naming the field. An address is normalised (``10.0.0.7``,
    ``10.0.0.0/8``, ``2001:db8::/32``), so one network has one key."""
    if kind not in KINDS:
        raise BadEntry("kind", f"kind must be one of {', '.join(KINDS)}")
    assert isinstance(kind, str)
    if not isinstance(value, str) or not value:
        raise BadEntry("value", "value must be a non-empty string")
    if not isinstance(reason, str):
        raise BadEntry("reason", "reason must be a string")
    if until is not None and (not isinstance(until, int | float) or isinstance(until, bool)):
        raise BadEntry("until", "until must be epoch seconds or null")
    pattern: _Pattern | ipaddress.IPv4Network | ipaddress.IPv6Network | None = None
    if kind == "address":
        try:
            network = ipaddress.ip_network(value, strict=False)
        except ValueError:
            raise BadEntry("value", f"{value!r} is not an IP address or CIDR network") from None
        mapped = network.network_address
        if isinstance(mapped, ipaddress.IPv6Address) and mapped.ipv4_mapped is not None:
            # ::ffff:a.b.c.d/n: peers are matched as IPv4, so the entry is kept as IPv4
            prefix = max(0, network.prefixlen - 96)
            network = ipaddress.ip_network(f"{mapped.ipv4_mapped}/{prefix}", strict=False)
        pattern = network
        value = str(network.network_address) if network.num_addresses == 1 else str(network)
    elif kind == "client_id_regex":
        if len(value) > MAX_REGEX_LENGTH:
            raise BadEntry("value", f"a pattern is at most {MAX_REGEX_LENGTH} characters")
        try:
            pattern = re2.compile(value, _RE2_OPTIONS)
        except re2.error as e:
            detail = e.args[0].decode() if e.args and isinstance(e.args[0], bytes) else e
            raise BadEntry("value", f"not a regular expression RE2 accepts: {detail}") from None
    return BlockEntry(
        kind, value, reason, None if until is None else float(until), created, by, pattern
    )


_NETWORKS = (ipaddress.IPv4Network, ipaddress.IPv6Network)


def entry_from_json(data: dict[str, Any]) -> BlockEntry:
    return make_entry(
        data.get("kind"),
        data.get("value"),
        reason=data.get("reason", ""),
        until=data.get("until"),
        created=float(data.get("created") or 0.0),
        by=str(data.get("by") or "admin"),
    )


class BlockList:
    """The entries in force on this broker, looked up at every CONNECT.

    Exact client IDs, usernames and single addresses are dictionary lookups;
    networks and patterns are tried one by one (a fleet's list of those is
    short). An entry past its deadline no longer matches and goes at the next
    :meth:`replace` or :meth:`prune`.
    """

    def __init__(self) -> None:
        self._exact: dict[str, BlockEntry] = {}  # key -> entry, for the three exact kinds
        self._scanned: dict[str, BlockEntry] = {}  # networks and patterns
        # Changes made here, counted, and the count at each key's last one: a list
        # read from elsewhere before a change must not undo it (``changed_since``).
        self.changes = 0
        self._changed: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._exact) + len(self._scanned)

    def entries(self) -> list[BlockEntry]:
        return sorted([*self._exact.values(), *self._scanned.values()], key=lambda e: e.key)

    def get(self, key: str) -> BlockEntry | None:
        return self._exact.get(key) or self._scanned.get(key)

    def add(self, entry: BlockEntry) -> None:
        self.remove(entry.key)
        if _is_exact(entry):
            self._exact[entry.key] = entry
        else:
            self._scanned[entry.key] = entry

    def remove(self, key: str) -> BlockEntry | None:
        self.changes += 1
        self._changed[key] = self.changes
        return self._exact.pop(key, None) or self._scanned.pop(key, None)

    def changed_since(self, key: str, mark: int) -> bool:
        """Was ``key`` added or removed here after :attr:`changes` was ``mark``?"""
        return self._changed.get(key, 0) > mark

    def forget_changes(self, mark: int) -> None:
        """Changes up to ``mark`` are in every list read from now on: forget them."""
        self._changed = {k: n for k, n in self._changed.items() if n > mark}

    def prune(self, now: float) -> None:
        for key in [e.key for e in self.entries() if e.expired(now)]:
            self.remove(key)

    def match(
        self, client_id: str, username: str | None, address: str, now: float
    ) -> BlockEntry | None:
        """The entry that refuses this CONNECT, or None."""
        exact = self._exact
        if exact:
            for key in (
                f"client_id:{client_id}",
                f"username:{username}" if username is not None else None,
                f"address:{_normalised(address)}",
            ):
                entry = exact.get(key) if key is not None else None
                if entry is not None and not entry.expired(now):
                    return entry
        for entry in self._scanned.values():
            if not entry.expired(now) and entry.matches(client_id, username, address):
                return entry
        return None


def _is_exact(entry: BlockEntry) -> bool:
    if entry.kind == "address":
        return "/" not in entry.value
    return entry.kind != "client_id_regex"


def _normalised(address: str) -> str:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


class FlapDetector:
    """More than ``max_connects`` CONNECTs of one client ID within ``window`` seconds
    is flapping. It is told only CONNECTs that authenticated (a client cannot get
    another blocked by naming its ID), and remembers at most :data:`MAX_TRACKED`
    client IDs, those that connected within a window."""

    def __init__(self, max_connects: int, window: float) -> None:
        self.max_connects = max_connects
        self.window = window
        self._seen: dict[str, deque[float]] = {}
        self._swept = 0.0

    def connected(self, client_id: str, now: float) -> bool:
        """Count a CONNECT; True when it is one too many (the client is flapping)."""
        times = self._seen.get(client_id)
        if times is None:
            if len(self._seen) >= MAX_TRACKED:
                self._sweep(now)
                if len(self._seen) >= MAX_TRACKED:
                    return False  # too many clients at once to tell: none is blocked
            times = self._seen[client_id] = deque()
        times.append(now)
        while times and times[0] <= now - self.window:
            times.popleft()
        if now - self._swept >= self.window:
            self._sweep(now)
        if len(times) > self.max_connects:
            times.clear()  # counted again from zero once the ban ends
            return True
        return False

    def _sweep(self, now: float) -> None:
        self._swept = now
        horizon = now - self.window
        for client_id in [c for c, t in self._seen.items() if not t or t[-1] <= horizon]:
            del self._seen[client_id]
