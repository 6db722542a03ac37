"""CPU accounting from /proc (Linux): the machine, and the broker under test.

The broker is found by its listening port (``/proc/net/tcp`` gives the
socket inode, ``/proc/*/fd`` the process holding it); its CPU is that of the
process and all its descendants (devicemq's embedded Redis and Kafka-protocol
broker are its children). Everything here degrades to ``None`` where /proc is
not there or not readable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CpuSample", "find_listener_pid", "sample", "tree_cpu"]

_PROC = Path("/proc")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class CpuSample:
    wall: float  # time.monotonic()
    busy: float | None  # CPU seconds all cores spent not idle, since boot
    total: float | None  # CPU seconds of all cores, since boot
    watched: float | None  # CPU seconds of the watched processes (and their children)


def _system() -> tuple[float, float] | None:
    try:
        fields = (_PROC / "stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    values = [int(v) for v in fields[:8]]
    idle = values[3] + values[4]  # idle + iowait
    total = sum(values)
    return (total - idle) / _TICK, total / _TICK


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user+system CPU seconds of the process itself)."""
    try:
        raw = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    rest = raw[raw.rindex(")") + 2 :].split()
    # fields after the command: state ppid ... utime(12th) stime(13th)
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / _TICK


def _tree(roots: list[int]) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None:
                parents.setdefault(st[0], []).append(int(entry.name))
    out: list[int] = []
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid in out:
            continue
        out.append(pid)
        todo.extend(parents.get(pid, []))
    return out


def sample(pids: list[int]) -> CpuSample:
    import time

    system = _system()
    watched: float | None = None
    if pids:
        total = 0.0
        seen = False
        for pid in _tree(pids):
            st = _stat(pid)
            if st is not None:
                total += st[1]
                seen = True
        watched = total if seen else None
    return CpuSample(
        time.monotonic(),
        system[0] if system else None,
        system[1] if system else None,
        watched,
    )


def tree_cpu(roots: list[int]) -> dict[int, tuple[str, float]]:
    """Each process of the trees under ``roots``: pid -> (command name, user+system
    CPU seconds), so that a broker's CPU can be told from its Redis' and Kafka's."""
    out: dict[int, tuple[str, float]] = {}
    for pid in _tree(roots):
        st = _stat(pid)
        if st is None:
            continue
        try:
            name = (_PROC / str(pid) / "comm").read_text().strip()
        except OSError:
            continue
        out[pid] = (name, st[1])
    return out


def find_listener_pid(port: int) -> int | None:
    """The process listening on TCP ``port`` (IPv4 or IPv6), or None."""
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (_PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    if not inodes:
        return None
    targets = {f"socket:[{inode}]" for inode in inodes}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in targets:
                    return int(entry.name)
            except OSError:
                continue
    return None
