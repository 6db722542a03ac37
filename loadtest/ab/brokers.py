"""A fresh broker for each run: devicemq of a tree, or Mosquitto; and their CPU.

devicemq is started as a user would, ``devicemq run`` of that tree on free
ports with a data dir of its own, so a persistent run gets a fresh embedded
Redis and Kafka (Tansu) that it starts itself (BENCHMARKS.md: Tansu's memory
store slows as it fills, so reused services would favour whichever side ran
first). Its settings are the tree's defaults, except what a load test from one
address needs and what must not collide:

- ``mqtt.max_connection_rate`` and ``mqtt.max_connection_rate_per_source``
  0: every client of the loader comes from 127.0.0.1;
- ``persistence.enabled`` as the scenario asks;
- ``metrics.host`` 127.0.0.1 (``/ready`` is asked there; nothing listens
  beyond the machine);
- ``admin.enabled`` false (its fixed port would collide between runs; older
  trees without the setting ignore the variable, as they ignore every unknown
  ``DEVICEMQ_*``);
- ``--log-level WARNING``, as in BENCHMARKS.md.

A run waits for ``/ready`` (MQTT served and, when persistent, Redis and Kafka
answering and the consumer holding its partitions), and stops the broker with
SIGTERM, then ``devicemq services stop`` of its data dir.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from loadtest import procstat
from loadtest.ab.build import Tree

__all__ = ["BrokerError", "Running", "cpu_seconds", "start_devicemq", "start_mosquitto"]

HOST = "127.0.0.1"
READY_TIMEOUT = 120.0
STOP_TIMEOUT = 40.0
MOSQUITTO = "/usr/sbin/mosquitto"

# What a load test from one address needs of every devicemq (see the docstring).
SETTINGS = {
    "DEVICEMQ_MQTT_MAX_CONNECTION_RATE": "0",
    "DEVICEMQ_MQTT_MAX_CONNECTION_RATE_PER_SOURCE": "0",
    "DEVICEMQ_ADMIN_ENABLED": "false",
    "DEVICEMQ_METRICS_HOST": HOST,
}


class BrokerError(RuntimeError):
    """A broker did not start (its log's tail is in the message)."""


@dataclass
class Running:
    """A broker started for one run."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int
    workdir: Path
    log: Path
    stop_command: list[str] = field(default_factory=list)  # after the process: services stop
    env: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM (the broker drains), SIGKILL if it takes too long; then its
        embedded services."""
        proc = self.proc
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if self.stop_command:
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                subprocess.run(
                    self.stop_command,
                    cwd=self.workdir,
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=60,
                    check=False,
                )


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: the sockets stay bound until all are chosen, or
    the kernel may hand out one port twice (the MQTT and the metrics listener
    then collide)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind((HOST, 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def start_devicemq(
    name: str,
    tree: Tree,
    persistent: bool,
    workdir: Path,
    ports: tuple[int, int] | None = None,
    settings: dict[str, str] | None = None,
) -> Running:
    """``devicemq run`` of ``tree`` with its data in ``workdir``, ready; on
    ``ports`` (MQTT, metrics) when given, else on free ones; ``settings``: more
    ``DEVICEMQ_*`` variables (one side's own, e.g. the embedded Kafka's storage)."""
    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    port, metrics = ports or free_ports(2)
    enabled = "true" if persistent else "false"
    env = tree.env({**SETTINGS, "DEVICEMQ_PERSISTENCE_ENABLED": enabled, **(settings or {})})
    argv = tree.command("run", "--host", HOST, "--port", str(port))
    argv += ["--metrics-port", str(metrics), "--data-dir", str(data), "--log-level", "WARNING"]
    log = workdir / "broker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out
        )
    stop = tree.command("services", "stop", "--data-dir", str(data)) if persistent else []
    running = Running(name, proc, port, workdir, log, stop, env)
    try:
        _wait_ready(running, f"http://{HOST}:{metrics}/ready")
    except BaseException:
        running.stop()
        raise
    return running


def _wait_ready(running: Running, url: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    reason = "no answer"
    while True:
        if running.proc.poll() is not None:
            raise BrokerError(
                f"{running.name}: the broker exited ({running.proc.returncode}) before it was "
                f"ready:\n{running.log_tail()}"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return
        except urllib.error.HTTPError as e:
            reason = f"{e.code} {e.read()[:200].decode(errors='replace')}"
        except OSError as e:
            reason = str(e)
        if time.monotonic() > deadline:
            raise BrokerError(
                f"{running.name}: not ready after {READY_TIMEOUT:g} s ({reason}):\n"
                f"{running.log_tail()}"
            )
        time.sleep(0.1)


def mosquitto_binary() -> str | None:
    found = shutil.which("mosquitto")
    if found:
        return found
    return MOSQUITTO if os.access(MOSQUITTO, os.X_OK) else None


def start_mosquitto(workdir: Path) -> Running:
    """Mosquitto on a free port: anonymous, in memory, its other settings its
    defaults (``max_inflight_messages`` 20, ``max_queued_messages`` 1000), as
    in BENCHMARKS.md."""
    binary = mosquitto_binary()
    if binary is None:
        raise BrokerError("--mosquitto: no mosquitto binary on PATH or at /usr/sbin/mosquitto")
    workdir.mkdir(parents=True, exist_ok=True)
    (port,) = free_ports(1)
    conf = workdir / "mosquitto.conf"
    conf.write_text(
        f"listener {port} {HOST}\nallow_anonymous true\npersistence false\nlog_dest stderr\n"
        "log_type error\nlog_type warning\n"
    )
    log = workdir / "mosquitto.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [binary, "-c", str(conf)], cwd=workdir, stdin=subprocess.DEVNULL, stdout=out, stderr=out
        )
    running = Running("mosquitto", proc, port, workdir, log)
    deadline = time.monotonic() + 15
    while True:
        if proc.poll() is not None:
            raise BrokerError(f"mosquitto exited ({proc.returncode}):\n{running.log_tail()}")
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex((HOST, port)) == 0:
                return running
        if time.monotonic() > deadline:
            running.stop()
            raise BrokerError(f"mosquitto not listening after 15 s:\n{running.log_tail()}")
        time.sleep(0.05)


def role(command_name: str) -> str:
    """Which part of the server a process is: ``redis``, ``kafka`` or ``broker``."""
    if command_name.startswith("redis"):
        return "redis"
    if "tansu" in command_name or "kafka" in command_name:
        return "kafka"
    return "broker"


def cpu_seconds(pid: int) -> tuple[float, dict[str, float]]:
    """(time.monotonic(), CPU seconds by role) of the process ``pid`` and its
    children: the broker's embedded Redis and Kafka are its children."""
    now = time.monotonic()
    out = {"broker": 0.0, "redis": 0.0, "kafka": 0.0}
    for name, seconds in procstat.tree_cpu([pid]).values():
        out[role(name)] += seconds
    return now, out
