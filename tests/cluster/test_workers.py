"""``devicemq run --workers N``: N broker processes on one port, started and stopped as one.

Real processes throughout: the command as a user types it, with its embedded
Redis and Tansu, paho clients, and signals sent by PID. What must hold
whichever worker the kernel hands a connection to: persistent subscribers get
everything in order, a worker killed is started again, one SIGTERM drains them
all, and a supervisor killed outright leaves no worker behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from app.embedded_services import hand_out
from tests.cluster.test_replicas import Client, every_persistent_subscriber_gets_all
from tests.conftest import admin_env, free_port
from tests.faults.checker import Publisher
from tests.faults.test_integrations import read_records

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 60.0


@dataclass
class Workers:
    proc: subprocess.Popen[bytes]
    port: int
    metrics_port: int
    data_dir: Path
    log_path: Path

    @property
    def address(self) -> tuple[str, int]:
        return "127.0.0.1", self.port

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def worker_pids(self) -> list[int]:
        return [p for p in _children(self.proc.pid) if _is_worker(p)]

    def ready(self, index: int) -> bool:
        try:
            url = f"http://127.0.0.1:{self.metrics_port + index}/ready"
            with urllib.request.urlopen(url, timeout=2) as response:
                return bool(json.loads(response.read())["ready"])
        except (OSError, urllib.error.URLError, ValueError, KeyError):
            return False


def _children(pid: int) -> list[int]:
    """PIDs whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces, so split after its ")".
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return sorted(found)


def _free_ports(count: int) -> int:
    """The first of ``count`` consecutive free ports (worker i serves metrics on +i)."""
    for _ in range(100):
        first = free_port()
        with contextlib.ExitStack() as stack:
            try:
                for i in range(count):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", first + i))
            except OSError:
                continue
        hand_out(range(first + 1, first + count))  # no other process's choice meanwhile
        return first
    raise AssertionError("no consecutive free ports")


def _marked_workers(mark: str) -> list[int]:
    """Worker processes started by a supervisor given ``WORKERS_TEST_MARK=mark``,
    wherever they were re-parented."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _is_worker(int(entry.name)):
            try:
                if f"WORKERS_TEST_MARK={mark}".encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _is_worker(pid: int) -> bool:
    """A worker, not the embedded services or multiprocessing's resource tracker."""
    try:
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie still answers kill(0)
        if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
            return False
    return True


def _wait_until(condition, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _start(tmp: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    process_env = {k: v for k, v in os.environ.items() if not k.startswith("DEVICEMQ_")}
    process_env["PYTHONPATH"] = str(REPO)
    process_env.update(admin_env())
    process_env.update(env or {})
    with (tmp / "devicemq.log").open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "app.cli", "run", *args],
            cwd=REPO,
            env=process_env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _stop_services(data_dir: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "app.embedded_services", "stop", "--data-dir", str(data_dir)],
        cwd=REPO,
        capture_output=True,
        timeout=60,
        check=False,
    )


@contextlib.contextmanager
def running_workers(
    tmp: Path, count: int = 2, env: dict[str, str] | None = None
) -> Iterator[Workers]:
    port, metrics_port = free_port(), _free_ports(count)
    data_dir = tmp / "data"
    proc = _start(
        tmp,
        "--workers",
        str(count),
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        "--data-dir",
        str(data_dir),
        env={"DEVICEMQ_MQTT_MAX_CONNECTION_RATE_PER_SOURCE": "0", **(env or {})},
    )
    workers = Workers(proc, port, metrics_port, data_dir, tmp / "devicemq.log")
    started: list[int] = []
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not all(workers.ready(i) for i in range(count)):
            assert proc.poll() is None, f"exited with {proc.returncode}:\n{workers.log()}"
            assert time.monotonic() < deadline, f"workers not ready:\n{workers.log()}"
            time.sleep(0.2)
        started = workers.worker_pids()
        yield workers
    finally:
        # The first ones too: a supervisor killed by a test no longer lists its workers.
        pids = set(started) | set(workers.worker_pids())
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for pid in pids:  # a worker outliving its supervisor would hold the port
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _stop_services(data_dir)


def test_two_workers_share_the_port_and_act_as_one_broker(tmp_path: Path) -> None:
    with running_workers(tmp_path) as workers:
        pids = workers.worker_pids()
        assert len(pids) == 2, pids
        subs = [Client(workers, f"wk-sub-{i}", expiry=600) for i in range(12)]
        pub = Client(workers, "wk-pub")
        every_persistent_subscriber_gets_all(pub, subs, "workers/t", 100)
        # 13 connections, each worker took some (all on one: a chance of 2**-12).
        lines = workers.log().splitlines()
        for worker in ("w0", "w1"):
            assert any(
                "client wk-sub-" in line and f"worker='{worker}'" in line for line in lines
            ), f"worker {worker} got no client"
        # One SIGTERM stops both, cleanly.
        workers.proc.send_signal(signal.SIGTERM)
        assert workers.proc.wait(60) == 0, workers.log()
        _wait_until(lambda: not any(_alive(p) for p in pids), 10, "workers still running")


