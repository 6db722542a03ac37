"""Start a real broker process for end-to-end tests.

The broker is devicemq (``python -m app.cli run``) unless
``DEVICEMQ_TEST_BROKER=mosquitto``, which starts the reference broker
(``/usr/sbin/mosquitto``) on the same terms, to check that a test expects
what a mature broker does. Tests that need a devicemq-only setting are
skipped under mosquitto, with the reason.

Fixtures:

- ``broker``: one broker for the whole session, default settings. Tests keep
  out of each other's way with unique topics and client ids (``names``).
- ``broker_factory``: ``start({"mqtt.connect_timeout": 1})`` starts a broker
  of its own with those settings (as ``DEVICEMQ_<SECTION>_<FIELD>``
  environment variables); stopped when the test ends. These brokers keep
  persistent sessions in memory (``persistence.enabled=false``: no embedded
  Redis and Kafka to start, so they are up in a fraction of a second) unless
  the settings name a ``persistence.*`` value; the shared ``broker`` runs the
  default, durable path.

devicemq's embedded Redis and Tansu outlive the broker process by design
(app/embedded_services.py); every fixture stops them with
``python -m app.embedded_services stop --data-dir DIR`` after the broker.
- ``names``: unique topic prefix and client ids for one test.
- ``clients``: makes paho and raw-socket clients, all closed when the test ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import admin_env, free_port
from tests.e2e.clients import V5, Paho, Raw

REPO = Path(__file__).resolve().parents[2]
BROKER_KIND = os.environ.get("DEVICEMQ_TEST_BROKER", "devicemq").strip().lower() or "devicemq"
MOSQUITTO = "/usr/sbin/mosquitto"
HOST = "127.0.0.1"
START_TIMEOUT = 30.0  # a loaded CI machine started the embedded Redis and Tansu in 14 s
STOP_TIMEOUT = 8.0

# devicemq settings that mean the same thing in mosquitto.conf
_MOSQUITTO_EQUIVALENTS = {
    "mqtt.max_keep_alive": "max_keepalive",
    "mqtt.max_packet_size": "max_packet_size",
    "sys_interval": "sys_interval",
}


def is_mosquitto() -> bool:
    return BROKER_KIND == "mosquitto"


def devicemq_only(reason: str) -> pytest.MarkDecorator:
    """Skip a test that checks devicemq behaviour mosquitto need not share."""
    return pytest.mark.skipif(is_mosquitto(), reason=f"devicemq-specific: {reason}")


def env_var(setting: str) -> str:
    """``mqtt.connect_timeout`` -> ``DEVICEMQ_MQTT_CONNECT_TIMEOUT`` (broker/config.py)."""
    return "DEVICEMQ_" + setting.replace(".", "_").upper()


@dataclass
class BrokerProcess:
    kind: str
    host: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    data_dir: Path
    settings: Mapping[str, object] = field(default_factory=dict)

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM, wait, SIGKILL if it will not go; then its embedded services.
        Safe to call twice."""
        proc = self.proc
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(STOP_TIMEOUT)
        self.stop_services()

    def stop_services(self) -> None:
        """Stop the Redis and Tansu this devicemq started under its data dir, if any."""
        if self.kind != "devicemq" or not (self.data_dir / "services").exists():
            return
        argv = [sys.executable, "-m", "app.embedded_services", "stop", "--data-dir"]
        subprocess.run(
            [*argv, str(self.data_dir)],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=30,
            check=False,
        )


def _wait_ready(broker: BrokerProcess) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        if not broker.alive():
            raise RuntimeError(
                f"{broker.kind} exited with status {broker.proc.returncode} before listening:\n"
                + broker.log()
            )
        with socket.socket() as s:
            s.settimeout(0.5)
            try:
                s.connect(broker.address)
            except OSError:
                pass
            else:
                return
        if time.monotonic() > deadline:
            broker.stop()
            raise RuntimeError(
                f"{broker.kind} not listening on {broker.host}:{broker.port} after "
                f"{START_TIMEOUT} s:\n" + broker.log()
            )
        time.sleep(0.05)


