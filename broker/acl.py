"""Authorisation: what a connected client may publish, subscribe to and receive.

The ACL file (``auth.acl_file``) is Mosquitto-like, one rule a line, ``#``
comments on their own line or after the rule (`` # `` with whitespace on both
sides, :mod:`broker.watched_file`)::

    # before any "user" line: rules for anonymous clients
    topic read public/#

    user alice
    topic readwrite alice/#
    topic deny alice/secret/#

    # every client, %c = its client ID, %u = its user name
    pattern write devices/%c/#
    pattern read commands/%c/#

A rule is ``topic|pattern [read|write|readwrite|deny] TOPIC`` (access
defaults to readwrite); ``read`` covers subscribing and receiving, ``write``
publishing. ``user NAME`` starts the rules of that user (up to the next
``user`` line); ``pattern`` lines apply to every client wherever they stand.

Whatever the file says, and without one, no client may publish to ``$SYS``
(:meth:`Authorizer.can_publish`).

Decisions, once an ACL file is configured (no file: everything else allowed):

- anything not granted is denied;
- a ``deny`` rule that matches wins over every grant;
- PUBLISH: the topic must match a write rule;
- SUBSCRIBE: the filter must be *covered* by a read rule (every topic the
  filter can match, the rule matches too: rule ``devices/%c/#`` allows
  ``devices/c1/temp`` and ``devices/c1/#`` to client c1, not ``devices/#``),
  and not be covered by a deny rule. A deny rule that only overlaps the
  filter is enforced per message on delivery;
- receiving: every message routed to a client is checked against its read
  rules (``Broker.resolve``); decisions are cached per (client, topic).

A client ID or user name containing ``/``, ``+`` or ``#`` (or empty) is not
substituted: a grant rule naming it does not apply, so it cannot widen a
pattern into another client's topics, and a deny rule naming it denies
everything from that level on (fail closed), so it cannot evade a deny. A rule
is a plain topic filter: ``$share/`` and ``$queue/`` rules are refused (a
shared subscription is checked by its inner filter).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from broker.limits import is_loopback
from broker.topics import is_sys_topic, is_valid_topic_filter, parse_shared, topic_matches
from broker.watched_file import FileChangeWatch, content_lines, has_comment_marker

__all__ = [
    "DENY",
    "READ",
    "WRITE",
    "Acl",
    "AclError",
    "Authorizer",
    "Grant",
    "Rule",
    "filter_covers",
    "parse_acl",
    "parse_granted_rules",
    "parse_rule",
]

log = logging.getLogger("devicemq.acl")

DENY = 0
READ = 1
WRITE = 2
_ACCESS = {"read": READ, "write": WRITE, "readwrite": READ | WRITE, "deny": DENY}
CACHE_SIZE = 65_536
_UNSAFE = ("/", "+", "#")


class AclError(ValueError):
    """An ACL file that cannot be used; the message names the line."""


@dataclass(frozen=True, slots=True)
class Rule:
    access: int  # READ, WRITE, both, or DENY
    topic: str  # a topic filter, with %c / %u in patterns

    def resolve(self, client_id: str, username: str | None) -> str | None:
        """The rule's topic for this client, or None if it cannot apply.

        A client ID or user name that is empty or holds ``/``, ``+`` or ``#`` is
        not substituted: a grant rule then does not apply, and a deny rule fails
        closed, denying everything from the level of ``%c``/``%u`` on (``deny
        devices/%c/fw`` becomes ``deny devices/#``), so no choice of client ID
        evades it. A ``%u`` rule does not apply to a client without a user name.
        """
        topic = self.topic
        if "%" not in topic:
            return topic
        if "%u" in topic and username is None:
            return None
        unsafe = ("%c" in topic and not _safe(client_id)) or (
            "%u" in topic and not _safe(username or "")
        )
        if unsafe:
            if self.access != DENY:
                return None
            levels = topic.split("/")
            first = next(i for i, level in enumerate(levels) if "%c" in level or "%u" in level)
            return "/".join([*levels[:first], "#"])
        return topic.replace("%c", client_id).replace("%u", username or "")


def _safe(value: str) -> bool:
    return bool(value) and not any(ch in value for ch in _UNSAFE)


@dataclass(slots=True)
class Acl:
    """A parsed ACL file."""

    anonymous: list[Rule] = field(default_factory=list)
    users: dict[str, list[Rule]] = field(default_factory=dict)
    patterns: list[Rule] = field(default_factory=list)

    def rules_for(self, client_id: str, username: str | None) -> list[tuple[int, str]]:
        """(access, topic filter) of every rule that applies to this client."""
        own = self.anonymous if username is None else self.users.get(username, [])
        result = [(rule.access, rule.topic) for rule in own]
        for rule in self.patterns:
            topic = rule.resolve(client_id, username)
            if topic is not None:
                result.append((rule.access, topic))
        return result


def parse_acl(text: str, source: str = "acl file") -> Acl:
    """Parse an ACL file's text; comments as in :mod:`broker.watched_file`."""
    acl = Acl()
    current = acl.anonymous
    for number, line in content_lines(text):
        where = f"{source}: line {number}"
        keyword, _, rest = line.partition(" ")
        rest = rest.strip()
        if keyword == "user":
            if not rest:
                raise AclError(f"{where}: 'user' needs a user name")
            if has_comment_marker(rest):
                raise AclError(
                    f"{where}: {rest!r} is not a user name: an inline comment needs "
                    "whitespace on both sides of its '#'"
                )
            current = acl.users.setdefault(rest, [])
            continue
        if keyword not in ("topic", "pattern"):
            raise AclError(f"{where}: expected 'user', 'topic' or 'pattern', got {keyword!r}")
        word, _, after = rest.partition(" ")
        if not rest or (word in _ACCESS and not after.strip()):
            raise AclError(
                f"{where}: '{keyword}' needs a topic (' # ' starts a comment: "
                "a rule for the filter '#' keeps its comment on the line above)"
            )
        rule = parse_rule(rest, where)
        if keyword == "pattern":
            acl.patterns.append(rule)
        else:
            current.append(rule)
    return acl


def parse_rule(text: str, where: str) -> Rule:
    """``[read|write|readwrite|deny] TOPIC`` (what follows ``topic`` in the file, and a
    rule from auth.chain's service or token); AclError names ``where``."""
    text = text.strip()
    word, _, after = text.partition(" ")
    if word in _ACCESS:
        access, topic = _ACCESS[word], after.strip()
    else:
        access, topic = READ | WRITE, text
    if not topic:
        raise AclError(f"{where}: {text!r} needs a topic")
    check = topic.replace("%c", "c").replace("%u", "u")
    if check.startswith(("$share/", "$queue/")) or not is_valid_topic_filter(check):
        raise AclError(f"{where}: {topic!r} is not a valid topic filter")
    return Rule(access, topic)


def parse_granted_rules(value: object, source: str) -> tuple[Rule, ...]:
    """A client's own rules from auth.chain (the service's answer, a token's claim): a
    list of rule strings as :func:`parse_rule` reads them; AclError names ``source``."""
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise AclError(f"{source}: expected a list of rule strings")
    return tuple(parse_rule(item, f"{source}[{i}]") for i, item in enumerate(value))


def read_acl(path: str | Path) -> Acl:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise AclError(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from e
    return parse_acl(text, str(path))


def filter_covers(rule: str, topic_filter: str) -> bool:
    """Whether every topic ``topic_filter`` matches is matched by ``rule`` too."""
    if topic_filter.startswith("$") and rule[0] in "+#":
        return False  # a wildcard first level never reaches $-topics [MQTT-4.7.2-1]
    rule_levels = rule.split("/")
    filter_levels = topic_filter.split("/")
    for depth, level in enumerate(rule_levels):
        if level == "#":
            return True  # covers this level (or none: "a/#" matches "a") and below
        if depth == len(filter_levels):
            return False
        wanted = filter_levels[depth]
        if wanted == "#":
            return False  # many levels, covered only by "#"
        if level != "+" and level != wanted:
            return False  # a literal covers only itself ("+" in the filter is wider)
    return len(rule_levels) == len(filter_levels)


@dataclass(eq=False, slots=True)
class Grant:
    """The ACL rules auth.chain gave one CONNECT of a client (its service's answer or its
    token), in force next to the ACL file's while its session lasts.

    Compared by identity: every CONNECT brings a new grant, so decisions cached
    under the previous one are never reused for the next.
    """

    rules: tuple[Rule, ...]


class Authorizer:
    """The ACL in force, with reload and the per-(client, topic) receive cache.

    Two sources of rules, combined per client as one list: the ACL file's
    that apply to it (its user's and the patterns) and its own :class:`Grant`
    from auth.chain. Any grant in either allows, a deny in either wins; a
    client holding a grant is held to "anything not granted is denied" even
    without an ACL file. ``grants``: auth.chain can give grants, so every
    delivery is checked (``active``) even without an ACL file.
    """

    def __init__(
        self,
        path: str,
        clock: Callable[[], float] = time.monotonic,
        cache_size: int = CACHE_SIZE,
        grants: bool = False,
        *,
        acl: Acl | None = None,
    ) -> None:
        """``acl``: the ACL file as read, by the composition root
        (app/authentication.py ``open_authorizer``); this class re-reads it when it
        changes."""
        self.path = Path(path) if path else None
        if self.path is not None and acl is None:
            raise ValueError(
                "auth.acl_file is read at the composition root: "
                "build the Authorizer with app.authentication.open_authorizer"
            )
        self.file_active = self.path is not None
        # False: everything allowed, nothing checked
        self.active = self.file_active or grants
        self.clock = clock
        self.acl = acl or Acl()
        self.cache_size = cache_size
        self._receive_cache: OrderedDict[tuple[str, str | None, Grant | None, str], bool] = (
            OrderedDict()
        )
        self._rules: OrderedDict[tuple[str, str | None, Grant | None], list[tuple[int, str]]] = (
            OrderedDict()
        )
        # Who each connected (or session-holding) client authenticated as.
        self.usernames: dict[str, str | None] = {}
        self.grants: dict[str, Grant] = {}
        self._watch: FileChangeWatch | None = None
        if self.path is not None:
            self._watch = FileChangeWatch(self.path, clock)
            log.info("ACL: %s", self.path)

    # -- reloading --------------------------------------------------------------------

    def maybe_reload(self, force: bool = False) -> None:
        if self._watch is None or not self._watch.changed(force):
            return
        try:
            acl = read_acl(self._watch.path)
        except AclError as e:
            log.error("ACL file not reloaded, the previous one stays in force: %s", e)
            return
        self.acl = acl
        self._receive_cache.clear()
        self._rules.clear()
        log.info("ACL file reloaded: %s", self.path)

    # -- clients ----------------------------------------------------------------------

    def client_connected(
        self, client_id: str, username: str | None, grant: Grant | None = None
    ) -> None:
        if self.active:
            self.usernames[client_id] = username
            if grant is None:
                self.grants.pop(client_id, None)
            else:
                self.grants[client_id] = grant

    def forget(self, client_id: str) -> None:
        self.usernames.pop(client_id, None)
        self.grants.pop(client_id, None)

    def _rules_for(
        self, client_id: str, username: str | None, grant: Grant | None
    ) -> list[tuple[int, str]]:
        key = (client_id, username, grant)
        rules = self._rules.get(key)
        if rules is None:
            rules = self.acl.rules_for(client_id, username) if self.file_active else []
            if grant is not None:
                for rule in grant.rules:
                    topic = rule.resolve(client_id, username)
                    if topic is not None:
                        rules.append((rule.access, topic))
            self._rules[key] = rules
            if len(self._rules) > self.cache_size:
                self._rules.popitem(last=False)
        return rules

    # -- decisions ----------------------------------------------------------------------

    def _decide(
        self, client_id: str, username: str | None, grant: Grant | None, topic: str, want: int
    ) -> bool:
        allowed = False
        for access, rule in self._rules_for(client_id, username, grant):
            if topic_matches(rule, topic):
                if access == DENY:
                    return False
                if access & want:
                    allowed = True
        return allowed

    def can_publish(self, client_id: str, username: str | None, topic: str) -> bool:
        """May the client publish on ``topic`` (a PUBLISH)? Under its grant, if any.

        ``$SYS`` is read-only for every client, ACL file or not: only the broker
        writes it (broker/sys_topics.py). Mosquitto denies writes to topics that
        begin with ``$SYS`` the same way (``acl__check_dollar``); spec 4.7.2 leaves
        ``$`` topics to the server.
        """
        if not self.active:  # no ACL file and no grants (none recorded): $SYS alone is shut
            return not is_sys_topic(topic)
        return self.may_publish(client_id, username, self.grants.get(client_id), topic)

    def may_publish(
        self, client_id: str, username: str | None, grant: Grant | None, topic: str
    ) -> bool:
        """:meth:`can_publish` under a given grant: a will, checked at CONNECT before the
        grant is in force and when published after its client's session ended."""
        if is_sys_topic(topic):
            return False
        if not self.file_active and grant is None:
            return True
        return self._decide(client_id, username, grant, topic, WRITE)

    def can_subscribe(
        self, client_id: str, username: str | None, topic_filter: str, address: str = ""
    ) -> bool:
        """May the client subscribe to ``topic_filter``? ``address``: where it connects
        from (an IP address).

        Without an ACL file every filter is allowed except those that can take the
        presence events (``$SYS/brokers/...``: every client's ID, user and address),
        which only clients on this host get, as EMQX's default rules keep ``$SYS``
        to 127.0.0.1; an ACL file grants them like any topic (``topic read $SYS/#``).
        So does a client's grant.
        """
        _, inner = parse_shared(topic_filter)
        grant = self.grants.get(client_id)
        if not self.file_active and grant is None:
            return not _takes_presence(inner) or is_loopback(address)
        allowed = False
        for access, rule in self._rules_for(client_id, username, grant):
            if filter_covers(rule, inner):
                if access == DENY:
                    return False
                if access & READ:
                    allowed = True
        return allowed

    def can_receive(self, client_id: str, topic: str) -> bool:
        """May ``client_id`` be sent a message on ``topic``? Cached, LRU-bounded.

        The user name is the one the client last connected with; for a
        session restored after a restart and not yet reconnected it is not
        known, and only the ``pattern`` rules without ``%u`` apply (grants
        live in memory only: none is known either).
        """
        if not self.active:
            return True
        grant = self.grants.get(client_id)
        if not self.file_active and grant is None:
            return True
        known = client_id in self.usernames
        username = self.usernames.get(client_id)
        key = (client_id, username if known else "\x00unknown", grant, topic)
        cache = self._receive_cache
        decision = cache.get(key)
        if decision is not None:
            cache.move_to_end(key)
            return decision
        if known:
            decision = self._decide(client_id, username, grant, topic, READ)
        else:
            decision = self._decide_patterns_only(client_id, topic)
        cache[key] = decision
        if len(cache) > self.cache_size:
            cache.popitem(last=False)
        return decision

    def _decide_patterns_only(self, client_id: str, topic: str) -> bool:
        allowed = False
        for rule in self.acl.patterns:
            resolved = rule.resolve(client_id, None)
            if resolved is not None and topic_matches(resolved, topic):
                if rule.access == DENY:
                    return False
                if rule.access & READ:
                    allowed = True
        return allowed


def _takes_presence(topic_filter: str) -> bool:
    """Can ``topic_filter`` match ``$SYS/brokers/{node}/clients/{id}/...``?"""
    levels = topic_filter.split("/", 2)
    return levels[0] == "$SYS" and len(levels) > 1 and levels[1] in ("brokers", "+", "#")
