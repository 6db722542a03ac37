"""Connection lifecycle: takeover, keep alive, connect timeout (MQTT 5.0 3.1.4, 3.1.2.10)."""

from __future__ import annotations

from broker.connection import MQTTConnection
from broker.packets import Disconnect, PingReq, PingResp, Properties, ReasonCode, Will
from broker.session import Session
from tests.unit.core_harness import V311, Harness, payloads


def test_takeover_old_connection_gets_0x8e_and_is_closed() -> None:
    """MQTT-3.1.4-3: the existing client gets DISCONNECT 0x8E and its connection closes."""
    h = Harness()
    old = h.connected("dev", session_expiry_interval=60)
    new = h.client()
    new.connect("dev", clean_start=False)
    assert old.read() == [Disconnect(ReasonCode.SESSION_TAKEN_OVER)]
    assert old.closed
    assert not new.closed
    assert h.broker.sessions["dev"].connection is new.conn


def test_takeover_clean_start_0_keeps_the_session() -> None:
    """MQTT-3.1.4-4: clean start 0 resumes the existing session, subscriptions included."""
    h = Harness()
    old = h.connected("dev", session_expiry_interval=60)
    old.subscribe("t", qos=1)
    new = h.client()
    assert new.connect("dev", clean_start=False).session_present is True
    pub = h.connected("pub")
    pub.publish("t", b"hello", qos=1)
    assert payloads(new.read()) == [b"hello"]
    assert old.read() == [Disconnect(ReasonCode.SESSION_TAKEN_OVER)]


def test_takeover_clean_start_1_discards_the_session() -> None:
    h = Harness()
    old = h.connected("dev", session_expiry_interval=60)
    old.subscribe("t")
    new = h.client()
    assert new.connect("dev", clean_start=True).session_present is False
    pub = h.connected("pub")
    pub.publish("t", b"hello")
    assert new.read() == []


def test_takeover_v311_closes_old_without_disconnect_packet() -> None:
    h = Harness()
    old = h.connected("dev", V311, clean_start=False)
    new = h.client(V311)
    assert new.connect("dev", clean_start=False).session_present is True
    assert old.read() == []
    assert old.closed


def test_takeover_publishes_old_connections_will() -> None:
    """Spec 3.1.4: if the existing client has a will, it is published."""
    h = Harness()
    watcher = h.connected("w")
    watcher.subscribe("wills/#")
    h.connected("dev", will=Will("wills/dev", b"gone"))
    h.client().connect("dev")
    assert payloads(watcher.read()) == [b"gone"]


# -- Keep alive (MQTT-3.1.2-22 / 3.1.1 MQTT-3.1.2-24) -----------------------------------


def test_keep_alive_one_and_a_half_times_then_disconnect_0x8d() -> None:
    h = Harness()
    watcher = h.connected("w")
    watcher.subscribe("wills/dev")
    c = h.connected("dev", keep_alive=10, will=Will("wills/dev", b"lost"))
    h.advance(15)  # exactly 1.5 x keep alive: still alive
    assert c.read() == []
    assert not c.closed
    h.advance(0.5)
    assert c.read() == [Disconnect(ReasonCode.KEEP_ALIVE_TIMEOUT)]
    assert c.closed
    assert payloads(watcher.read()) == [b"lost"]


def test_any_packet_resets_the_keep_alive_timer() -> None:
    h = Harness()
    c = h.connected("dev", keep_alive=10)
    for _ in range(5):
        h.advance(14)
        c.send(PingReq())
        assert c.read() == [PingResp()]
    assert not c.closed
    h.advance(16)
    assert c.closed


def test_keep_alive_v311_timeout_closes_without_disconnect() -> None:
    h = Harness()
    c = h.connected("dev", V311, keep_alive=4)
    h.advance(7)
    assert c.read() == []
    assert c.closed


def test_keep_alive_0_never_times_out() -> None:
    """Spec 3.1.2.10: a Keep Alive of 0 turns the mechanism off."""
    h = Harness()
    c = h.connected("dev", keep_alive=0)
    h.advance(10 * 24 * 3600)
    assert not c.closed
    c.send(PingReq())
    assert c.read() == [PingResp()]


