"""broker.acl: the ACL file, filter coverage, decisions, and publish / subscribe / receive
enforcement through the sans-IO core."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from app.authentication import open_authorizer
from broker.acl import (
    DENY,
    READ,
    WRITE,
    Acl,
    AclError,
    Authorizer,
    Grant,
    Rule,
    filter_covers,
    parse_acl,
)
from broker.auth import hash_password, write_password_file
from broker.config import AuthSettings, ConfigError, Settings
from broker.packets import (
    ConnAck,
    Connect,
    Properties,
    PubAck,
    PubComp,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    Subscription,
    Will,
)
from tests.unit.core_harness import V5, V311, Client, Harness, payloads

ACL = """\
# anonymous clients
topic read public/#

user alice
topic readwrite alice/#
topic deny alice/secret/#
topic devices/+/status

user bob
topic write bob/out

# every client
pattern write devices/%c/#
pattern read commands/%c/#
pattern readwrite users/%u/#
"""


def authorizer(tmp_path: Path, text: str = ACL) -> Authorizer:
    path = tmp_path / "acl"
    path.write_text(text)
    return open_authorizer(str(path))


# ------------------------------------------------------------------ the file


def test_parse_sections_and_access_words() -> None:
    acl = parse_acl(ACL)
    assert acl.anonymous == [Rule(READ, "public/#")]
    assert acl.users["alice"] == [
        Rule(READ | WRITE, "alice/#"),
        Rule(DENY, "alice/secret/#"),
        Rule(READ | WRITE, "devices/+/status"),  # no access word: readwrite
    ]
    assert acl.users["bob"] == [Rule(WRITE, "bob/out")]
    assert acl.patterns == [
        Rule(WRITE, "devices/%c/#"),
        Rule(READ, "commands/%c/#"),
        Rule(READ | WRITE, "users/%u/#"),
    ]


def test_inline_comments_one_rule_everywhere() -> None:
    """Issue 19: ``user alice    # restricted account`` named a user
    ``alice    # restricted account``, silently leaving alice without rules."""
    acl = parse_acl(
        "user alice    # restricted account\n"
        "topic read alice/#\t# a tab before the comment\n"
        "topic read #\n"  # a lone '#' ending the line is the filter, not a comment
        "  # an indented comment line\n"
        "user a#b   # '#' inside a word is data\n"
        "topic deny +/#\n"
    )
    assert acl.users == {
        "alice": [Rule(READ, "alice/#"), Rule(READ, "#")],
        "a#b": [Rule(DENY, "+/#")],
    }
    # A '#' after whitespace that ends the line is never silently part of a name or topic.
    with pytest.raises(AclError, match="line 1: 'devices/%c/# #' is not a valid topic filter"):
        parse_acl("pattern write devices/%c/# #")


def test_security_md_example_loads_and_means_what_it_says() -> None:
    """The ACL example of SECURITY.md, read from the file itself (it has inline comments)."""
    import re

    text = (Path(__file__).resolve().parents[2] / "SECURITY.md").read_text(encoding="utf-8")
    match = re.search(r"The format follows Mosquitto's `acl_file`.*?```\n(.*?)```", text, re.S)
    assert match
    acl = parse_acl(match.group(1), "SECURITY.md")
    assert acl.anonymous == [Rule(READ, "public/#")]
    assert acl.users == {
        "alice": [
            Rule(READ | WRITE, "alice/#"),
            Rule(DENY, "alice/secret/#"),
            Rule(READ | WRITE, "devices/+/status"),
        ]
    }
    assert acl.patterns == [Rule(WRITE, "devices/%c/#"), Rule(READ, "commands/%c/#")]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("user", "line 1: 'user' needs a user name"),
        ("user alice #", "line 1: 'alice #' is not a user name"),
        ("user alice #nope", "line 1: 'alice #nope' is not a user name"),
        ("topic read", "line 1: 'topic' needs a topic"),
        ("topic read # everything", "line 1: 'topic' needs a topic .* on the line above"),
        ("# x\nallow a/b", "line 2: expected 'user', 'topic' or 'pattern', got 'allow'"),
        ("topic read a/#/b", "not a valid topic filter"),
        ("pattern write a/%c+", "not a valid topic filter"),
        ("topic read $share/g/a", "not a valid topic filter"),
        ("topic read $queue/jobs/#", "not a valid topic filter"),
        ("pattern deny $queue/%c/#", "not a valid topic filter"),
    ],
)
def test_parse_errors_name_the_line(text: str, message: str) -> None:
    with pytest.raises(AclError, match=message):
        parse_acl(text, "acl")


