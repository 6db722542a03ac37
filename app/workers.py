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
from broker.logging_setup import setup_logging

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


def worker_settings(settings: Settings, endpoints: tuple[str, str], index: int) -> Settings:
    """Worker ``index``'s settings: a cluster replica sharing the ports, on ``endpoints``
    (redis_url, kafka_bootstrap), its metrics on ``metrics.port + index``."""
    base = settings.cluster.node_id or socket.gethostname()
    redis_url, bootstrap = endpoints
    return dataclasses.replace(
        settings,
        workers="1",
        cluster=dataclasses.replace(
            settings.cluster, enabled=True, share_ports=True, node_id=f"{base}-w{index}"
        ),
        persistence=dataclasses.replace(
            settings.persistence, redis_url=redis_url, kafka_bootstrap=bootstrap
        ),
        metrics=dataclasses.replace(settings.metrics, port=settings.metrics.port + index),
    )


# --------------------------------------------------------------------------
# The worker's side
# --------------------------------------------------------------------------

# Messages a worker sends its supervisor: ("listening", None) once its listeners are
# open, ("error", one line) when it cannot start.
LISTENING = "listening"
ERROR = "error"


def _worker_main(settings: Settings, name: str, conn: Connection) -> None:
    """A worker process: serve like ``devicemq run`` until SIGTERM or the supervisor dies."""
    os.setpgrp()  # a terminal's Ctrl-C is the supervisor's to handle
    setup_logging(settings.log.level, settings.log.format)
    tag = _Tag(name)
    for handler in logging.getLogger().handlers:
        handler.addFilter(tag)
    from app.cli import startup_error
    from app.serve import run

    parent = multiprocessing.parent_process()
    sentinel = parent.sentinel if parent is not None else None
    try:
        run(
            settings,
            on_listening=lambda: conn.send((LISTENING, None)),
            stop_when_readable=sentinel,
        )
    except BaseException as e:
        line = startup_error(settings, e)
        if line is None:
            raise
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
    settings: Settings
    process: BaseProcess | None = None
    conn: Connection | None = None
    listening: bool = False
    started: float = 0.0
    delay: float = RESTART_DELAY
    restart_at: float | None = None

    @property
    def name(self) -> str:
        return f"w{self.index}"


class Supervisor:
    """Starts ``count`` workers, keeps them running, and drains them on a signal."""

    def __init__(self, settings: Settings, count: int, endpoints: tuple[str, str]) -> None:
        self._context = multiprocessing.get_context("spawn")
        self.workers = [_Worker(i, worker_settings(settings, endpoints, i)) for i in range(count)]
        self._signals = 0

    def _signalled(self, signum: int, frame: object) -> None:
        self._signals += 1

    def run(self) -> int:
        """Serve until signalled; the exit status: 0 after a clean drain, else 1."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._signalled)
        for worker in self.workers:
            self._start(worker)
        status = self._serve()
        return self._drain(status)

    def _start(self, worker: _Worker) -> None:
        ours, theirs = self._context.Pipe(duplex=False)
        process = self._context.Process(
            target=_worker_main,
            args=(worker.settings, worker.name, theirs),
            name=f"devicemq-{worker.name}",
        )
        process.start()
        theirs.close()
        worker.process, worker.conn = process, ours
        worker.listening, worker.started, worker.restart_at = False, time.monotonic(), None
        log.info("worker %s started (pid %d)", worker.name, process.pid)

    def _serve(self) -> int:
        """Watch the workers until a signal (0) or a worker that cannot start (1)."""
        starting = True
        while not self._signals:
            self._poll()
            for worker in self.workers:
                failed = self._check(worker)
                if failed is not None and starting:
                    # As one broker would: the first start's error ends the command.
                    print(f"devicemq: error: {failed}", file=sys.stderr, flush=True)
                    return 1
                if worker.restart_at is not None and time.monotonic() >= worker.restart_at:
                    self._start(worker)
            if starting and all(w.listening for w in self.workers):
                starting = False
                log.info("%d workers listening", len(self.workers))
        return 0

    def _poll(self) -> None:
        waitables: list[Connection | int] = []
        for worker in self.workers:
            if worker.conn is not None:
                waitables.append(worker.conn)
            if worker.process is not None:
                waitables.append(worker.process.sentinel)
        if waitables:
            multiprocessing.connection.wait(waitables, timeout=_TICK)
        else:
            time.sleep(_TICK)

    def _check(self, worker: _Worker) -> str | None:
        """Read what ``worker`` said and whether it died; a start failure's line, if any."""
        failed = None
        conn = worker.conn
        while conn is not None and conn.poll():
            try:
                kind, detail = conn.recv()
            except (EOFError, OSError):
                conn.close()
                worker.conn = conn = None
                break
            if kind == LISTENING:
                worker.listening = True
                worker.delay = RESTART_DELAY
                log.info("worker %s listening", worker.name)
            elif kind == ERROR:
                failed = str(detail)
        process = worker.process
        if process is not None and process.exitcode is not None:
            uptime = time.monotonic() - worker.started
            worker.process = None
            if worker.conn is not None:
                worker.conn.close()
                worker.conn = None
            if failed is None and not worker.listening:
                failed = f"worker {worker.name} exited with status {process.exitcode}"
            if uptime >= STABLE:
                worker.delay = RESTART_DELAY
            log.error(
                "worker %s (pid %d) exited with status %s after %.1f s: starting it again in "
                "%.0f s",
                worker.name,
                process.pid,
                process.exitcode,
                uptime,
                worker.delay,
            )
            worker.restart_at = time.monotonic() + worker.delay
            worker.delay = min(worker.delay * 2, RESTART_MAX)
        return failed

    def _drain(self, status: int) -> int:
        """SIGTERM every worker once (again on a second signal: exit at once), then wait."""
        log.info("stopping %d workers", len(self.workers))
        signals_sent = self._signals
        self._terminate()
        deadline = time.monotonic() + DRAIN_TIMEOUT
        while any(w.process is not None and w.process.is_alive() for w in self.workers):
            if time.monotonic() > deadline:
                log.error("workers still running after %.0f s: killing them", DRAIN_TIMEOUT)
                for worker in self.workers:
                    if worker.process is not None and worker.process.is_alive():
                        worker.process.kill()
                status = 1
                break
            if self._signals > signals_sent:
                signals_sent = self._signals
                self._terminate()
            self._poll()
        for worker in self.workers:
            if worker.process is not None:
                worker.process.join(5)
                if worker.process.exitcode not in (0, None):
                    code = worker.process.exitcode
                    log.error("worker %s exited with status %s", worker.name, code)
                    status = 1
        return status

    def _terminate(self) -> None:
        for worker in self.workers:
            if worker.process is not None and worker.process.is_alive():
                worker.process.terminate()  # SIGTERM


def run_workers(
    settings: Settings, count: int, start_services: Callable[[], tuple[str, str]]
) -> int:
    """Blocking entry point of ``devicemq run --workers N`` (N > 1)."""
    from persistence.device_persistence import configured_endpoints

    endpoints = configured_endpoints(settings)
    if endpoints is None:
        endpoints = start_services()
        log.info("embedded services: redis %s, kafka %s", *endpoints)
    Path(settings.data_dir).mkdir(parents=True, exist_ok=True)
    return Supervisor(settings, count, endpoints).run()