def test_a_killed_worker_is_started_again_and_nothing_stored_is_lost(tmp_path: Path) -> None:
    with running_workers(tmp_path) as workers:
        first = workers.worker_pids()
        sub = Client(workers, "wk-stored", expiry=600)
        sub.subscribe("workers/stored", 1)
        sub.close()
        pub = Client(workers, "wk-pub-2")
        for i in range(50):
            pub.client.publish("workers/stored", b"s-%d" % i, qos=1).wait_for_publish(10)
        victim = first[0]
        os.kill(victim, signal.SIGKILL)
        _wait_until(
            lambda: len(workers.worker_pids()) == 2 and victim not in workers.worker_pids(),
            30,
            "the killed worker was not started again",
        )
        _wait_until(lambda: workers.ready(0) and workers.ready(1), 60, "a new worker not ready")
        assert f"(pid {victim}) exited with status -9" in workers.log()
        back = Client(workers, "wk-stored", expiry=600)
        try:
            _wait_until(lambda: len(set(back.received(b"s-"))) == 50, 30, "50 stored back")
            assert sorted(set(back.received(b"s-")), key=lambda p: int(p[2:])) == [
                b"s-%d" % i for i in range(50)
            ]
        finally:
            back.close()
            pub.close()


def test_workers_create_the_rules_topics_on_the_embedded_kafka(tmp_path: Path) -> None:
    """Each worker is given the embedded Kafka's address as persistence.kafka_bootstrap:
    it must still know that Kafka is the embedded one and create the rules' topics
    there, as ``devicemq run`` alone does (it took them for the user's, and every
    publish matching a rule failed: issue 18)."""
    topic = f"wk.rule.{uuid.uuid4().hex[:8]}"
    rule = json.dumps([{"name": "wk", "topic_filter": "wk-rule/#", "kafka_topic": topic}])
    with running_workers(tmp_path, env={"DEVICEMQ_INTEGRATIONS": rule}) as workers:
        # Several publishers: the kernel spreads them over the workers.
        pubs = [
            Publisher(workers.address, f"wk-rule-{i}", f"wk-rule/{i}", version=5) for i in range(6)
        ]
        try:
            for pub in pubs:
                pub.publish(1)
            _wait_until(lambda: all(p.outcomes.get(1) is not None for p in pubs), 30, "no PUBACK")
            assert [p.outcomes[1] for p in pubs] == [0] * 6, workers.log()
        finally:
            for pub in pubs:
                pub.close()
        (bootstrap,) = re.findall(r"embedded services: redis \S+, kafka (\S+)", workers.log())
        values = read_records(bootstrap, topic, 6)
        assert sorted(v for _, v in values) == sorted(f"wk-rule-{i}:1".encode() for i in range(6))
        assert "does not exist" not in workers.log()


def test_workers_outlive_no_supervisor(tmp_path: Path) -> None:
    """A supervisor killed by SIGKILL cannot signal: its workers see it gone and stop."""
    with running_workers(tmp_path) as workers:
        pids = workers.worker_pids()
        workers.proc.kill()
        workers.proc.wait(10)
        _wait_until(lambda: not any(_alive(p) for p in pids), 70, "workers left running")
        assert "the supervisor is gone: stopping" in workers.log()


@pytest.mark.parametrize(
    ("args", "env", "status", "line"),
    [
        (["--workers", "0"], {}, 2, "workers: must be 1 to 256 or auto, got 0"),
        (["--workers", "many"], {}, 2, "workers: expected a number of processes or auto"),
        (
            ["--workers", "2"],
            {"DEVICEMQ_PERSISTENCE_ENABLED": "false"},
            2,
            "workers: workers share sessions through Redis and Kafka: enable persistence",
        ),
    ],
)
def test_bad_worker_settings_get_one_line(
    tmp_path: Path, args: list[str], env: dict[str, str], status: int, line: str
) -> None:
    proc = _start(tmp_path, *args, "--data-dir", str(tmp_path / "data"), env=env)
    assert proc.wait(60) == status
    out = (tmp_path / "devicemq.log").read_text()
    assert line in out.splitlines()[-1], out
    assert "Traceback" not in out


def test_a_port_in_use_stops_every_worker_with_one_line(tmp_path: Path) -> None:

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        data_dir = tmp_path / "data"
        mark = uuid.uuid4().hex
        proc = _start(
            tmp_path,
            *("--workers", "2", "--port", str(port), "--data-dir", str(data_dir)),
            env={"WORKERS_TEST_MARK": mark},
        )
        try:
            assert proc.wait(90) == 1
            out = (tmp_path / "devicemq.log").read_text()
            assert out.splitlines()[-1].startswith(
                f"devicemq: error: cannot listen on 127.0.0.1:{port}"
            ), out
            assert not _marked_workers(mark), "workers left running"
        finally:
            if proc.poll() is None:
                proc.kill()
            _stop_services(data_dir)