def test_bad_file_at_start_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"auth\.acl_file"):
        open_authorizer(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="line 1"):
        authorizer(tmp_path, "nonsense here")


def test_substitution() -> None:
    rule = Rule(WRITE, "devices/%c/%u/#")
    assert rule.resolve("c1", "alice") == "devices/c1/alice/#"
    assert rule.resolve("c1", None) is None  # %u needs a user
    # Values that would widen the pattern never match.
    for bad in ("a/b", "+", "#", "x#", ""):
        assert rule.resolve(bad, "alice") is None
        assert rule.resolve("c1", bad) is None
    assert Rule(READ, "plain/topic").resolve("a/b", None) == "plain/topic"


def test_a_deny_rule_fails_closed_on_values_it_cannot_substitute() -> None:
    """A client ID or user name holding '/', '+', '#' (or empty) cannot evade a deny:
    the rule denies everything from the level it names on."""
    fw = Rule(DENY, "devices/%c/fw")
    assert fw.resolve("d1", None) == "devices/d1/fw"
    for bad in ("d/1", "d+1", "#", ""):
        assert fw.resolve(bad, None) == "devices/#"
    assert Rule(DENY, "%u/x/%c").resolve("c1", "a/b") == "#"
    assert Rule(DENY, "users/%u/#").resolve("c1", None) is None  # no user: not about it
    acl = open_authorizer("", grants=True)
    grant = Grant((Rule(READ | WRITE, "devices/#"), Rule(DENY, "devices/%c/fw")))
    for client_id in ("d1", "d+1", "d/1"):
        acl.client_connected(client_id, "dev", grant)
        assert not acl.can_publish(client_id, "dev", f"devices/{client_id}/fw"), client_id
        assert not acl.can_receive(client_id, f"devices/{client_id}/fw"), client_id
    assert acl.can_publish("d1", "dev", "devices/d1/temp")
    assert not acl.can_publish("d/1", "dev", "devices/d/1/temp")  # closed: all of devices/#
    by_user = Grant((Rule(READ | WRITE, "devices/#"), Rule(DENY, "devices/%u/#")))
    for username in ("bob", "bo+b", "bo/b"):
        acl.client_connected("x", username, by_user)
        assert not acl.can_publish("x", username, "devices/bob/x"), username


# ------------------------------------------------------------------ coverage


@pytest.mark.parametrize(
    ("rule", "topic_filter", "covered"),
    [
        ("devices/c1/#", "devices/c1/temp", True),
        ("devices/c1/#", "devices/c1/#", True),
        ("devices/c1/#", "devices/c1", True),  # "a/#" matches "a"
        ("devices/c1/#", "devices/c1/+/x", True),
        ("devices/c1/#", "devices/#", False),
        ("devices/c1/#", "devices/+/temp", False),
        ("devices/c1/#", "devices/c2/temp", False),
        ("devices/+/temp", "devices/+/temp", True),
        ("devices/+/temp", "devices/c1/temp", True),
        ("devices/+/temp", "devices/#", False),
        ("devices/+/temp", "devices/c1/temp/x", False),
        ("devices/+/temp", "devices/c1", False),
        ("a/b", "a/b", True),
        ("a/b", "a/+", False),
        ("a/b", "a/b/c", False),
        ("#", "#", True),
        ("#", "anything/+/#", True),
        ("#", "$SYS/broker", False),  # wildcards never reach $-topics
        ("+/broker", "$SYS/broker", False),
        ("$SYS/#", "$SYS/broker/+", True),
    ],
)
def test_filter_covers(rule: str, topic_filter: str, covered: bool) -> None:
    assert filter_covers(rule, topic_filter) is covered


# ------------------------------------------------------------------ decisions


