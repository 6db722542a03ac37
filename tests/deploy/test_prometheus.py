"""A real Prometheus with config/prometheus.yml scrapes the devicemq of docker-compose.yml."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import free_port
from tests.deploy.conftest import REPO, ComposeBroker, compose, http_get
from tests.e2e.clients import V311, Paho

PROMETHEUS_YML = REPO / "config" / "prometheus.yml"
DASHBOARD = REPO / "config" / "grafana" / "dashboards" / "devicemq.json"
TIMEOUT = 20.0


def find_prometheus() -> str | None:
    return shutil.which("prometheus") or (
        "/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None
    )


def scrape_config_for(metrics_port: int, prometheus_port: int) -> dict[str, Any]:
    """config/prometheus.yml with the devicemq job pointed at one local broker, 1 s scrapes.

    In compose the job finds replicas by DNS (the service name); here the one
    broker is a static target on its free port.
    """
    config: dict[str, Any] = yaml.safe_load(PROMETHEUS_YML.read_text(encoding="utf-8"))
    config["global"]["scrape_interval"] = "1s"
    config["global"]["evaluation_interval"] = "1s"
    # the alert rules, by their path from config/prometheus.yml (the config is written elsewhere)
    config["rule_files"] = [str(PROMETHEUS_YML.parent / p) for p in config["rule_files"]]
    for job in config["scrape_configs"]:
        if job["job_name"] == "devicemq":
            job.pop("dns_sd_configs")
            job["static_configs"] = [{"targets": [f"127.0.0.1:{metrics_port}"]}]
        else:
            job["static_configs"] = [{"targets": [f"127.0.0.1:{prometheus_port}"]}]
        job["scrape_interval"] = "1s"
    return config


def test_prometheus_yml_scrapes_the_compose_metrics_port() -> None:
    config = yaml.safe_load(PROMETHEUS_YML.read_text(encoding="utf-8"))
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "devicemq"]
    env = compose()["services"]["devicemq"]["environment"]
    assert job["metrics_path"] == "/metrics"
    (sd,) = job["dns_sd_configs"]
    assert sd["names"] == ["devicemq"]  # the service name: every replica
    assert str(sd["port"]) == str(env["DEVICEMQ_METRICS_PORT"])


@dataclass
class Prometheus:
    base: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def until(self, check: Callable[[], bool], what: str) -> None:
        """Poll ``check`` until true; fail with Prometheus's log after TIMEOUT."""
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text(errors="replace")
            if check():
                return
            time.sleep(0.2)
        log = self.log_path.read_text(errors="replace")
        raise AssertionError(f"{what}: not within {TIMEOUT} s\n{log[-3000:]}")

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.base}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        status, body = http_get(url)
        assert status == 200, body
        data = json.loads(body)
        assert data["status"] == "success", data
        return data["data"]


@pytest.fixture
def prometheus(compose_broker: ComposeBroker, tmp_path: Path) -> Iterator[Prometheus]:
    binary = find_prometheus()
    if binary is None:
        pytest.fail("prometheus not installed (bash .ci/run installs the Debian package)")
    port = free_port()
    config_file = tmp_path / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(scrape_config_for(compose_broker.metrics_port, port)))
    log_path = tmp_path / "prometheus.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config_file}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    server = Prometheus(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        server.until(lambda: _ok(server.base + "/-/ready"), "Prometheus ready")
        yield server
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait(5)
        log.close()


def _ok(url: str) -> bool:
    with contextlib.suppress(OSError):
        return http_get(url, timeout=2)[0] == 200
    return False


def test_prometheus_scrapes_devicemq(compose_broker: ComposeBroker, prometheus: Prometheus) -> None:
    def devicemq_target_up() -> bool:
        targets = prometheus.api("targets", state="active")["activeTargets"]
        ours = [t for t in targets if t["labels"]["job"] == "devicemq"]
        assert len(ours) <= 1
        return bool(ours) and ours[0]["health"] == "up"

    prometheus.until(devicemq_target_up, "devicemq target up")

    before = compose_broker.metric("devicemq_messages_received_total")
    client = Paho(
        compose_broker, f"deploy-prom-{uuid.uuid4().hex[:6]}", V311, **compose_broker.credentials
    )
    try:
        client.connect()
        for i in range(5):
            client.publish(f"deploy/prom/{i}", b"x", qos=1)
    finally:
        client.close()

    def traffic_scraped() -> bool:
        query = "sum(devicemq_messages_received_total)"
        result = prometheus.api("query", query=query)["result"]
        return bool(result) and float(result[0]["value"][1]) >= before + 5

    prometheus.until(traffic_scraped, "the traffic in Prometheus")
    up = prometheus.api("query", query='up{job="devicemq"}')["result"]

    # The alert rules loaded and evaluated without error on the real series;
    # none fires on this healthy broker.
    def rules_evaluated() -> bool:
        groups = prometheus.api("rules", type="alert")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return bool(rules) and all(r.get("lastEvaluation", "").startswith("2") for r in rules)

    prometheus.until(rules_evaluated, "the alert rules evaluated")
    rules = [r for g in prometheus.api("rules", type="alert")["groups"] for r in g["rules"]]
    assert len(rules) >= 9
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    firing = [r["name"] for r in rules if r["state"] != "inactive"]
    assert firing == [], firing
    assert [float(r["value"][1]) for r in up] == [1.0]
    names = prometheus.api("label/__name__/values")
    for name in (
        "devicemq_build_info",
        "devicemq_connections_total",
        "devicemq_kafka_consumer_lag_records",
        "devicemq_delivery_latency_seconds_bucket",
        "devicemq_client_inflight_messages_bucket",
    ):
        assert name in names, name


def test_every_dashboard_query_is_valid_promql(
    compose_broker: ComposeBroker, prometheus: Prometheus
) -> None:
    """Each panel's query, with Grafana's variables filled in, is accepted by a real
    Prometheus (a typo in a hand-written expression would leave a panel empty)."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    grafana_vars = {"$instance": ".*", "$__rate_interval": "1m", "$__range": "5m"}
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in grafana_vars.items():
                expr = expr.replace(name, value)
            assert "$" not in expr, f"{panel['title']}: an unknown variable in {expr}"
            prometheus.api("query", query=expr)  # status "success", or the error
