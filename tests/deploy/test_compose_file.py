"""docker-compose.yml, Dockerfile and the Grafana provisioning, checked without a Docker engine."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from broker.config import load_settings, setting_specs
from tests.deploy.conftest import (
    COMPOSE_FILE,
    COMPOSE_VARIABLES,
    REPO,
    compose,
    interpolate,
    service_environment,
)

GRAFANA = REPO / "config" / "grafana"


def _check_jsonschema() -> str:
    beside_python = Path(sys.executable).with_name("check-jsonschema")
    found = str(beside_python) if beside_python.exists() else shutil.which("check-jsonschema")
    if found is None:
        pytest.fail("check-jsonschema missing: pip install -e '.[test]'")
    return found


def test_compose_file_follows_the_compose_specification() -> None:
    result = subprocess.run(
        [_check_jsonschema(), "--builtin-schema", "vendor.compose-spec", str(COMPOSE_FILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_devicemq_is_configured_only_through_its_environment() -> None:
    service = compose()["services"]["devicemq"]
    # no config file (or anything else) is mounted: only the admin token's volume
    assert service["volumes"] == ["devicemq-admin:/var/lib/devicemq/admin"]
    assert "command" not in service and "entrypoint" not in service
    assert "env_file" not in service and "configs" not in service
    env = service_environment("devicemq")
    assert "DEVICEMQ_CONFIG" not in env
    known = {spec.env_var for spec in setting_specs().values()}
    unknown = sorted(set(env) - known)
    assert not unknown, f"not devicemq settings: {unknown}"
    settings = load_settings(env=env)  # every value is valid
    assert settings.persistence.redis_url == "redis://redis:6379/0"
    assert settings.persistence.kafka_bootstrap == "kafka:9092"
    assert settings.log.format == "json"
    assert settings.listener.host == "0.0.0.0"
    assert settings.metrics.enabled and settings.metrics.host == "0.0.0.0"


def test_devicemq_starts_with_authentication_on() -> None:
    """Issue 19 (secure by default): the compose deployment publishes MQTT on the
    host, so it must not start open. The password file is created at the first
    start from DEVICEMQ_USER / DEVICEMQ_PASSWORD, and compose itself refuses to
    start without DEVICEMQ_PASSWORD."""
    env = service_environment("devicemq")
    assert env["DEVICEMQ_AUTH_PASSWORD_FILE"] == "/var/lib/devicemq/passwd"
    assert "DEVICEMQ_AUTH_ALLOW_ANONYMOUS" not in env  # auto: refused once a file is set
    with pytest.raises(AssertionError, match="refuse to start: DEVICEMQ_PASSWORD"):
        interpolate(env["DEVICEMQ_AUTH_INITIAL_PASSWORD"], {})
    expanded = {k: interpolate(v, COMPOSE_VARIABLES) for k, v in env.items()}
    settings = load_settings(env=expanded)
    assert settings.auth.initial_user == "devicemq"
    assert settings.auth.initial_password == COMPOSE_VARIABLES["DEVICEMQ_PASSWORD"]
    assert interpolate(env["DEVICEMQ_AUTH_INITIAL_USER"], {"DEVICEMQ_USER": "ops"}) == "ops"


def test_devicemq_scales() -> None:
    service = compose()["services"]["devicemq"]
    assert "container_name" not in service and "hostname" not in service
    for port in service.get("ports", []):
        host = str(port).rsplit(":", 1)[0]
        assert re.fullmatch(r"(127\.0\.0\.1:)?\d+-\d+", host), (
            f"{port}: a fixed host port stops --scale"
        )
    metrics_port = service_environment("devicemq")["DEVICEMQ_METRICS_PORT"]
    assert not any(str(p).endswith(f":{metrics_port}") for p in service.get("ports", []))


def test_every_service_has_healthcheck_restart_policy_and_named_volumes() -> None:
    data = compose()
    services = data["services"]
    assert set(services) == {"kafka", "redis", "devicemq", "prometheus", "grafana"}
    declared = set(data.get("volumes", {}))
    for name, service in services.items():
        assert service.get("healthcheck", {}).get("test"), f"{name}: no healthcheck"
        assert service.get("restart") in ("unless-stopped", "always", "on-failure"), name
        for volume in service.get("volumes", []):
            source = str(volume).split(":", 1)[0]
            assert source.startswith("./") or source in declared, f"{name}: {volume}"
        for dependency, condition in service.get("depends_on", {}).items():
            assert condition["condition"] in ("service_healthy", "service_started"), name
            assert dependency in services
    assert services["devicemq"]["depends_on"] == {
        "kafka": {"condition": "service_healthy"},
        "redis": {"condition": "service_healthy"},
    }
    assert services["grafana"]["depends_on"]["prometheus"] == {"condition": "service_healthy"}
    assert declared == {
        "devicemq-admin",
        "kafka-data",
        "redis-data",
        "prometheus-data",
        "grafana-data",
    }


def _published(service: str) -> list[tuple[str, str, str]]:
    """(host address, host port(s), container port) of a service's short-form ports."""
    out = []
    for port in compose()["services"][service].get("ports", []):
        parts = str(port).split(":")
        address = parts[0] if len(parts) == 3 else ""
        out.append((address, parts[-2], parts[-1]))
    return out


