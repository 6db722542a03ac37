"""What the admin API's tests share (tests/e2e/test_admin_api.py, test_admin_console.py,
tests/cluster/test_admin_replicas.py): waiting, a broker with the API, MQTT set-ups."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from app.admin_cli import AdminClient, ApiError
from tests.conftest import free_port
from tests.e2e.clients import V5, V311, Paho
from tests.e2e.conftest import BrokerProcess, start_broker

TOKEN = "t0ken-for-tests-of-the-admin-api"
BANNED = 0x8A
ADMINISTRATIVE_ACTION = 0x98


def wait_for(condition: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
    """``condition()``'s first true value, asked until ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def answering(api: AdminClient) -> AdminClient:
    """``api`` once its listener answers (any HTTP answer: the token may be wrong)."""

    def up() -> bool:
        try:
            api.call("GET", "stats")
        except ApiError as e:
            return e.status != 0
        return True

    wait_for(up, f"the admin API at {api.url} answers")
    return api


@contextmanager
def admin_broker(
    data_dir: Path, token: str | None = TOKEN, **settings: object
) -> Iterator[tuple[BrokerProcess, AdminClient]]:
    """A broker (persistent unless said) with the admin API on a free port."""
    port = free_port("127.0.0.1")
    config: dict[str, object] = {"persistence.enabled": True, "admin.port": port, **settings}
    if token is not None:
        config["admin.token"] = token
    broker = start_broker(data_dir, config)
    try:
        yield broker, answering(AdminClient(f"http://127.0.0.1:{port}", token))
    finally:
        broker.stop()


def status(api: AdminClient, method: str, path: str, **kw: Any) -> tuple[int, Any]:
    """(HTTP status, answer or error line) of a call."""
    try:
        return 200, api.call(method, path, **kw)
    except ApiError as e:
        return e.status, str(e)


def persistent_subscriber(broker: Any, cid: str, topic: str) -> Paho:
    """A 3.1.1 persistent session subscribed to ``topic`` at QoS 1, disconnected."""
    sub = Paho(broker, cid, V311)
    assert sub.connect(clean_start=False).reason_code == 0
    assert sub.subscribe(topic, 1) == [1]
    sub.disconnect()
    return sub


def publish(broker: Any, topic: str, n: int, cid: str) -> None:
    """``n`` QoS 1 messages m0, m1, ... on ``topic``, each acknowledged."""
    pub = Paho(broker, cid, V5)
    pub.connect()
    for i in range(n):
        pub.publish(topic, f"m{i}".encode(), qos=1)
    pub.disconnect()
