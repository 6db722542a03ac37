"""Valid MQTT packet streams and ways to break them, shared by the fuzz tests.

:func:`seed_packets` is a set of well-formed packets of every type a client
sends (3.1.1 and 5.0, with properties); :func:`mutate` damages a byte
stream the way fuzzers do: flip, insert, delete, truncate, duplicate,
splice in random bytes, and overwrite length fields with extreme values.
"""

from __future__ import annotations

import random

from broker.codec import encode
from broker.packets import (
    Auth,
    Connect,
    Disconnect,
    Packet,
    PingReq,
    Properties,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    Subscribe,
    Subscription,
    Unsubscribe,
    Will,
)

V311 = 4
V5 = 5


def connect_packet(level: int, client_id: str = "fuzz", **kw: object) -> bytes:
    return encode(Connect(client_id, protocol_level=level, **kw), level)  # type: ignore[arg-type]


def seed_packets(level: int) -> list[bytes]:
    """Well-formed client packets after CONNECT, every type, some with properties."""
    v5 = level == V5
    props = (
        Properties(
            message_expiry_interval=60,
            topic_alias=1,
            content_type="text/plain",
            response_topic="r/t",
            correlation_data=b"\x00\x01",
            user_properties=(("k", "v"),),
            payload_format_indicator=1,
        )
        if v5
        else None
    )
    packets: list[Packet] = [
        Publish("fuzz/a", b"hello", 0, False, False, None),
        Publish("fuzz/b", b"x" * 300, 1, True, False, 7, props),
        Publish("fuzz/c", b"", 2, False, True, 8),
        PubAck(1),
        PubRec(2),
        PubRel(3),
        PubComp(4),
        Subscribe(
            5,
            [Subscription("fuzz/#", 2), Subscription("$share/g/fuzz/+", 1)],
            Properties(subscription_identifiers=(3,)) if v5 else None,
        ),
        Unsubscribe(6, ["fuzz/#", "nothing"]),
        PingReq(),
        Disconnect(0x04 if v5 else 0, Properties(session_expiry_interval=0) if v5 else None),
    ]
    if v5:
        packets.append(Auth(0x18, Properties(authentication_method="x")))
    return [encode(p, level) for p in packets]


def connect_variants(level: int) -> list[bytes]:
    v5 = level == V5
    will_props = Properties(will_delay_interval=1, message_expiry_interval=5) if v5 else None
    return [
        connect_packet(level),
        connect_packet(level, "", clean_start=True),
        connect_packet(
            level,
            "fuzz-w",
            clean_start=False,
            keep_alive=5,
            will=Will("fuzz/will", b"bye", 1, True, will_props),
            username="u",
            password=b"p",
            properties=Properties(
                session_expiry_interval=10, receive_maximum=2, topic_alias_maximum=3
            )
            if v5
            else None,
        ),
    ]


_EXTREMES = [
    b"\xff\xff\xff\x7f",
    b"\xff\xff\xff\xff",
    b"\x80\x80\x80\x80\x01",
    b"\x00",
    b"\xff\xff",
]


def mutate(data: bytes, rng: random.Random, rounds: int | None = None) -> bytes:
    """A damaged copy of ``data``."""
    buf = bytearray(data)
    for _ in range(rounds or rng.randint(1, 4)):
        op = rng.randrange(8)
        n = len(buf)
        i = rng.randrange(n + 1)
        if op == 0 and n:
            buf[min(i, n - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:
            buf[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 2 and n:
            del buf[i : i + rng.randint(1, 8)]
        elif op == 3:
            del buf[i:]
        elif op == 4 and n:
            j = rng.randrange(n)
            buf[i:i] = buf[j : j + rng.randint(1, 32)]
        elif op == 5:
            buf[i : i + 4] = rng.choice(_EXTREMES)
        elif op == 6 and n:
            buf[min(i, n - 1)] = rng.choice([0x00, 0x7F, 0x80, 0xFF, 0xC0, 0xE0, 0xF0])
        else:
            buf[i:i] = rng.choice(_EXTREMES)
    return bytes(buf)


def random_stream(rng: random.Random, level: int) -> bytes:
    """A CONNECT (valid or not) then valid, mutated and random packets."""
    parts: list[bytes] = []
    connect = rng.choice(connect_variants(level))
    if rng.random() < 0.7:
        parts.append(connect)
    elif rng.random() < 0.5:
        parts.append(mutate(connect, rng))
    seeds = seed_packets(level)
    for _ in range(rng.randint(1, 12)):
        roll = rng.random()
        if roll < 0.5:
            parts.append(rng.choice(seeds))
        elif roll < 0.85:
            parts.append(mutate(rng.choice(seeds), rng))
        else:
            parts.append(bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))))
    return b"".join(parts)