def test_only_mqtt_is_published_beyond_the_hosts_loopback() -> None:
    """Issue 40: Grafana (admin/admin) and Prometheus were published on every
    interface; the admin API is published on loopback only, behind its token."""
    for name in compose()["services"]:
        for address, host, container in _published(name):
            if (name, container) == ("devicemq", "1883"):
                continue  # MQTT: devices connect from elsewhere (authentication is on)
            assert address == "127.0.0.1", f"{name}: {host}:{container} on every interface"
    assert ("127.0.0.1", "3000", "3000") in _published("grafana")
    assert ("127.0.0.1", "9090", "9090") in _published("prometheus")


def test_the_admin_console_is_reachable_with_a_generated_token() -> None:
    """The admin listener on the container's every address (so the published port
    reaches it), its token in a file created at the first start, in a volume."""
    env = service_environment("devicemq")
    settings = load_settings(env={k: interpolate(v, COMPOSE_VARIABLES) for k, v in env.items()})
    admin = settings.admin
    assert admin.enabled and admin.host == "0.0.0.0"
    assert ("127.0.0.1", "18083-18084", str(admin.port)) in _published("devicemq")
    assert admin.generate_token and admin.token_file == "/var/lib/devicemq/admin/token"
    assert admin.token == ""  # the operator's DEVICEMQ_ADMIN_TOKEN, if exported
    own = {
        k: interpolate(v, {**COMPOSE_VARIABLES, "DEVICEMQ_ADMIN_TOKEN": "t0k"})
        for k, v in env.items()
    }
    assert load_settings(env=own).admin.token == "t0k"
    (volume,) = compose()["services"]["devicemq"]["volumes"]
    assert str(Path(admin.token_file).parent) == volume.split(":")[1]
    dockerfile = (REPO / "Dockerfile").read_text(encoding="utf-8")
    # the image makes the directory the devicemq user's (a new volume copies it)
    assert "install -d -o devicemq -g devicemq -m 0700 /var/lib/devicemq/admin" in dockerfile


def test_stop_grace_period_outlasts_the_drain() -> None:
    """Issue 40: 45 s, shorter than the 60 s drain: Docker's SIGKILL cut it short."""
    from app.serve import SHUTDOWN_TIMEOUT

    grace = str(compose()["services"]["devicemq"]["stop_grace_period"])
    match = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", grace)
    assert match and grace, grace
    seconds = int(match.group(1) or 0) * 60 + int(match.group(2) or 0)
    assert seconds > SHUTDOWN_TIMEOUT, (
        f"stop_grace_period {grace} <= the drain's {SHUTDOWN_TIMEOUT} s"
    )
    workers = service_environment("devicemq").get("DEVICEMQ_WORKERS", "1")
    assert workers == "1", "with workers the supervisor's drain (app/workers.py) is longer"
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert f"The drain ends within {SHUTDOWN_TIMEOUT:.0f} s" in readme


