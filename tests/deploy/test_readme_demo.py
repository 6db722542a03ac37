"""README's "A persistent session in a minute", run as written against devicemq.

The shell lines of the README block run in bash with Mosquitto's own clients,
pointed at a broker on a free port (a function adds ``-p PORT``); their output
must be the README's. The variant the README mentions, a broker restarted
while the device is away, runs too.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy.conftest import REPO
from tests.e2e.conftest import start_broker

SECTION = "### A persistent session in a minute\n"


def _blocks() -> tuple[list[str], list[str]]:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split(SECTION, 1)[1].split("\n#", 1)[0]
    script = re.search(r"```sh\n(.*?)```", section, re.DOTALL)
    output = re.search(r"```text\n(.*?)```", section, re.DOTALL)
    assert script and output
    return script.group(1).strip().splitlines(), output.group(1).strip().splitlines()


def _run(lines: list[str], port: int) -> subprocess.CompletedProcess[str]:
    prelude = (
        f'mosquitto_sub() {{ command mosquitto_sub -h 127.0.0.1 -p {port} "$@"; }}\n'
        f'mosquitto_pub() {{ command mosquitto_pub -h 127.0.0.1 -p {port} "$@"; }}\n'
    )
    return subprocess.run(
        ["bash", "-c", prelude + "\n".join(lines)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_readme_demo(tmp_path: Path) -> None:
    if shutil.which("mosquitto_sub") is None:
        pytest.fail("mosquitto-clients not installed (bash .ci/run installs them)")
    lines, expected = _blocks()
    assert len(lines) == 3
    broker = start_broker(tmp_path / "broker")
    try:
        first = _run(lines[:1], broker.port)
        # -W: mosquitto_sub's exit status 27 after "Timed out", as the README says
        assert first.returncode == 27 and "Timed out" in first.stderr, first.stderr
        rest = _run(lines[1:], broker.port)
        assert rest.returncode == 0, rest.stderr
        assert rest.stdout.splitlines() == expected
    finally:
        broker.stop()


def test_the_readme_demo_across_a_restart(tmp_path: Path) -> None:
    """ "stop the broker between the second and third line and start it again"."""
    if shutil.which("mosquitto_sub") is None:
        pytest.fail("mosquitto-clients not installed (bash .ci/run installs them)")
    lines, expected = _blocks()
    data = tmp_path / "broker"
    broker = start_broker(data)
    try:
        assert _run(lines[:1], broker.port).returncode == 27
        assert _run(lines[1:2], broker.port).returncode == 0
    finally:
        broker.stop()  # SIGTERM (drained), and its embedded Redis and Kafka stopped too
    broker = start_broker(data)
    try:
        back = _run(lines[2:], broker.port)
        assert back.returncode == 0, back.stderr
        assert back.stdout.splitlines() == expected
    finally:
        broker.stop()