def test_server_keep_alive_is_what_is_enforced() -> None:
    h = Harness(max_keep_alive=10)
    c = h.connected("dev", keep_alive=1000)
    h.advance(16)
    assert c.closed


def test_connect_timeout_closes_a_silent_socket() -> None:
    """A socket that never sends CONNECT is closed after connect_timeout."""
    h = Harness(connect_timeout=5.0)
    c = h.client()
    h.advance(4)
    assert not c.closed
    h.advance(2)
    assert c.closed
    assert c.read() == []


def test_connect_timeout_does_not_touch_connected_clients() -> None:
    h = Harness(connect_timeout=5.0)
    c = h.connected("dev")
    h.advance(60)
    assert not c.closed


def test_connection_lost_before_connect_leaves_no_trace() -> None:
    h = Harness()
    c = h.client()
    c.conn.connection_lost()
    assert c.closed
    assert h.broker.sessions == {}
    assert c.conn not in h.broker.connections


def test_v311_keep_alive_above_max_is_refused_not_silently_shortened() -> None:
    """3.1.1 has no Server Keep Alive, and MQTT-3.1.2-24 (3.1.1) makes the client's
    Keep Alive the one that counts: shortening it behind the client's back would
    time out a client that pings on time. Refused as Mosquitto does (rc 2)."""
    h = Harness(max_keep_alive=30)
    c = h.client(V311)
    ack = c.connect("dev", keep_alive=120, check=False)
    assert ack.reason_code == 2
    assert c.closed
    ok = h.client(V311)
    ok.connect("dev", keep_alive=30)
    h.advance(44)
    assert not ok.closed


# -- the tick looks at what is due, not at every connection (Broker.tick) ----------------


def test_short_keep_alive_is_enforced_before_the_connect_timeout_would_look() -> None:
    """The first look at a connection is at its connect timeout; a CONNECT with a
    keep-alive shorter than that moves the look forward (MQTT-3.1.2-22)."""
    h = Harness(connect_timeout=30.0)
    c = h.connected("dev", keep_alive=2)
    h.advance(3)
    assert not c.closed
    h.advance(0.5)
    assert c.closed


def test_a_session_detached_twice_expires_at_its_second_deadline() -> None:
    """The first detach's deadline is stale once the client came back and left again."""
    h = Harness()
    c = h.connected("dev", session_expiry_interval=10)
    c.conn.connection_lost()
    h.advance(5)
    again = h.connected("dev", session_expiry_interval=10, clean_start=False)
    h.advance(1)
    again.conn.connection_lost()  # expires at +16 now, not at +10
    h.advance(6)
    assert "dev" in h.broker.sessions
    h.advance(5)
    assert "dev" not in h.broker.sessions


def test_a_delayed_will_fires_then_the_session_expires_later() -> None:
    h = Harness()
    watcher = h.connected("w")
    watcher.subscribe("wills/dev")
    will = Will("wills/dev", b"gone", properties=Properties(will_delay_interval=3))
    c = h.connected("dev", session_expiry_interval=8, will=will)
    c.conn.connection_lost()
    h.advance(2)
    assert watcher.read() == []
    h.advance(1.5)
    assert payloads(watcher.read()) == [b"gone"]
    assert "dev" in h.broker.sessions
    h.advance(5)
    assert "dev" not in h.broker.sessions


def test_a_closed_connection_and_an_ended_session_are_not_kept_by_the_tick() -> None:
    """The tick's deadlines held every connection until its old deadline (1.5 x keep
    alive after CONNECT): 100,000 clients connecting and leaving within that time
    were all kept in memory."""
    import gc

    h = Harness()
    c = h.connected("dev", keep_alive=60, session_expiry_interval=3600)
    first = h.broker.sessions["dev"]
    c.conn.connection_lost()
    again = h.connected("dev", keep_alive=60, clean_start=True)  # the old session ends
    again.conn.connection_lost()
    assert h.broker.sessions.get("dev") is not first
    del c, again, first
    gc.collect()
    # Found among the live objects, not through weak references: the classes compiled
    # with mypyc (loadtest/ab/compiled.py) take none.
    live = gc.get_objects()
    assert [o for o in live if isinstance(o, MQTTConnection) and o.broker is h.broker] == []
    assert [o for o in live if isinstance(o, Session) and o.stats is h.broker.stats] == []
