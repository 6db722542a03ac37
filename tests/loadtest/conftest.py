"""A real devicemq process for the load tool's smoke runs.

``clean_broker``: persistence disabled (sessions in memory), for the
clean-subscriber scenarios. ``persistent_broker``: the default, persistent
sessions through the embedded Redis and Kafka-protocol broker that
``devicemq run`` starts in its data dir; they are stopped afterwards with
``devicemq services stop``. ``paced_broker``: in memory, 5 CONNECTs a second
from one address (``mqtt.max_connection_rate_per_source``), so that the load
tool's clients, all from 127.0.0.1, are refused as busy and must retry.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import admin_env, free_port

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"


@dataclass
class Broker:
    port: int
    proc: subprocess.Popen[bytes]
    data_dir: Path

    def log(self) -> str:
        try:
            return (self.data_dir / "broker.log").read_text(errors="replace")[-4000:]
        except OSError:
            return ""


def _env(persistence: bool, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVICEMQ_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["DEVICEMQ_PERSISTENCE_ENABLED"] = "true" if persistence else "false"
    env.update(admin_env())
    env.update(extra or {})
    return env


def _start(
    data_dir: Path, persistence: bool, timeout: float = 30.0, extra: dict[str, str] | None = None
) -> Broker:
    data_dir.mkdir(parents=True, exist_ok=True)
    port = free_port(HOST)
    argv = [sys.executable, "-m", "app.cli", "run", "--host", HOST, "--port", str(port)]
    argv += ["--data-dir", str(data_dir)]
    with open(data_dir / "broker.log", "wb") as log:
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env=_env(persistence, extra),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
    broker = Broker(port, proc, data_dir)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"devicemq exited with {proc.returncode}:\n{broker.log()}")
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex((HOST, port)) == 0:
                return broker
        if time.monotonic() > deadline:
            _stop(broker, persistence)
            raise RuntimeError(f"devicemq not listening after {timeout} s:\n{broker.log()}")
        time.sleep(0.05)


def _stop(broker: Broker, persistence: bool) -> None:
    proc = broker.proc
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    if persistence:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "app.cli",
                "services",
                "stop",
                "--data-dir",
                str(broker.data_dir),
            ],
            cwd=REPO,
            env=_env(persistence),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=30,
            check=False,
        )


@pytest.fixture(scope="session")
def clean_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    broker = _start(tmp_path_factory.mktemp("loadtest-clean"), persistence=False)
    try:
        yield broker
    finally:
        _stop(broker, persistence=False)


@pytest.fixture(scope="session")
def persistent_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    broker = _start(tmp_path_factory.mktemp("loadtest-persistent"), persistence=True)
    try:
        yield broker
    finally:
        _stop(broker, persistence=True)


@pytest.fixture(scope="session")
def paced_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    broker = _start(
        tmp_path_factory.mktemp("loadtest-paced"),
        persistence=False,
        extra={"DEVICEMQ_MQTT_MAX_CONNECTION_RATE_PER_SOURCE": "5"},
    )
    try:
        yield broker
    finally:
        _stop(broker, persistence=False)


@pytest.fixture(scope="session")
def narrow_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """Persistent (a PUBLISH stays in flight until Kafka has it), a Receive Maximum
    of 4: MQTT 5 publishers may have 4 QoS 1/2 PUBLISHes unacknowledged, whatever
    window they would like (over it: DISCONNECT 0x93)."""
    broker = _start(
        tmp_path_factory.mktemp("loadtest-narrow"),
        persistence=True,
        extra={"DEVICEMQ_MQTT_RECEIVE_MAXIMUM": "4"},
    )
    try:
        yield broker
    finally:
        _stop(broker, persistence=True)
