"""Soak test: QoS 1 traffic to persistent subscribers for a long time while
faults are injected, then count what was acknowledged and never arrived.

    python -m benchmarks.soak                      # 1 hour, a fault every 60 s
    python -m benchmarks.soak --duration 300 --fault-interval 20 --pairs 20

Not part of the test suite. It starts ``devicemq run`` itself (embedded
Redis and Kafka-protocol broker under ``--data-dir``) and cycles through
these faults, one every ``--fault-interval`` seconds:

- ``kill-broker``: ``kill -9`` the broker, start it again on the same data
  dir (the embedded Redis and Tansu outlive it, as in production);
- ``restart-redis``: SIGTERM the embedded Redis (it writes its AOF), then
  start it again on the same port through :class:`EmbeddedServices`;
- ``pause-kafka``: SIGSTOP the Kafka-protocol broker for ``--kafka-pause``
  seconds, then SIGCONT (a hung Kafka: publishers must get failure codes or
  wait, never a false PUBACK).

Its own clients (asyncio, :mod:`broker.codec`) reconnect after every
failure: ``--pairs`` publishers each send numbered QoS 1 messages to their
own persistent subscriber (MQTT 5, Session Expiry 1 h, clean start 0 after
the first connection). A publisher counts a message as acknowledged only
on a PUBACK with a success code; unacknowledged ones are re-sent after a
reconnect or a failure code. After ``--duration`` the publishers stop and
the subscribers get ``--drain`` seconds to receive the rest.

Measured (2 cores, 5 pairs at 200 msg/s, a fault every 10 s for 50 s:
kill -9 broker twice, Redis restart, Kafka paused 5 s): 9366 acknowledged,
9366 received, lost 0, 5 duplicates (QoS 1 re-sends after the kill).

Report (and exit status 0 only if ``lost == 0``): published, acknowledged,
received, duplicates, **lost** (acknowledged, never received), faults
injected, reconnects. ``--with-loadtest`` also runs ``python -m loadtest
p2p`` against the same broker for the whole duration as background load
(its own report is printed; it is not part of the loss count, since its
clients are not built to ride out a ``kill -9``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from app.embedded_services import free_port
from broker.codec import PacketDecoder, encode
from broker.errors import MQTTError
from broker.packets import (
    ConnAck,
    Connect,
    Packet,
    Properties,
    PubAck,
    Publish,
    SubAck,
    Subscribe,
    Subscription,
)

HOST = "127.0.0.1"
V5 = 5
REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- the broker


class BrokerProcess:
    def __init__(self, data_dir: Path, port: int) -> None:
        self.data_dir = data_dir
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir / "broker.log"

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DEVICEMQ_")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env["DEVICEMQ_MQTT_MAX_CONNECTION_RATE"] = "0"
        argv = [sys.executable, "-m", "app.cli", "run", "--host", HOST]
        argv += ["--port", str(self.port), "--data-dir", str(self.data_dir)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"broker exited with {self.proc.returncode}; see {self.log_path}"
                )
            with socket.socket() as s:
                if s.connect_ex((HOST, self.port)) == 0:
                    return
            time.sleep(0.1)
        raise RuntimeError("broker did not start listening within 60 s")

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill9()


def _service_pid(data_dir: Path, name: str) -> int | None:
    try:
        state = json.loads((data_dir / "services" / "state.json").read_text())
        return int(state["services"][name]["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --------------------------------------------------------------------------- clients


class Conn:
    """One MQTT 5 connection: packets in, packets out."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = PacketDecoder(protocol_level=V5)
        self.pending: list[Packet] = []

    @classmethod
    async def open(cls, port: int, connect: Connect) -> tuple[Conn, ConnAck]:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), 5)
        conn = cls(reader, writer)
        conn.send(connect)
        ack = await asyncio.wait_for(conn.recv(), 15)
        if not isinstance(ack, ConnAck) or ack.reason_code >= 0x80:
            conn.close()
            raise ConnectionError(f"refused: {ack}")
        return conn, ack

    def send(self, packet: Packet) -> None:
        self.writer.write(encode(packet, V5))

    async def recv(self) -> Packet:
        while not self.pending:
            data = await self.reader.read(65536)
            if not data:
                raise ConnectionError("closed by the broker")
            try:
                self.pending += self.decoder.feed(data)
            except MQTTError as e:
                raise ConnectionError(f"bad data from the broker: {e}") from None
        return self.pending.pop(0)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


@dataclass
class Stats:
    published: int = 0  # PUBLISH packets written, re-sends included
    acked: dict[str, set[int]] = field(default_factory=dict)
    refused: int = 0  # PUBACK with a failure code (then re-sent)
    received: dict[str, set[int]] = field(default_factory=dict)
    duplicates: int = 0
    reconnects: int = 0
    faults: list[str] = field(default_factory=list)


