"""broker.config: defaults, the documented YAML, environment, precedence, errors."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from broker.config import (
    ConfigError,
    ListenerSettings,
    LogSettings,
    MqttSettings,
    Settings,
    load_settings,
    setting_specs,
)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_YML = REPO / "config" / "devicemq.yml"


def write(tmp_path: Path, text: str, name: str = "devicemq.yml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def error_of(path: str | Path | None = None, **kw: object) -> str:
    with pytest.raises(ConfigError) as info:
        load_settings(path, **kw)  # type: ignore[arg-type]
    text = str(info.value)
    assert "\n" not in text
    return text


# ---------------------------------------------------------------- defaults


def test_defaults() -> None:
    s = Settings()
    assert s.listener == ListenerSettings(host="", port=1883)  # "": decided by auth
    assert s.data_dir == "./data"
    assert s.log == LogSettings(level="INFO", format="text")
    m = s.mqtt
    assert m.max_packet_size == 1_048_576
    assert m.receive_maximum == 1024
    assert m.max_inflight == 64
    assert m.max_queued_messages == 10_000
    assert m.topic_alias_maximum == 64
    assert m.max_keep_alive == 65535
    assert m.connect_timeout == 10.0
    assert m.max_session_expiry_interval == 604_800
    assert m.retain_available is True
    assert m.maximum_qos == 2
    assert m.wildcard_subscriptions is True
    assert m.shared_subscriptions is True
    assert m.subscription_identifiers is True
    assert m.write_buffer_high_water == 1_048_576
    assert m.max_client_id_length == 65535


def test_settings_are_frozen_slotted_and_need_no_validation_in_code() -> None:
    s = Settings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.listener.port = 1  # type: ignore[misc]
    assert not hasattr(s.mqtt, "__dict__")
    # Tests build settings directly, e.g. port 0 for a free port: allowed in code.
    assert Settings(listener=ListenerSettings(port=0)).listener.port == 0


def test_no_arguments_and_empty_env_give_defaults() -> None:
    assert load_settings(env={}) == Settings()


def test_every_setting_is_described_and_defaults_are_valid() -> None:
    specs = setting_specs()
    assert "mqtt.receive_maximum" in specs and "data_dir" in specs
    for spec in specs.values():
        assert spec.doc.strip(), spec.name
        # the default passes its own validation, as text and as a value
        assert load_settings(env={}, overrides={spec.name: spec.default}) == Settings()


# ------------------------------------------------------ the documented YAML


def test_shipped_yml_equals_defaults() -> None:
    assert load_settings(DEFAULT_YML, env={}) == Settings()


def test_every_field_is_documented_in_the_yml() -> None:
    data = yaml.safe_load(DEFAULT_YML.read_text())
    text = DEFAULT_YML.read_text().splitlines()
    for spec in setting_specs().values():
        if spec.section is None:
            assert spec.key in data, f"{spec.name} missing from {DEFAULT_YML.name}"
        else:
            assert spec.key in (data.get(spec.section) or {}), f"{spec.name} missing"
        # ...with a comment on the line(s) just above it
        indent = "" if spec.section is None else "  "
        lines = [i for i, line in enumerate(text) if line.startswith(f"{indent}{spec.key}:")]
        assert lines, spec.name
        above = text[lines[-1] - 1].strip()
        assert above.startswith("#") and len(above) > 3, f"{spec.name} has no comment"


def test_every_documented_key_is_a_setting() -> None:
    data = yaml.safe_load(DEFAULT_YML.read_text())
    specs = setting_specs()
    for top, body in data.items():
        if top == "integrations":  # a list of rules, tests/unit/test_integration_rules.py
            assert body == []
        elif isinstance(body, dict):
            for key in body:
                assert f"{top}.{key}" in specs
        else:
            assert top in specs


def test_env_var_names() -> None:
    specs = setting_specs()
    assert specs["mqtt.receive_maximum"].env_var == "DEVICEMQ_MQTT_RECEIVE_MAXIMUM"
    assert specs["listener.port"].env_var == "DEVICEMQ_LISTENER_PORT"
    assert specs["data_dir"].env_var == "DEVICEMQ_DATA_DIR"
    names = [s.env_var for s in specs.values()]
    assert len(names) == len(set(names))
    assert "DEVICEMQ_CONFIG" not in names  # used by the CLI for the file path


# ---------------------------------------------------------------- the file


def test_file_values(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
listener:
  host: 127.0.0.1
  port: 1884
data_dir: /var/lib/devicemq
log:
  level: debug
  format: json
mqtt:
  receive_maximum: 10
  connect_timeout: 3        # an int is fine for a float
  retain_available: false
""",
    )
    s = load_settings(path, env={})
    assert s.listener == ListenerSettings("127.0.0.1", 1884)
    assert s.data_dir == "/var/lib/devicemq"
    assert s.log == LogSettings("DEBUG", "json")  # choices are case-insensitive
    assert s.mqtt.receive_maximum == 10
    assert s.mqtt.connect_timeout == 3.0 and isinstance(s.mqtt.connect_timeout, float)
    assert s.mqtt.retain_available is False
    assert s.mqtt.max_inflight == MqttSettings().max_inflight  # untouched


