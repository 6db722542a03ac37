"""One worker: an event loop (uvloop when installed) running a share of the clients.

A worker runs in a process of its own (``--processes N``) or, for one
worker, in a thread of the coordinating process. Either way it talks to the
coordinator over a ``multiprocessing`` connection, with plain tuples:

    worker -> coordinator             coordinator -> worker
    ("connecting", n, busy, failed)   ("start", t0_ns)
    ("ready", clients)
    ("progress", sent, acked, deliv)  ("expect", {publisher: acked})
    ("published", {publisher: acked}) ("abort",)
    ("result", WorkerResult)
    ("error", text)

Phases: connect (subscribers first, then publishers) -> ready -> publish from
t0 for warm-up + duration seconds -> wait for the publishers' outstanding
acknowledgements -> published -> drain until every local subscriber has every
acknowledged message it should get (or the drain time is up) -> disconnect,
remove the run's persistent sessions -> result.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import os
import random
import signal
import threading
import time
import traceback
from array import array
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from time import monotonic_ns
from typing import Any

from loadtest.client import NS, ClientError, Publisher, Stats, Subscriber, _Client
from loadtest.scenarios import LoadConfig, Plan

__all__ = ["WorkerResult", "run_worker", "start_thread_worker"]

PROGRESS_INTERVAL = 0.5
CONNECTING_INTERVAL = 1.0  # seconds between reports while connecting
PING_INTERVAL = 60.0


@dataclass
class SubscriberResult:
    counts: dict[int, bytearray]  # publisher -> times each seq arrived
    received: int
    duplicates: int
    duplicates_flagged: int
    out_of_order: int
    foreign: int
    reconnects: int
    lost_connections: int
    latencies: bytes = b""  # e2e us of its deliveries in the measured window (array "I")


@dataclass
class PublisherResult:
    sent: int
    acked: bytearray  # 1 at each acknowledged sequence number
    rejected: int
    no_subscribers: int
    lost_connections: int


@dataclass
class WorkerResult:
    worker: int
    t0: int
    buckets: list[tuple[int, int, bytes, bytes]]  # sent, acked, e2e us, puback us (array bytes)
    cpu: list[tuple[float, float]]  # (seconds since t0, thread CPU seconds)
    publishers: dict[int, PublisherResult] = field(default_factory=dict)
    subscribers: dict[int, SubscriberResult] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    connect_seconds: float = 0.0
    busy_refusals: int = 0  # CONNECTs refused as busy and retried (Client.connect)
    connect_failures: int = 0  # connections failed before their CONNACK and retried
    drain_seconds: float = 0.0


class _Aborted(Exception):
    pass


class _Worker:
    def __init__(self, conn: Connection, config: LoadConfig, plan: Plan, worker: int) -> None:
        self.conn = conn
        self.config = config
        self.plan = plan
        self.worker = worker
        self.stats = Stats()
        self.inbox: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        self.errors: list[str] = []
        self.cpu: list[tuple[float, float]] = []
        self.rng = random.Random(f"{config.seed}/{worker}")
        level = config.level
        persistent = bool(config.persistent)
        expiry = config.session_expiry if persistent and level == 5 else 0
        self.publishers = [
            Publisher(
                spec.index,
                spec.client_id,
                spec.topic,
                config.qos,
                config.payload_size,
                plan.nonce,
                level,
                self.stats,
                config.rate,
                config.inflight,
                plan.padding,
            )
            for spec in (plan.publishers[i] for i in plan.worker_publishers[worker])
        ]
        self.subscribers = [
            Subscriber(
                spec.index,
                spec.client_id,
                spec.topic_filter,
                config.qos,
                plan.nonce,
                level,
                not persistent,
                expiry,
                self.stats,
            )
            for spec in (plan.subscribers[j] for j in plan.worker_subscribers[worker])
        ]
        for s in self.subscribers:  # latency per subscriber: by client, by replica (report.py)
            s.latencies = array("I")
        self.sources = {s.index: plan.subscribers[s.index].publishers for s in self.subscribers}
        self.reconnects: dict[int, int] = {s.index: 0 for s in self.subscribers}
        self._tasks: set[asyncio.Task[None]] = set()

    # -- messages -------------------------------------------------------------------

    def send(self, *message: object) -> None:
        self.conn.send(message)

    def _readable(self) -> None:
        try:
            while self.conn.poll():
                self.inbox.put_nowait(self.conn.recv())
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(self.conn.fileno())
            self.inbox.put_nowait(("abort",))

    async def expect(self, kind: str) -> tuple[Any, ...]:
        message = await self.inbox.get()
        if message[0] == "abort":
            raise _Aborted
        if message[0] != kind:
            raise RuntimeError(f"worker {self.worker}: expected {kind!r}, got {message[0]!r}")
        return message

    # -- phases -----------------------------------------------------------------------

    async def _bounded(self, jobs: list[Callable[[], Awaitable[None]]]) -> None:
        gate = asyncio.Semaphore(self.config.connect_concurrency)

        async def one(job: Callable[[], Awaitable[None]]) -> None:
            async with gate:
                await job()

        await asyncio.gather(*(one(job) for job in jobs))

    async def connect_all(self) -> None:
        """Subscribers, then publishers; all within ``config.connect_timeout`` seconds
        (each client retries refusals as busy and failed connections until then)."""
        config = self.config
        host = config.host
        loop = asyncio.get_running_loop()
        deadline = loop.time() + config.connect_timeout

        def left() -> float:
            return max(deadline - loop.time(), 0.1)

        await self._bounded(
            [
                lambda s=s: s.start(host, config.subscriber_port(s.index), left())  # type: ignore[misc]
                for s in self.subscribers
            ]
        )
        for s in self.subscribers:
            if s.session_present:
                self.errors.append(f"{s.client_id}: a session was present on first connect")
        await self._bounded(
            [
                lambda p=p: p.connect(host, config.publisher_port(p.index), left())  # type: ignore[misc]
                for p in self.publishers
            ]
        )

    async def _report_connecting(self) -> None:
        """("connecting", connected, refused as busy, failed) every CONNECTING_INTERVAL."""
        clients: list[_Client] = [*self.subscribers, *self.publishers]
        while True:
            await asyncio.sleep(CONNECTING_INTERVAL)
            self.send(
                "connecting",
                sum(1 for c in clients if c.connected),
                sum(c.busy_refusals for c in clients),
                sum(c.connect_failures for c in clients),
            )

    def _progress(self) -> None:
        sent = acked = delivered = 0
        for b in self.stats.buckets:
            sent += b.sent
            acked += b.acked
            delivered += len(b.e2e)
        self.send("progress", sent, acked, delivered)

    async def _reconnect(self, sub: Subscriber, deadline: int) -> None:
        while monotonic_ns() < deadline:
            try:
                await sub.start(self.config.host, self.config.subscriber_port(sub.index))
            except ClientError:
                await asyncio.sleep(0.2)
                continue
            self.reconnects[sub.index] += 1
            return
        self.errors.append(f"{sub.client_id}: could not reconnect")

    async def publish_phase(self, t0: int) -> None:
        config = self.config
        self.stats.restart(t0)
        # The report's measured window: whole seconds after t0 (report.summarize).
        w0 = round(config.warmup)
        window = (t0 + w0 * NS, t0 + max(w0 + 1, round(config.warmup + config.duration)) * NS)
        for s in self.subscribers:
            s.window = window
        end = t0 + int(config.total_seconds * NS)
        drain_deadline = end + int(config.drain * NS)
        delay = (t0 - monotonic_ns()) / NS
        if delay > 0:
            await asyncio.sleep(delay)
        self.cpu.append((0.0, time.thread_time()))
        spread = int(NS / config.rate) if config.rate else 0
        for p in self.publishers:
            p.start(t0 + (self.rng.randrange(spread) if spread else 0))
        reconnect_ns = int(config.reconnect_every * NS)
        next_reconnect = {
            s.index: t0 + self.rng.randrange(max(1, reconnect_ns)) + reconnect_ns
            for s in self.subscribers
        }
        next_progress = next_cpu = next_ping = t0
        tick = 0.005 if config.rate else 0.05
        tick_ns = int(tick * NS)
        # Throttled publishers by when their next message is due: a tick wakes only
        # those (asking all 4,000 at every 5 ms tick was most of the tool's CPU). A
        # publisher whose window is full sends from its PUBACKs (Publisher.data_received).
        due = [(p.next_due(), n) for n, p in enumerate(self.publishers)] if config.rate else []
        heapq.heapify(due)
        while True:
            now = monotonic_ns()
            if now >= end:
                break
            while due and due[0][0] <= now:
                _, n = due[0]
                p = self.publishers[n]
                p.fill(now)
                heapq.heapreplace(due, (max(p.next_due(), now + tick_ns), n))
            if now >= next_progress:
                self._progress()
                next_progress += int(PROGRESS_INTERVAL * NS)
            if now >= next_cpu:
                self.cpu.append(((now - t0) / NS, time.thread_time()))
                next_cpu += NS
            if now >= next_ping + int(PING_INTERVAL * NS):
                next_ping = now
                for c in [*self.publishers, *self.subscribers]:
                    c.ping()
            if reconnect_ns:
                for s in self.subscribers:
                    if now >= next_reconnect[s.index] and s.connected:
                        next_reconnect[s.index] = now + reconnect_ns
                        s.drop()
                        task = asyncio.create_task(self._reconnect(s, drain_deadline))
                        self._tasks.add(task)
                        task.add_done_callback(self._tasks.discard)
            for message in self._drain_inbox():
                if message[0] == "abort":
                    raise _Aborted
            await asyncio.sleep(tick)
        for p in self.publishers:
            p.stop()
        now = monotonic_ns()
        self.cpu.append(((now - t0) / NS, time.thread_time()))
        # Outstanding acknowledgements of the last PUBLISHes.
        while monotonic_ns() < drain_deadline and any(
            p.outstanding and p.connected for p in self.publishers
        ):
            await asyncio.sleep(0.01)
        for p in self.publishers:
            if p.lost_connections:
                self.errors.append(f"{p.client_id}: lost its connection")
        self.send("published", {p.index: p.acked_count for p in self.publishers})
        (_, expected) = await self.expect("expect")
        started = monotonic_ns()
        while monotonic_ns() < drain_deadline and not self._complete(expected):
            if monotonic_ns() >= next_progress:
                self._progress()
                next_progress += int(PROGRESS_INTERVAL * NS)
            await asyncio.sleep(0.02)
        if self._complete(expected):
            await asyncio.sleep(0.2)  # a duplicate right behind the last message still counts
        self.drain_seconds = (monotonic_ns() - started) / NS
        self._progress()
        for task in list(self._tasks):
            task.cancel()

    def _drain_inbox(self) -> list[tuple[Any, ...]]:
        out = []
        while not self.inbox.empty():
            out.append(self.inbox.get_nowait())
        return out

    def _complete(self, expected: dict[int, int]) -> bool:
        for s in self.subscribers:
            for publisher in self.sources[s.index]:
                if s.unique(publisher) < expected.get(publisher, 0):
                    return False
        return True

    async def close_all(self) -> None:
        clients: list[_Client] = [*self.publishers, *self.subscribers]
        await asyncio.gather(*(c.disconnect() for c in clients), return_exceptions=True)
        if not self.config.persistent or self.config.keep_sessions:
            return
        # Remove the run's persistent sessions: connect once more with a clean session.
        level = self.config.level
        host, port = self.config.host, self.config.port
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.connect_timeout  # as connecting: rate limits

        async def clean(client_id: str) -> None:
            c = _Client(client_id, level, True, 0, Stats())
            try:
                await c.connect(host, port, timeout=max(deadline - loop.time(), 0.1))
                await c.disconnect()
            except ClientError as e:
                self.errors.append(f"cleanup: {e}")

        await self._bounded([lambda i=s.client_id: clean(i) for s in self.subscribers])  # type: ignore[misc]

    def result(self) -> WorkerResult:
        return WorkerResult(
            worker=self.worker,
            t0=self.stats.t0,
            buckets=[
                (b.sent, b.acked, b.e2e.tobytes(), b.puback.tobytes()) for b in self.stats.buckets
            ],
            cpu=self.cpu,
            publishers={
                p.index: PublisherResult(
                    p.sent, p.acked, p.rejected, p.no_subscribers, p.lost_connections
                )
                for p in self.publishers
            },
            subscribers={
                s.index: SubscriberResult(
                    s.counts(),
                    s.received,
                    s.duplicates,
                    s.duplicates_flagged,
                    s.out_of_order,
                    s.foreign,
                    self.reconnects[s.index],
                    s.lost_connections - self.reconnects[s.index],
                    s.latencies.tobytes() if s.latencies is not None else b"",
                )
                for s in self.subscribers
            },
            errors=self.errors,
            drain_seconds=self.drain_seconds,
            busy_refusals=sum(c.busy_refusals for c in (*self.publishers, *self.subscribers)),
            connect_failures=sum(c.connect_failures for c in (*self.publishers, *self.subscribers)),
        )

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(self.conn.fileno(), self._readable)
        # uvloop made the pipe non-blocking; sends (a result can be megabytes) must block.
        os.set_blocking(self.conn.fileno(), True)
        try:
            started = time.monotonic()
            reporter = asyncio.create_task(self._report_connecting())
            try:
                await self.connect_all()
            except ClientError as e:
                self.send("error", str(e))
                return
            finally:
                reporter.cancel()
            connect_seconds = time.monotonic() - started
            self.send("ready", len(self.publishers) + len(self.subscribers))
            (_, t0) = await self.expect("start")
            await self.publish_phase(t0)
            await self.close_all()
            result = self.result()
            result.connect_seconds = connect_seconds
            self.send("result", result)
        except _Aborted:
            pass
        finally:
            with contextlib.suppress(Exception):
                loop.remove_reader(self.conn.fileno())
            for c in [*self.publishers, *self.subscribers]:
                if c.transport is not None:
                    c.transport.abort()


def raise_nofile_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit (a socket per
    client); the limit now in force."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # pragma: no cover - not Linux
        return 0


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.new_event_loop
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run_worker(conn: Connection, config: LoadConfig, plan: Plan, worker: int) -> None:
    """Entry point of a worker process or thread."""
    if threading.current_thread() is threading.main_thread():
        # A worker process: Ctrl-C is the coordinator's to handle.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise_nofile_limit()
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(_Worker(conn, config, plan, worker).serve())
    except Exception:
        with contextlib.suppress(Exception):
            conn.send(("error", f"worker {worker} crashed:\n{traceback.format_exc()}"))
    finally:
        conn.close()


def start_thread_worker(
    conn: Connection, config: LoadConfig, plan: Plan, worker: int
) -> threading.Thread:
    thread = threading.Thread(
        target=run_worker, args=(conn, config, plan, worker), name=f"loadtest-{worker}", daemon=True
    )
    thread.start()
    return thread
