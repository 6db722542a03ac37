"""Hypothesis fuzz of the sans-IO connection at random protocol states.

Bytes reach an :class:`~broker.connection.MQTTConnection` fresh, right after
CONNECT, after SUBSCRIBE with messages in flight, or mid-QoS-2; whatever
they are, the broker answers with well-formed packets or closes the
connection (with a DISCONNECT reason code in MQTT 5), and raises nothing.
Other clients of the same broker keep working.

Regression inputs that once broke something live in ``corpus/`` and are
replayed by :func:`test_corpus` at every state.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.codec import PacketDecoder
from broker.connection import ConnectionState
from broker.packets import ConnAck, Disconnect, Publish
from tests.fuzz.streams import V5, V311, connect_variants, mutate, random_stream, seed_packets
from tests.unit.core_harness import Client, Harness

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CORPUS = Path(__file__).parent / "corpus"
STATES = ["fresh", "connected", "subscribed", "qos2_pending"]


def _prepare(h: Harness, state: str, level: int) -> Client:
    """A client at ``state``; a second one publishes to it so it has traffic in flight."""
    c = h.client(level, peer="fuzzed")
    if state == "fresh":
        return c
    c.connect("fuzzed", keep_alive=30)
    if state in ("subscribed", "qos2_pending"):
        c.subscribe("fuzz/#", qos=2)
        other = h.connected("feeder")
        other.publish_acked("fuzz/x", b"in flight", qos=1)
        other.publish("fuzz/y", b"qos2", qos=2)
        c.read()
    if state == "qos2_pending":
        c.publish("fuzz/z", b"half", qos=2, packet_id=77)  # PUBREC owed, PUBREL not sent
        c.read()
    return c


def _check(h: Harness, c: Client, chunks: list[bytes], level: int) -> None:
    decoder = PacketDecoder(protocol_level=level)
    for chunk in chunks:
        c.send_raw(chunk)  # must not raise
        out = c.conn.data_to_send()
        if not out:
            continue
        # The broker's output parses as MQTT at the connection's level: a CONNECT
        # with an unknown level is answered in the 3.1.1 form (MQTT-3.1.2-2).
        decoder.protocol_level = c.conn.protocol_level
        for packet in decoder.feed(out):
            assert not isinstance(packet, Publish) or packet.topic or packet.properties
    if c.conn.state is ConnectionState.CLOSED:
        assert c.conn.close_requested
        assert c.conn.data_to_send() == b""
        c.send_raw(b"\x30\x03\x00\x01a")  # input after the close is ignored
        assert c.conn.data_to_send() == b""
    assert len(c.conn.decoder._buffer) <= c.conn.decoder.max_packet_size
    h.advance(100)  # deadlines run without error whatever the state
    listener = h.connected("canary-listener")
    listener.subscribe("canary")
    h.connected("canary-talker").publish_acked("canary", b"alive")
    assert [p.payload for p in listener.read() if isinstance(p, Publish)] == [b"alive"]


@FUZZ
@given(
    st.sampled_from(STATES),
    st.sampled_from([V311, V5]),
    st.integers(0, 2**32),
    st.integers(1, 40),
)
def test_mutated_streams_at_every_state(state: str, level: int, seed: int, step: int) -> None:
    h = Harness(max_packet_size=2048, receive_maximum=4, topic_alias_maximum=2)
    c = _prepare(h, state, level)
    rng = random.Random(seed)
    stream = (
        random_stream(rng, level)
        if state == "fresh"
        else b"".join(
            mutate(p, rng) if rng.random() < 0.4 else p
            for p in rng.choices(seed_packets(level), k=rng.randint(1, 10))
        )
    )
    _check(h, c, [stream[i : i + step] for i in range(0, len(stream), step)], level)


@FUZZ
@given(st.sampled_from(STATES), st.sampled_from([V311, V5]), st.lists(st.binary(max_size=64)))
def test_random_bytes_at_every_state(state: str, level: int, chunks: list[bytes]) -> None:
    h = Harness()
    c = _prepare(h, state, level)
    _check(h, c, chunks, level)


def test_protocol_error_after_connect_is_a_v5_disconnect() -> None:
    h = Harness()
    c = _prepare(h, "connected", V5)
    c.send_raw(b"\x10\x00")  # a second (empty) CONNECT
    packets = c.read()
    assert isinstance(packets[-1], Disconnect) and packets[-1].reason_code >= 0x80
    assert c.closed


def test_every_connect_variant_is_accepted() -> None:
    for level in (V311, V5):
        for connect in connect_variants(level):
            h = Harness()
            c = h.client(level)
            c.send_raw(connect)
            (ack,) = c.read()
            assert isinstance(ack, ConnAck) and ack.reason_code == 0


def _corpus() -> list[Path]:
    return sorted(CORPUS.glob("*.bin"))


@pytest.mark.parametrize("path", _corpus(), ids=lambda p: p.stem)
@pytest.mark.parametrize("state", STATES)
def test_corpus(path: Path, state: str) -> None:
    """Inputs that once found a bug; the file name says which level they were for."""
    level = V311 if "v311" in path.stem else V5
    h = Harness(max_packet_size=2048, receive_maximum=4, topic_alias_maximum=2)
    c = _prepare(h, state, level)
    data = path.read_bytes()
    _check(h, c, [data], level)
    h2 = Harness(max_packet_size=2048, receive_maximum=4, topic_alias_maximum=2)
    c2 = _prepare(h2, state, level)
    _check(h2, c2, [data[i : i + 1] for i in range(len(data))], level)