def test_empty_file_and_empty_sections_give_defaults(tmp_path: Path) -> None:
    assert load_settings(write(tmp_path, ""), env={}) == Settings()
    assert load_settings(write(tmp_path, "# only comments\n"), env={}) == Settings()
    path = write(tmp_path, "listener:\n  # port: 1\nmqtt:\n")
    assert load_settings(path, env={}) == Settings()


def test_path_may_be_str_or_path(tmp_path: Path) -> None:
    path = write(tmp_path, "listener:\n  port: 2000\n")
    assert load_settings(str(path), env={}).listener.port == 2000
    assert load_settings(path, env={}).listener.port == 2000


# ------------------------------------------------------------ interpolation


def test_interpolation(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
listener:
  host: ${BIND:127.0.0.1}
  port: ${PORT:1885}
data_dir: ${BASE}/data
mqtt:
  retain_available: ${RETAIN:no}
  connect_timeout: ${TIMEOUT:2.5}
""",
    )
    s = load_settings(path, env={"BASE": "/srv"})
    assert s.listener == ListenerSettings("127.0.0.1", 1885)
    assert s.data_dir == "/srv/data"
    assert s.mqtt.retain_available is False
    assert s.mqtt.connect_timeout == 2.5
    s = load_settings(path, env={"BASE": "", "BIND": "::", "PORT": "1999", "RETAIN": "true"})
    assert s.listener == ListenerSettings("::", 1999)
    assert s.data_dir == "/data"
    assert s.mqtt.retain_available is True


def test_interpolation_with_empty_default(tmp_path: Path) -> None:
    path = write(tmp_path, "data_dir: ${DIR:}\n")
    assert load_settings(path, env={}).data_dir == ""


def test_interpolated_text_is_still_validated(tmp_path: Path) -> None:
    path = write(tmp_path, "mqtt:\n  receive_maximum: ${RM:0}\n")
    assert error_of(path, env={}) == (
        f"{path}: mqtt.receive_maximum: must be between 1 and 65535, got 0"
    )
    assert error_of(path, env={"RM": "lots"}) == (
        f"{path}: mqtt.receive_maximum: expected an integer, got 'lots'"
    )


def test_interpolation_of_unset_variable_without_default(tmp_path: Path) -> None:
    path = write(tmp_path, "listener:\n  host: ${DEVICEMQ_TEST_UNSET_HOST}\n")
    assert error_of(path, env={}) == (
        f"{path}: listener.host: environment variable DEVICEMQ_TEST_UNSET_HOST is not set"
        " and ${DEVICEMQ_TEST_UNSET_HOST} has no default"
    )


# -------------------------------------------------------------- environment


@pytest.mark.parametrize(
    ("var", "text", "name", "expected"),
    [
        ("DEVICEMQ_LISTENER_HOST", "127.0.0.1", "listener.host", "127.0.0.1"),
        ("DEVICEMQ_LISTENER_PORT", "1999", "listener.port", 1999),
        ("DEVICEMQ_LISTENER_PORT", " 1999 ", "listener.port", 1999),
        ("DEVICEMQ_DATA_DIR", "/tmp/x", "data_dir", "/tmp/x"),
        ("DEVICEMQ_LOG_LEVEL", "warning", "log.level", "WARNING"),
        ("DEVICEMQ_MQTT_RECEIVE_MAXIMUM", "100", "mqtt.receive_maximum", 100),
        ("DEVICEMQ_MQTT_CONNECT_TIMEOUT", "0.5", "mqtt.connect_timeout", 0.5),
        ("DEVICEMQ_MQTT_CONNECT_TIMEOUT", "3", "mqtt.connect_timeout", 3.0),
        ("DEVICEMQ_MQTT_RETAIN_AVAILABLE", "false", "mqtt.retain_available", False),
        ("DEVICEMQ_MQTT_RETAIN_AVAILABLE", "0", "mqtt.retain_available", False),
        ("DEVICEMQ_MQTT_RETAIN_AVAILABLE", "No", "mqtt.retain_available", False),
        ("DEVICEMQ_MQTT_SHARED_SUBSCRIPTIONS", "TRUE", "mqtt.shared_subscriptions", True),
        ("DEVICEMQ_MQTT_SHARED_SUBSCRIPTIONS", "1", "mqtt.shared_subscriptions", True),
        ("DEVICEMQ_MQTT_SHARED_SUBSCRIPTIONS", "yes", "mqtt.shared_subscriptions", True),
    ],
)
def test_env_override(var: str, text: str, name: str, expected: object) -> None:
    s = load_settings(env={var: text})
    section, _, key = name.rpartition(".")
    value = getattr(getattr(s, section) if section else s, key)
    assert value == expected and type(value) is type(expected)


def test_every_setting_has_a_working_env_var() -> None:
    for spec in setting_specs().values():
        text = str(spec.default).lower() if spec.type is bool else str(spec.default)
        if spec.type is tuple:
            text = yaml.safe_dump(list(spec.default), default_flow_style=True)
        assert load_settings(env={spec.env_var: text}) == Settings(), spec.name


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('["^backend-", "^etl-[0-9]+$"]', ("^backend-", "^etl-[0-9]+$")),
        ("[]", ()),
        ("", ()),
        ("^backend-", ("^backend-",)),  # not a list: one expression
    ],
)
def test_a_list_setting_from_the_environment(text: str, expected: tuple[str, ...]) -> None:
    s = load_settings(env={"DEVICEMQ_APPLICATION_CLIENT_IDS": text})
    assert s.application.client_ids == expected


def test_a_list_setting_from_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "application:\n  client_ids: ['^svc-']\n  usernames: [backend]\n")
    s = load_settings(path, env={})
    assert s.application.client_ids == ("^svc-",)
    assert s.application.usernames == ("backend",)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('["^ok", "(unclosed"]', "'(unclosed' is not a regular expression"),
        ("[1, 2]", "expected a list of strings, got a list"),
        ('["a"', "expected a list such as"),
    ],
)
def test_a_bad_list_setting_names_itself(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(env={"DEVICEMQ_APPLICATION_CLIENT_IDS": text})
    assert err.value.name == "application.client_ids"
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("var", "message"),
    [
        (
            "DEVICEMQ_LISTENER_PROT",
            "env DEVICEMQ_LISTENER_PROT: not a devicemq setting "
            "(did you mean DEVICEMQ_LISTENER_PORT?)",
        ),
        (
            "DEVICEMQ_SOMETHING_ELSE",
            "env DEVICEMQ_SOMETHING_ELSE: not a devicemq setting (docs/configuration.md; unset it)",
        ),
    ],
)
def test_an_unknown_devicemq_env_var_is_refused_like_an_unknown_key(var: str, message: str) -> None:
    """A misspelt setting in the environment was ignored: the broker ran with the
    default the operator meant to change."""
    with pytest.raises(ConfigError) as caught:
        load_settings(env={var: "1"})
    assert str(caught.value) == message


def test_devicemq_env_vars_that_are_not_settings_are_let_be() -> None:
    env = {
        "DEVICEMQ_CONFIG": "y",  # the CLI's
        "DEVICEMQ_PASSWORD": "p",  # docker-compose's
        "DEVICEMQ_TEST_KAFKA_BOOTSTRAP": "127.0.0.1:9",  # the test suite's
        "DEVICEMQ_CI_PYTEST_PROCESSES": "2",  # CI's
        "DEVICEMQ_COMPILE": "0",  # the build's (setup.py), left in an operator's shell
    }
    assert load_settings(env=env) == Settings()


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEVICEMQ_LISTENER_PORT", "2345")
    assert load_settings().listener.port == 2345


@pytest.mark.parametrize(
    ("var", "text", "message"),
    [
        ("DEVICEMQ_LISTENER_PORT", "abc", "listener.port: expected an integer, got 'abc'"),
        ("DEVICEMQ_LISTENER_PORT", "1.5", "listener.port: expected an integer, got '1.5'"),
        ("DEVICEMQ_LISTENER_PORT", "", "listener.port: expected an integer, got ''"),
        (
            "DEVICEMQ_LISTENER_PORT",
            "70000",
            "listener.port: must be between 1 and 65535, got 70000",
        ),
        (
            "DEVICEMQ_MQTT_RETAIN_AVAILABLE",
            "maybe",
            "mqtt.retain_available: expected true/false/1/0/yes/no, got 'maybe'",
        ),
        (
            "DEVICEMQ_MQTT_CONNECT_TIMEOUT",
            "nan",
            "mqtt.connect_timeout: expected a finite number, got nan",
        ),
        (
            "DEVICEMQ_MQTT_CONNECT_TIMEOUT",
            "-1",
            "mqtt.connect_timeout: must be greater than 0, got -1.0",
        ),
        ("DEVICEMQ_LOG_FORMAT", "xml", "log.format: must be one of text, json, got 'xml'"),
    ],
)
def test_env_errors(var: str, text: str, message: str) -> None:
    assert error_of(env={var: text}) == f"env {var}: {message}"


# --------------------------------------------------------------- precedence


def test_precedence_defaults_file_env_overrides(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "listener:\n  host: 10.0.0.1\n  port: 2001\nmqtt:\n  max_inflight: 5\n"
        "  receive_maximum: 7\n",
    )
    env = {"DEVICEMQ_LISTENER_PORT": "2002", "DEVICEMQ_MQTT_MAX_INFLIGHT": "6"}
    overrides = {"listener.port": "2003"}
    s = load_settings(path, env=env, overrides=overrides)
    assert s.listener.host == "10.0.0.1"  # file over default
    assert s.mqtt.receive_maximum == 7  # file over default
    assert s.mqtt.max_inflight == 6  # env over file
    assert s.listener.port == 2003  # override over env over file
    assert s.mqtt.max_packet_size == 1_048_576  # default
    assert load_settings(path, env=env).listener.port == 2002


def test_overrides_take_text_or_typed_values() -> None:
    s = load_settings(env={}, overrides={"listener.port": 1999, "log.level": "debug"})
    assert s.listener.port == 1999 and s.log.level == "DEBUG"
    s = load_settings(env={}, overrides={"mqtt.connect_timeout": 1, "mqtt.retain_available": "no"})
    assert s.mqtt.connect_timeout == 1.0 and s.mqtt.retain_available is False
    assert load_settings(env={}, overrides={}) == Settings()


def test_override_errors() -> None:
    assert error_of(env={}, overrides={"listener.port": "0"}) == (
        "command line: listener.port: must be between 1 and 65535, got 0"
    )
    assert error_of(env={}, overrides={"listener.port": True}) == (
        "command line: listener.port: expected an integer, got true"
    )
    assert error_of(env={}, overrides={"listener.prot": 1}) == (
        "command line: listener.prot: unknown setting (did you mean 'listener.port'?)"
    )


# ------------------------------------------------------------- file errors


def test_file_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yml"
    assert error_of(missing, env={}) == f"{missing}: file not found"


def test_file_is_a_directory(tmp_path: Path) -> None:
    assert error_of(tmp_path, env={}).startswith(f"{tmp_path}: cannot read: ")


def test_unparsable_yaml_names_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "listener:\n  port: 1883\n  host: [oops\nmqtt: {}\n")
    message = error_of(path, env={})
    assert re.fullmatch(rf"{re.escape(str(path))}: line \d+: invalid YAML: .+", message)
    path = write(tmp_path, "listener:\n  port: 1883\n bad: indent\n")
    assert error_of(path, env={}).startswith(f"{path}: line 3: invalid YAML: ")


def test_duplicate_key(tmp_path: Path) -> None:
    path = write(tmp_path, "listener:\n  port: 1\n  port: 2\n")
    assert error_of(path, env={}) == f"{path}: line 3: duplicate key 'port'"


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yml"
    path.write_bytes(b"data_dir: caf\xe9\n")
    assert error_of(path, env={}) == f"{path}: cannot read: not UTF-8 text"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # out of range / invalid choice
        (
            "mqtt:\n  receive_maximum: 0\n",
            "mqtt.receive_maximum: must be between 1 and 65535, got 0",
        ),
        (
            "mqtt:\n  max_queued_messages: -1\n",
            "mqtt.max_queued_messages: must be at least 0, got -1",
        ),
        ("mqtt:\n  connect_timeout: 0\n", "mqtt.connect_timeout: must be greater than 0, got 0.0"),
        ("mqtt:\n  maximum_qos: 3\n", "mqtt.maximum_qos: must be between 0 and 2, got 3"),
        (
            "mqtt:\n  max_client_id_length: 22\n",
            "mqtt.max_client_id_length: must be between 23 and 65535, got 22",
        ),
        (
            "mqtt:\n  max_packet_size: 268435461\n",
            "mqtt.max_packet_size: must be between 16 and 268435460, got 268435461",
        ),
        (
            "log:\n  level: TRACE\n",
            "log.level: must be one of DEBUG, INFO, WARNING, ERROR, got 'TRACE'",
        ),
        # wrong type: no coercion
        ("mqtt:\n  receive_maximum: abc\n", "mqtt.receive_maximum: expected an integer, got 'abc'"),
        ("listener:\n  port: '1883'\n", "listener.port: expected an integer, got '1883'"),
        ("listener:\n  port: 1883.0\n", "listener.port: expected an integer, got 1883.0"),
        ("listener:\n  port: true\n", "listener.port: expected an integer, got true"),
        ("listener:\n  port:\n", "listener.port: expected an integer, got null"),
        ("mqtt:\n  retain_available: 1\n", "mqtt.retain_available: expected true or false, got 1"),
        (
            "mqtt:\n  retain_available: 'true'\n",
            "mqtt.retain_available: expected true or false, got 'true'",
        ),
        ("mqtt:\n  connect_timeout: soon\n", "mqtt.connect_timeout: expected a number, got 'soon'"),
        ("mqtt:\n  connect_timeout: false\n", "mqtt.connect_timeout: expected a number, got false"),
        ("listener:\n  host: 10\n", "listener.host: expected a string, got 10"),
        ("listener:\n  host: [a, b]\n", "listener.host: expected a string, got a list"),
        ("data_dir: {a: 1}\n", "data_dir: expected a string, got a mapping"),
        # shape
        ("mqtt: 5\n", "mqtt: expected a mapping of settings, got 5"),
        ("- listener\n", "expected a mapping of sections, got a list"),
        # unknown names, with suggestions
        (
            "mqtt:\n  recieve_maximum: 5\n",
            "mqtt.recieve_maximum: unknown setting (did you mean 'mqtt.receive_maximum'?)",
        ),
        ("mqt:\n  receive_maximum: 5\n", "mqt: unknown setting (did you mean 'mqtt'?)"),
        (
            "listener:\n  max_packet_size: 5\n",
            "listener.max_packet_size: unknown setting (did you mean 'mqtt.max_packet_size'?)",
        ),
        ("port: 1883\n", "port: unknown setting (did you mean 'listener.port'?)"),
        ("kafka:\n  servers: x\n", "kafka: unknown setting"),
        ("mqtt:\n  zzzz: 5\n", "mqtt.zzzz: unknown setting"),
    ],
)
def test_file_errors_are_one_line(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    assert error_of(path, env={}) == f"{path}: {message}"


def test_error_message_shape_from_the_issue(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.mkdir()
    write(config, "mqtt:\n  receive_maximum: 0\n")
    with pytest.MonkeyPatch.context() as mp, pytest.raises(ConfigError) as info:
        mp.chdir(tmp_path)
        load_settings("config/devicemq.yml", env={})
    err = info.value
    assert (
        str(err) == "config/devicemq.yml: mqtt.receive_maximum: must be between 1 and 65535, got 0"
    )
    assert (err.source, err.name) == ("config/devicemq.yml", "mqtt.receive_maximum")
    assert err.message == "must be between 1 and 65535, got 0"


def test_optional_settings_accept_null() -> None:
    # No optional setting exists yet; the loader already supports `str | None`.
    from broker.config import SettingSpec, _check_value, _parse_text

    spec = SettingSpec(
        "tls.certfile", "tls", "certfile", str, True, None, "cert", None, None, None, None
    )
    assert _check_value(spec, None) is None
    assert _parse_text(spec, "") is None and _parse_text(spec, "null") is None
    assert _parse_text(spec, "/etc/cert.pem") == "/etc/cert.pem"
    required = dataclasses.replace(spec, optional=False)
    with pytest.raises(ConfigError, match="expected a string, got null"):
        _check_value(required, None)


def test_a_complex_yaml_key_is_one_line_naming_the_file(tmp_path: Path) -> None:
    """``? [a] : 1`` makes a list a key: not a name, and unhashable (a TypeError before)."""
    path = write(tmp_path, "mqtt: {? [a] : 1}\n")
    assert error_of(path, env={}) == f"{path}: line 1: a key must be a name, not a list"
    path = write(tmp_path, "mqtt:\n  ? {a: 1}\n  : 1\n")
    assert error_of(path, env={}) == f"{path}: line 2: a key must be a name, not a mapping"


def test_a_complex_yaml_key_in_the_rules_variable_is_one_line_naming_it() -> None:
    env = {"DEVICEMQ_INTEGRATIONS": '[{"topic_filter":"a","kafka_topic":"b"}]: '}
    assert error_of(env=env) == (
        "env DEVICEMQ_INTEGRATIONS: line 1: a key must be a name, not a list"
    )


def test_application_sessions_need_persistence() -> None:
    env = {"DEVICEMQ_PERSISTENCE_ENABLED": "false"}
    with pytest.raises(ConfigError) as err:
        load_settings(env={"DEVICEMQ_APPLICATION_CLIENT_IDS": "^app-", **env})
    assert err.value.name == "application.client_ids"
    assert "need persistence.enabled" in str(err.value)
    load_settings(env=env)  # without APPLICATION sessions: fine


def test_application_sessions_are_served_by_replicas() -> None:
    load_settings(
        env={
            "DEVICEMQ_APPLICATION_CLIENT_IDS": "^app-",
            "DEVICEMQ_PERSISTENCE_ENABLED": "true",
            "DEVICEMQ_CLUSTER_ENABLED": "true",
        }
    )
