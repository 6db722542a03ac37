"""Limits: connection and publish rates, topic size, subscriptions, queue policy,
max connections and slow consumers. The sans-IO ones through the core harness,
the socket ones (max_connections, write buffer) through an in-process server."""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import pytest

from broker.codec import encode
from broker.config import ListenerSettings, MqttSettings, PersistenceSettings, Settings
from broker.limits import (
    LogLimiter,
    SourceBuckets,
    TokenBucket,
    bucket_or_none,
    source_key,
    topic_within_limits,
)
from broker.packets import (
    ConnAck,
    Connect,
    ConnectReturnCode,
    Disconnect,
    Properties,
    PubAck,
    Publish,
    PubRec,
    ReasonCode,
    SubAck,
    Subscribe,
    Subscription,
    Unsubscribe,
    Will,
)
from edge.server import BrokerServer
from tests.unit.core_harness import V5, V311, Harness, payloads

# ------------------------------------------------------------------ building blocks


def test_token_bucket() -> None:
    bucket = TokenBucket(2.0, now=0.0)
    assert bucket.take(0.0) and bucket.take(0.0)
    assert not bucket.take(0.0)  # burst of one second's worth, then empty
    assert not bucket.take(0.4)
    assert bucket.take(0.5)  # 0.5 s x 2/s = 1 token
    assert not bucket.take(0.5)
    assert bucket.take(100.0) and bucket.take(100.0) and not bucket.take(100.0)  # capped
    slow = TokenBucket(0.5, now=0.0)  # below 1/s: the bucket still holds one token
    assert slow.take(0.0) and not slow.take(1.0) and slow.take(2.0)
    assert bucket_or_none(0, 0.0) is None


def test_topic_within_limits() -> None:
    assert topic_within_limits("a/b/c", 5, 3)
    assert not topic_within_limits("a/b/cd", 5, 3)  # 6 bytes
    assert not topic_within_limits("a/b/c/d", 100, 3)  # 4 levels
    assert topic_within_limits("éé", 4, 1)  # 4 bytes in UTF-8
    assert not topic_within_limits("ééé", 5, 1)  # 3 characters, 6 bytes
    assert topic_within_limits("/", 1, 2) and not topic_within_limits("//", 2, 2)


# ------------------------------------------------------------------ connection rate


def test_connection_rate_v5_gets_0x9f_v311_server_unavailable() -> None:
    h = Harness(max_connection_rate=2)
    h.connected("a")
    h.connected("b")
    c = h.client(V5)
    assert c.connect("c", check=False).reason_code == ReasonCode.CONNECTION_RATE_EXCEEDED
    assert c.closed
    old = h.client(V311)
    ack = old.connect("d", check=False)
    assert ack.reason_code == ConnectReturnCode.SERVER_UNAVAILABLE and old.closed
    assert h.broker.stats.connections_rejected["connection_rate_exceeded"] == 2
    h.advance(0.5)  # one token back
    h.connected("e")
    assert h.client().connect("f", check=False).reason_code == 0x9F