def test_publish_decisions(tmp_path: Path) -> None:
    a = authorizer(tmp_path)
    assert a.can_publish("c1", "alice", "alice/x")
    assert not a.can_publish("c1", "alice", "alice/secret/x")  # deny wins over alice/#
    assert a.can_publish("c1", "alice", "devices/c1/temp")  # pattern %c
    assert not a.can_publish("c1", "alice", "devices/c2/temp")
    assert not a.can_publish("c1", "alice", "commands/c1")  # read only
    assert a.can_publish("c9", "bob", "bob/out")
    assert not a.can_publish("c9", "bob", "alice/x")
    assert a.can_publish("c9", "bob", "users/bob/x")  # pattern %u
    assert not a.can_publish("c9", None, "users/bob/x")
    assert not a.can_publish("c9", None, "public/x")  # anonymous may only read
    assert not a.can_publish("c9", "carol", "anything")  # not granted: denied


def test_subscribe_decisions(tmp_path: Path) -> None:
    a = authorizer(tmp_path)
    assert a.can_subscribe("c1", "alice", "commands/c1/#")
    assert a.can_subscribe("c1", "alice", "commands/c1/reboot")
    assert not a.can_subscribe("c1", "alice", "commands/#")
    assert not a.can_subscribe("c1", "alice", "commands/c2/#")
    assert not a.can_subscribe("c1", "alice", "devices/c1/#")  # write only
    assert a.can_subscribe("c1", "alice", "alice/#")  # overlaps a deny: allowed, filtered later
    assert not a.can_subscribe("c1", "alice", "alice/secret/#")  # covered by the deny
    assert a.can_subscribe("c1", "alice", "$share/g/commands/c1/#")  # the inner filter counts
    assert a.can_subscribe("x", None, "public/#")
    assert not a.can_subscribe("x", None, "#")


def test_receive_decisions_are_cached_and_bounded(tmp_path: Path) -> None:
    path = tmp_path / "acl"
    path.write_text(ACL)
    a = open_authorizer(str(path), cache_size=4)
    a.client_connected("c1", "alice")
    assert a.can_receive("c1", "alice/x")
    assert not a.can_receive("c1", "alice/secret/x")
    assert a.can_receive("c1", "commands/c1/go")
    assert not a.can_receive("c1", "commands/c2/go")
    for i in range(10):
        a.can_receive("c1", f"alice/{i}")
    assert len(a._receive_cache) == 4


def test_receive_for_a_client_whose_user_is_unknown(tmp_path: Path) -> None:
    """A session restored after a restart: only patterns without %u apply until it reconnects."""
    a = authorizer(tmp_path)
    assert a.can_receive("c1", "commands/c1/go")
    assert not a.can_receive("c1", "alice/x")
    assert not a.can_receive("c1", "public/x")
    a.client_connected("c1", "alice")
    assert a.can_receive("c1", "alice/x")
    a.forget("c1")
    assert not a.can_receive("c1", "alice/x")


def test_no_acl_allows_everything() -> None:
    a = open_authorizer("")
    assert not a.active
    assert a.can_publish("c", None, "x")
    assert a.can_subscribe("c", None, "#")
    assert a.can_receive("c", "x")


def test_acl_reloads_when_it_changes(tmp_path: Path) -> None:
    now = [0.0]
    path = tmp_path / "acl"
    path.write_text("pattern readwrite a/%c\n")
    a = open_authorizer(str(path), clock=lambda: now[0])
    a.client_connected("c1", None)
    assert a.can_receive("c1", "a/c1")
    path.write_text("pattern readwrite b/%c\n")
    os.utime(path, ns=(1, 1))
    # The server's sweep asks (edge/server.py); the checks themselves never stat.
    assert a.can_receive("c1", "a/c1")
    now[0] += 0.5
    a.maybe_reload()
    assert a.can_receive("c1", "a/c1")  # looked at at most once a second
    now[0] += 1
    a.maybe_reload()
    assert not a.can_receive("c1", "a/c1")  # caches cleared
    assert a.can_publish("c1", None, "b/c1")
    path.write_text("broken line\n")
    now[0] += 2
    a.maybe_reload()
    assert a.can_publish("c1", None, "b/c1")  # the previous rules stay
    path.write_text("pattern read c/%c\n")
    a.maybe_reload(force=True)
    assert a.acl == Acl(patterns=[Rule(READ, "c/%c")])


# ------------------------------------------------------------------ through the core


PASSWORD = b"pw"
PASSWORD_HASH = hash_password(PASSWORD)


