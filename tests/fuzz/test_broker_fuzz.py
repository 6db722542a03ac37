"""Fuzz a running broker over TCP and WebSocket, with a canary client.

A real ``devicemq run`` process (persistence off, the WebSocket listener on)
receives hundreds of concurrent connections carrying valid, mutated and
random packet streams (tests/fuzz/streams.py) at random protocol states,
cut at random points, some reset abruptly. Meanwhile and afterwards a
canary subscriber must keep receiving what a canary publisher sends. At the
end: the process is alive, its stderr holds no traceback and no ERROR line,
its memory did not balloon, every byte it sent parses as MQTT, and sockets
that never sent a valid CONNECT were closed within the connect timeout.

Deterministic: the streams come from ``random.Random(SEED + i)``. For a longer
hunt: ``DEVICEMQ_FUZZ_SCALE=50 DEVICEMQ_FUZZ_SEED=123 pytest tests/fuzz/test_broker_fuzz.py``.
"""

from __future__ import annotations

import asyncio
import base64
import os
import random
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.codec import PacketDecoder, encode
from broker.errors import MQTTError
from broker.packets import Connect, Publish, Subscribe, Subscription
from edge.websocket import OP_BINARY, OP_CLOSE, OP_CONTINUATION, OP_PING, encode_frame
from tests.conftest import free_port
from tests.e2e.conftest import HOST, BrokerProcess, devicemq_only, start_broker
from tests.fuzz.streams import V5, V311, mutate, random_stream

pytestmark = devicemq_only("fuzzes devicemq's own process")

SEED = int(os.environ.get("DEVICEMQ_FUZZ_SEED", "7000"))
SCALE = int(os.environ.get("DEVICEMQ_FUZZ_SCALE", "1"))  # e.g. 50 for a long hunt
CONNECTIONS = 400 * SCALE  # MQTT over TCP
WS_CONNECTIONS = 120 * SCALE
CONCURRENCY = 60
CONNECT_TIMEOUT = 1.5


@pytest.fixture(scope="module")
def fuzzed_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BrokerProcess, int]]:
    ws_port = free_port(HOST)
    broker = start_broker(
        tmp_path_factory.mktemp("fuzz-broker"),
        {
            "persistence.enabled": False,
            "mqtt.connect_timeout": CONNECT_TIMEOUT,
            "mqtt.max_packet_size": 65536,
            "mqtt.max_connection_rate": 0,
            "websocket.enabled": True,
            "websocket.host": HOST,
            "websocket.port": ws_port,
        },
    )
    try:
        yield broker, ws_port
    finally:
        broker.stop()


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Canary:
    """A subscriber and a publisher that must keep working through the fuzzing."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.n = 0

    async def open(self) -> None:
        self.sub_r, self.sub_w = await asyncio.open_connection(HOST, self.port)
        self.sub_w.write(encode(Connect("canary-sub", protocol_level=V5, keep_alive=0), V5))
        self.sub_w.write(encode(Subscribe(1, [Subscription("canary/#", 1)]), V5))
        self.pub_r, self.pub_w = await asyncio.open_connection(HOST, self.port)
        self.pub_w.write(encode(Connect("canary-pub", protocol_level=V5, keep_alive=0), V5))
        self.decoder = PacketDecoder(protocol_level=V5)
        self.pending: list[object] = []
        await self._expect(lambda p: type(p).__name__ == "SubAck")

    async def _expect(self, match: object) -> None:
        deadline = time.monotonic() + 5
        while True:
            for i, p in enumerate(self.pending):
                if match(p):  # type: ignore[operator]
                    del self.pending[i]
                    return
            left = deadline - time.monotonic()
            assert left > 0, f"canary: nothing matching among {self.pending}"
            data = await asyncio.wait_for(self.sub_r.read(65536), left)
            assert data, "canary subscriber was disconnected"
            self.pending += self.decoder.feed(data)

    async def check(self) -> None:
        self.n += 1
        payload = f"alive {self.n}".encode()
        self.pub_w.write(encode(Publish("canary/t", payload, 0, False, False, None), V5))
        await self._expect(lambda p: isinstance(p, Publish) and p.payload == payload)

    def close(self) -> None:
        self.sub_w.close()
        self.pub_w.close()


def _parses(out: bytes) -> bool:
    """The broker's bytes are MQTT at some level (the fuzzer may have mangled its CONNECT)."""
    for level in (V5, V311):
        try:
            PacketDecoder(protocol_level=level).feed(out)
        except MQTTError:
            continue
        return True
    return False


async def _read_until(reader: asyncio.StreamReader, seconds: float) -> tuple[bytes, bool]:
    """(bytes read, closed by the server) within ``seconds``."""
    got = b""
    deadline = time.monotonic() + seconds
    try:
        while (left := deadline - time.monotonic()) > 0:
            chunk = await asyncio.wait_for(reader.read(65536), left)
            if not chunk:
                return got, True
            got += chunk
    except TimeoutError:
        return got, False
    except (ConnectionResetError, BrokenPipeError):
        return got, True
    return got, False


