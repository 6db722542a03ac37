"""``python -m tests.model`` as a user runs it: stopped with ``kill``, it leaves nothing
running (before, a SIGTERM ended the checker and left its brokers and Redis up)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _running_in(root: Path) -> list[int]:
    """PIDs of live processes whose command line names a path under ``root``, or that
    run in a directory under it (Redis sets its process title to its address)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            cwd = os.readlink(entry / "cwd")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        inside = str(root).encode() in cmdline or cwd.startswith(str(root))
        if inside and state != "Z":
            found.append(int(entry.name))
    return found


def test_a_checker_stopped_with_kill_stops_the_processes_of_its_run(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "tests.model", "--runs", "1", "--ops", "400", "--seed", "7"]
    checker = subprocess.Popen(
        [*argv, "--dir", str(tmp_path)],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    log = tmp_path / "seed-7" / "broker-0" / "broker.log"
    try:
        # Into its operations: a client of the run connected (a kill while the run
        # starts its processes is as good, tests/faults/conftest.py DeviceMQ.start).
        deadline = time.monotonic() + 60
        while not (log.exists() and b"connected from" in log.read_bytes()):
            assert checker.poll() is None, "the checker ended before a client connected"
            assert time.monotonic() < deadline, "no client of the run connected"
            time.sleep(0.1)
        started = _running_in(tmp_path)
        assert started, "no process of the run names its directory"
        checker.send_signal(signal.SIGTERM)
        assert checker.wait(60) == 128 + signal.SIGTERM
        left = _running_in(tmp_path)
        assert not left, f"still running after the checker ended: {left}"
    finally:
        if checker.poll() is None:
            checker.kill()
            checker.wait()
        for pid in _running_in(tmp_path):  # what a failure left: stopped by PID
            os.kill(pid, signal.SIGKILL)
