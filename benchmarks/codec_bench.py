"""Micro-benchmark of the hot codec paths: ``python -m benchmarks.codec_bench``.

Reports nanoseconds per operation (best of several timeit repeats, so the
number is what the code costs, not what the machine was busy with) for a
QoS 1 PUBLISH with a 64-byte payload and for a PUBACK, on MQTT 3.1.1 and 5.
"""

from __future__ import annotations

import timeit
from collections.abc import Callable
from functools import partial

from broker.codec import PacketDecoder, encode
from broker.packets import PubAck, Publish

NUMBER = 50_000
REPEAT = 7


def _ns_per_call(func: Callable[[], object]) -> float:
    best = min(timeit.repeat(func, number=NUMBER, repeat=REPEAT))
    return best / NUMBER * 1e9


def main() -> None:
    publish = Publish("devices/sensor-0042/telemetry", bytes(64), qos=1, packet_id=4242)
    puback = PubAck(4242)
    rows = []
    for level, label in ((4, "3.1.1"), (5, "5.0")):
        for name, packet in (("PUBLISH QoS1 64B", publish), ("PUBACK", puback)):
            wire = encode(packet, level)
            decoder = PacketDecoder(protocol_level=level)
            assert decoder.feed(wire) == [packet]
            decode_ns = _ns_per_call(partial(decoder.feed, wire))
            encode_ns = _ns_per_call(partial(encode, packet, level))
            rows.append((f"{name} v{label}", len(wire), decode_ns, encode_ns))

    print(f"{'packet':<26}{'bytes':>6}{'decode ns':>12}{'encode ns':>12}")
    for name, size, decode_ns, encode_ns in rows:
        print(f"{name:<26}{size:>6}{decode_ns:>12.0f}{encode_ns:>12.0f}")


if __name__ == "__main__":
    main()
