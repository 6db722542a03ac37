"""devicemq started exactly as docker-compose.yml configures it, with real Redis and Kafka."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import yaml

from tests.deploy.conftest import REPO, ComposeBroker, http_get, json_of
from tests.e2e.clients import V311, Paho

DASHBOARD = REPO / "config" / "grafana" / "dashboards" / "devicemq.json"
ALERTS = REPO / "config" / "prometheus" / "alerts.yml"


def test_health_and_ready(compose_broker: ComposeBroker) -> None:
    status, body = http_get(compose_broker.url("/health"))
    assert (status, json_of(body)) == (200, {"status": "up"})
    status, body = http_get(compose_broker.url("/ready"))
    ready = json_of(body)
    assert status == 200 and ready["ready"] is True, body
    assert ready["partitions"] == int(compose_broker.env["DEVICEMQ_PERSISTENCE_PARTITIONS"])
    # ... and the same as series (issue 40: the dashboard could only show "serving")
    assert compose_broker.metric("devicemq_ready") == 1
    assert compose_broker.metric("devicemq_unready_reason") == 0  # every reason at 0
    assert compose_broker.metric("devicemq_unready_reason", reason="kafka") == 0


def test_logs_are_json_lines(compose_broker: ComposeBroker) -> None:
    lines = [line for line in compose_broker.log().splitlines() if line.strip()]
    assert lines
    events = [json.loads(line) for line in lines]  # DEVICEMQ_LOG_FORMAT=json: every line
    assert any(e["msg"].startswith("devicemq listening on") for e in events)


def test_persistent_round_trip(compose_broker: ComposeBroker) -> None:
    topic = f"deploy/{uuid.uuid4().hex[:8]}/t"
    login = compose_broker.credentials  # authentication is on in the compose deployment
    device = Paho(compose_broker, f"deploy-dev-{uuid.uuid4().hex[:6]}", V311, **login)
    publisher = Paho(compose_broker, f"deploy-pub-{uuid.uuid4().hex[:6]}", V311, **login)
    try:
        assert device.connect(clean_start=False).reason_code == 0
        assert device.subscribe(topic, 1) == [1]
        device.disconnect()  # offline: the message must wait in Kafka + Redis

        publisher.connect()
        publisher.publish(topic, b"while you were away", qos=1)  # PUBACK after Kafka acked

        connack = device.connect(clean_start=False)
        assert connack.session_present
        message = device.get(timeout=15)
        assert (message.topic, message.payload, message.qos) == (
            topic,
            b"while you were away",
            1,
        )
    finally:
        device.close()
        publisher.close()

    assert compose_broker.metric("devicemq_persisted_messages_stored_total") >= 1
    assert compose_broker.metric("devicemq_persisted_messages_delivered_total") >= 1
    assert compose_broker.metric("devicemq_delivery_latency_seconds_count") >= 1
    assert compose_broker.metric("devicemq_messages_received_total", qos="1") >= 1
    assert compose_broker.metric("devicemq_kafka_produce_duration_seconds_count") >= 1
    assert compose_broker.metric("devicemq_redis_script_duration_seconds_count") >= 1
    assert compose_broker.metric("devicemq_kafka_records_consumed_total") >= 1


def test_anonymous_clients_are_refused(compose_broker: ComposeBroker) -> None:
    """Authentication is on in the compose deployment from its first start."""
    anonymous = Paho(compose_broker, f"deploy-anon-{uuid.uuid4().hex[:6]}", V311)
    try:
        assert anonymous.connect().reason_code != 0
    finally:
        anonymous.close()
    assert "created " in compose_broker.log() and "auth.initial_user" in compose_broker.log()
    assert compose_broker.env["DEVICEMQ_AUTH_INITIAL_PASSWORD"] not in compose_broker.log()


def test_metrics_follow_prometheus_conventions(compose_broker: ComposeBroker) -> None:
    status, text = http_get(compose_broker.url("/metrics"))
    assert status == 200
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))
    ours = {name: kind for name, kind in types.items() if name.startswith("devicemq_")}
    assert len(ours) >= 40
    assert set(types) == set(ours), "every series is devicemq_*"
    for name, kind in ours.items():
        if kind == "counter":
            assert name.endswith("_total"), name
        else:
            assert not name.endswith("_total"), name
        if "latency" in name or "duration" in name:
            assert name.endswith("_seconds"), name
    for needed in (
        "devicemq_connections_current",
        "devicemq_connections_total",
        "devicemq_connections_rejected_total",
        "devicemq_sessions",
        "devicemq_subscriptions",
        "devicemq_retained_messages",
        "devicemq_messages_received_total",
        "devicemq_messages_sent_total",
        "devicemq_messages_received_bytes_total",
        "devicemq_messages_sent_bytes_total",
        "devicemq_publish_dropped_total",
        "devicemq_kafka_produce_duration_seconds",
        "devicemq_kafka_produce_errors_total",
        "devicemq_kafka_consumer_lag_records",
        "devicemq_kafka_records_consumed_total",
        "devicemq_redis_script_duration_seconds",
        "devicemq_redis_script_errors_total",
        "devicemq_persisted_messages_stored_total",
        "devicemq_persisted_messages_delivered_total",
        "devicemq_persisted_messages_acked_total",
        "devicemq_persisted_messages_expired_total",
        "devicemq_persisted_messages_trimmed_total",
        "devicemq_persisted_replay_page_messages",
        "devicemq_persisted_backlog_messages",
        "devicemq_client_inflight_messages",
        "devicemq_delivery_latency_seconds",
    ):
        assert needed in ours, needed
    # Issue 40: the labelled failure counters have their series before their first
    # event, so rate() and increase() alerts see it (and their panels are not empty).
    for series in (
        'devicemq_redis_script_errors_total{script="save_batch"} 0.0',
        'devicemq_redis_script_errors_total{script="queue_save"} 0.0',
        'devicemq_publish_dropped_total{reason="queue_full"} 0.0',
        'devicemq_connections_rejected_total{reason="banned"} 0.0',
        'devicemq_writes_given_up_total{writer="session_saves"} 0.0',
    ):
        assert series in text, series
    lag = [line for line in text.splitlines() if line.startswith("devicemq_kafka_consumer_lag")]
    partitions = int(compose_broker.env["DEVICEMQ_PERSISTENCE_PARTITIONS"])
    assert len(lag) == partitions  # one series per assigned partition, no per-client labels


def assert_exported(compose_broker: ComposeBroker, exprs: list[str], what: str) -> None:
    """Every devicemq_* name in the PromQL ``exprs`` is a series /metrics exports."""
    status, text = http_get(compose_broker.url("/metrics"))
    assert status == 200
    exported = set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))
    samples = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    assert exprs
    used = {m for e in exprs for m in re.findall(r"\bdevicemq_[a-z_]+", e)}
    assert used
    for name in used:
        # A histogram's family is exported (its # TYPE line) before its first sample:
        # the check holds whichever tests ran before on the module's broker.
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in exported or name in samples or family in exported, (
            f"{what} uses {name}, not exported"
        )


def test_alerts_query_only_exported_metrics(compose_broker: ComposeBroker) -> None:
    rules = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    assert_exported(compose_broker, exprs, "config/prometheus/alerts.yml")


def test_dashboard_queries_only_exported_metrics(compose_broker: ComposeBroker) -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert_exported(compose_broker, exprs, "the dashboard")
    # ... and every family exported is on a panel (issue 40: 32 were on none)
    status, text = http_get(compose_broker.url("/metrics"))
    assert status == 200
    families = set(re.findall(r"^# TYPE (devicemq_\w+) ", text, re.MULTILINE))
    # a gauge histogram's _gcount and _gsum come as families of their own
    families = {
        re.sub(r"_(gcount|gsum)$", "", f) for f in families if not f.startswith("devicemq_process_")
    }
    shown = {
        re.sub(r"_(bucket|sum|count)$", "", m)
        for e in exprs
        for m in re.findall(r"\bdevicemq_[a-z_]+", e)
    }
    missing = sorted(families - shown)
    assert not missing, f"exported, on no panel of {DASHBOARD.name}: {missing}"
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("throughput", "latency", "backlog", "lag", "connections"):
        assert topic in titles


def test_the_docs_list_exported_metrics(compose_broker: ComposeBroker) -> None:
    status, text = http_get(compose_broker.url("/metrics"))
    assert status == 200
    exported = {
        name.removesuffix("_bucket")
        for name in re.findall(r"^(devicemq_\w+?)(?:\{| )", text, re.MULTILINE)
    } | set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))
    metrics = (REPO / "docs" / "metrics.md").read_text(encoding="utf-8")
    section = metrics.split("## Metrics\n", 1)[1].split("\n## $SYS topics", 1)[0]
    documented = set(re.findall(r"`(devicemq_[a-z_]*[a-z])[`{]", section))
    documented = {n for n in documented if not n.startswith("devicemq_process_")}
    assert len(documented) >= 35
    missing = sorted(documented - exported)
    assert not missing, f"docs/metrics.md documents metrics /metrics lacks: {missing}"
    undocumented = sorted(
        n
        for n in exported
        if n.startswith("devicemq_")
        and not n.startswith("devicemq_process_")
        and n not in documented
        and not n.endswith(("_count", "_sum", "_gcount", "_gsum"))
    )
    assert not undocumented, f"/metrics has series docs/metrics.md does not list: {undocumented}"


def test_backlog_of_the_fullest_session_and_its_limit(compose_broker: ComposeBroker) -> None:
    """What the backlog alert compares (config/prometheus/alerts.yml): the largest
    backlog of one session, and persistence.max_messages_per_client."""
    assert compose_broker.metric("devicemq_persisted_backlog_limit_messages") == 10_000
    topic = f"deploy/{uuid.uuid4().hex[:8]}/backlog"
    login = compose_broker.credentials
    device = Paho(compose_broker, f"deploy-full-{uuid.uuid4().hex[:6]}", V311, **login)
    publisher = Paho(compose_broker, f"deploy-pub-{uuid.uuid4().hex[:6]}", V311, **login)
    try:
        device.connect(clean_start=False)
        assert device.subscribe(topic, 1) == [1]
        device.disconnect()
        publisher.connect()
        for i in range(7):
            publisher.publish(topic, b"%d" % i, qos=1)
        # counted at most every 5 s (app/metrics.py REFRESH_INTERVAL): poll for it
        deadline = time.monotonic() + 20
        while compose_broker.metric("devicemq_persisted_backlog_client_max_messages") < 7:
            assert time.monotonic() < deadline, "the fullest session's backlog never showed 7"
            time.sleep(0.5)
        largest = compose_broker.metric("devicemq_persisted_backlog_client_max_messages")
        assert largest <= compose_broker.metric("devicemq_persisted_backlog_messages")
        device.connect(clean_start=False)
        assert [device.get(timeout=15).payload for _ in range(7)] == [b"%d" % i for i in range(7)]
    finally:
        device.close()
        publisher.close()


def _admin_get(broker: ComposeBroker, token: str | None) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{broker.admin_port}/api/v1/sessions")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as e:
        return e.code


def test_the_admin_token_is_generated_once_and_read_again_when_changed(
    compose_broker: ComposeBroker,
) -> None:
    """Issue 40: the console reachable from the host under compose, with a token made
    at the first start (admin.generate_token), shown once in the log, kept in the
    file (the compose volume), and read again when the file changes."""
    token_file = Path(compose_broker.env["DEVICEMQ_ADMIN_TOKEN_FILE"])
    assert token_file.stat().st_mode & 0o777 == 0o600
    token = token_file.read_text().strip()
    assert len(token) >= 32
    log = compose_broker.log()
    assert log.count(token) == 1, "the generated token is logged exactly once"
    assert "admin token" in log
    assert _admin_get(compose_broker, None) == 401
    assert _admin_get(compose_broker, "wrong") == 401
    assert _admin_get(compose_broker, token) == 200

    new = "rotated-" + uuid.uuid4().hex
    try:
        token_file.write_text(new + "\n")
        # noticed by mtime, at most one stat() a second (broker/watched_file.py)
        deadline = time.monotonic() + 10
        while _admin_get(compose_broker, new) != 200:
            assert time.monotonic() < deadline, "the changed token file was not read again"
            time.sleep(0.2)
        assert _admin_get(compose_broker, token) == 401
        token_file.write_text("")  # an empty file keeps the token in force
        deadline = time.monotonic() + 10
        while "is empty: the token in force stays" not in compose_broker.log():
            assert time.monotonic() < deadline, "the emptied token file was not looked at"
            assert _admin_get(compose_broker, new) == 200
            time.sleep(0.2)
        assert _admin_get(compose_broker, new) == 200
        assert new not in compose_broker.log()
    finally:
        token_file.write_text(token + "\n")