def test_kafka_is_one_kraft_node_with_data_on_a_volume() -> None:
    kafka = compose()["services"]["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    env = {k: str(v) for k, v in kafka["environment"].items()}
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == "1@kafka:9093"
    assert env["KAFKA_ADVERTISED_LISTENERS"] == "PLAINTEXT://kafka:9092"
    assert "kafka-data:" + env["KAFKA_LOG_DIRS"] in kafka["volumes"]


def test_redis_keeps_an_append_only_file_on_a_volume() -> None:
    redis = compose()["services"]["redis"]
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command
    assert "redis-data:/data" in redis["volumes"]


def test_dockerfile() -> None:
    text = (REPO / "Dockerfile").read_text(encoding="utf-8")
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.MULTILINE)
    user = re.findall(r"^USER (\S+)", text, re.MULTILINE)
    assert user and user[-1] not in ("root", "0")
    exposed = set(" ".join(re.findall(r"^EXPOSE (.+)$", text, re.MULTILINE)).split())
    assert {"1883", "9883"} <= exposed
    healthcheck = re.search(r"^HEALTHCHECK .*?(?<!\\)$", text, re.MULTILINE | re.DOTALL)
    assert healthcheck and "/health" in healthcheck.group(0) and "curl" not in healthcheck.group(0)
    assert "import uvloop" in text
    # Every package of pyproject.toml's discovery re-included (issue 40: app/ was
    # not); tests/deploy/test_image_build.py builds the wheel from the context.
    ignore = (REPO / ".dockerignore").read_text(encoding="utf-8").split()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.removesuffix("*") for p in include}
    assert packages == {"app", "broker", "edge", "persistence", "pipeline", "loadtest"}
    for package in sorted(packages):
        assert f"!{package}/" in ignore, f".dockerignore does not re-include {package}/"


def test_grafana_provisioning() -> None:
    datasources = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    assert (source["type"], source["url"]) == ("prometheus", "http://prometheus:9090")
    providers = yaml.safe_load((GRAFANA / "provisioning/dashboards/devicemq.yml").read_text())
    (provider,) = providers["providers"]
    grafana = compose()["services"]["grafana"]
    mounts = {m.split(":")[1]: m.split(":")[0] for m in grafana["volumes"]}
    assert mounts[provider["options"]["path"]] == "./config/grafana/dashboards"
    dashboard = json.loads((GRAFANA / "dashboards/devicemq.json").read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uids == {source["uid"]}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel.get("targets") or panel["type"] == "row", panel["title"]
        box = panel["gridPos"]
        assert box["x"] + box["w"] <= 24, panel["title"]
    # no two panels overlap on the grid
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        box = panel["gridPos"]
        for x in range(box["x"], box["x"] + box["w"]):
            for y in range(box["y"], box["y"] + box["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_dashboard_shows_the_silent_trouble() -> None:
    """Issue 40: every counter docs/metrics.md says to watch for silent trouble is on a panel
    of the dashboard's "Silent trouble" row (the panels below the row's header)."""
    dashboard = json.loads((GRAFANA / "dashboards/devicemq.json").read_text())
    panels = sorted(dashboard["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    (row,) = [p for p in panels if p["type"] == "row" and "silent trouble" in p["title"].lower()]
    below = [p for p in panels if p["gridPos"]["y"] > row["gridPos"]["y"]]
    assert not any(p["type"] == "row" for p in below)
    exprs = " ".join(t["expr"] for p in below for t in p["targets"])
    for counter in (
        "devicemq_integration_records_failed_total",
        "devicemq_redis_wait_failures_total",
        "devicemq_writes_given_up_total",
        "devicemq_kafka_push_back_seconds_total",
        "devicemq_kafka_offset_holes_passed_total",
        "devicemq_persistence_consumer_failures_total",
        "devicemq_redis_lost_writes_total",
        "devicemq_kafka_consumer_assigned_partitions",
        "devicemq_input_pauses_total",
    ):
        assert re.search(rf"\b{counter}\b", exprs), f"{counter} not in the silent trouble row"


def test_the_commented_secured_kafka_example_names_real_settings() -> None:
    """docker-compose.yml's commented SASL/TLS example (docs/backends.md "Secured Kafka"):
    uncommented, every variable is a devicemq setting and every value loads."""
    example: dict[str, str] = {}
    for line in COMPOSE_FILE.read_text(encoding="utf-8").splitlines():
        text = line.strip().removeprefix("#").strip()
        if line.strip().startswith("#") and text.startswith("DEVICEMQ_PERSISTENCE_KAFKA_"):
            name, _, value = text.partition(":")
            example[name] = value.strip()
    assert {
        "DEVICEMQ_PERSISTENCE_KAFKA_SECURITY_PROTOCOL",
        "DEVICEMQ_PERSISTENCE_KAFKA_SASL_PASSWORD_FILE",
        "DEVICEMQ_PERSISTENCE_KAFKA_TLS_CA_FILE",
    } <= set(example)
    known = {spec.env_var for spec in setting_specs().values()}
    assert set(example) <= known, sorted(set(example) - known)
    settings = load_settings(env=example)
    assert settings.persistence.kafka_security_protocol in ("SSL", "SASL_SSL")
