"""The ports a broker binds after its embedded services start (app/serve.py
own_ports): the services are kept off them."""

from __future__ import annotations

from dataclasses import replace

from app.serve import own_ports
from broker.config import Settings


def test_own_ports_are_the_enabled_listeners_metrics_and_admin() -> None:
    base = Settings()
    assert own_ports(base) == {base.listener.port, base.admin.port}
    every = replace(
        base,
        tls=replace(base.tls, enabled=True, port=8883),
        websocket=replace(base.websocket, enabled=True, port=8083),
        websocket_tls=replace(base.websocket_tls, enabled=True, port=8084),
        metrics=replace(base.metrics, enabled=True, port=9883),
    )
    assert own_ports(every) == {1883, 8883, 8083, 8084, 9883, 18083}
    none_but_tls = replace(
        every,
        listener=replace(base.listener, enabled=False),
        admin=replace(base.admin, enabled=False),
        metrics=replace(base.metrics, enabled=False),
        websocket=replace(base.websocket, enabled=False),
        websocket_tls=replace(base.websocket_tls, enabled=False),
    )
    assert own_ports(none_but_tls) == {8883}


def test_own_ports_hold_every_workers_metrics_port() -> None:
    """``--workers N``: worker i serves metrics on ``metrics.port + i`` (app/workers.py),
    bound after the supervisor started the services."""
    base = Settings()
    workers = replace(base, workers="3", metrics=replace(base.metrics, enabled=True, port=9883))
    assert own_ports(workers) == {1883, 9883, 9884, 9885, 18083}