def acl_harness(tmp_path: Path, text: str = ACL) -> Harness:
    """ACLs need authenticated user names: alice, bob and carol, all with PASSWORD."""
    path = tmp_path / "acl"
    path.write_text(text)
    passwd = tmp_path / "passwd"
    write_password_file(passwd, dict.fromkeys(("alice", "bob", "carol"), PASSWORD_HASH))
    auth = AuthSettings(acl_file=str(path), password_file=str(passwd), allow_anonymous=True)
    return Harness(dataclasses.replace(Settings(), auth=auth))


def connected(h: Harness, cid: str, user: str | None, level: int = V5) -> Client:
    client = h.client(level, peer=cid)
    password = PASSWORD if user is not None else None
    client.send(Connect(cid, protocol_level=level, username=user, password=password))
    connack = client.read_one()
    assert isinstance(connack, ConnAck) and connack.reason_code == 0, connack
    return client


def suback(client: Client, *filters: str) -> list[int]:
    client.send(Subscribe(client.next_id(), [Subscription(f, 1) for f in filters]))
    packet = client.read_one()
    assert isinstance(packet, SubAck)
    return packet.reason_codes


def test_subscribe_denied_per_filter(tmp_path: Path) -> None:
    h = acl_harness(tmp_path)
    v5 = connected(h, "c1", "alice")
    assert suback(v5, "commands/c1/#", "commands/#", "alice/secret/#") == [1, 0x87, 0x87]
    v3 = connected(h, "c2", "alice", V311)
    assert suback(v3, "commands/#", "commands/c2/x") == [0x80, 1]
    assert h.broker.stats.dropped["subscribe_not_authorized"] == 3
    assert [e.topic_filter for e in h.broker.subscriptions.match("commands/c1/x").entries] == [
        "commands/c1/#"
    ]


def test_publish_denied_v5(tmp_path: Path) -> None:
    h = acl_harness(tmp_path, ACL + "pattern read #\n")
    watcher = connected(h, "w", None)
    assert suback(watcher, "#") == [1]
    alice = connected(h, "c1", "alice")
    assert alice.publish_acked("alice/ok", qos=1) == 0
    watcher.read()
    assert alice.publish_acked("alice/secret/x", qos=1) == 0x87
    alice.publish("alice/secret/x", qos=2, packet_id=7)
    assert alice.read() == [PubRec(7, 0x87)]  # ends the QoS 2 flow
    alice.publish("alice/secret/x", qos=0, retain=True)
    assert watcher.read() == []
    assert [m.topic for m in h.broker.retained.matching("alice/#", h.clock.now)] == []
    assert h.broker.stats.dropped["not_authorized"] == 3


def test_publish_denied_v311_is_acknowledged_and_dropped(tmp_path: Path) -> None:
    h = acl_harness(tmp_path, ACL + "pattern read #\n")
    watcher = connected(h, "w", None)
    assert suback(watcher, "#") == [1]
    bob = connected(h, "c9", "bob", V311)
    bob.publish("alice/x", qos=1, packet_id=1)
    assert bob.read() == [PubAck(1)]
    bob.publish("alice/x", qos=2, packet_id=2)
    assert bob.read() == [PubRec(2)]
    bob.send(PubRel(2))
    assert bob.read() == [PubComp(2)]
    assert watcher.read() == []
    bob.publish("bob/out", b"ok", qos=1, packet_id=3)
    assert bob.read() == [PubAck(3)]
    assert payloads(watcher.read()) == [b"ok"]


def test_receive_denied_by_overlapping_deny(tmp_path: Path) -> None:
    h = acl_harness(tmp_path, ACL + "user carol\ntopic write #\n")
    alice = connected(h, "c1", "alice")
    assert suback(alice, "alice/#") == [1]
    carol = connected(h, "c5", "carol")
    carol.publish("alice/secret/plan", b"no", qos=0, retain=True)
    carol.publish("alice/news", b"yes", qos=0)
    assert payloads(alice.read()) == [b"yes"]
    assert h.broker.stats.dropped["not_authorized_receive"] == 1
    # Retained messages on subscribe are filtered the same way.
    carol.publish("alice/open", b"r", qos=0, retain=True)
    alice.read()
    alice.send(
        Subscribe(alice.next_id(), [Subscription("alice/+/plan", 0), Subscription("alice/#", 0)])
    )
    packets = alice.read()
    assert isinstance(packets[0], SubAck)
    assert payloads(packets[1:]) == [b"r"]