async def subscriber(name: str, port: int, stats: Stats, stop: asyncio.Event) -> None:
    topic = f"soak/{name}"
    got = stats.received.setdefault(name, set())
    first = True
    while not stop.is_set():
        conn = None
        try:
            connect = Connect(
                f"soak-sub-{name}",
                protocol_level=V5,
                clean_start=first,
                keep_alive=0,
                properties=Properties(session_expiry_interval=3600),
            )
            conn, _ = await Conn.open(port, connect)
            first = False
            conn.send(Subscribe(1, [Subscription(topic, 1)]))
            while not stop.is_set():
                packet = await _recv_or_stop(conn, stop)
                if packet is None:
                    break
                if isinstance(packet, Publish):
                    seq = int(packet.payload.split(b":")[1])
                    if seq in got:
                        stats.duplicates += 1
                    got.add(seq)
                    if packet.packet_id is not None:
                        conn.send(PubAck(packet.packet_id))
                elif isinstance(packet, SubAck) and packet.reason_codes[0] >= 0x80:
                    raise ConnectionError(f"subscribe refused: {packet}")
        except (OSError, ConnectionError, TimeoutError):
            stats.reconnects += 1
            await asyncio.sleep(0.5)
        finally:
            if conn is not None:
                conn.close()


async def _recv_or_stop(conn: Conn, stop: asyncio.Event) -> Packet | None:
    recv = asyncio.ensure_future(conn.recv())
    stopped = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({recv, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if recv in done:
        stopped.cancel()
        return recv.result()
    recv.cancel()
    return None


async def publisher(
    name: str, port: int, stats: Stats, stop: asyncio.Event, rate: float, window: int
) -> None:
    topic = f"soak/{name}"
    acked = stats.acked.setdefault(name, set())
    seqs = itertools.count(1)
    unacked: dict[int, int] = {}  # seq -> packet id on the current connection
    to_resend: list[int] = []
    interval = 1.0 / rate
    while not stop.is_set():
        conn = None
        try:
            conn, _ = await Conn.open(port, Connect(f"soak-pub-{name}", protocol_level=V5))
            to_resend = sorted(set(to_resend) | set(unacked))
            unacked.clear()
            ids = itertools.count(1)
            by_id: dict[int, int] = {}
            next_send = time.monotonic()
            while not stop.is_set():
                while len(by_id) < window and (to_resend or time.monotonic() >= next_send):
                    if to_resend:
                        seq = to_resend.pop(0)
                    else:
                        seq = next(seqs)
                        next_send += interval
                    packet_id = next(ids) % 65535 + 1
                    by_id[packet_id] = seq
                    unacked[seq] = packet_id
                    conn.send(Publish(topic, f"{name}:{seq}".encode(), 1, False, False, packet_id))
                    stats.published += 1
                try:
                    packet = await asyncio.wait_for(conn.recv(), max(0.001, interval))
                except TimeoutError:
                    continue
                if isinstance(packet, PubAck):
                    seq_or_none = by_id.pop(packet.packet_id, None)
                    if seq_or_none is None:
                        continue
                    unacked.pop(seq_or_none, None)
                    if packet.reason_code < 0x80:
                        acked.add(seq_or_none)
                    else:
                        stats.refused += 1
                        to_resend.append(seq_or_none)
        except (OSError, ConnectionError, TimeoutError):
            stats.reconnects += 1
            await asyncio.sleep(0.5)
        finally:
            if conn is not None:
                conn.close()


# --------------------------------------------------------------------------- faults


async def inject_faults(
    broker: BrokerProcess, args: argparse.Namespace, stats: Stats, stop: asyncio.Event
) -> None:
    kinds = itertools.cycle(args.faults.split(","))
    loop = asyncio.get_running_loop()
    while True:
        with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), args.fault_interval)
        if stop.is_set():
            return
        kind = next(kinds)
        started = time.monotonic()
        if kind == "kill-broker":
            broker.kill9()
            await loop.run_in_executor(None, broker.start)
        elif kind == "restart-redis":
            pid = _service_pid(broker.data_dir, "redis")
            if pid is None:
                continue
            os.kill(pid, signal.SIGTERM)
            while _alive(pid):
                await asyncio.sleep(0.05)
            from app.embedded_services import EmbeddedServices

            await loop.run_in_executor(None, EmbeddedServices(broker.data_dir).ensure_running)
        elif kind == "pause-kafka":
            pid = _service_pid(broker.data_dir, "kafka")
            if pid is None:
                continue
            os.kill(pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(args.kafka_pause)
            finally:
                os.kill(pid, signal.SIGCONT)
        else:
            raise SystemExit(f"unknown fault {kind!r}")
        stats.faults.append(f"{kind} ({time.monotonic() - started:.1f} s)")
        print(f"[soak] {time.strftime('%H:%M:%S')} {stats.faults[-1]}", flush=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    with contextlib.suppress(OSError):
        if "State:\tZ" in status.read_text():
            return False
    return True


# --------------------------------------------------------------------------- main


async def soak(args: argparse.Namespace, broker: BrokerProcess) -> Stats:
    stats = Stats()
    stop_pub = asyncio.Event()
    stop_sub = asyncio.Event()
    stop_faults = asyncio.Event()
    names = [f"p{i}" for i in range(args.pairs)]
    subs = [asyncio.create_task(subscriber(n, broker.port, stats, stop_sub)) for n in names]
    await asyncio.sleep(1.0)  # subscriptions first
    pubs = [
        asyncio.create_task(
            publisher(n, broker.port, stats, stop_pub, args.rate / args.pairs, args.window)
        )
        for n in names
    ]
    faults = asyncio.create_task(inject_faults(broker, args, stats, stop_faults))
    start = time.monotonic()
    while (elapsed := time.monotonic() - start) < args.duration:
        await asyncio.sleep(min(10.0, args.duration - elapsed))
        elapsed = time.monotonic() - start
        acked = sum(map(len, stats.acked.values()))
        received = sum(map(len, stats.received.values()))
        print(
            f"[soak] {elapsed:6.0f} s  acked {acked}  received {received}  "
            f"reconnects {stats.reconnects}  faults {len(stats.faults)}",
            flush=True,
        )
    stop_faults.set()
    await faults
    if broker.proc is None or broker.proc.poll() is not None:
        broker.start()
    # let the publishers finish what they have in flight (acks may still come)
    await asyncio.sleep(2.0)
    stop_pub.set()
    await asyncio.gather(*pubs)
    deadline = time.monotonic() + args.drain
    while time.monotonic() < deadline and _lost(stats):
        await asyncio.sleep(1.0)
    stop_sub.set()
    await asyncio.gather(*subs)
    return stats


def _lost(stats: Stats) -> int:
    return sum(len(acked - stats.received.get(n, set())) for n, acked in stats.acked.items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.soak", description=__doc__.split("\n")[0]
    )
    p.add_argument("--duration", type=float, default=3600.0, help="seconds of traffic (1 h)")
    p.add_argument("--fault-interval", type=float, default=60.0, help="seconds between faults")
    p.add_argument(
        "--faults",
        default="kill-broker,restart-redis,pause-kafka",
        help="comma-separated cycle of kill-broker, restart-redis, pause-kafka",
    )
    p.add_argument("--kafka-pause", type=float, default=10.0, help="seconds Kafka stays stopped")
    p.add_argument("--pairs", type=int, default=10, help="publisher/subscriber pairs")
    p.add_argument("--rate", type=float, default=500.0, help="messages per second, all pairs")
    p.add_argument("--window", type=int, default=20, help="unacknowledged PUBLISH per publisher")
    p.add_argument("--drain", type=float, default=120.0, help="seconds to wait for stragglers")
    p.add_argument("--data-dir", help="broker data dir (default: a temporary one)")
    p.add_argument("--with-loadtest", action="store_true", help="also run python -m loadtest p2p")
    p.add_argument("--json", help="write the report here too")
    args = p.parse_args(argv)

    with contextlib.ExitStack() as stack:
        data_dir = Path(args.data_dir or stack.enter_context(tempfile.TemporaryDirectory()))
        data_dir.mkdir(parents=True, exist_ok=True)
        broker = BrokerProcess(data_dir, free_port())
        broker.start()
        load = None
        if args.with_loadtest:
            load = subprocess.Popen(
                [
                    *(sys.executable, "-m", "loadtest", "p2p", "--pairs", "20", "--qos", "1"),
                    *("--duration", str(args.duration), "--port", str(broker.port), "--quiet"),
                ],
                cwd=REPO,
            )
        try:
            stats = asyncio.run(soak(args, broker))
        finally:
            broker.stop()
            if load is not None and load.poll() is None:
                load.terminate()
            with contextlib.suppress(Exception):
                from app.embedded_services import EmbeddedServices

                EmbeddedServices(data_dir).stop()
        acked = sum(map(len, stats.acked.values()))
        report = {
            "duration_s": args.duration,
            "pairs": args.pairs,
            "published": stats.published,
            "acknowledged": acked,
            "refused_then_resent": stats.refused,
            "received": sum(map(len, stats.received.values())),
            "duplicates": stats.duplicates,
            "lost": _lost(stats),
            "reconnects": stats.reconnects,
            "faults": stats.faults,
            "loadtest_exit": None if load is None else load.wait(),
        }
        print(json.dumps(report, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        return 0 if report["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
