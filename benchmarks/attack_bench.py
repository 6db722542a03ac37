"""What the attacks the broker was hardened against still cost: the numbers in SECURITY.md.

    python -m benchmarks.attack_bench retained [--retained 100000]
    python -m benchmarks.attack_bench decode
    python -m benchmarks.attack_bench overlap [--filters 1000] [--ids]
    python -m benchmarks.attack_bench flood {bad-password,bad-password-no-wait,anonymous,
                                           stranger} [--seconds 10]
    python -m benchmarks.attack_bench admin-retained [--retained 100000]
    python -m benchmarks.attack_bench admin-guess [--seconds 5]

``admin-guess`` starts ``devicemq run`` with an admin token and sends wrong tokens
from 127.0.0.9 with four threads: how many were compared (401) and how many
refused unread (429), and whether the right token from another address gets in.
``admin-retained`` times ``GET /api/v1/retained?topic=#&limit=1000`` on the admin
API in this process, with a task beside it that counts the event loop's turns.
``retained``, ``decode`` and ``overlap`` time the sans-IO core in this process
(no sockets: the event-loop time a packet costs); ``flood`` starts ``devicemq
run`` (a password file, persistence off, metrics on), floods it with CONNECTs
from 127.0.0.5 with four threads and reads the broker's CPU time from /proc;
``flood stranger`` (a stranger trying to get a device banned) has flapping on,
alice connected as ``dev-9``, and mallory's CONNECTs name ``dev-9`` with her
own password.
Times depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from app.embedded_services import free_port
from benchmarks.blocking_mqtt import running_broker
from broker.codec import PacketDecoder, encode
from broker.config import MqttSettings, Settings
from broker.connection import MQTTConnection
from broker.core import Broker
from broker.message import Message
from broker.packets import Connect, Packet, Properties, Publish, Subscribe, Subscription
from edge.websocket import OP_BINARY, OP_CONTINUATION, WebSocketServer, encode_frame

# ------------------------------------------------------------------ in process


def _broker(**mqtt: object) -> tuple[Broker, list[Callable[[], None]]]:
    # Settings this version does not have are left out, so the same command runs
    # against an older checkout (d9587ee) for comparison.
    known = {f.name for f in dataclasses.fields(MqttSettings)}
    mqtt = {k: v for k, v in mqtt.items() if k in known}
    settings = dataclasses.replace(Settings(), mqtt=dataclasses.replace(MqttSettings(), **mqtt))  # type: ignore[arg-type]
    broker = Broker(settings)
    ready: list[Callable[[], None]] = []
    broker.call_soon = ready.append  # one callback list: one event-loop iteration
    return broker, ready


def _client(broker: Broker, client_id: str) -> tuple[MQTTConnection, PacketDecoder]:
    conn = MQTTConnection(broker, client_id, lambda _: None)
    conn.receive_data(encode(Connect(client_id, protocol_level=5), 5))
    decoder = PacketDecoder(protocol_level=5)
    decoder.feed(conn.data_to_send())
    return conn, decoder


def _send(conn: MQTTConnection, packet: Packet) -> float:
    started = time.perf_counter()
    conn.receive_data(encode(packet, 5))
    return time.perf_counter() - started


def retained(count: int) -> None:
    """SUBSCRIBE against ``count`` retained messages on bob/<i>/status."""
    broker, ready = _broker(max_retained_messages_per_client=0)
    for i in range(count):
        broker.retained.store(Message(f"bob/{i}/status", b"v", 0, True, origin="pub"))
    cases = {
        "bob/+/none x 40 (matches nothing)": [Subscription("bob/+/none", 0)] * 40,
        "bob/# (matches all)": [Subscription("bob/#", 0)],
    }
    for name, filters in cases.items():
        conn, _ = _client(broker, "sub-" + str(len(name)))
        first = _send(conn, Subscribe(1, filters))
        conn.data_to_send()
        chunks = []
        while ready:
            batch = list(ready)
            ready.clear()
            started = time.perf_counter()
            for callback in batch:
                callback()
            chunks.append(time.perf_counter() - started)
            conn.data_to_send()
        total = first + sum(chunks)
        print(
            f"{count} retained, SUBSCRIBE {name}: its own loop iteration {first * 1000:.1f} ms, "
            f"then {len(chunks)} iterations of at most {max(chunks, default=0) * 1000:.1f} ms; "
            f"{total * 1000:.0f} ms of loop time in all"
        )


def decode() -> None:
    """A 1 MB CONNECT of user properties, and 1-byte WebSocket frames."""
    broker, _ = _broker()
    props = Properties(user_properties=(("", ""),) * 200_000)
    big = encode(Connect("big", protocol_level=5, properties=props), 5)
    conn = MQTTConnection(broker, "attacker", lambda _: None)
    started = time.perf_counter()
    conn.receive_data(big)
    took = time.perf_counter() - started
    print(
        f"CONNECT of {len(big)} bytes (200,000 user properties): {took * 1000:.2f} ms, "
        f"{'closed' if conn.close_requested else 'accepted'}"
    )
    ws = WebSocketServer()
    ws.receive_data(
        b"GET /mqtt HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Protocol: mqtt\r\n\r\n"
    )
    mask = b"\x01\x02\x03\x04"
    ws.receive_data(encode_frame(OP_BINARY, b"", fin=False, mask=mask))
    frames = encode_frame(OP_CONTINUATION, b"x", fin=False, mask=mask) * 10_000
    started = time.perf_counter()
    ws.receive_data(frames)
    took = time.perf_counter() - started
    print(
        f"10,000 one-byte WebSocket frames (websocket.max_frame_rate's default a second): "
        f"{took * 1000:.1f} ms ({took / 10_000 * 1e6:.2f} us a frame)"
    )


def overlap(filters: int, ids: bool) -> None:
    """One client's ``filters`` overlapping filters, all matching one topic (with
    ``ids``, subscribed with a Subscription Identifier)."""
    broker, _ = _broker(max_subscriptions_per_client=filters, max_topic_filters_per_packet=filters)
    levels = "abcdefghijklm"
    width = len(levels)
    all_filters = [
        "/".join(
            lv if bit == "0" else "+" for lv, bit in zip(levels, f"{i:0{width}b}", strict=True)
        )
        for i in range(filters)
    ]
    conn, _ = _client(broker, "overlap")
    properties = Properties(subscription_identifiers=(7,)) if ids else None
    _send(conn, Subscribe(1, [Subscription(f, 0) for f in all_filters], properties))
    conn.data_to_send()
    publisher, _ = _client(broker, "publisher")
    packet = Publish("/".join(levels), b"x", 0)
    rounds = 200
    started = time.perf_counter()
    for _ in range(rounds):
        _send(publisher, packet)
        conn.data_to_send()
    took = (time.perf_counter() - started) / rounds
    with_ids = " with a subscription identifier" if ids else ""
    print(
        f"{filters} overlapping filters of one client{with_ids}: "
        f"{took * 1000:.2f} ms per matching PUBLISH"
    )


# ------------------------------------------------------------------ a running broker


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _connack(port: int, data: bytes, source: str, wait: bool = True) -> int | None:
    with socket.create_connection(("127.0.0.1", port), 20, source_address=(source, 0)) as s:
        s.sendall(data)
        if not wait:
            return None
        answer = s.recv(64)
    return answer[3] if len(answer) > 3 else None


def flood(mode: str, seconds: float) -> None:
    metrics_port = free_port()
    settings = {
        "DEVICEMQ_PERSISTENCE_ENABLED": "false",
        "DEVICEMQ_METRICS_ENABLED": "true",
        "DEVICEMQ_METRICS_HOST": "127.0.0.1",
        "DEVICEMQ_METRICS_PORT": str(metrics_port),
        "DEVICEMQ_AUTH_ALLOW_ANONYMOUS": "true" if mode == "anonymous" else "false",
        "DEVICEMQ_FLAPPING_ENABLED": "true" if mode == "stranger" else "false",
    }
    with running_broker(settings, users=("alice", "mallory")) as broker:
        port, tmp = broker.port, broker.data_dir
        login = encode(
            Connect("alice-dev", protocol_level=5, username="alice", password=b"alice-pw"), 5
        )
        assert _connack(port, login, "127.0.0.2") == 0  # verified once: cached from now on
        device = None
        if mode == "stranger":  # the device, connected as dev-9 while mallory names it
            device = socket.create_connection(
                ("127.0.0.1", port), 20, source_address=("127.0.0.2", 0)
            )
            device.sendall(
                encode(
                    Connect("dev-9", protocol_level=5, username="alice", password=b"alice-pw"), 5
                )
            )
            assert device.recv(64)[3] == 0
            attack = encode(
                Connect("dev-9", protocol_level=5, username="mallory", password=b"mallory-pw"), 5
            )
        elif mode == "anonymous":
            attack = encode(Connect("x", protocol_level=5), 5)
        else:
            attack = encode(Connect("x", protocol_level=5, username="eve", password=b"guess"), 5)
        wait = mode != "bad-password-no-wait"
        sent = [0]
        stop = threading.Event()

        def attacker() -> None:
            while not stop.is_set():
                with contextlib.suppress(OSError):
                    _connack(port, attack, "127.0.0.5", wait)
                sent[0] += 1

        threads = [threading.Thread(target=attacker, daemon=True) for _ in range(4)]
        cpu0, t0 = _cpu_seconds(broker.pid), time.monotonic()
        for t in threads:
            t.start()
        time.sleep(seconds / 2)
        started = time.monotonic()
        code = _connack(port, login, "127.0.0.2")
        cached = time.monotonic() - started
        time.sleep(seconds / 2)
        stop.set()
        for t in threads:
            t.join()
        cpu1, t1 = _cpu_seconds(broker.pid), time.monotonic()
        time.sleep(1.0)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics") as response:
            text = response.read().decode()
        rejected = dict(
            re.findall(
                r'^devicemq_connections_rejected_total\{reason="([^"]+)"\} (\S+)$', text, re.M
            )
        )
        lines = sum("refused" in line for line in (tmp / "broker.log").read_text().splitlines())
        elapsed = t1 - t0
        print(
            f"{mode}: {sent[0]} CONNECTs from one address in {elapsed:.1f} s "
            f"({sent[0] / elapsed:.0f}/s); the broker used {100 * (cpu1 - cpu0) / elapsed:.0f}% "
            f"of a core; a cached login meanwhile: code {code} in {cached * 1000:.0f} ms"
        )
        print(f"  refused by reason: {rejected}; refusal log lines: {lines}")
        if device is not None:
            device.settimeout(0.5)
            try:
                answer = device.recv(64)
                fate = f"disconnected ({answer.hex() or 'closed'})"
            except TimeoutError:
                fate = "still connected"
            device.close()
            blocks = re.search(r"^devicemq_flapping_blocks_total (\S+)$", text, re.M)
            print(f"  dev-9: {fate}; flapping blocks: {blocks.group(1) if blocks else '?'}")


def admin_retained(count: int) -> None:
    """The admin API's listing of every retained message: its total time, the
    longest event-loop step during it, and the loop's turns."""
    import asyncio

    from app.admin import AdminApi
    from app.http import Request
    from benchmarks.admin_bench import measure_request

    settings = Settings()
    broker = Broker(settings)
    for i in range(count):
        broker.retained.store(Message(f"site/{i % 100}/dev{i}/state", b"x" * 10, 0, True))
    api = AdminApi(settings, broker, "bench", token=None)
    request = Request("GET", "/api/v1/retained", {"topic": "#", "limit": "1000"}, {}, b"", "::1")

    total, step, turns = min(asyncio.run(measure_request(api, request)) for _ in range(3))
    print(
        f"GET /api/v1/retained?topic=# over {count:,} retained: {total * 1000:.0f} ms, "
        f"longest loop step {step * 1000:.1f} ms, {turns} loop turns (best of 3)"
    )