def test_shared_subscription_member_denied(tmp_path: Path) -> None:
    h = acl_harness(tmp_path, "user carol\ntopic readwrite #\ntopic deny jobs/secret\n")
    member = connected(h, "m", "carol")
    assert suback(member, "$share/g/jobs/#") == [1]
    carol = connected(h, "p", "carol")
    carol.publish("jobs/secret", b"no")
    carol.publish("jobs/open", b"yes")
    assert payloads(member.read()) == [b"yes"]


def test_shared_group_skips_the_member_that_may_not_read(tmp_path: Path) -> None:
    """Issue 19: the round robin picked bob, whose ACL denies the topic, and the
    message was dropped although carol, in the same group, may read it."""
    h = acl_harness(
        tmp_path,
        "user carol\ntopic readwrite jobs/#\nuser bob\ntopic read jobs/#\ntopic deny jobs/secret\n",
    )
    carol = connected(h, "m1", "carol")
    bob = connected(h, "m2", "bob")
    assert suback(carol, "$share/g/jobs/#") == [1]
    assert suback(bob, "$share/g/jobs/#") == [1]
    publisher = connected(h, "p", "carol")
    for i in range(4):
        publisher.publish("jobs/secret", str(i).encode())
    assert payloads(carol.read()) == [b"0", b"1", b"2", b"3"]
    assert bob.read() == []
    assert "not_authorized_receive" not in h.broker.stats.dropped
    publisher.publish("jobs/open", b"a")
    publisher.publish("jobs/open", b"b")
    assert len(carol.read()) + len(bob.read()) == 2  # both still take turns


def test_will_on_a_denied_topic_is_refused(tmp_path: Path) -> None:
    h = acl_harness(tmp_path)
    client = h.client(V5)
    will = Will("alice/secret/gone", b"x")
    client.send(Connect("c1", username="alice", password=PASSWORD, will=will))
    assert client.read() == [ConnAck(False, 0x87)]
    ok = h.client(V5)
    ok.send(Connect("c1", username="alice", password=PASSWORD, will=Will("alice/gone", b"x")))
    connack = ok.read_one()
    assert isinstance(connack, ConnAck) and connack.reason_code == 0


def test_will_is_checked_again_when_published(tmp_path: Path) -> None:
    """Issue 19: a will allowed at CONNECT went out after a reload revoked its topic."""
    h = acl_harness(tmp_path, ACL + "pattern read #\n")
    watcher = connected(h, "w", "bob")
    assert suback(watcher, "alice/gone", "alice/later") == [1, 1]
    client = h.client(V5)
    client.send(Connect("c1", username="alice", password=PASSWORD, will=Will("alice/gone", b"x")))
    assert client.read_one().reason_code == 0  # type: ignore[attr-defined]
    revoked = ACL.replace("topic readwrite alice/#", "topic read alice/#")
    (tmp_path / "acl").write_text(revoked + "pattern read #\n")
    h.broker.acl.maybe_reload(force=True)
    client.conn.connection_lost()  # abnormal end: the will is due
    assert watcher.read() == []
    assert h.broker.stats.dropped["will_not_authorized"] == 1
    # A delayed will is checked when its delay is over, not when it was set.
    (tmp_path / "acl").write_text(ACL + "pattern read #\n")
    h.broker.acl.maybe_reload(force=True)
    later = h.client(V5)
    will = Will("alice/later", b"y", properties=Properties(will_delay_interval=5))
    later.send(
        Connect(
            "c2",
            username="alice",
            password=PASSWORD,
            will=will,
            properties=Properties(session_expiry_interval=60),
        )
    )
    assert later.read_one().reason_code == 0  # type: ignore[attr-defined]
    later.conn.connection_lost()
    h.advance(6)
    assert payloads(watcher.read()) == [b"y"]


def test_publish_without_acl_is_unchecked(tmp_path: Path) -> None:
    h = Harness()
    sub = h.connected("s")
    sub.subscribe("#")
    pub = h.connected("p")
    pub.publish("anything/at/all", b"x")
    assert payloads(sub.read()) == [b"x"]
    assert h.broker.acl.usernames == {}
