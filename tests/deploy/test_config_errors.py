"""Start-up refuses a bad configuration with one line naming the setting and the file (exit 2)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app import cli


@pytest.fixture(autouse=True)
def no_devicemq_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only what a test sets: no DEVICEMQ_* variable of the calling shell."""
    for var in [v for v in os.environ if v.startswith("DEVICEMQ_")]:
        monkeypatch.delenv(var)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("listener:\n  port: 70000\n", "listener.port: must be between 1 and 65535, got 70000"),
        ("listener:\n  port: 0\n", "listener.port: must be between 1 and 65535, got 0"),
        ("metrics:\n  port: 65536\n", "metrics.port: must be between 1 and 65535, got 65536"),
        (
            "persistence:\n  max_messages_per_client: 65536\n",
            "persistence.max_messages_per_client: must be between 1 and 65535, got 65536",
        ),
        (
            "mqtt:\n  receive_maximum: 100000\n",
            "mqtt.receive_maximum: must be between 1 and 65535, got 100000",
        ),
        (
            "metrics:\n  prot: 9883\n",
            "metrics.prot: unknown setting (did you mean 'metrics.port'?)",
        ),
        ("metrics:\n  enabled: 1\n", "metrics.enabled: expected true or false, got 1"),
        ("metrics:\n  port: '9883'\n", "metrics.port: expected an integer, got '9883'"),
        ("listener:\n  port: abc\n", "listener.port: expected an integer, got 'abc'"),
    ],
)
def test_bad_file_stops_start_up(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    text: str,
    message: str,
) -> None:
    path = tmp_path / "devicemq.yml"
    path.write_text(text, encoding="utf-8")
    assert cli.main(["run", "--config", str(path)]) == 2
    assert capsys.readouterr().err == f"devicemq: error: {path}: {message}\n"


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (
            ["--metrics-port", "99999"],
            {},
            "command line: metrics.port: must be between 1 and 65535, got 99999",
        ),
        (
            [],
            {"DEVICEMQ_METRICS_PORT": "x"},
            "env DEVICEMQ_METRICS_PORT: metrics.port: expected an integer, got 'x'",
        ),
        (
            [],
            {"DEVICEMQ_METRICS_ENABLED": "maybe"},
            "env DEVICEMQ_METRICS_ENABLED: metrics.enabled: expected true/false/1/0/yes/no,"
            " got 'maybe'",
        ),
    ],
)
def test_bad_flag_or_variable_stops_start_up(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    env: dict[str, str],
    message: str,
) -> None:
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert cli.main(["run", *argv]) == 2
    assert capsys.readouterr().err == f"devicemq: error: {message}\n"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"DEVICEMQ_CLUSTER_ENABLED": "true", "DEVICEMQ_PERSISTENCE_ENABLED": "false"},
            "cluster.enabled: the cluster shares Redis: enable persistence",
        ),
        (
            {"DEVICEMQ_CLUSTER_SHARE_PORTS": "true"},
            "cluster.share_ports: brokers sharing a port must form a cluster: enable cluster",
        ),
    ],
)
def test_settings_that_need_each_other_stop_start_up(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    env: dict[str, str],
    message: str,
) -> None:
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert cli.main(["run", "--data-dir", str(tmp_path), "--log-level", "ERROR"]) == 2
    assert capsys.readouterr().err.endswith(f"devicemq: error: {message}\n")
