"""The block list and flapping detection (broker/blocklist.py), and the CONNECT
refusal they cause before any password work (broker/handlers/connect.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from broker.blocklist import BadEntry, BlockList, FlapDetector, entry_from_json, make_entry
from broker.config import AuthSettings, FlappingSettings, Settings
from broker.packets import ConnAck, Connect, ConnectReturnCode, Disconnect, ReasonCode
from tests.unit.core_harness import V5, V311, Harness


def test_each_kind_matches_what_it_names() -> None:
    blocks = BlockList()
    blocks.add(make_entry("client_id", "dev-1"))
    blocks.add(make_entry("username", "mallory"))
    blocks.add(make_entry("address", "10.0.0.7"))
    blocks.add(make_entry("address", "192.168.0.0/16"))
    blocks.add(make_entry("address", "2001:db8::/32"))
    blocks.add(make_entry("client_id_regex", r"bot-\d+"))
    now = 0.0
    found = blocks.match("dev-1", None, "1.2.3.4", now)
    assert found is not None and found.key == "client_id:dev-1"
    assert blocks.match("x", "mallory", "1.2.3.4", now) is not None
    assert blocks.match("x", None, "10.0.0.7", now) is not None
    assert blocks.match("x", None, "::ffff:10.0.0.7", now) is not None  # IPv4-mapped
    assert blocks.match("x", None, "192.168.44.1", now) is not None
    assert blocks.match("x", None, "2001:db8:1::5", now) is not None
    assert blocks.match("bot-17", None, "1.2.3.4", now) is not None
    # near misses
    assert blocks.match("dev-10", "alice", "10.0.0.8", now) is None
    assert blocks.match("bot-17x", None, "192.169.0.1", now) is None  # fullmatch, not search
    assert blocks.match("x", None, "2001:db9::1", now) is None
    assert blocks.match("x", None, "not-an-ip", now) is None
    assert len(blocks) == 6


def test_an_address_is_normalised_so_one_network_has_one_key() -> None:
    assert make_entry("address", "10.1.2.3/8").key == "address:10.0.0.0/8"
    assert make_entry("address", "10.1.2.3/32").key == "address:10.1.2.3"
    assert make_entry("address", "2001:DB8::1").key == "address:2001:db8::1"
    # peers are matched as IPv4 when IPv4-mapped: so are the entries
    assert make_entry("address", "::ffff:10.0.0.7").key == "address:10.0.0.7"
    assert make_entry("address", "::ffff:10.0.0.0/104").key == "address:10.0.0.0/8"


@pytest.mark.parametrize(
    ("kind", "value", "field"),
    [
        ("ip", "1.2.3.4", "kind"),
        ("client_id", "", "value"),
        ("client_id", 5, "value"),
        ("address", "10.0.0.300", "value"),
        ("client_id_regex", "(", "value"),
        ("client_id_regex", r"(a)\1", "value"),  # RE2: no back-references
        ("client_id_regex", "a" * 513, "value"),
    ],
)
def test_a_bad_entry_names_its_field(kind: object, value: object, field: str) -> None:
    with pytest.raises(BadEntry) as caught:
        make_entry(kind, value)
    assert caught.value.field == field


def test_until_must_be_a_number() -> None:
    with pytest.raises(BadEntry) as caught:
        make_entry("client_id", "a", until="tomorrow")
    assert caught.value.field == "until"
    with pytest.raises(BadEntry):
        make_entry("client_id", "a", until=True)


def test_an_entry_ends_at_its_deadline() -> None:
    blocks = BlockList()
    blocks.add(make_entry("client_id", "a", until=100.0))
    blocks.add(make_entry("address", "10.0.0.0/8", until=100.0))
    assert blocks.match("a", None, "1.1.1.1", 99.9) is not None
    assert blocks.match("b", None, "10.1.1.1", 99.9) is not None
    assert blocks.match("a", None, "1.1.1.1", 100.0) is None
    assert blocks.match("b", None, "10.1.1.1", 100.0) is None
    blocks.prune(100.0)
    assert len(blocks) == 0


def test_an_entry_round_trips_through_json_and_replaces_by_key() -> None:
    entry = make_entry("client_id_regex", "x.*", reason="spam", until=5.5, created=1.0)
    again = entry_from_json(entry.to_json())
    assert again == entry
    blocks = BlockList()
    blocks.add(entry)
    blocks.add(make_entry("client_id_regex", "x.*", reason="changed"))
    assert [e.reason for e in blocks.entries()] == ["changed"]
    assert blocks.remove(entry.key) is not None
    assert blocks.match("xy", None, "", 0) is None


def test_flapping_is_one_connect_more_than_the_limit_within_the_window() -> None:
    flaps = FlapDetector(max_connects=3, window=10.0)
    assert [flaps.connected("c", t) for t in (0.0, 1.0, 2.0)] == [False] * 3
    assert flaps.connected("c", 3.0)
    # counted from zero again afterwards
    assert not flaps.connected("c", 4.0)
    # spread out, never flapping
    spread = FlapDetector(max_connects=2, window=10.0)
    assert not any(spread.connected("d", t) for t in (0.0, 6.0, 12.0, 18.0, 24.0))


def test_flapping_forgets_clients_gone_quiet() -> None:
    flaps = FlapDetector(max_connects=5, window=1.0)
    for i in range(1000):
        flaps.connected(f"c{i}", i * 0.001)
    flaps.connected("late", 10.0)
    assert set(flaps._seen) == {"late"}


# -- CONNECT refusals (sans IO) ---------------------------------------------------------


def _harness(**auth: Any) -> Harness:
    settings = dataclasses.replace(
        Settings(),
        auth=AuthSettings(**auth),
        flapping=FlappingSettings(enabled=True, max_connects=2, window=60.0, ban_time=30.0),
    )
    return Harness(settings)


def test_a_blocked_client_is_refused_banned_before_authentication() -> None:
    h = _harness(allow_anonymous=False)
    h.broker.add_block(make_entry("client_id", "bad"))
    client = h.client(V5)
    client.send(Connect("bad", protocol_level=V5, username="u", password=b"wrong"))
    ack = client.read_one()
    # 0x8A, not 0x86: the password was never looked at
    assert isinstance(ack, ConnAck) and ack.reason_code == ReasonCode.BANNED
    assert client.closed
    assert h.broker.stats.connections_rejected == {"banned": 1}
    v3 = h.client(V311)
    v3.send(Connect("bad", protocol_level=V311))
    ack = v3.read_one()
    assert isinstance(ack, ConnAck) and ack.reason_code == ConnectReturnCode.NOT_AUTHORIZED


def test_a_new_entry_disconnects_the_clients_it_matches() -> None:
    h = _harness()
    keep = h.connected("good")
    gone = h.connected("bad-1")
    assert h.broker.add_block(make_entry("client_id_regex", "bad-.*")) == 1
    (packet,) = gone.read()
    assert isinstance(packet, Disconnect)
    assert packet.reason_code == ReasonCode.ADMINISTRATIVE_ACTION
    assert gone.closed
    keep.expect_nothing()
    assert not keep.closed


def test_a_flapping_client_is_blocked_for_ban_time() -> None:
    h = _harness()
    for _ in range(2):
        h.connected("flap").conn.connection_lost()
        h.advance(1)
    third = h.client(V5)
    ack = third.connect("flap", check=False)
    assert ack.reason_code == ReasonCode.BANNED
    (entry,) = h.broker.blocklist.entries()
    assert (entry.key, entry.by) == ("client_id:flap", "flapping")
    assert entry.until == h.clock.now + 30.0
    assert h.broker.stats.flapping_blocks == 1
    h.advance(30)
    h.connected("flap")  # the ban is over


def test_flapping_is_off_unless_enabled() -> None:
    h = Harness(Settings())
    for _ in range(30):
        h.connected("often").conn.connection_lost()
    assert len(h.broker.blocklist) == 0


# -- what the review of the first version found ------------------------------------------


def test_connects_that_fail_authentication_do_not_count_for_flapping() -> None:
    """Counted before authentication, 16 CONNECTs naming a device's client ID with a
    wrong password got the real device banned and disconnected."""
    settings = dataclasses.replace(
        Settings(),
        auth=AuthSettings(allow_anonymous=False),
        flapping=FlappingSettings(enabled=True, max_connects=2),
    )
    h = Harness(settings)
    for _ in range(10):
        attacker = h.client(V5)
        assert attacker.connect("victim", check=False).reason_code == ReasonCode.NOT_AUTHORIZED
    assert len(h.broker.blocklist) == 0
    assert h.broker.stats.flapping_blocks == 0


def test_a_username_entry_also_refuses_a_user_named_by_its_certificate() -> None:
    """With auth.use_identity_as_username the user is known only after authentication:
    the list is asked again then (the CONNECT's username field was empty)."""
    settings = dataclasses.replace(
        Settings(), auth=AuthSettings(use_identity_as_username=True, allow_anonymous=False)
    )
    h = Harness(settings)
    h.broker.add_block(make_entry("username", "mallory"))
    client = h.client(V5)
    client.conn.peer_certificate = {"subject": ((("commonName", "mallory"),),)}
    assert client.connect("any-id", check=False).reason_code == ReasonCode.BANNED
    assert h.broker.stats.connections_rejected == {"banned": 1}


def test_a_pattern_runs_in_linear_time_on_an_id_made_to_fail_it() -> None:
    """Python's re needs seconds for 25 characters against this pattern (each one
    more doubles it): one CONNECT held the broker's loop. RE2 answers at once."""
    entry = make_entry("client_id_regex", "([a-z0-9]+-?)+")
    assert not entry.matches("a" * 100_000 + "!", None, "")
    assert entry.matches("abc-def", None, "")


def test_an_id_over_the_length_limit_is_not_looked_up() -> None:
    h = _harness()
    h.broker.add_block(make_entry("client_id_regex", ".*"))
    too_long = "x" * (h.broker.settings.mqtt.max_client_id_length + 1)
    assert h.broker.blocked(too_long, None, "10.0.0.1") is None
    assert h.broker.blocked("x", None, "10.0.0.1") is not None


def test_ended_entries_are_swept_without_a_store() -> None:
    h = _harness()
    h.broker.add_block(make_entry("client_id", "a", until=h.clock.now + 5))
    h.advance(11)
    assert len(h.broker.blocklist) == 0


def test_the_flapping_memory_is_bounded() -> None:
    from broker.blocklist import MAX_TRACKED

    flaps = FlapDetector(max_connects=5, window=60.0)
    for i in range(MAX_TRACKED + 10):
        flaps.connected(f"c{i}", 0.0)
    assert len(flaps._seen) == MAX_TRACKED
