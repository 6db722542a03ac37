"""The test Kafka's own fixtures (tests/kafka_fixtures.py): a test that freezes or
kills "its" Tansu by PID must hold the one its clients reach."""

from __future__ import annotations

import signal

import pytest

from tests.kafka_fixtures import bootstrap_of, freeze, listens, start_tansu, stop_tansu


def test_a_port_another_kafka_holds_is_not_taken_for_ours() -> None:
    first = start_tansu()
    try:
        port = int(bootstrap_of(first).rsplit(":", 1)[1])
        assert listens(first.pid, port)
        # The second cannot bind; a Kafka answers on the port all the same.
        with pytest.raises(RuntimeError, match="did not become ready"):
            start_tansu(port, timeout=3.0)
    finally:
        stop_tansu(first)


def test_freeze_returns_once_the_process_is_stopped() -> None:
    server = start_tansu()
    try:
        freeze(server)
        with open(f"/proc/{server.pid}/stat") as stat:
            assert stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    finally:
        server.send_signal(signal.SIGCONT)  # so that SIGTERM ends it
        stop_tansu(server)
