"""Coverage-guided fuzzing of the codec, the sans-IO connection and the
WebSocket layer with atheris (libFuzzer). Not part of the test suite.

    pip install atheris
    python tests/fuzz/atheris_connection.py -max_total_time=300 tests/fuzz/corpus/

The first input byte picks the target and the protocol state; the rest is
fed in chunks. Anything but a clean run (an exception other than MQTTError
escaping the decoder, any exception from MQTTConnection.receive_data or
WebSocketServer.receive_data, output that does not parse) is a crash, and
libFuzzer writes the input to ``crash-*``: copy it into tests/fuzz/corpus/
(name it ``*-v311.bin`` for 3.1.1) and tests/fuzz/test_connection_fuzz.py
replays it at every protocol state from then on.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import atheris  # type: ignore[import-untyped]

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

with atheris.instrument_imports(include=["broker"]):
    import broker.core
    import broker.handlers  # instrumented for coverage feedback
    from broker.codec import PacketDecoder
    from broker.errors import MQTTError
    from edge.websocket import WebSocketServer
    from tests.fuzz.test_connection_fuzz import STATES, _check, _prepare
    from tests.unit.core_harness import Harness

assert broker.core

logging.disable(logging.CRITICAL)


def one_input(data: bytes) -> None:
    if len(data) < 2:
        return
    selector, step, body = data[0], data[1] % 64 + 1, data[2:]
    chunks = [body[i : i + step] for i in range(0, len(body), step)]
    target = selector % 3
    if target == 0:
        decoder = PacketDecoder(protocol_level=(None, 4, 5)[selector // 3 % 3])
        try:
            for chunk in chunks:
                decoder.feed(chunk)
        except MQTTError:
            pass
    elif target == 1:
        level = 5 if selector & 0x80 else 4
        state = STATES[selector // 3 % len(STATES)]
        h = Harness(max_packet_size=2048, receive_maximum=4, topic_alias_maximum=2)
        _check(h, _prepare(h, state, level), chunks, level)
    else:
        ws = WebSocketServer()
        for chunk in chunks:
            ws.receive_data(chunk)
            ws.data_to_send()


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
