"""The deployment as docker-compose.yml describes it, without a Docker engine.

``compose_broker`` starts devicemq the way the compose file does: the
``environment`` of its ``devicemq`` service, unchanged except for what only
makes sense inside the compose network (``redis:6379`` and ``kafka:9092``
become a real ``redis-server`` and a real Tansu started here; the MQTT and
metrics ports become free ones; the data dir a temporary one). It runs
``python -m app.cli run`` with no other ``DEVICEMQ_*`` variable and no
config file, and is stopped by its PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import admin_env, free_port
from tests.integration.redis_servers import RedisServer, find_redis_server
from tests.kafka_fixtures import bootstrap_of, start_tansu, stop_tansu

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
START_TIMEOUT = 30.0


def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def service_environment(service: str) -> dict[str, str]:
    """A service's ``environment`` as a mapping (compose allows a list of KEY=VALUE too)."""
    env = compose()["services"][service].get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """(status, body) of a GET; error statuses are returned, not raised."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@dataclass
class ComposeBroker:
    proc: subprocess.Popen[bytes]
    env: dict[str, str]
    port: int
    metrics_port: int
    log_path: Path
    admin_port: int = 0

    @property
    def address(self) -> tuple[str, int]:
        return "127.0.0.1", self.port

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.metrics_port}{path}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def credentials(self) -> dict[str, str]:
        """The compose deployment's first user, as Paho keyword arguments."""
        return {
            "username": self.env["DEVICEMQ_AUTH_INITIAL_USER"],
            "password": self.env["DEVICEMQ_AUTH_INITIAL_PASSWORD"],
        }

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` (with those labels) in a /metrics scrape."""
        status, text = http_get(self.url("/metrics"))
        assert status == 200
        total, found = 0.0, False
        for line in text.splitlines():
            if line.startswith("#") or not line.startswith(name):
                continue
            series, _, value = line.rpartition(" ")
            metric, _, label_text = series.partition("{")
            if metric != name or any(f'{k}="{v}"' not in label_text for k, v in labels.items()):
                continue
            total += float(value)
            found = True
        assert found, f"{name} {labels} not in /metrics"
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


# What an operator exports before `docker compose up` (README, docker-compose.yml).
COMPOSE_VARIABLES = {"DEVICEMQ_PASSWORD": "deploy-test-password"}

_COMPOSE_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def interpolate(value: str, variables: dict[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?error}`` (the subset
    the compose file uses), as ``docker compose`` would expand them."""

    def sub(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        value = variables.get(name)
        if value is not None and (value or not (op or "").startswith(":")):
            return value
        if op is not None and op.endswith("?"):
            raise AssertionError(f"compose would refuse to start: {name}: {arg}")
        return arg or ""

    return _COMPOSE_VAR.sub(sub, value)


def compose_env_for_test(redis_port: int, bootstrap: str, data_dir: Path) -> dict[str, str]:
    """The devicemq service's environment with in-network names swapped for local ones,
    compose variables expanded as with :data:`COMPOSE_VARIABLES` exported."""
    env = service_environment("devicemq")
    swapped = {}
    for key, value in env.items():
        value = interpolate(value, COMPOSE_VARIABLES)
        value = value.replace("redis:6379", f"127.0.0.1:{redis_port}")
        value = value.replace("kafka:9092", bootstrap)
        value = value.replace("/var/lib/devicemq", str(data_dir))
        swapped[key] = value
    swapped["DEVICEMQ_LISTENER_PORT"] = str(free_port())
    swapped["DEVICEMQ_METRICS_PORT"] = str(free_port())
    swapped["DEVICEMQ_DATA_DIR"] = str(data_dir)
    return swapped


@pytest.fixture(scope="session")
def compose_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeBroker]:
    if find_redis_server() is None:
        pytest.fail("redis-server not installed (bash .ci/run installs it)")
    tmp = tmp_path_factory.mktemp("compose-broker")
    redis = RedisServer()
    tansu = start_tansu(log=tmp / "tansu.log")
    broker: ComposeBroker | None = None
    try:
        env = compose_env_for_test(redis.port, bootstrap_of(tansu), tmp / "data")
        process_env = {k: v for k, v in os.environ.items() if not k.startswith("DEVICEMQ_")}
        process_env.update(env)
        admin = admin_env()
        process_env.update(admin)
        process_env["PYTHONPATH"] = str(REPO)
        log_path = tmp / "devicemq.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "app.cli", "run"],
                cwd=tmp,
                env=process_env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        broker = ComposeBroker(
            proc,
            env,
            int(env["DEVICEMQ_LISTENER_PORT"]),
            int(env["DEVICEMQ_METRICS_PORT"]),
            log_path,
            int(admin["DEVICEMQ_ADMIN_PORT"]),
        )
        _wait_ready(broker)
        yield broker
    finally:
        if broker is not None:
            broker.stop()
        stop_tansu(tansu)
        redis.stop()


def _wait_ready(broker: ComposeBroker) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    last = ""
    while time.monotonic() < deadline:
        if broker.proc.poll() is not None:
            raise AssertionError(f"devicemq exited with {broker.proc.returncode}:\n{broker.log()}")
        with contextlib.suppress(OSError):
            status, body = http_get(broker.url("/ready"), timeout=3)
            if status == 200:
                return
            last = body
        time.sleep(0.1)
    broker.stop()
    raise AssertionError(f"devicemq not ready in {START_TIMEOUT} s ({last}):\n{broker.log()}")


def json_of(body: str) -> dict[str, Any]:
    data = json.loads(body)
    assert isinstance(data, dict)
    return data
