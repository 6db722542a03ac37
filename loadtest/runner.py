"""The coordinator: starts the workers, keeps them in step, merges what they saw.

One worker runs in a thread of this process; more run in processes of their
own (``multiprocessing``, spawn), so that the load generator can use every
core. All share one clock, ``time.monotonic_ns`` (CLOCK_MONOTONIC is
system-wide on Linux), so a message timed by one worker can be received by
another.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from loadtest import procstat
from loadtest.client import THROTTLE_HINT
from loadtest.progress import Progress
from loadtest.replicas import partition_owners
from loadtest.report import summarize
from loadtest.scenarios import LoadConfig, make_plan
from loadtest.worker import WorkerResult, run_worker, start_thread_worker

__all__ = ["LoadTestError", "run_load"]

READY_MARGIN = 30.0  # seconds past config.connect_timeout before a silent worker is given up
START_DELAY = 0.3  # seconds between "start" and t0, for every worker to get it


class LoadTestError(RuntimeError):
    """The run could not be carried out (connection refused, worker crash...)."""


class _Workers:
    def __init__(self, config: LoadConfig, plan: Any) -> None:
        self.conns: list[Connection] = []
        self.processes: list[Any] = []
        self.threads: list[Any] = []
        if config.processes == 1:
            parent, child = multiprocessing.Pipe()
            self.threads.append(start_thread_worker(child, config, plan, 0))
            self.conns.append(parent)
            self._child_ends = [child]
            return
        ctx = multiprocessing.get_context("spawn")
        self._child_ends = []
        for worker in range(config.processes):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=run_worker,
                args=(child, config, plan, worker),
                name=f"loadtest-{worker}",
                daemon=True,
            )
            proc.start()
            child.close()
            self.processes.append(proc)
            self.conns.append(parent)

    def broadcast(self, *message: object) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(message)

    def close(self) -> None:
        self.broadcast("abort")
        for proc in self.processes:
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
                proc.join(2)
        for thread in self.threads:
            thread.join(5)
        for conn in self.conns:
            conn.close()


def run_load(
    config: LoadConfig,
    *,
    label: str = "",
    progress: bool | None = None,
    watch_pids: list[int] | None = None,
    on_progress: Callable[[float, str, int, int, int], None] | None = None,
) -> dict[str, Any]:
    """Run one scenario against ``config.host:config.port``; return the result dict
    (see ``loadtest.report.summarize``). Raises ``LoadTestError`` if it cannot run."""
    config = config.resolved()
    plan = make_plan(config)
    label = label or config.label or f"{config.host}:{config.port}"
    show = progress if progress is not None else True
    bar = Progress(label, config.total_seconds, enabled=show)
    pids = list(watch_pids or [])
    broker_pid = procstat.find_listener_pid(config.port) if config.host in _LOCAL else None
    if broker_pid is not None and broker_pid not in pids:
        pids.insert(0, broker_pid)
    if config.host in _LOCAL:  # every replica's process counts as the broker
        for port, _ in config.replicas:
            pid = procstat.find_listener_pid(port)
            if pid is not None and pid not in pids:
                pids.append(pid)
    owners: tuple[dict[int, int], int] | None = None
    workers = _Workers(config, plan)
    pending = dict(enumerate(workers.conns))
    totals = [(0, 0, 0)] * len(workers.conns)
    try:
        # -- connect
        deadline = time.monotonic() + config.connect_timeout + READY_MARGIN
        ready: set[int] = set()
        connect_started = time.monotonic()
        connecting = [(0, 0, 0)] * len(workers.conns)
        next_say = connect_started + CONNECTING_SAY
        while len(ready) < len(workers.conns):
            for i, message in _receive(pending, deadline):
                if message[0] == "error":
                    raise LoadTestError(message[1])
                if message[0] == "ready":
                    ready.add(i)
                if message[0] == "connecting":
                    connecting[i] = message[1:]
            if show and time.monotonic() >= next_say and len(ready) < len(workers.conns):
                next_say += CONNECTING_SAY
                bar.stream.write(_connecting_line(label, config, connecting, connect_started))
        if show:
            bar.stream.write(
                f"{label}: {config.publishers} publishers, {config.subscribers} subscribers "
                f"connected in {time.monotonic() - connect_started:.1f} s\n"
            )
        # -- publish
        t0 = time.monotonic_ns() + int(START_DELAY * 1e9)
        t0_wall = time.monotonic() + START_DELAY
        workers.broadcast("start", t0)
        window_start = t0_wall + config.warmup
        window_end = window_start + config.duration
        samples: dict[str, procstat.CpuSample] = {}
        published: dict[int, dict[int, int]] = {}
        results: dict[int, WorkerResult] = {}
        phase = "warmup"
        # and the persistent sessions' removal, paced as connecting was (close_all)
        end = t0_wall + config.total_seconds + config.drain + config.connect_timeout + 30.0
        while len(results) < len(workers.conns):
            now = time.monotonic()
            if "start" not in samples and now >= window_start:
                samples["start"] = procstat.sample(pids)
                phase = "measure"
                if config.replicas:  # after the warm-up: the group has its partitions
                    owners = partition_owners(config.host, [m for _, m in config.replicas])
            if "end" not in samples and now >= window_end:
                samples["end"] = procstat.sample(pids)
                phase = "drain"
            if now > end:
                raise LoadTestError("workers did not finish (drain took too long?)")
            for i, message in _receive(pending, now + 0.1, block=False):
                kind = message[0]
                if kind == "progress":
                    totals[i] = message[1:]
                elif kind == "published":
                    published[i] = message[1]
                    if len(published) == len(workers.conns):
                        acked: dict[int, int] = {}
                        for part in published.values():
                            acked.update(part)
                        workers.broadcast("expect", acked)
                elif kind == "result":
                    results[i] = message[1]
                    pending.pop(i, None)
                elif kind == "error":
                    raise LoadTestError(message[1])
            sent, acked_n, delivered = (sum(t[k] for t in totals) for k in range(3))
            elapsed = time.monotonic() - t0_wall
            bar.update(elapsed, phase, sent, acked_n, delivered)
            if on_progress is not None:
                on_progress(elapsed, phase, sent, acked_n, delivered)
        bar.close()
    except BaseException:
        bar.close()
        raise
    finally:
        workers.close()
    return summarize(
        config,
        plan,
        [results[i] for i in sorted(results)],
        label=label,
        cpu_start=samples.get("start"),
        cpu_end=samples.get("end"),
        broker_pid=broker_pid,
        watched_pids=pids,
        owners=owners,
    )


_LOCAL = ("127.0.0.1", "localhost", "::1", "0.0.0.0")
CONNECTING_SAY = 5.0  # seconds between lines while the clients connect


def _connecting_line(
    label: str, config: LoadConfig, connecting: list[tuple[int, int, int]], started: float
) -> str:
    """How far connecting has come; when throttled, what to raise (one line)."""
    assert config.publishers is not None and config.subscribers is not None
    connected, busy, failed = (sum(c[k] for c in connecting) for k in range(3))
    line = (
        f"{label}: connecting: {connected:,} of {config.publishers + config.subscribers:,} "
        f"clients after {time.monotonic() - started:.0f} s"
    )
    if failed:
        line += f", {failed:,} failed connections retried"
    if busy:
        line += f", {busy:,} CONNECTs refused as busy: {THROTTLE_HINT}"
    return line + "\n"


def _receive(
    pending: dict[int, Connection], deadline: float, block: bool = True
) -> list[tuple[int, tuple[Any, ...]]]:
    """Messages available from the workers before ``deadline``."""
    out: list[tuple[int, tuple[Any, ...]]] = []
    by_conn = {id(conn): i for i, conn in pending.items()}
    timeout = max(0.0, deadline - time.monotonic())
    if block and timeout <= 0:
        raise LoadTestError("timed out waiting for the workers to connect their clients")
    for conn in wait(list(pending.values()), timeout):
        assert isinstance(conn, Connection)
        i = by_conn[id(conn)]
        try:
            while conn.poll():
                message = conn.recv()
                out.append((i, message))
                if message[0] in ("result", "error"):
                    pending.pop(i, None)
                    break
        except (EOFError, OSError) as e:
            pending.pop(i, None)
            out.append((i, ("error", f"worker {i} exited unexpectedly ({e!r})")))
    return out


def default_processes() -> int:
    return max(1, (os.cpu_count() or 1) // 2)
