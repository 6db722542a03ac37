"""``loadtest fleet``: the TBMQ shape as a preset, connecting through rate limits,
and the reconnect storm; tiny runs against a real devicemq, correctness not speed."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from loadtest.cli import fleet_processes, main
from loadtest.client import Stats, _Client
from tests.conftest import free_port
from tests.loadtest.conftest import HOST, Broker

pytestmark = pytest.mark.timeout(120)

SETTING = "mqtt.max_connection_rate_per_source"


class _Observer:
    """A paho client subscribed to every load-test topic: what went over the wire."""

    def __init__(self, port: int) -> None:
        self.messages: list[tuple[str, int, int, bool]] = []  # topic, QoS, size, retain
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="fleet-observer")
        subscribed = threading.Event()
        self.client.on_message = lambda c, u, m: self.messages.append(
            (m.topic, m.qos, len(m.payload), m.retain)
        )
        self.client.on_subscribe = lambda *a: subscribed.set()
        self.client.connect(HOST, port)
        self.client.loop_start()
        self.client.subscribe("loadtest/+/p2p/+", qos=1)
        assert subscribed.wait(10)

    def of_run(self, run_id: str, count: int, timeout: float = 15.0) -> list[tuple[str, int, int]]:
        """The run's messages, once ``count`` came (the observer may trail the run's
        own subscribers) or ``timeout`` passed: (topic, QoS, payload size)."""
        base = f"loadtest/{run_id}/p2p/"
        deadline = time.monotonic() + timeout
        while True:
            seen = [(t, q, n) for t, q, n, _ in list(self.messages) if t.startswith(base)]
            if len(seen) >= count or time.monotonic() > deadline:
                return seen
            time.sleep(0.05)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture
def observer(persistent_broker: Broker) -> Iterator[_Observer]:
    o = _Observer(persistent_broker.port)
    try:
        yield o
    finally:
        o.close()


def _session_present(port: int, client_id: str) -> bool:
    async def run() -> bool:
        c = _Client(client_id, 4, False, 0, Stats())
        await c.connect(HOST, port, timeout=10)
        present = c.session_present
        await c.disconnect()
        c = _Client(client_id, 4, True, 0, Stats())  # and remove it
        await c.connect(HOST, port, timeout=10)
        await c.disconnect()
        return present

    return asyncio.run(run())


def test_fleet_preset_sends_the_tbmq_shape_and_reports_it(
    persistent_broker: Broker,
    observer: _Observer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out_json = tmp_path / "fleet.json"
    code = main(
        [
            "fleet",
            "--devices=4",
            "--duration=2",
            "--warmup=1",
            "--seed=11",
            "--keep-sessions",
            f"--port={persistent_broker.port}",
            f"--json={out_json}",
            "--quiet",
        ]
    )
    report = capsys.readouterr().out
    (result,) = json.loads(out_json.read_text())["runs"]
    assert code == 0, report
    config = result["config"]
    assert (config["preset"], config["scenario"], config["pairs"]) == ("fleet", "p2p", 4)
    assert (config["qos"], config["payload_size"], config["rate"]) == (1, 62, 1.0)
    assert (config["mqtt"], config["persistent"], config["processes"]) == ("3.1.1", True, 1)
    check = result["check"]
    assert check["ok"] and check["lost"] == 0 and check["duplicates"] == 0
    assert check["out_of_order"] == 0
    # 1 msg/s each over 3 s (warm-up + window), from a random phase in the first second:
    # 3 each (the last may miss the end if the tool's loop is late)
    assert 4 * 2 <= check["acked"] <= 4 * 3
    assert check["delivered"] == check["expected"] == check["acked"]
    # on the wire: every message of the run 62 bytes at QoS 1, on its device's own topic
    base = f"loadtest/{result['run_id']}/p2p/"
    seen = observer.of_run(result["run_id"], check["acked"])
    assert len(seen) == check["acked"]
    assert {(qos, size) for _, qos, size in seen} == {(1, 62)}
    assert {topic for topic, *_ in seen} == {base + str(i) for i in range(4)}
    # the subscribers' sessions are persistent (clean session 0): still there after
    assert _session_present(persistent_broker.port, f"lt-{result['run_id']}-s0")
    # the report: the headline, delivered/offered, latency, the check, the broker's CPU
    assert "fleet: fleet of 4 devices" in report
    assert "62 B payload, 1 msg/s per publisher" in report
    for row in ("delivered msg/s", "acked (published) msg/s", "e2e latency p99 ms"):
        assert row in report
    assert "check 127.0.0.1" in report and ": OK:" in report
    assert result["cpu"]["broker_pid"] == persistent_broker.proc.pid
    # the broker's CPU by process: itself, its embedded Redis and Kafka (Tansu)
    by_process = result["cpu"]["broker_cores_by_process"]
    assert {"broker", "redis-server"} <= set(by_process) and len(by_process) >= 3
    assert "server CPU 127.0.0.1" in report and "redis-server" in report
    assert "8 clients connected in" in report


def test_fleet_processes_rule() -> None:
    """One process per 5,000 devices; more when the open-files limit needs them
    (two sockets a device, 256 kept for the rest)."""
    assert fleet_processes(1, open_files=20_000) == 1
    assert fleet_processes(5_000, open_files=1_048_576) == 1
    assert fleet_processes(5_001, open_files=1_048_576) == 2
    assert fleet_processes(9_000, open_files=20_000) == 2  # by CPU; the files would do with 1
    assert fleet_processes(10_000, open_files=20_000) == 2
    assert fleet_processes(3_000, open_files=4_096) == 2  # by files: 6,000 sockets
    assert fleet_processes(1_000, open_files=1_024) == 3  # 2,000 sockets over 768


def test_fleet_connects_through_the_per_address_rate_limit(
    paced_broker: Broker, capsys: pytest.CaptureFixture[str]
) -> None:
    """5 CONNECTs a second from one address, 20 clients: refused as busy, they back off
    and retry until all are in; the report says how long it took and names the setting."""
    code = main(
        [
            "fleet",
            "--devices=10",
            "--clean",  # the paced broker keeps sessions in memory only
            "--duration=1",
            "--warmup=0",
            f"--port={paced_broker.port}",
            "--quiet",
        ]
    )
    report = capsys.readouterr().out
    assert code == 0, report
    connect = next(line for line in report.splitlines() if line.startswith("connect "))
    assert "20 clients connected in" in connect
    assert "CONNECTs refused as busy (rate limit)" in connect
    throttled = next(line for line in report.splitlines() if line.startswith("throttled "))
    assert SETTING in throttled and "DEVICEMQ_MQTT_MAX_CONNECTION_RATE_PER_SOURCE" in throttled


def test_fleet_gives_up_connecting_after_the_connect_timeout_naming_the_setting(
    paced_broker: Broker, capsys: pytest.CaptureFixture[str]
) -> None:
    """40 clients cannot all connect within 2 s at 5 a second (with a burst of 5): the
    run stops at the bound and the one-line error names the setting to raise."""
    code = main(
        [
            "fleet",
            "--devices=20",
            "--clean",
            "--duration=1",
            "--warmup=0",
            "--connect-timeout=2",
            f"--port={paced_broker.port}",
            "--quiet",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "CONNECT refused as busy" in err and SETTING in err


def test_storm_delivers_every_backlog_whole_and_samples_the_brokers_memory(
    persistent_broker: Broker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json, out_png = tmp_path / "storm.json", tmp_path / "storm.png"
    code = main(
        [
            "fleet",
            "--storm",
            "--devices=6",
            "--backlog=15",
            "--storm-window=1",
            "--seed=5",
            f"--port={persistent_broker.port}",
            f"--json={out_json}",
            f"--plot={out_png}",
            "--quiet",
        ]
    )
    report = capsys.readouterr().out
    (result,) = json.loads(out_json.read_text())["runs"]
    assert code == 0, report
    check, storm, rss = result["check"], result["storm"], result["rss"]
    assert check == {
        "expected": 90,
        "delivered": 90,
        "lost": 0,
        "duplicates": 0,
        "out_of_order": 0,
        "unexpected": 0,
        "sessions_lost": 0,
        "ok": True,
    }
    assert storm["devices_whole"] == 6 and storm["within_goal"]
    assert storm["all_whole_seconds"] > 0 and storm["last_reconnect_seconds"] >= 0
    assert sum(storm["delivered_per_second"]) == 90
    assert result["store"]["messages"] == 90
    assert result["errors"] == []
    # the broker's RSS, and its tree's (Redis, Kafka), sampled over the storm
    assert rss["broker_pid"] == persistent_broker.proc.pid
    assert len(rss["pids"]) >= 2 and len(rss["samples"]) >= 2
    assert all(b and t and t > b for _, b, t in rss["samples"])
    assert "every backlog whole and in order" in report and "check: OK" in report
    assert "broker RSS MiB" in report
    assert {"broker", "redis-server"} <= set(storm["broker_cores_by_process"])
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the storm removed its sessions afterwards
    assert not _session_present(persistent_broker.port, f"lt-{result['run_id']}-s0")


class _ResettingProxy:
    """A TCP proxy to the broker that resets its first ``resets`` connections, as a
    full listen backlog or a restarting broker would."""

    def __init__(self, target: int, resets: int) -> None:
        self.target = target
        self.resets = resets
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.port = 0

        async def serve() -> None:
            server = await asyncio.start_server(self._handle, HOST, 0)
            self.port = server.sockets[0].getsockname()[1]
            self._server = server
            started.set()

        self.thread = threading.Thread(
            target=lambda: (self.loop.run_until_complete(serve()), self.loop.run_forever()),
            daemon=True,
        )
        self.thread.start()
        assert started.wait(10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.resets > 0:
            self.resets -= 1
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection(HOST, self.target)

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            finally:
                w.close()

        await asyncio.gather(
            pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True
        )

    def close(self) -> None:
        async def shutdown() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def test_fleet_retries_connections_that_fail_before_their_connack(
    clean_broker: Broker, capsys: pytest.CaptureFixture[str]
) -> None:
    proxy = _ResettingProxy(clean_broker.port, resets=3)
    try:
        code = main(
            [
                "fleet",
                "--devices=2",
                "--clean",
                "--duration=1",
                "--warmup=0",
                f"--port={proxy.port}",
                "--quiet",
            ]
        )
    finally:
        proxy.close()
    report = capsys.readouterr().out
    assert code == 0, report
    connect = next(line for line in report.splitlines() if line.startswith("connect "))
    assert "4 clients connected in" in connect and "retried 3 failed connections" in connect
    assert "throttled" not in report


def test_a_port_nobody_listens_on_is_said_at_once_not_retried(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Failed connections are retried once the broker was reached; a refused one
    before that is a wrong port or a broker not started, and the run says so at
    once (the bound is 300 s; the test's timeout would end it first)."""
    code = main(["fleet", "--devices=2", f"--port={free_port(HOST)}", "--quiet"])
    err = capsys.readouterr().err
    assert code == 1
    assert "cannot connect to 127.0.0.1:" in err and "Connection refused" in err
