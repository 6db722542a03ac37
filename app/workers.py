"""``devicemq run --workers N``: N broker processes on one port, started and stopped as one.

One broker is one Python process, so one core (BENCHMARKS.md, "Where the time
goes"). Each worker here is a replica of the cluster (broker/cluster.py,
persistence/cluster_link.py) whose listeners are bound with SO_REUSEPORT
(``cluster.share_ports``): the kernel spreads new connections over them, and
the cluster link carries what crosses workers, as between replicas on several
hosts. This process, the supervisor, serves no client: it starts the embedded
Redis and Kafka once, gives every worker their addresses, restarts a worker
that dies, and on SIGTERM or SIGINT drains them all.

Each worker runs in its own process group, so a terminal's Ctrl-C reaches the
supervisor only, and every worker gets exactly one SIGTERM (a second signal
means "exit now" to a broker, app/serve.py). A worker whose supervisor dies
(even by SIGKILL) sees the parent's sentinel close and drains as if signalled.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

from broker.config import ConfigError, Settings
from edge.logging_setup import setup_logging

log = logging.getLogger("devicemq.workers")

MAX_WORKERS = 256
# A worker that dies is started again after this, doubling up to RESTART_MAX while it
# keeps dying within STABLE seconds of its start.
RESTART_DELAY = 1.0
RESTART_MAX = 30.0
STABLE = 60.0
# The supervisor's own bound on the drain: the workers bound theirs (SHUTDOWN_TIMEOUT).
DRAIN_TIMEOUT = 90.0

_TICK = 0.25
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def worker_count(settings: Settings) -> int:
    """The number of workers ``workers`` asks for: a number, or ``auto`` (one per core)."""
    text = settings.workers.strip().lower()
    if text == "auto":
        return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    try:
        count = int(text)
    except ValueError:
        raise ConfigError(
            f"expected a number of processes or auto, got {settings.workers!r}", name="workers"
        ) from None
    if not 1 <= count <= MAX_WORKERS:
        raise ConfigError(f"must be 1 to {MAX_WORKERS} or auto, got {count}", name="workers")
    return count


def check_workers(settings: Settings, count: int) -> None:
    """Refuse settings several workers cannot run with, each named in one line."""
    if count == 1:
        return
    if not settings.persistence.enabled:
        raise ConfigError(
            "workers share sessions through Redis and Kafka: enable persistence", name="workers"
        )
    if settings.metrics.enabled and settings.metrics.port + count - 1 > 65535:
        raise ConfigError(
            f"worker i serves metrics on metrics.port + i: {settings.metrics.port} + {count - 1}"
            " is beyond 65535",
            name="metrics.port",
        )


def worker_settings(
    settings: Settings, endpoints: tuple[str, str], index: int, node_id: str
) -> Settings:
    """Worker ``index``'s settings: a cluster replica named ``node_id`` sharing the
    ports, on ``endpoints`` (redis_url, kafka_bootstrap), its metrics on
    ``metrics.port + index``."""
    redis_url, bootstrap = endpoints
    return dataclasses.replace(
        settings,
        workers="1",
        cluster=dataclasses.replace(
            settings.cluster, enabled=True, share_ports=True, node_id=node_id
        ),
        persistence=dataclasses.replace(
            settings.persistence, redis_url=redis_url, kafka_bootstrap=bootstrap
        ),
        metrics=dataclasses.replace(settings.metrics, port=settings.metrics.port + index),
    )


def node_name(settings: Settings, index: int, incarnation: int) -> str:
    """A worker's name in the cluster: new at every start, as a replica's default
    (hostname-pid) is, so that the others see a dead one go (its heartbeat key
    expires) rather than the same name come back before it does."""
    base = settings.cluster.node_id or f"{socket.gethostname()}-{os.getpid()}"
    return f"{base}-w{index}-{incarnation}"


# --------------------------------------------------------------------------
# The worker's side
# --------------------------------------------------------------------------

# Messages on the pipe between a worker and its supervisor. From the worker:
# (LISTENING, None) once its listeners are open, (ERROR, one line) when it cannot
# start. From the supervisor: (DRAIN, None), (EXIT, None): exit without a drain.
# A pipe, not signals: under a service manager that signals every process of the
# service (systemd's default), a worker would take the supervisor's SIGTERM for a
# second signal and skip its drain.
LISTENING = "listening"
ERROR = "error"
DRAIN = "drain"
EXIT = "exit"


def _worker_main(settings: Settings, name: str, conn: Connection, embedded_kafka: bool) -> None:
    """A worker process: serve like ``devicemq run`` until SIGTERM, its supervisor
    asks, or its supervisor is gone (the pipe's end). ``embedded_kafka``: its
    ``persistence.kafka_bootstrap`` is the embedded Kafka the supervisor started."""
    os.setpgrp()  # a terminal's Ctrl-C is the supervisor's to handle
    setup_logging(settings.log.level, settings.log.format)
    tag = _Tag(name)
    for handler in logging.getLogger().handlers:
        handler.addFilter(tag)
    from app.serve import run
    from app.start_errors import startup_error

    def controls(
        loop: asyncio.AbstractEventLoop, drain: Callable[[], None], exit_now: Callable[[str], None]
    ) -> None:
        fd = conn.fileno()

        def readable() -> None:
            try:
                while conn.poll():
                    kind, _ = conn.recv()
                    if kind == DRAIN:
                        drain()
                    elif kind == EXIT:
                        exit_now("told to by the supervisor")
            except (EOFError, OSError):
                loop.remove_reader(fd)
                log.error("the supervisor is gone: stopping")
                drain()

        loop.add_reader(fd, readable)

    try:
        run(
            settings,
            on_listening=lambda: conn.send((LISTENING, None)),
            controls=controls,
            embedded_kafka=embedded_kafka,
        )
    except BaseException as e:
        line = startup_error(settings, e)
        if line is None:
            raise
        log.error("cannot start: %s", line)
        with contextlib.suppress(OSError):
            conn.send((ERROR, line))
        os._exit(1)


class _Tag(logging.Filter):
    """Adds ``worker=<name>`` to every line of a worker's log."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.worker = name

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = self.worker
        return True


# --------------------------------------------------------------------------
# The supervisor
# --------------------------------------------------------------------------


@dataclasses.dataclass
class _Worker:
    index: int
    process: BaseProcess | None = None
    conn: Connection | None = None
    listening: bool = False
    started: float = 0.0
    incarnation: int = 0
    delay: float = RESTART_DELAY
    restart_at: float | None = None

    @property
    def name(self) -> str:
        return f"w{self.index}"

    def alive(self) -> bool:
        return self.process is not None and self.process.exitcode is None


class Supervisor:
    """Starts ``count`` workers, keeps them running, and drains them on a signal."""

    def __init__(
        self,
        settings: Settings,
        count: int,
        endpoints: tuple[str, str],
        *,
        embedded: bool = False,
    ) -> None:
        """``embedded``: ``endpoints`` are the embedded services, started by this
        process (the workers are told: app/serve.py creates the integration rules'
        topics on the embedded Kafka only)."""
        self._context = multiprocessing.get_context("spawn")
        self._settings = settings
        self._endpoints = endpoints
        self._embedded = embedded
        self.workers = [_Worker(i) for i in range(count)]
        self._signals = 0
        self.failure: str | None = None  # why the first start failed

    def _signalled(self, signum: int, frame: object) -> None:
        self._signals += 1

    def run(self) -> int:
        """Serve until signalled; the exit status: 0 after a clean drain, else 1."""
        previous = {sig: signal.signal(sig, self._signalled) for sig in _SIGNALS}
        status = 1
        try:
            status = self._serve()
        finally:
            # Whatever ended the watch, even an error here: never leave workers behind
            # (multiprocessing's exit would wait for them, and they for a drain order).
            status = self._drain(status)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if self.failure is not None:  # the last line, after the drain's
            print(f"devicemq: error: {self.failure}", file=sys.stderr, flush=True)
        return status

    def _start(self, worker: _Worker) -> None:
        ours, theirs = self._context.Pipe(duplex=True)
        name = node_name(self._settings, worker.index, worker.incarnation)
        worker.incarnation += 1
        settings = worker_settings(self._settings, self._endpoints, worker.index, name)
        process = self._context.Process(
            target=_worker_main,
            args=(settings, worker.name, theirs, self._embedded),
            name=f"devicemq-{name}",
        )
        process.start()
        theirs.close()
        worker.process, worker.conn = process, ours
        worker.listening, worker.started, worker.restart_at = False, time.monotonic(), None
        log.info("worker %s started as %s (pid %d)", worker.name, name, process.pid)

    def _serve(self) -> int:
        """Watch the workers until a signal (0) or a worker that cannot start (1)."""
        starting = True
        for worker in self.workers:
            if self._signals:
                return 0
            self._start(worker)
        while not self._signals:
            self._poll()
            for worker in self.workers:
                failed = self._check(worker)
                if failed is not None and starting:
                    # As one broker would: the first start's error ends the command.
                    self.failure = failed
                    return 1
                if worker.restart_at is not None and time.monotonic() >= worker.restart_at:
                    if self._signals:
                        break
                    self._start(worker)
            if starting and all(w.listening for w in self.workers):
                starting = False
                log.info("%d workers listening", len(self.workers))
        return 0

    def _poll(self) -> None:
        """Wait (a tick at most) for a message or an exit of a live worker."""
        waitables: list[Connection | int] = []
        for worker in self.workers:
            if worker.conn is not None:
                waitables.append(worker.conn)
            if worker.alive():
                assert worker.process is not None
                waitables.append(worker.process.sentinel)
        if waitables:
            multiprocessing.connection.wait(waitables, timeout=_TICK)
        else:
            time.sleep(_TICK)

    def _read(self, worker: _Worker) -> str | None:
        """What ``worker`` said since the last look; its start failure's line, if any.
        The pipe is closed at its end (the worker exited)."""
        failed = None
        conn = worker.conn
        try:
            while conn is not None and conn.poll():
                kind, detail = conn.recv()
                if kind == LISTENING:
                    worker.listening = True
                    log.info("worker %s listening", worker.name)
                elif kind == ERROR:
                    failed = str(detail)
        except (EOFError, OSError):
            assert conn is not None
            conn.close()
            worker.conn = None
        return failed

    def _check(self, worker: _Worker) -> str | None:
        """Read what ``worker`` said and whether it died (then plan its restart);
        a start failure's line, if any."""
        failed = self._read(worker)
        process = worker.process
        if process is None or process.exitcode is None:
            return failed
        # Exited: everything it sent before is in the pipe, read it to the end.
        while worker.conn is not None:
            failed = self._read(worker) or failed
            if worker.conn is not None and not worker.conn.poll(0.1):
                worker.conn.close()
                worker.conn = None
        uptime = time.monotonic() - worker.started
        worker.process = None
        if uptime >= STABLE:
            worker.delay = RESTART_DELAY
        if failed is None and not worker.listening:
            failed = f"worker {worker.name} exited with status {process.exitcode}"
        log.error(
            "worker %s (pid %d) exited with status %s after %.1f s%s: starting it again in %.0f s",
            worker.name,
            process.pid,
            process.exitcode,
            uptime,
            f" ({failed})" if failed else "",
            worker.delay,
        )
        worker.restart_at = time.monotonic() + worker.delay
        worker.delay = min(worker.delay * 2, RESTART_MAX)
        return failed

    def _drain(self, status: int) -> int:
        """Ask every worker to drain (to exit at once after a second signal), wait."""
        log.info("stopping %d workers", len(self.workers))
        for worker in self.workers:
            worker.restart_at = None
        told = EXIT if self._signals >= 2 else DRAIN
        signals_seen = max(self._signals, 1)
        self._tell(told)
        deadline = time.monotonic() + DRAIN_TIMEOUT
        while any(w.alive() for w in self.workers):
            if time.monotonic() > deadline:
                log.error("workers still running after %.0f s: killing them", DRAIN_TIMEOUT)
                for worker in self.workers:
                    if worker.alive():
                        assert worker.process is not None
                        worker.process.kill()
                status = 1
                break
            if self._signals > signals_seen and told != EXIT:
                told = EXIT
                self._tell(EXIT)
            self._poll()
            for worker in self.workers:
                self._read(worker)  # a closed pipe leaves the wait list: no busy loop
        for worker in self.workers:
            process = worker.process
            if process is None:
                continue
            process.join(5)
            if process.exitcode != 0:
                log.error("worker %s exited with status %s", worker.name, process.exitcode)
                status = 1
            if worker.conn is not None:
                worker.conn.close()
                worker.conn = None
        return status

    def _tell(self, kind: str) -> None:
        for worker in self.workers:
            if not worker.alive():
                continue
            try:
                assert worker.conn is not None
                worker.conn.send((kind, None))
            except (AssertionError, OSError):  # no pipe to it: the signal it understands
                assert worker.process is not None
                worker.process.terminate()


def run_workers(
    settings: Settings, count: int, start_services: Callable[[], tuple[str, str]]
) -> int:
    """Blocking entry point of ``devicemq run --workers N`` (N > 1)."""
    from persistence.device_persistence import configured_endpoints

    endpoints = configured_endpoints(settings)
    embedded = endpoints is None
    if endpoints is None:
        from app.embedded_services import url_shown

        endpoints = start_services()
        log.info("embedded services: redis %s, kafka %s", url_shown(endpoints[0]), endpoints[1])
    Path(settings.data_dir).mkdir(parents=True, exist_ok=True)
    return Supervisor(settings, count, endpoints, embedded=embedded).run()
