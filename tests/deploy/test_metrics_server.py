"""app/metrics.py in-process: the HTTP endpoints, readiness states and histogram export."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from app.metrics import (
    KNOWN_DROPS,
    KNOWN_REJECTIONS,
    READINESS_CAUSES,
    MetricsServer,
    MetricsUnavailable,
    readiness_cause,
)
from broker.config import MetricsSettings, Settings
from broker.core import Broker
from broker.stats import Histogram
from tests.conftest import free_port


async def request(port: int, raw: bytes) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


async def get(port: int, path: str, method: str = "GET") -> tuple[int, str]:
    return await request(port, f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())


async def test_endpoints_before_and_after_the_broker_serves() -> None:
    server = MetricsServer(MetricsSettings(enabled=True, host="127.0.0.1", port=free_port()))
    await server.start()
    try:
        port = server.port
        assert await get(port, "/health") == (200, '{"status":"up"}\n')
        assert await get(port, "/ready") == (503, '{"ready":false,"reason":"starting"}\n')
        status, text = await get(port, "/metrics")
        assert status == 200 and "devicemq_serving 0.0" in text
        assert "devicemq_ready 0.0" in text  # issue 40: /ready's answer as a series
        assert 'devicemq_unready_reason{reason="starting"} 1.0' in text
        assert 'devicemq_unready_reason{reason="redis"} 0.0' in text
        assert "devicemq_process_resident_memory_bytes" in text

        broker = Broker(Settings())
        server.attach(broker, None)
        # Issue 40: the failure counters have their series before their first event.
        status, text = await get(port, "/metrics")
        assert 'devicemq_connections_rejected_total{reason="bad_user_name_or_password"} 0.0' in text
        assert 'devicemq_connections_rejected_total{reason="banned"} 0.0' in text
        assert 'devicemq_publish_dropped_total{reason="queue_full"} 0.0' in text
        assert await get(port, "/ready") == (200, '{"ready":true,"persistence":"disabled"}\n')
        broker.stats.messages_received[1] += 3
        broker.stats.drop("queue_full")
        broker.stats.reject("bad_user_name_or_password")
        broker.stats.delivery_latency.observe(0.003)
        status, text = await get(port, "/metrics?x=1")
        assert status == 200
        assert 'devicemq_messages_received_total{qos="1"} 3.0' in text
        assert 'devicemq_publish_dropped_total{reason="queue_full"} 1.0' in text
        assert 'devicemq_connections_rejected_total{reason="bad_user_name_or_password"} 1.0' in text
        assert 'devicemq_delivery_latency_seconds_bucket{le="0.0025"} 0.0' in text
        assert 'devicemq_delivery_latency_seconds_bucket{le="0.005"} 1.0' in text
        assert "devicemq_delivery_latency_seconds_count 1.0" in text
        assert "devicemq_kafka" not in text  # persistence disabled: no Kafka series
        assert "devicemq_ready 1.0" in text
        assert 'devicemq_unready_reason{reason="starting"} 0.0' in text

        assert await get(port, "/health", "HEAD") == (200, "")
        assert (await get(port, "/nope"))[0] == 404
        assert (await get(port, "/metrics", "POST"))[0] == 405
        assert (await request(port, b"nonsense\r\n\r\n"))[0] == 400

        server.stopping = True
        assert await get(port, "/ready") == (503, '{"ready":false,"reason":"shutting down"}\n')
        status, text = await get(port, "/metrics")
        assert "devicemq_ready 0.0" in text
        assert 'devicemq_unready_reason{reason="shutting_down"} 1.0' in text
    finally:
        await server.stop()


async def test_taken_port_is_one_readable_error() -> None:
    first = MetricsServer(MetricsSettings(enabled=True, host="127.0.0.1", port=free_port()))
    await first.start()
    try:
        second = MetricsServer(MetricsSettings(enabled=True, host="127.0.0.1", port=first.port))
        try:
            await second.start()
        except MetricsUnavailable as e:
            assert str(e).startswith(f"cannot serve metrics on 127.0.0.1:{first.port}: ")
        else:
            await second.stop()
            raise AssertionError("a second server bound the same port")
    finally:
        await first.stop()


def test_histogram_buckets_are_upper_bounds() -> None:
    h = Histogram((1.0, 2.0))
    for value in (0.5, 1.0, 1.5, 2.0, 3.0):
        h.observe(value)
    assert h.counts == [2, 2, 1]
    assert h.sum == 8.0


def test_every_unready_reason_has_its_label() -> None:
    """/ready's 503 reasons (app/metrics.py, persistence/consumer.py) and their
    devicemq_unready_reason label."""
    reasons = {
        "starting": "starting",
        "shutting down": "shutting_down",
        "redis refuses commands: MISCONF": "redis",
        "redis unreachable: Connection refused": "redis",
        "kafka unreachable: no broker answered": "kafka",
        "consumer has no partitions assigned": "no_partitions",
        "persistence consumer stopped": "persistence_consumer",
        "consumer group join stuck for 15 s: rejoining": "persistence_consumer",
    }
    for reason, label in reasons.items():
        assert readiness_cause({"ready": False, "reason": reason}) == label, reason
    assert set(reasons.values()) == set(READINESS_CAUSES)


BROKER = Path(__file__).resolve().parents[2] / "broker"


def _names_counted(*patterns: str) -> set[str]:
    found: set[str] = set()
    for source in BROKER.rglob("*.py"):
        text = source.read_text(encoding="utf-8")
        for pattern in patterns:
            found |= {m.lower() for m in re.findall(pattern, text, re.DOTALL)}
    return found


def test_every_rejection_counted_in_broker_starts_at_zero() -> None:
    """The names broker/ counts connections_rejected_total under, each in
    KNOWN_REJECTIONS (so its series exists from the start)."""
    counted = _names_counted(
        r'\.reject\("(\w+)"\)',  # named closes
        r'counter="(\w+)"',  # ConnectRefused / AuthResult counters
        r'failed = "(\w+)"',  # websocket_{failed}
        r"MQTTError\(\s*ReasonCode\.(\w+)",  # protocol errors: their code's name
    )
    counted = {f"websocket_{n}" if n in ("frame_rate", "handshake") else n for n in counted}
    counted.discard("protocol_error")  # websocket_protocol_error's, and a code's: both listed
    assert len(counted) > 15
    missing = sorted(counted - set(KNOWN_REJECTIONS) - {"protocol_error"})
    assert not missing, f"add to app/metrics.py KNOWN_REJECTIONS: {missing}"
    assert len(set(KNOWN_REJECTIONS)) == len(KNOWN_REJECTIONS)


def test_every_drop_counted_in_broker_starts_at_zero() -> None:
    counted = _names_counted(
        r'\.drop\("(\w+)"\)',
        r'_denied\([^()]*?"(\w+)"\)',
        r'counter: str = "(\w+)"',
        r'return "(retained_\w+)"',
        r"_refuse\(conn, packet, ReasonCode\.(\w+)\)",
    )
    assert len(counted) > 15
    missing = sorted(counted - set(KNOWN_DROPS))
    assert not missing, f"add to app/metrics.py KNOWN_DROPS: {missing}"
    assert len(set(KNOWN_DROPS)) == len(KNOWN_DROPS)
