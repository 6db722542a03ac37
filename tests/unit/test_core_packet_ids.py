"""Packet identifiers the server chooses (MQTT 5.0 spec 2.2.1)."""

from __future__ import annotations

from broker.codec import encode
from broker.packets import PubAck, Publish
from tests.unit.core_harness import V5, Harness, publishes


def test_packet_ids_wrap_to_1_never_0_never_reuse_one_in_flight() -> None:
    """MQTT-2.2.1-2/-3: a non-zero id not in use; 65535 wraps to 1 and the id still
    awaiting its PUBACK is skipped. Drives more than 65535 QoS 1 deliveries through
    a subscriber that acknowledges all but the first."""
    h = Harness()
    sub = h.connected("sub")
    sub.subscribe("t", qos=1)
    pub = h.connected("pub")
    one = encode(Publish("t", b"", 1, False, False, 1), V5)
    batch = 63  # the default in-flight cap is 64, one of which stays held
    ids: list[int] = []
    held: Publish | None = None
    while len(ids) < 65535 + 200:
        pub.send_raw(one * batch)
        pub.conn.data_to_send()  # PUBACKs for the publisher, not looked at
        got = publishes(sub.read())
        assert len(got) == batch
        if held is None:
            held, got = got[0], got[1:]
            ids.append(held.packet_id or 0)
        ids.extend(p.packet_id or 0 for p in got)
        sub.send_raw(b"".join(encode(PubAck(p.packet_id or 0), V5) for p in got))
    assert held is not None and held.packet_id == 1
    assert 0 not in ids
    assert ids[:65535] == list(range(1, 65536))
    # After the wrap: 1 is still unacknowledged, so the sequence goes on at 2.
    assert ids[65535:65540] == [2, 3, 4, 5, 6]
    assert ids.count(1) == 1
    assert list(h.broker.sessions["sub"].outflow.inflight) == [1]


def test_packet_id_skips_every_id_in_flight() -> None:
    """MQTT-2.2.1-3: ids of unacknowledged messages are not reused after the wrap."""
    h = Harness()
    sub = h.connected("sub", receive_maximum=10)
    sub.subscribe("t", qos=1)
    session = h.broker.sessions["sub"]
    session.outflow.feed._last_packet_id = 65530  # type: ignore[attr-defined]  # start near the wrap without 65k round trips
    pub = h.connected("pub")
    for _ in range(8):
        pub.publish("t", qos=1)
    first = publishes(sub.read())
    assert [p.packet_id for p in first] == [65531, 65532, 65533, 65534, 65535, 1, 2, 3]
    # Ack the middle ones only; 65531, 65532 and 2 stay in flight.
    for p in first:
        if p.packet_id not in (65531, 65532, 2):
            sub.send(PubAck(p.packet_id or 0))
    session.outflow.feed._last_packet_id = 65530  # type: ignore[attr-defined]
    for _ in range(6):
        pub.publish("t", qos=1)
    nxt = publishes(sub.read())
    assert [p.packet_id for p in nxt] == [65533, 65534, 65535, 1, 3, 4]