def _abort(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()


async def _fuzz_tcp(i: int, port: int, problems: list[str]) -> None:
    rng = random.Random(SEED + i)
    level = rng.choice([V311, V5])
    garbage_only = rng.random() < 0.15
    if garbage_only:  # never a valid CONNECT: must be closed within the connect timeout
        first = rng.choice([0x00, 0x20, 0x30, 0x82, 0xC0, 0xE0, 0xF0, 0x47])
        stream = bytes([first]) + bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))
    else:
        stream = random_stream(rng, level)
    try:
        reader, writer = await asyncio.open_connection(HOST, port)
    except OSError as e:
        problems.append(f"#{i}: connect failed: {e}")
        return
    out = b""
    closed = False
    try:
        pos = 0
        while pos < len(stream):
            step = rng.randint(1, 200)
            writer.write(stream[pos : pos + step])
            pos += step
            if rng.random() < 0.3:
                await asyncio.sleep(rng.random() * 0.02)
        await writer.drain()
        if rng.random() < 0.1:
            _abort(writer)  # reset mid-conversation
            return
        wait = CONNECT_TIMEOUT + 1.5 if garbage_only else rng.random() * 0.3
        got, closed = await _read_until(reader, wait)
        out += got
    except (ConnectionResetError, BrokenPipeError):
        closed = True
    finally:
        writer.close()
    if out and not _parses(out):
        problems.append(f"#{i}: unparsable output {out[:60].hex()}")
    if garbage_only and not closed:
        problems.append(f"#{i}: garbage {stream[:20].hex()} not closed within the connect timeout")


def _ws_handshake(rng: random.Random) -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    lines = [
        "GET /mqtt HTTP/1.1",
        "Host: fuzz",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {key}",
        "Sec-WebSocket-Version: 13",
        "Sec-WebSocket-Protocol: mqtt",
    ]
    rng.shuffle(lines[1:])  # header order does not matter
    wire = ("\r\n".join(lines) + "\r\n\r\n").encode()
    return mutate(wire, rng, 1) if rng.random() < 0.15 else wire


def _ws_frames(rng: random.Random, payload: bytes) -> bytes:
    frames = []
    pos = 0
    first = True
    while pos < len(payload):
        size = rng.randint(1, 300)
        chunk = payload[pos : pos + size]
        pos += size
        opcode = OP_BINARY if first else OP_CONTINUATION
        first = False
        frames.append(encode_frame(opcode, chunk, fin=pos >= len(payload), mask=os.urandom(4)))
        if rng.random() < 0.1:
            frames.append(encode_frame(OP_PING, b"p", mask=os.urandom(4)))
    if rng.random() < 0.2:
        frames.append(encode_frame(OP_CLOSE, b"\x03\xe8", mask=os.urandom(4)))
    wire = b"".join(frames)
    return mutate(wire, rng) if rng.random() < 0.3 else wire


async def _fuzz_ws(i: int, port: int, problems: list[str]) -> None:
    rng = random.Random(SEED + 100_000 + i)
    level = rng.choice([V311, V5])
    wire = _ws_handshake(rng) + _ws_frames(rng, random_stream(rng, level))
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        for pos in range(0, len(wire), 500):
            writer.write(wire[pos : pos + 500])
        await writer.drain()
        await _read_until(reader, rng.random() * 0.3)
    except (ConnectionResetError, BrokenPipeError):
        pass
    finally:
        writer.close()


async def _run_all(port: int, ws_port: int) -> list[str]:
    problems: list[str] = []
    canary = Canary(port)
    await canary.open()
    semaphore = asyncio.Semaphore(CONCURRENCY)

    async def limited(job: object) -> None:
        async with semaphore:
            await job  # type: ignore[misc]

    jobs = [_fuzz_tcp(i, port, problems) for i in range(CONNECTIONS)]
    jobs += [_fuzz_ws(i, ws_port, problems) for i in range(WS_CONNECTIONS)]
    random.Random(SEED).shuffle(jobs)
    tasks = [asyncio.create_task(limited(job)) for job in jobs]
    while not all(t.done() for t in tasks):
        await canary.check()  # the canary keeps working during the storm
        await asyncio.sleep(0.2)
    for t in tasks:
        t.result()
    await canary.check()
    canary.close()
    return problems


def test_fuzz_running_broker(fuzzed_broker: tuple[BrokerProcess, int]) -> None:
    broker, ws_port = fuzzed_broker
    rss_before = _rss_kib(broker.proc.pid)
    problems = asyncio.run(_run_all(broker.port, ws_port))
    assert broker.alive(), broker.log()[-4000:]
    assert problems == []
    log = broker.log()
    assert "Traceback" not in log, log[log.index("Traceback") - 500 :][:4000]
    assert " ERROR " not in log and '"ERROR"' not in log, log[-4000:]
    growth = _rss_kib(broker.proc.pid) - rss_before
    assert growth < 100_000, f"broker RSS grew {growth} KiB"
