"""``/ready`` and ``/health`` while Redis is down and while Kafka is stalled.

A real devicemq with metrics enabled, a real redis-server (stopped, then
started again on the same port and dir) and the shared Tansu (SIGSTOP, then
SIGCONT), with paho publishers and a persistent paho subscriber running the
whole time:

- ``/ready`` is 200 when healthy, 503 with a JSON reason naming the backend
  while it is away, and 200 again by itself once it is back;
- ``/ready`` answers within its probe timeout even while Kafka is frozen (an
  orchestrator's HTTP client must not time out instead of getting a 503);
- ``/health`` is 200 throughout and the broker process never exits;
- nothing acknowledged is lost, order and DUP hold (the checker).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time

from app.embedded_services import free_port
from tests.faults.checker import (
    V5,
    PahoSubscriber,
    Publisher,
    assert_ok,
    check,
    start_publishers,
    wait_until,
)
from tests.faults.conftest import HOST, Stack
from tests.kafka_fixtures import freeze

HTTP_TIMEOUT = 5.0  # longer than the broker's readiness probe timeout (2 s)


def http_get(port: int, path: str, timeout: float = HTTP_TIMEOUT) -> tuple[int, dict[str, object]]:
    """(status, JSON body); status 0 if there was no answer in time."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read()
        try:
            data = json.loads(body)
        except ValueError:
            data = {}
        return response.status, data
    except OSError as e:
        return 0, {"error": repr(e)}
    finally:
        conn.close()


def metrics_text(port: int) -> str:
    """One /metrics scrape."""
    conn = http.client.HTTPConnection(HOST, port, timeout=HTTP_TIMEOUT * 2)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        assert response.status == 200
        return response.read().decode()
    finally:
        conn.close()


def metrics_settings(**extra: object) -> dict[str, object]:
    return {"metrics.enabled": True, "metrics.host": HOST, "metrics.port": free_port(HOST), **extra}


def wait_ready(port: int, status: int, timeout: float, naming: str = "") -> dict[str, object]:
    """Poll /ready until it answers ``status`` (and its reason names ``naming``)."""
    seen: list[tuple[int, dict[str, object]]] = []

    def ok() -> bool:
        got = http_get(port, "/ready")
        seen.append(got)
        code, body = got
        return code == status and naming.lower() in str(body.get("reason", "")).lower()

    try:
        wait_until(ok, timeout, f"/ready {status} {naming}")
    except AssertionError as e:
        raise AssertionError(f"{e}; last answers: {seen[-3:]}") from None
    return seen[-1][1]


class HealthWatch:
    """Polls ``/health`` from a thread every 0.2 s and records every status."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.statuses.append(http_get(self.port, "/health")[0])

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join(10)
        return self.statuses


def _grows(pubs: list[Publisher], by: int, timeout: float, what: str) -> None:
    before = [len(p.acked) for p in pubs]
    wait_until(
        lambda: all(len(p.acked) >= b + by for p, b in zip(pubs, before, strict=True)),
        timeout,
        what,
    )


def _traffic(stack: Stack) -> tuple[PahoSubscriber, list[Publisher]]:
    topic = stack.topic("t")
    sub = PahoSubscriber(stack.broker.address, stack.client("sub"), version=V5)
    sub.connect()
    sub.subscribe(topic + "/#", qos=1)
    pubs: list[Publisher] = []
    start_publishers(pubs, stack, topic)
    return sub, pubs


def _finish(stack: Stack, sub: PahoSubscriber, pubs: list[Publisher]) -> None:
    for pub in pubs:
        pub.stop()
    sub.wait_all(pubs, timeout=30)
    assert_ok(check(pubs, sub))
    v5 = pubs[0]
    assert all(rc is None or rc < 0x80 or rc == 0x80 for rc in v5.outcomes.values())


def test_ready_while_redis_is_down(stack_factory) -> None:  # type: ignore[no-untyped-def]
    settings = metrics_settings()
    stack: Stack = stack_factory(settings)
    port = int(settings["metrics.port"])  # type: ignore[call-overload]
    wait_ready(port, 200, 15)
    health = HealthWatch(port)
    sub, pubs = _traffic(stack)
    try:
        _grows(pubs, 200, 15, "traffic before the Redis outage")
        stack.redis.stop()
        body = wait_ready(port, 503, 5, naming="redis")
        assert body["ready"] is False
        time.sleep(1.5)
        code, body = http_get(port, "/ready")
        assert code == 503 and "redis" in str(body.get("reason")).lower(), (code, body)
        # The same as series (issue 40): what Prometheus and the dashboard see.
        text = metrics_text(port)
        assert "\ndevicemq_ready 0.0\n" in text
        assert 'devicemq_unready_reason{reason="redis"} 1.0' in text
        stack.redis.start()
        wait_ready(port, 200, 15)  # by itself: nobody touches the broker
        assert "\ndevicemq_ready 1.0\n" in metrics_text(port)
        _grows(pubs, 200, 20, "traffic after Redis came back")
        _finish(stack, sub, pubs)
        statuses = health.stop()
        assert statuses and set(statuses) == {200}, statuses
        assert stack.broker.alive(), stack.broker.log()[-3000:]
        assert stack.broker.exit_codes == []
    finally:
        health.stop()
        sub.close()
        for pub in pubs:
            pub.close()


def test_ready_while_kafka_is_stalled(stack_factory) -> None:  # type: ignore[no-untyped-def]
    settings = metrics_settings(**{"persistence.kafka_request_timeout_ms": 2000})
    stack: Stack = stack_factory(settings)
    assert stack.tansu_pid is not None
    port = int(settings["metrics.port"])  # type: ignore[call-overload]
    wait_ready(port, 200, 15)
    health = HealthWatch(port)
    sub, pubs = _traffic(stack)
    paused = False
    try:
        _grows(pubs, 200, 15, "traffic before the Kafka stall")
        freeze(stack.tansu_pid)
        paused = True
        started = time.monotonic()
        body = wait_ready(port, 503, 6, naming="kafka")
        assert body["ready"] is False
        # Still frozen: each /ready answers (503) well within the HTTP client's timeout.
        t0 = time.monotonic()
        code, body = http_get(port, "/ready")
        took = time.monotonic() - t0
        assert code == 503 and "kafka" in str(body.get("reason")).lower(), (code, body)
        assert took < HTTP_TIMEOUT - 1, f"/ready took {took:.1f} s while Kafka was frozen"
        time.sleep(max(0.0, 4.0 - (time.monotonic() - started)))
        os.kill(stack.tansu_pid, signal.SIGCONT)
        paused = False
        wait_ready(port, 200, 20)  # by itself, after the consumer group settles again
        _grows(pubs, 200, 25, "traffic after Kafka came back")
        _finish(stack, sub, pubs)
        statuses = health.stop()
        assert statuses and set(statuses) == {200}, statuses
        assert stack.broker.alive(), stack.broker.log()[-3000:]
        assert stack.broker.exit_codes == []
    finally:
        if paused:
            os.kill(stack.tansu_pid, signal.SIGCONT)
        health.stop()
        sub.close()
        for pub in pubs:
            pub.close()