def test_source_key() -> None:
    assert source_key("192.0.2.7") == "192.0.2.7"
    assert source_key("::ffff:192.0.2.7") == "192.0.2.7"  # IPv4-mapped is the IPv4 address
    assert source_key("2001:db8:1:2:aaaa::1") == "2001:db8:1:2::/64"
    assert source_key("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"  # same /64, same source
    assert source_key("fe80::1%eth0") == "fe80::/64"
    assert source_key("peer") == "peer"


def test_source_buckets_are_separate_and_bounded() -> None:
    buckets = SourceBuckets(2.0, max_sources=3)
    assert buckets.take("a", 0.0) and buckets.take("a", 0.0)
    assert not buckets.take("a", 0.0)
    assert buckets.take("b", 0.0)  # a's bucket is a's alone
    for name in ("c", "d", "e"):
        buckets.take(name, 0.0)
    assert len(buckets) == 3  # least recently used (a, b) dropped


def test_log_limiter(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    logger = logging.getLogger("test.limiter")
    limiter = LogLimiter(logger, "refusals", rate=1.0, burst=3.0)
    with caplog.at_level(logging.INFO, logger="test.limiter"):
        for i in range(10):
            limiter.log(0.0, logging.INFO, "refused %d", i)
        assert [r.getMessage() for r in caplog.records] == ["refused 0", "refused 1", "refused 2"]
        assert limiter.suppressed == 7
        limiter.log(1.0, logging.INFO, "refused %d", 10)
        assert caplog.records[-1].getMessage() == (
            "refused 10 (7 more refusals not logged before this one: rate limit)"
        )
        limiter.log(1.0, logging.INFO, "refused %d", 11)
        limiter.flush(1.5)  # no token yet
        limiter.flush(2.0)
        assert caplog.records[-1].getMessage().startswith("1 refusals not logged")
        assert limiter.suppressed == 0


def test_connection_rate_per_source_comes_before_the_global_one() -> None:
    """Issue 19: one source used up the broker-wide bucket and locked everyone out."""
    h = Harness(max_connection_rate=5, max_connection_rate_per_source=2)
    attacker = [h.client(V5, peer="6.6.6.6:1") for _ in range(10)]
    codes = [c.connect(f"a{i}", check=False).reason_code for i, c in enumerate(attacker)]
    assert codes == [0, 0] + [ReasonCode.CONNECTION_RATE_EXCEEDED] * 8
    rejected = h.broker.stats.connections_rejected
    assert rejected == {"connection_rate_exceeded_per_source": 8}
    # The global bucket lost only the two accepted CONNECTs: three others get in.
    for i in range(3):
        c = h.client(V5, peer=f"10.0.0.{i}:1")
        c.conn.source = f"10.0.0.{i}"
        c.connect(f"d{i}")
    late = h.client(V5, peer="10.0.0.9:1")
    late.conn.source = "10.0.0.9"
    assert late.connect("d9", check=False).reason_code == ReasonCode.CONNECTION_RATE_EXCEEDED
    assert rejected["connection_rate_exceeded"] == 1


def test_connection_rate_zero_is_off() -> None:
    h = Harness(max_connection_rate=0, max_connection_rate_per_source=0)
    for i in range(50):
        h.connected(f"c{i}")


# ------------------------------------------------------------------ publish rate


def test_publish_rate_v5_disconnects_with_0x96() -> None:
    h = Harness(max_publish_rate=5)
    sub = h.connected("sub")
    sub.subscribe("t")
    pub = h.connected("pub")
    for _ in range(5):
        pub.publish("t", b"ok")
    assert not pub.closed
    pub.publish("t", b"too many")
    assert pub.read() == [Disconnect(ReasonCode.MESSAGE_RATE_TOO_HIGH)]
    assert pub.closed
    assert payloads(sub.read()) == [b"ok"] * 5
    assert h.broker.stats.dropped["message_rate_too_high"] == 1


def test_publish_rate_refills_and_v311_closes() -> None:
    h = Harness(max_publish_rate=2)
    pub = h.connected("pub", level=V311)
    pub.publish("t")
    pub.publish("t")
    h.advance(0.5)
    pub.publish("t")  # the refilled token
    assert not pub.closed
    pub.publish("t")
    assert pub.read() == [] and pub.closed  # 3.1.1 has no DISCONNECT from the server


def test_publish_rate_is_per_client() -> None:
    h = Harness(max_publish_rate=1)
    a, b = h.connected("a"), h.connected("b")
    a.publish("t")
    b.publish("t")
    assert not a.closed and not b.closed


# ------------------------------------------------------------------ decoding before CONNECT


def test_connect_above_the_pre_connect_size_is_closed_from_its_header() -> None:
    """Issue 19: a 1 MB CONNECT was buffered and decoded before any limit applied."""
    h = Harness(max_connect_packet_size=1000)
    c = h.client(V5)
    big = encode(Connect("c", protocol_level=5, will=Will("t", b"x" * 2000)), 5)
    c.send_raw(big[:5])  # the fixed header is enough to refuse it
    assert c.closed and c.read() == []
    assert h.broker.stats.connections_rejected == {"packet_too_large": 1}
    # Once connected, packets up to max_packet_size are fine.
    ok = h.connected("ok")
    ok.subscribe("t")
    pub = h.connected("pub")
    pub.publish("t", b"y" * 5000)
    assert payloads(ok.read()) == [b"y" * 5000]


def test_what_follows_connect_is_decoded_after_connack_with_the_full_limit() -> None:
    """Pipelined packets wait undecoded until the CONNECT is accepted, then count
    against max_packet_size, not the pre-CONNECT limit."""
    h = Harness(max_connect_packet_size=100)
    sub = h.connected("sub")
    sub.subscribe("t")
    c = h.client(V5)
    wire = encode(Connect("p", protocol_level=5), 5) + encode(
        Publish("t", b"z" * 3000, 0, False, False, None), 5
    )
    c.send_raw(wire)
    assert [type(p) for p in c.read()] == [ConnAck]
    assert payloads(sub.read()) == [b"z" * 3000]


def test_refused_connect_leaves_what_followed_undecoded() -> None:
    h = Harness(max_connection_rate=1, max_connection_rate_per_source=0)
    h.connected("first")
    c = h.client(V5)
    garbage = b"\x00\x00" * 10  # would be Malformed if it were ever decoded
    c.send_raw(encode(Connect("second", protocol_level=5), 5) + garbage)
    assert c.read() == [ConnAck(False, ReasonCode.CONNECTION_RATE_EXCEEDED)]
    assert "malformed_packet" not in h.broker.stats.connections_rejected


def test_user_properties_over_the_limit_v5_disconnect_0x97() -> None:
    h = Harness(max_user_properties=3)
    sub = h.connected("sub")
    sub.subscribe("t")
    pub = h.connected("pub")
    three = Properties(user_properties=(("a", "1"),) * 3)
    pub.send(Publish("t", b"ok", 0, False, False, None, three))
    assert payloads(sub.read()) == [b"ok"]
    four = Properties(user_properties=(("a", "1"),) * 4)
    pub.send(Publish("t", b"no", 0, False, False, None, four))
    assert pub.read() == [Disconnect(ReasonCode.QUOTA_EXCEEDED)] and pub.closed
    assert sub.read() == []
    assert h.broker.stats.connections_rejected["quota_exceeded"] == 1
    # In CONNECT (no CONNACK can say it before the CONNECT is decoded): closed.
    c = h.client(V5)
    c.send(Connect("c", protocol_level=5, properties=four))
    assert c.read() == [] and c.closed


def test_topic_filters_per_packet() -> None:
    h = Harness(max_topic_filters_per_packet=2)
    c = h.connected("c")
    c.send(Subscribe(1, [Subscription("a", 0), Subscription("b", 0)]))
    assert [type(p) for p in c.read()] == [SubAck]
    c.send(Subscribe(2, [Subscription(f"t/{i}", 0) for i in range(3)]))
    assert c.read() == [Disconnect(ReasonCode.QUOTA_EXCEEDED)]
    assert h.broker.subscriptions.match("t/0").entries == []
    old = h.connected("old", level=V311)
    old.send(Unsubscribe(1, ["a", "b", "c"]))
    assert old.read() == [] and old.closed


# ------------------------------------------------------------------ topic limits


def test_publish_topic_too_long_v5() -> None:
    h = Harness(max_topic_length=10)
    sub = h.connected("sub")
    sub.subscribe("#")
    pub = h.connected("pub")
    assert pub.publish_acked("0123456789") == 0  # exactly at the limit
    sub.read()
    assert pub.publish_acked("0123456789a", qos=1) == ReasonCode.TOPIC_NAME_INVALID
    packet_id = pub.publish("0123456789a", qos=2)
    assert pub.read() == [PubRec(packet_id or 0, ReasonCode.TOPIC_NAME_INVALID)]  # flow ends
    pub.publish("0123456789a", qos=0)
    pub.publish("éééééé", qos=0)  # 6 characters, 12 bytes
    assert sub.read() == []
    assert h.broker.stats.dropped["topic_limit"] == 4
    assert not pub.closed


def test_publish_topic_too_deep_v311_is_acknowledged_and_dropped() -> None:
    h = Harness(max_topic_levels=3)
    sub = h.connected("sub")
    sub.subscribe("#")
    pub = h.connected("pub", level=V311)
    assert pub.publish_acked("a/b/c/d", qos=1) == 0  # 3.1.1 cannot say no
    assert pub.publish_acked("a/b/c/d", qos=2) == 0
    assert sub.read() == []
    pub.publish_acked("a/b/c", qos=1)
    assert payloads(sub.read()) == [b"x"]


def test_subscribe_filter_beyond_limits() -> None:
    h = Harness(max_topic_length=8, max_topic_levels=3)
    c = h.connected("c")
    assert c.subscribe("a/b/c", "a/b/c/d", "123456789", "+/+/#") == [0, 0x8F, 0x8F, 0]
    old = h.connected("old", level=V311)
    assert old.subscribe("a/b/c/d", "ok") == [0x80, 0]
    assert h.broker.stats.dropped["subscribe_topic_limit"] == 3


def test_will_topic_beyond_limits_is_refused() -> None:
    h = Harness(max_topic_length=5)
    c = h.client()
    ack = c.connect("w", will=Will("toolong", b"bye"), check=False)
    assert ack.reason_code == ReasonCode.TOPIC_NAME_INVALID and c.closed


def test_topic_alias_cannot_bypass_the_limit() -> None:
    from broker.packets import Properties

    h = Harness(max_topic_length=5)
    pub = h.connected("pub")
    pub.send(Publish("abcdef", b"x", 1, False, False, 1, Properties(topic_alias=1)))
    assert pub.read() == [PubAck(1, ReasonCode.TOPIC_NAME_INVALID)]
    pub.send(Publish("", b"x", 1, False, False, 2, Properties(topic_alias=1)))
    assert pub.read() == [PubAck(2, ReasonCode.TOPIC_NAME_INVALID)]


# ------------------------------------------------------------------ subscriptions


def test_max_subscriptions_per_client_quota_exceeded() -> None:
    h = Harness(max_subscriptions_per_client=2)
    c = h.connected("c")
    assert c.subscribe("a", "b", "c") == [0, 0, ReasonCode.QUOTA_EXCEEDED]
    assert c.subscribe("a") == [0]  # replacing one is not a new one
    c.unsubscribe("a")
    assert c.subscribe("c", "d") == [0, ReasonCode.QUOTA_EXCEEDED]
    old = h.connected("old", level=V311)
    assert old.subscribe("1", "2", "3") == [0, 0, 0x80]
    assert h.broker.stats.dropped["subscription_quota"] == 3


# ------------------------------------------------------------------ queue policy


@pytest.mark.parametrize(("policy", "survivors"), [("newest", [1, 2, 3]), ("oldest", [3, 4, 5])])
def test_queue_drop_policy(policy: str, survivors: list[int]) -> None:
    h = Harness(max_queued_messages=3, max_inflight=1, queue_drop_policy=policy)
    sub = h.connected("sub")
    sub.subscribe("t", qos=1)
    pub = h.connected("pub")
    for i in range(6):
        pub.publish_acked("t", str(i).encode())
    first = sub.read()
    assert payloads(first) == [b"0"]  # in flight
    assert h.broker.stats.dropped["queue_full"] == 2
    got = []
    last = first[0]
    for _ in survivors:
        sub.ack(last)
        (last,) = sub.read()
        got.append(int(last.payload))  # type: ignore[attr-defined]
    assert got == survivors


def test_queue_zero_with_oldest_policy_drops_the_new_one() -> None:
    h = Harness(max_queued_messages=0, max_inflight=1, queue_drop_policy="oldest")
    sub = h.connected("sub")
    sub.subscribe("t", qos=1)
    pub = h.connected("pub")
    pub.publish_acked("t", b"0")
    pub.publish_acked("t", b"1")
    assert payloads(sub.read()) == [b"0"]
    assert h.broker.stats.dropped["queue_full"] == 1


# ------------------------------------------------------------------ the socket edge


def _server_settings(**mqtt: object) -> Settings:
    return Settings(
        listener=ListenerSettings(host="127.0.0.1", port=0),
        mqtt=dataclasses.replace(MqttSettings(), **mqtt),  # type: ignore[arg-type]
        persistence=PersistenceSettings(enabled=False),
    )


async def _closed_by_server(reader: asyncio.StreamReader, timeout: float = 3.0) -> bool:
    try:
        while await asyncio.wait_for(reader.read(65536), timeout):
            pass
    except ConnectionResetError:
        pass
    return True


async def test_max_connections_refuses_at_accept() -> None:
    server = BrokerServer(_server_settings(max_connections=2))
    await server.start()
    try:
        opened = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(2)]
        await asyncio.sleep(0.05)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        assert await _closed_by_server(reader)
        assert server.broker.stats.connections_rejected["max_connections"] == 1
        # the first two still work
        from broker.codec import encode

        r, w = opened[0]
        w.write(encode(Connect("one", protocol_level=5), 5))
        assert (await asyncio.wait_for(r.read(2), 3))[0] == 0x20
        for _, w in [*opened, (reader, writer)]:
            w.close()
        await asyncio.sleep(0.05)
        r, w = await asyncio.open_connection("127.0.0.1", server.port)  # room again
        w.write(encode(Connect("again", protocol_level=5), 5))
        assert (await asyncio.wait_for(r.read(2), 3))[0] == 0x20
        w.close()
    finally:
        await server.stop()


async def _subscriber_that_does_not_read(port: int, topic: str) -> socket.socket:
    from broker.codec import PacketDecoder, encode
    from broker.packets import Subscribe, Subscription

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(sock, encode(Connect("slow", protocol_level=5), 5))
    await loop.sock_sendall(sock, encode(Subscribe(1, [Subscription(topic, 0)]), 5))
    decoder = PacketDecoder(protocol_level=5)
    got: list[object] = []
    while len(got) < 2:
        got += decoder.feed(await asyncio.wait_for(loop.sock_recv(sock, 4096), 3))
    assert isinstance(got[0], ConnAck)
    return sock


async def _publisher(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    from broker.codec import encode

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(encode(Connect("pub", protocol_level=5), 5))
    await asyncio.wait_for(reader.read(64), 3)
    return reader, writer


async def test_write_buffer_hard_limit_aborts_the_client() -> None:
    from broker.codec import encode

    server = BrokerServer(
        _server_settings(
            max_packet_size=16_777_216,
            write_buffer_high_water=65536,
            write_buffer_hard_limit=1 << 20,
        )
    )
    await server.start()
    try:
        slow = await _subscriber_that_does_not_read(server.port, "big")
        _, writer = await _publisher(server.port)
        payload = b"x" * 12_000_000  # far more than socket buffers hold
        writer.write(encode(Publish("big", payload, 0, False, False, None), 5))
        await writer.drain()
        for _ in range(100):
            if server.broker.stats.connections_rejected.get("slow_consumer"):
                break
            await asyncio.sleep(0.05)
        assert server.broker.stats.connections_rejected["slow_consumer"] == 1
        assert (
            "slow" not in server.broker.sessions
            or server.broker.sessions["slow"].connection is None
        )
        slow.close()
        writer.close()
    finally:
        await server.stop()


async def test_congested_too_long_is_a_slow_consumer() -> None:
    from broker.codec import encode

    server = BrokerServer(
        _server_settings(write_buffer_high_water=16384, slow_consumer_timeout=0.3)
    )
    await server.start()
    try:
        slow = await _subscriber_that_does_not_read(server.port, "flood")
        _, writer = await _publisher(server.port)
        packet = encode(Publish("flood", b"y" * 60_000, 0, False, False, None), 5)
        for _ in range(80):  # ~5 MB: the buffer passes high water and stays there
            writer.write(packet)
        await writer.drain()
        for _ in range(60):
            if server.broker.stats.connections_rejected.get("slow_consumer"):
                break
            await asyncio.sleep(0.05)
        stats = server.broker.stats
        assert stats.connections_rejected["slow_consumer"] == 1
        assert stats.dropped.get("qos0_congested", 0) > 0  # QoS 0 was dropped first
        slow.close()
        writer.close()
    finally:
        await server.stop()


def test_queue_bytes_bound_what_a_session_holds() -> None:
    """Issue 19, finding 6: message count alone let ten 1 MB messages per queue slot
    hold memory without bound; mqtt.max_queued_bytes caps the payload bytes queued."""
    h = Harness(max_queued_messages=100, max_queued_bytes=3000, max_inflight=1)
    sub = h.connected("sub")
    sub.subscribe("t", qos=1)
    pub = h.connected("pub")
    for i in range(6):
        pub.publish_acked("t", bytes([48 + i]) * 1000)
    (first,) = sub.read()  # in flight; 3 of the other 5 fit in 3000 bytes
    assert h.broker.stats.dropped["queue_bytes_full"] == 2
    got = []
    last = first
    for _ in range(3):
        sub.ack(last)
        (last,) = sub.read()
        got.append(last.payload[:1])  # type: ignore[attr-defined]
    assert got == [b"1", b"2", b"3"]


def test_queue_bytes_with_the_oldest_policy_make_room_for_the_newest() -> None:
    h = Harness(max_queued_bytes=2000, max_inflight=1, queue_drop_policy="oldest")
    sub = h.connected("sub")
    sub.subscribe("t", qos=1)
    pub = h.connected("pub")
    for i in range(5):
        pub.publish_acked("t", bytes([48 + i]) * 1000)
    (first,) = sub.read()
    sub.ack(first)
    (second,) = sub.read()
    sub.ack(second)
    (third,) = sub.read()
    assert [p.payload[:1] for p in (first, second, third)] == [b"0", b"3", b"4"]  # type: ignore[attr-defined]


def test_a_client_that_never_acknowledges_its_window_is_disconnected() -> None:
    """Issue 19, finding 6: a client that reads but never PUBACKs held its window and
    everything queued behind it with no timeout (320 MiB measured)."""
    h = Harness(max_inflight=2, inflight_timeout=30)
    sub = h.connected("sub", session_expiry_interval=60)
    sub.subscribe("t", qos=1)
    pub = h.connected("pub")
    for i in range(3):
        pub.publish_acked("t", b"%d" % i)
    first, _second = sub.read()
    h.advance(20)
    sub.ack(first)  # progress: the clock starts again
    sub.read()
    h.advance(20)
    assert not sub.closed
    h.advance(11)
    assert sub.closed
    assert h.broker.stats.connections_rejected["inflight_timeout"] == 1
    again = h.connected("sub", session_expiry_interval=60, clean_start=False)
    assert len(again.pending) == 2  # kept for the session's next connection, DUP


def test_a_client_idle_longer_than_the_timeout_is_not_stalled_by_its_next_window() -> None:
    """The in-flight timeout's clock ran from the last acknowledgement: a client that
    received nothing for longer than mqtt.inflight_timeout was disconnected 0x97 at
    the next tick after its window filled, before it could acknowledge."""
    h = Harness(max_inflight=2, inflight_timeout=30)
    sub = h.connected("sub", session_expiry_interval=60)
    sub.subscribe("t", qos=1)
    pub = h.connected("pub")
    h.advance(100)  # nothing to receive, longer than the timeout
    for i in range(2):
        pub.publish_acked("t", b"%d" % i)
    assert len(sub.read()) == 2  # its window is full now
    h.advance(1)
    assert not sub.closed
    h.advance(29.5)
    assert sub.closed  # 30 s of a full window unacknowledged
    assert h.broker.stats.connections_rejected["inflight_timeout"] == 1
