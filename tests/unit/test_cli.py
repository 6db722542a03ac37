"""app.cli: --version, `run` with its flags, one-line errors, logging setup."""

from __future__ import annotations

import errno
import io
import logging
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from app import cli
from broker import __version__
from broker.compiled import describe
from broker.config import Settings
from edge.logging_setup import setup_logging

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No DEVICEMQ_* from the developer's shell; logging restored afterwards."""
    for name in list(os.environ):
        if name.startswith("DEVICEMQ_"):
            monkeypatch.delenv(name)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def fake_server(monkeypatch: pytest.MonkeyPatch) -> list[Settings]:
    """Replace app.serve with a stub whose run() records its settings."""
    calls: list[Settings] = []
    module = types.ModuleType("app.serve")
    module.run = calls.append  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "app.serve", module)
    return calls


def run_module(*args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=60,
    )


# ------------------------------------------------------------------ version


def test_version_as_module() -> None:
    result = run_module("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"devicemq {__version__} ({describe()})"
    assert result.stderr == ""


def test_version_via_main(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"devicemq {__version__} ({describe()})"


def test_help_lists_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    assert "run" in capsys.readouterr().out
    assert cli.main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--config", "--host", "--port", "--data-dir", "--log-level"):
        assert flag in out


def test_no_command_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "COMMAND" in capsys.readouterr().err


def test_unknown_command_or_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("devicemq: error: argument COMMAND: invalid choice")
    assert cli.main(["run", "--bogus"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "devicemq: error: unrecognized arguments: --bogus"


def test_commands_are_a_table() -> None:
    assert {"run", "services", "loadtest", "passwd"} <= set(cli.COMMANDS)
    assert all(callable(c.handler) for c in cli.COMMANDS.values())


# ------------------------------------------------------------- config errors

BAD_CONFIGS = [
    ("mqtt:\n  receive_maximum: 0\n", "mqtt.receive_maximum: must be between 1 and 65535, got 0"),
    (
        "mqtt:\n  recieve_maximum: 5\n",
        "mqtt.recieve_maximum: unknown setting (did you mean 'mqtt.receive_maximum'?)",
    ),
    ("listener:\n  port: abc\n", "listener.port: expected an integer, got 'abc'"),
    ("listener: [\n", "line 2: invalid YAML: expected the node content, but found '<stream end>'"),
]


@pytest.mark.parametrize(("text", "message"), BAD_CONFIGS)
def test_bad_config_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text(text)
    assert cli.main(["run", "--config", str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"devicemq: error: {bad}: {message}\n"
    assert captured.out == ""


def test_bad_config_as_module_has_no_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text("mqtt:\n  receive_maximum: 0\n")
    result = run_module("run", "--config", str(bad))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        f"devicemq: error: {bad}: mqtt.receive_maximum: must be between 1 and 65535, got 0"
    ]


def test_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.yml"
    assert cli.main(["run", "--config", str(missing)]) == 2
    assert capsys.readouterr().err == f"devicemq: error: {missing}: file not found\n"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "0"], "listener.port: must be between 1 and 65535, got 0"),
        (["--port", "http"], "listener.port: expected an integer, got 'http'"),
        (
            ["--log-level", "loud"],
            "log.level: must be one of DEBUG, INFO, WARNING, ERROR, got 'loud'",
        ),
    ],
)
def test_bad_flag_value(
    capsys: pytest.CaptureFixture[str], fake_server: list[Settings], flags: list[str], message: str
) -> None:
    assert cli.main(["run", *flags]) == 2
    assert capsys.readouterr().err == f"devicemq: error: command line: {message}\n"
    assert fake_server == []


def test_bad_env_value(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fake_server: list[Settings]
) -> None:
    monkeypatch.setenv("DEVICEMQ_LISTENER_PORT", "x")
    assert cli.main(["run"]) == 2
    assert capsys.readouterr().err == (
        "devicemq: error: env DEVICEMQ_LISTENER_PORT: listener.port: expected an integer, got 'x'\n"
    )


# ---------------------------------------------------------------------- run


def test_run_with_defaults(fake_server: list[Settings]) -> None:
    assert cli.main(["run"]) == 0
    assert fake_server == [Settings()]


def test_run_flags_override_file_and_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_server: list[Settings]
) -> None:
    conf = tmp_path / "devicemq.yml"
    conf.write_text("listener:\n  host: 10.1.1.1\n  port: 2000\nmqtt:\n  max_inflight: 3\n")
    monkeypatch.setenv("DEVICEMQ_LISTENER_PORT", "2001")
    monkeypatch.setenv("DEVICEMQ_MQTT_MAX_INFLIGHT", "4")
    argv = ["run", "--config", str(conf), "--port", "2002", "--data-dir", "/tmp/dmq"]
    assert cli.main([*argv, "--log-level", "debug"]) == 0
    (s,) = fake_server
    assert s.listener.host == "10.1.1.1"
    assert s.listener.port == 2002
    assert s.mqtt.max_inflight == 4
    assert s.data_dir == "/tmp/dmq"
    assert s.log.level == "DEBUG"
    assert logging.getLogger().level == logging.DEBUG


