"""CPU accounting from /proc (Linux): the machine, and the broker under test.

The broker is found by its listening port (``/proc/net/tcp`` gives the
socket inode, ``/proc/*/fd`` the process holding it); its CPU is that of the
process and all its descendants (devicemq's embedded Redis and Kafka-protocol
broker are its children). Everything here degrades to ``None`` where /proc is
not there or not readable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "CpuSample",
    "cores_by_process",
    "find_listener_pid",
    "rss_kib",
    "sample",
    "tree",
    "tree_cpu",
]

_PROC = Path("/proc")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class CpuSample:
    wall: float  # time.monotonic()
    busy: float | None  # CPU seconds all cores spent not idle, since boot
    total: float | None  # CPU seconds of all cores, since boot
    watched: float | None  # CPU seconds of the watched processes (and their children)
    # each watched process: pid -> (command name, CPU seconds)
    parts: dict[int, tuple[str, float]] = field(default_factory=dict)


def cores_by_process(start: CpuSample, end: CpuSample, roots: list[int]) -> dict[str, float]:
    """Cores each watched process used between two samples, by name: a root (the
    broker under test) is ``broker``, a child its command (``redis-server``,
    ``tansu``); processes of one name add up."""
    wall = end.wall - start.wall
    out: dict[str, float] = {}
    if wall <= 0:
        return out
    for pid, (name, cpu) in end.parts.items():
        before = start.parts.get(pid)
        if before is None or before[0] != name:
            continue
        label = "broker" if pid in roots else name
        out[label] = round(out.get(label, 0.0) + (cpu - before[1]) / wall, 3)
    return out


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
    named = _named_stat(pid)
    return None if named is None else (named[0], named[2])


def _named_stat(pid: int) -> tuple[int, str, float] | None:
    """(parent pid, command name, user+system CPU seconds of the process itself)."""
    try:
        raw = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    close = raw.rindex(")")
    name = raw[raw.index("(") + 1 : close]
    rest = raw[close + 2 :].split()
    # fields after the command: state ppid ... utime(12th) stime(13th)
    return int(rest[1]), name, (int(rest[11]) + int(rest[12])) / _TICK


def tree(roots: list[int]) -> list[int]:
    """``roots`` and all their descendants."""
    return _tree(roots)


def rss_kib(pid: int) -> int | None:
    """Resident memory of ``pid`` in KiB (``VmRSS``), or None if it is gone."""
    try:
        with open(_PROC / str(pid) / "status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return 0  # a zombie has no VmRSS line


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
    parts = tree_cpu(pids) if pids else {}
    watched = sum(cpu for _, cpu in parts.values()) if parts else None
    return CpuSample(
        time.monotonic(),
        system[0] if system else None,
        system[1] if system else None,
        watched,
        parts,
    )


def tree_cpu(roots: list[int]) -> dict[int, tuple[str, float]]:
    """Each process of the trees under ``roots``: pid -> (command name, user+system
    CPU seconds), so that a broker's CPU can be told from its Redis' and Kafka's."""
    out: dict[int, tuple[str, float]] = {}
    for pid in _tree(roots):
        st = _named_stat(pid)
        if st is not None:
            out[pid] = (st[1], st[2])
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