def start_broker(data_dir: Path, settings: Mapping[str, object] | None = None) -> BrokerProcess:
    """Start a broker process on a free port and wait until it accepts TCP."""
    settings = dict(settings or {})
    data_dir.mkdir(parents=True, exist_ok=True)
    port = free_port(HOST)
    log_path = data_dir / "broker.log"
    if is_mosquitto():
        conf = data_dir / "mosquitto.conf"
        lines = [f"listener {port} {HOST}", "allow_anonymous true", "persistence false"]
        lines.append("max_queued_messages 100000")  # default 1000 drops bulk tests
        for name, value in settings.items():
            option = _MOSQUITTO_EQUIVALENTS.get(name)
            if option is None:
                pytest.skip(f"devicemq-specific: setting {name} has no mosquitto equivalent")
            lines.append(f"{option} {value}")
        conf.write_text("\n".join(lines) + "\n")
        argv = [MOSQUITTO, "-c", str(conf)]
        env = dict(os.environ)
    else:
        argv = [
            sys.executable,
            "-m",
            "app.cli",
            "run",
            "--host",
            HOST,
            "--port",
            str(port),
            "--data-dir",
            str(data_dir),
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("DEVICEMQ_")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env.update(admin_env())
        for name, value in settings.items():
            env[env_var(name)] = str(value).lower() if isinstance(value, bool) else str(value)
    with open(log_path, "wb") as log:  # a file, not a pipe: a full pipe would block the broker
        proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log
        )
    broker = BrokerProcess(BROKER_KIND, HOST, port, proc, log_path, data_dir, settings)
    try:
        _wait_ready(broker)
    except BaseException:
        broker.stop()
        raise
    return broker


@pytest.fixture(scope="session")
def _shared_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    broker = start_broker(tmp_path_factory.mktemp("shared-broker"))
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def broker(_shared_broker: BrokerProcess) -> Iterator[BrokerProcess]:
    """The session's broker, default settings; the test fails if it died meanwhile."""
    if not _shared_broker.alive():
        pytest.fail(f"the shared broker is not running:\n{_shared_broker.log()[-4000:]}")
    yield _shared_broker
    if not _shared_broker.alive():
        pytest.fail(f"the broker died during the test:\n{_shared_broker.log()[-4000:]}")


@pytest.fixture
def broker_factory(
    tmp_path: Path,
) -> Iterator[Callable[[Mapping[str, object] | None], BrokerProcess]]:
    """``start(settings)``: a broker of the test's own, stopped when the test ends."""
    started: list[BrokerProcess] = []

    def start(settings: Mapping[str, object] | None = None) -> BrokerProcess:
        settings = dict(settings or {})
        if not is_mosquitto() and not any(k.startswith("persistence.") for k in settings):
            settings["persistence.enabled"] = False
        broker = start_broker(tmp_path / f"broker-{len(started)}", settings)
        started.append(broker)
        return broker

    try:
        yield start
    finally:
        for broker in started:
            broker.stop()
    for broker in started:
        # a broker that crashed (rather than exiting on SIGTERM) is a bug worth seeing
        code = broker.proc.returncode
        if code not in (0, -signal.SIGTERM) and not is_mosquitto():
            pytest.fail(f"broker exited with status {code}:\n{broker.log()[-4000:]}")


@dataclass(frozen=True)
class Names:
    """Unique names for one test, so tests can share a broker."""

    prefix: str

    def topic(self, suffix: str = "") -> str:
        return f"{self.prefix}/{suffix}" if suffix else self.prefix

    def client(self, suffix: str) -> str:
        return f"{self.prefix.replace('/', '-')}-{suffix}"

    @property
    def short(self) -> str:
        """A short unique topic, for tests where every byte of a packet counts."""
        return "s/" + self.prefix[-8:]


@pytest.fixture
def names(request: pytest.FixtureRequest) -> Names:
    test = request.node.name.replace("[", "-").replace("]", "").replace("/", "-")
    return Names(f"e2e/{test[:40]}-{uuid.uuid4().hex[:8]}")


class Clients:
    """Makes test clients and closes every one of them at teardown."""

    def __init__(self) -> None:
        self._made: list[Paho | Raw] = []

    def paho(self, broker: BrokerProcess, client_id: str = "", version: int = V5) -> Paho:
        client = Paho(broker, client_id, version)
        self._made.append(client)
        return client

    def raw(self, broker: BrokerProcess, level: int = 5, source: str | None = None) -> Raw:
        client = Raw(broker, level, source)
        self._made.append(client)
        return client

    def close_all(self) -> None:
        for client in reversed(self._made):
            with contextlib.suppress(Exception):
                client.close()


@pytest.fixture
def clients() -> Iterator[Clients]:
    made = Clients()
    try:
        yield made
    finally:
        made.close_all()