def test_run_reads_config_path_from_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_server: list[Settings]
) -> None:
    conf = tmp_path / "devicemq.yml"
    conf.write_text("listener:\n  host: 127.0.0.1\n")
    monkeypatch.setenv("DEVICEMQ_CONFIG", str(conf))
    assert cli.main(["run", "--host", "::1"]) == 0
    assert cli.main(["run"]) == 0
    assert [s.listener.host for s in fake_server] == ["::1", "127.0.0.1"]


def test_run_with_shipped_config(fake_server: list[Settings]) -> None:
    assert cli.main(["run", "--config", str(REPO / "config" / "devicemq.yml")]) == 0
    assert fake_server == [Settings()]


def test_port_in_use_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def run(settings: Settings) -> None:
        raise OSError(errno.EADDRINUSE, "Address already in use")

    module = types.ModuleType("app.serve")
    module.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "app.serve", module)
    assert cli.main(["run", "--port", "1999"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        "devicemq: error: cannot listen on 127.0.0.1:1999: Address already in use"
    )


# ------------------------------------------------------------------ logging


def test_text_log_is_one_line_per_event() -> None:
    stream = io.StringIO()
    setup_logging("INFO", "text", stream)
    log = logging.getLogger("broker.test")
    log.debug("hidden")
    log.info("client %s connected", "c1", extra={"protocol": 5})
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed\nbadly")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].endswith("INFO broker.test: client c1 connected protocol=5")
    assert "ERROR broker.test: failed\\nbadly | Traceback" in lines[1]
    assert "ValueError: boom" in lines[1]


def test_json_log_is_one_object_per_line() -> None:
    stream = io.StringIO()
    setup_logging("DEBUG", "json", stream)
    log = logging.getLogger("broker.test")
    log.debug("hello %d", 1, extra={"client_id": "c1", "obj": object()})
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    first, second = (orjson.loads(line) for line in stream.getvalue().splitlines())
    assert first["level"] == "DEBUG" and first["logger"] == "broker.test"
    assert first["msg"] == "hello 1" and first["client_id"] == "c1"
    assert first["ts"].endswith("Z") and "obj" in first
    assert second["level"] == "ERROR" and "ValueError: boom" in second["exc"]


@pytest.mark.parametrize(
    ("level", "shown"),
    [
        ("INFO", ["WARNING aiokafka.consumer: lost"]),
        ("ERROR", []),
        (
            "DEBUG",
            ["INFO aiokafka.consumer: assigned [0, 1, 2]", "WARNING aiokafka.consumer: lost"],
        ),
    ],
)
def test_aiokafka_says_only_warnings_unless_debug(level: str, shown: list[str]) -> None:
    stream = io.StringIO()
    setup_logging(level, "text", stream)
    try:
        log = logging.getLogger("aiokafka.consumer")
        log.info("assigned %s", [0, 1, 2])
        log.warning("lost")
        got = [line.split(" ", 1)[1] for line in stream.getvalue().splitlines()]
        assert got == shown
    finally:
        logging.getLogger("aiokafka").setLevel(logging.NOTSET)


# A Python without the pipeline extra: the import system's own error for a missing
# module (ModuleNotFoundError "No module named 'pyspark'", .name set), raised for
# the one module named by the test, whatever else is installed.
_WITHOUT = """
import sys

class Absent:
    def find_spec(self, name, path=None, target=None):
        if name == sys.argv[1] or name.startswith(sys.argv[1] + "."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Absent())
from app.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize(
    ("absent", "argv"),
    [
        ("pyspark", ["pipeline", "audit", "--bootstrap", "127.0.0.1:1", "--redis", "redis://x"]),
        ("pyarrow", ["pipeline", "traffic", "--data-dir", "."]),
    ],
)
def test_pipeline_without_its_extra_is_one_line(
    absent: str, argv: list[str], tmp_path: Path
) -> None:
    """Issue 40: a 13-line traceback ending in ModuleNotFoundError, before."""
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT, absent, *argv],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(cli.__file__).resolve().parents[1])},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "pip install 'devicemq[pipeline]'" in lines[0] and absent in lines[0]
    assert "Traceback" not in result.stderr


def test_pipeline_errors_of_other_modules_are_not_hidden(tmp_path: Path) -> None:
    """Only the extra's modules get that line: a missing module of devicemq's own
    is a bug, and shows as one."""
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT, "pipeline.common", "pipeline", "audit", "--data-dir", "."],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(cli.__file__).resolve().parents[1])},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "devicemq[pipeline]" not in result.stderr
    assert "No module named 'pipeline.common'" in result.stderr
