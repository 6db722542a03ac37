"""Will messages (MQTT 5.0 spec 3.1.2.5, 3.1.3.2, 3.14.4)."""

from __future__ import annotations

from broker.packets import Connect, Disconnect, Properties, Publish, ReasonCode, Will
from tests.unit.core_harness import V311, Client, Harness, payloads, publishes

WILL = Will("wills/dev", b"dev is gone", qos=1)


def _watcher(h: Harness) -> Client:
    w = h.connected("watcher")
    w.subscribe("wills/#", qos=1)
    return w


def test_will_published_when_the_connection_is_lost() -> None:
    """MQTT-3.1.2-8: the will is published when the network connection closes abnormally."""
    h = Harness()
    w = _watcher(h)
    c = h.connected("dev", will=WILL)
    c.conn.connection_lost()
    assert payloads(w.read()) == [b"dev is gone"]


def test_will_published_on_protocol_error() -> None:
    """Spec 3.1.2.5: a protocol error closing the connection publishes the will."""
    h = Harness()
    w = _watcher(h)
    c = h.connected("dev", will=WILL)
    c.send(Connect("dev"))
    assert c.closed
    assert payloads(w.read()) == [b"dev is gone"]


def test_will_published_on_keep_alive_timeout() -> None:
    h = Harness()
    w = _watcher(h)
    h.connected("dev", keep_alive=2, will=WILL)
    h.advance(3.1)
    assert payloads(w.read()) == [b"dev is gone"]


def test_will_not_published_on_normal_disconnect() -> None:
    """MQTT-3.1.2-10 / MQTT-3.14.4-3: DISCONNECT 0x00 discards the will."""
    h = Harness()
    w = _watcher(h)
    c = h.connected("dev", will=WILL)
    c.disconnect()
    assert c.closed
    c.conn.connection_lost()  # the socket closing afterwards changes nothing
    assert w.read() == []


def test_will_not_published_on_v311_disconnect() -> None:
    h = Harness()
    w = _watcher(h)
    c = h.connected("dev", V311, will=WILL)
    c.disconnect()
    assert w.read() == []


def test_will_published_on_disconnect_with_will_message_0x04() -> None:
    """Spec 3.14.2.1: reason 0x04 asks the server to publish the will."""
    h = Harness()
    w = _watcher(h)
    c = h.connected("dev", will=WILL)
    c.disconnect(ReasonCode.DISCONNECT_WITH_WILL)
    assert payloads(w.read()) == [b"dev is gone"]


def test_will_qos_and_properties_forwarded() -> None:
    h = Harness()
    w = h.connected("watcher")
    w.subscribe("wills/#", qos=2)
    will = Will(
        "wills/dev",
        b"{}",
        qos=2,
        properties=Properties(content_type="application/json", user_properties=(("k", "v"),)),
    )
    c = h.connected("dev", will=will)
    c.conn.connection_lost()
    (got,) = publishes(w.read())
    assert got.qos == 2
    assert got.properties is not None
    assert got.properties.content_type == "application/json"
    assert got.properties.user_properties == (("k", "v"),)


def test_will_retain_is_stored() -> None:
    """MQTT-3.1.2-17: a will with Will Retain is published as a retained message."""
    h = Harness()
    c = h.connected("dev", will=Will("status/dev", b"offline", retain=True))
    c.conn.connection_lost()
    later = h.connected("later")
    later.subscribe("status/#")
    assert later.pending == [Publish("status/dev", b"offline", 0, True, False, None, None)]


def test_will_expiry_counts_from_publication_not_connect() -> None:
    """Spec 3.1.3.2.4: the will's Message Expiry Interval is sent as the Publication
    Expiry Interval when the will is published; a long-lived connection does not
    use it up."""
    h = Harness()
    w = _watcher(h)
    will = Will("wills/dev", b"gone", qos=1, properties=Properties(message_expiry_interval=60))
    c = h.connected("dev", will=will)
    h.advance(3600)
    c.conn.connection_lost()
    (got,) = publishes(w.read())
    assert got.properties is not None and got.properties.message_expiry_interval == 60


# -- Will Delay Interval (spec 3.1.3.2.2) ---------------------------------------------


def _delayed_will(delay: int) -> Will:
    return Will("wills/dev", b"late", qos=1, properties=Properties(will_delay_interval=delay))


def test_will_delay_publishes_after_the_delay() -> None:
    h = Harness()
    w = _watcher(h)
    c = h.connected("dev", will=_delayed_will(10), session_expiry_interval=100)
    c.conn.connection_lost()
    assert w.read() == []
    h.advance(9)
    assert w.read() == []
    h.advance(1)
    assert payloads(w.read()) == [b"late"]
    h.advance(100)
    assert w.read() == []


def test_will_delay_cancelled_when_session_resumed_in_time() -> None:
    """MQTT-3.1.3-9: a new connection for the session before the delay: no will."""
    h = Harness()
    w = _watcher(h)
    c = h.connected("dev", will=_delayed_will(10), session_expiry_interval=100)
    c.conn.connection_lost()
    h.advance(5)
    back = h.client()
    assert back.connect("dev", clean_start=False).session_present
    h.advance(20)
    assert w.read() == []


def test_will_delay_longer_than_session_expiry_published_at_session_end() -> None:
    """Spec 3.1.3.2.2: published when the delay passes or the session ends, if sooner."""
    h = Harness()
    w = _watcher(h)
    c = h.connected("dev", will=_delayed_will(60), session_expiry_interval=5)
    c.conn.connection_lost()
    h.advance(4)
    assert w.read() == []
    h.advance(1)
    assert payloads(w.read()) == [b"late"]
    assert "dev" not in h.broker.sessions


def test_will_delay_with_session_expiry_0_publishes_at_once() -> None:
    h = Harness()
    w = _watcher(h)
    c = h.connected("dev", will=_delayed_will(60))
    c.conn.connection_lost()
    assert payloads(w.read()) == [b"late"]


def test_will_delay_session_taken_over_with_clean_start_publishes_will() -> None:
    """Clean start on the new connection ends the old session: its pending will goes out."""
    h = Harness()
    w = _watcher(h)
    c = h.connected("dev", will=_delayed_will(60), session_expiry_interval=100)
    c.conn.connection_lost()
    h.client().connect("dev", clean_start=True)
    assert payloads(w.read()) == [b"late"]


def test_will_not_published_after_refused_connect() -> None:
    h = Harness(max_client_id_length=23)
    w = _watcher(h)
    c = h.client()
    c.connect("x" * 30, will=WILL, check=False)
    c.conn.connection_lost()
    assert w.read() == []


def test_disconnect_packet_after_will_gone_is_noop() -> None:
    h = Harness()
    w = _watcher(h)
    c = h.connected("dev", will=WILL)
    c.send(Disconnect())
    c.send(Disconnect(ReasonCode.DISCONNECT_WITH_WILL))  # after close: ignored
    assert w.read() == []