def _admin_status(port: int, token: str, source: str) -> int:
    request = f"GET /api/v1/stats HTTP/1.1\r\nAuthorization: Bearer {token}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), 5, source_address=(source, 0)) as s:
        s.sendall(request.encode())
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
    return int(answer[9:12])


def admin_guess(seconds: float) -> None:
    """Wrong admin tokens from one address, as fast as four threads send them."""
    token = "the-admin-token-" + os.urandom(8).hex()
    admin_port = free_port()
    settings = {
        "DEVICEMQ_PERSISTENCE_ENABLED": "false",
        "DEVICEMQ_ADMIN_ENABLED": "true",
        "DEVICEMQ_ADMIN_PORT": str(admin_port),
        "DEVICEMQ_ADMIN_TOKEN": token,
    }
    with running_broker(settings) as broker:
        for _ in range(150):
            try:
                _admin_status(admin_port, token, "127.0.0.2")
                break
            except OSError:
                time.sleep(0.1)
        counts: dict[int, int] = {}
        stop = threading.Event()

        def guesser() -> None:
            while not stop.is_set():
                with contextlib.suppress(OSError, ValueError):
                    code = _admin_status(admin_port, "guess-" + os.urandom(8).hex(), "127.0.0.9")
                    counts[code] = counts.get(code, 0) + 1

        threads = [threading.Thread(target=guesser, daemon=True) for _ in range(4)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(seconds)
        right = _admin_status(admin_port, token, "127.0.0.2")
        stop.set()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0
        log_lines = (broker.data_dir / "broker.log").read_text().splitlines()
        logged = sum("wrong token" in line for line in log_lines)
        compared = counts.get(401, 0)
        print(
            f"admin-guess: {sum(counts.values())} wrong tokens from one address in "
            f"{elapsed:.1f} s; compared (401): {compared} ({compared / elapsed:.1f}/s), "
            f"refused unread (429): {counts.get(429, 0)}; log lines: {logged}; "
            f"the right token from another address: {right}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attack_bench", description=__doc__)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("retained")
    p.add_argument("--retained", type=int, default=100_000)
    sub.add_parser("decode")
    p = sub.add_parser("overlap")
    p.add_argument("--filters", type=int, default=1000)
    p.add_argument("--ids", action="store_true", help="subscribe with a Subscription Identifier")
    p = sub.add_parser("flood")
    p.add_argument(
        "mode", choices=("bad-password", "bad-password-no-wait", "anonymous", "stranger")
    )
    p.add_argument("--seconds", type=float, default=10.0)
    p = sub.add_parser("admin-retained")
    p.add_argument("--retained", type=int, default=100_000)
    p = sub.add_parser("admin-guess")
    p.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args(argv)
    if args.what == "admin-retained":
        admin_retained(args.retained)
    elif args.what == "admin-guess":
        admin_guess(args.seconds)
    elif args.what == "retained":
        retained(args.retained)
    elif args.what == "decode":
        decode()
    elif args.what == "overlap":
        overlap(args.filters, args.ids)
    else:
        flood(args.mode, args.seconds)


if __name__ == "__main__":
    main()
