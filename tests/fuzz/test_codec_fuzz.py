"""Hypothesis fuzz of the codec: any bytes decode to packets or raise MQTTError.

Never another exception, never a packet the encoder cannot write back, and
never more buffered than ``max_packet_size``: the decoder is the first thing
every byte from the network meets.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from broker.codec import PacketDecoder, encode
from broker.errors import MQTTError
from broker.packets import Connect
from tests.fuzz.streams import V5, V311, mutate, seed_packets

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LEVELS = st.sampled_from([None, 3, V311, V5])


def _feed_all(decoder: PacketDecoder, chunks: list[bytes]) -> None:
    level = decoder.protocol_level or V5
    try:
        for chunk in chunks:
            for packet in decoder.feed(chunk):
                if isinstance(packet, Connect):
                    level = packet.protocol_level
                    decoder.protocol_level = level
                encode(packet, level)  # whatever decodes can be written back
                assert len(decoder._buffer) <= decoder.max_packet_size
    except MQTTError:
        pass


@FUZZ
@given(st.lists(st.binary(max_size=200), max_size=20), LEVELS, st.integers(16, 4096))
@example([b"\x30\xff\xff\xff\xff\x7f"], V5, 4096)  # a 5-byte remaining length
@example([b"\x82\x00"], V311, 4096)  # SUBSCRIBE without a body
@example([b"\x10\x0c\x00\x04MQTT\x05\x02\x00\x3c\x05\x11"], None, 4096)  # cut properties
def test_random_bytes(chunks: list[bytes], level: int | None, max_size: int) -> None:
    _feed_all(PacketDecoder(protocol_level=level, max_packet_size=max_size), chunks)


@FUZZ
@given(st.integers(0, 2**32), st.sampled_from([V311, V5]), st.integers(1, 7))
def test_mutated_valid_streams(seed: int, level: int, step: int) -> None:
    rng = random.Random(seed)
    stream = b"".join(mutate(p, rng) if rng.random() < 0.5 else p for p in seed_packets(level))
    chunks = [stream[i : i + step] for i in range(0, len(stream), step)]
    _feed_all(PacketDecoder(protocol_level=level), chunks)


@FUZZ
@given(st.binary(min_size=1, max_size=300), st.sampled_from([V311, V5]))
def test_valid_prefix_then_garbage(garbage: bytes, level: int) -> None:
    """Every seed packet decodes; what follows may only raise MQTTError."""
    stream = b"".join(seed_packets(level))
    decoder = PacketDecoder(protocol_level=level)
    assert len(decoder.feed(stream)) == len(seed_packets(level))
    _feed_all(decoder, [garbage])


def test_oversized_packet_refused_before_buffering() -> None:
    decoder = PacketDecoder(protocol_level=V5, max_packet_size=1024)
    try:
        decoder.feed(b"\x30\xff\xff\x03")  # announces ~64 KiB
    except MQTTError:
        pass
    else:
        raise AssertionError("a packet above max_packet_size was not refused")
