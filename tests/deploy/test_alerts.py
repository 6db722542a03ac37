"""config/prometheus/alerts.yml: valid for Prometheus, unit-tested, wired and documented.

promtool comes with Debian's ``prometheus`` package, which .ci/run installs
(tests/deploy/test_prometheus.py runs the server from it): a missing promtool
fails these tests rather than skipping them. That every expression names a
series devicemq exports is checked on a running broker:
tests/deploy/test_compose_broker.py::test_alerts_query_only_exported_metrics.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import REPO, compose

PROMETHEUS_YML = REPO / "config" / "prometheus.yml"
ALERTS = REPO / "config" / "prometheus" / "alerts.yml"
ALERTS_TEST = REPO / "tests" / "deploy" / "alerts_test.yml"
IN_CONTAINER = PurePosixPath("/etc/prometheus/prometheus.yml")  # docker-compose.yml


def promtool() -> str:
    found = shutil.which("promtool") or (
        "/usr/bin/promtool" if os.access("/usr/bin/promtool", os.X_OK) else None
    )
    if found is None:
        pytest.fail("promtool not installed (bash .ci/run installs Debian's prometheus package)")
    return found


def run_promtool(*args: str) -> str:
    result = subprocess.run(
        [promtool(), *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


def alert_rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    return [rule for group in data["groups"] for rule in group["rules"] if "alert" in rule]


def test_promtool_check_rules() -> None:
    output = run_promtool("check", "rules", str(ALERTS))
    assert f"SUCCESS: {len(alert_rules())} rules found" in output


def test_promtool_test_rules() -> None:
    assert "SUCCESS" in run_promtool("test", "rules", str(ALERTS_TEST))


def test_promtool_check_config_loads_the_rules() -> None:
    output = run_promtool("check", "config", str(PROMETHEUS_YML))
    assert "SUCCESS: 1 rule files found" in output
    assert str(ALERTS.relative_to(REPO)) in output or str(ALERTS) in output


def test_every_alert_is_unit_tested_firing() -> None:
    """Each alert has a promtool case where it fires (alerts_test.yml)."""
    tests = yaml.safe_load(ALERTS_TEST.read_text(encoding="utf-8"))
    fired = {
        case["alertname"]
        for test in tests["tests"]
        for case in test["alert_rule_test"]
        if case.get("exp_alerts")
    }
    names = [rule["alert"] for rule in alert_rules()]
    assert len(names) == len(set(names))
    assert set(names) == fired, set(names) ^ fired


def test_the_alerts_issue_40_asks_for() -> None:
    exprs = {rule["alert"]: rule["expr"] for rule in alert_rules()}
    wanted = {
        "DevicemqNotReady": "devicemq_ready",
        "DevicemqKafkaConsumerLagGrowing": "devicemq_kafka_consumer_lag_records",
        "DevicemqRedisWaitFailures": "devicemq_redis_wait_failures_total",
        "DevicemqWritesGivenUp": "devicemq_writes_given_up_total",
        "DevicemqRedisLostWrites": "devicemq_redis_lost_writes_total",
        "DevicemqIntegrationRecordsFailed": "devicemq_integration_records_failed_total",
        "DevicemqPersistenceConsumerFailures": "devicemq_persistence_consumer_failures_total",
        "DevicemqConnectionRejectionsSpiking": "devicemq_connections_rejected_total",
        "DevicemqBacklogNearClientLimit": "devicemq_persisted_backlog_limit_messages",
    }
    for alert, metric in wanted.items():
        assert alert in exprs, alert
        assert re.search(rf"\b{metric}\b", exprs[alert]), (alert, exprs[alert])
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]


def test_compose_mounts_the_rule_files_where_prometheus_yml_names_them() -> None:
    config = yaml.safe_load(PROMETHEUS_YML.read_text(encoding="utf-8"))
    rule_files = config["rule_files"]
    assert rule_files, "config/prometheus.yml loads no rules"
    volumes = compose()["services"]["prometheus"]["volumes"]
    mounts = {}
    for volume in volumes:
        source, target = str(volume).split(":")[:2]
        mounts[PurePosixPath(target)] = source
    assert mounts[IN_CONTAINER] == "./config/prometheus.yml"
    for pattern in rule_files:
        # the same relative path from the config file, in the repository and the container
        assert (PROMETHEUS_YML.parent / pattern).resolve() == ALERTS
        wanted = IN_CONTAINER.parent / pattern
        mounted = [
            Path(REPO, source, wanted.relative_to(target))
            for target, source in mounts.items()
            if wanted == target or target in wanted.parents
        ]
        assert mounted, f"{wanted} is not mounted in the prometheus service"
        assert mounted[0].resolve() == ALERTS


def test_the_docs_list_every_alert() -> None:
    metrics = (REPO / "docs" / "metrics.md").read_text(encoding="utf-8")
    section = metrics.split("## Alerts\n", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(Devicemq\w+)`", section, re.MULTILINE))
    assert listed == {rule["alert"] for rule in alert_rules()}
