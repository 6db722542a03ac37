"""The Redis connection settings (persistence/redis_security.py), checked at start:
each mistake is one line naming its setting (the real servers are in
tests/faults/test_redis_security.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from broker.config import ConfigError, PersistenceSettings
from persistence.redis_security import Sentinels, connect_options, for_embedded, sentinels

BASE = PersistenceSettings()


def _named(config: PersistenceSettings, url: str) -> str:
    with pytest.raises(ConfigError) as caught:
        connect_options(config, url)
    assert caught.value.name is not None
    return caught.value.name


def test_nothing_set_gives_no_options() -> None:
    assert connect_options(BASE, "redis://127.0.0.1:6379/0") == {}


def test_tls_files_need_a_rediss_url(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("x")
    config = replace(BASE, redis_tls_ca_file=str(ca))
    assert _named(config, "redis://h:6379/0") == "persistence.redis_tls_ca_file"


def test_a_certificate_needs_its_key_and_a_key_its_certificate(tmp_path: Path) -> None:
    url = "rediss://h:6379/0"
    assert _named(replace(BASE, redis_tls_cert_file="c"), url) == "persistence.redis_tls_key_file"
    assert _named(replace(BASE, redis_tls_key_file="k"), url) == "persistence.redis_tls_cert_file"


def test_unreadable_or_empty_files_are_named(tmp_path: Path) -> None:
    url = "rediss://h:6379/0"
    missing = str(tmp_path / "absent")
    assert _named(replace(BASE, redis_tls_ca_file=missing), url) == "persistence.redis_tls_ca_file"
    not_a_ca = tmp_path / "not-a-ca.crt"
    not_a_ca.write_text("hello")
    config = replace(BASE, redis_tls_ca_file=str(not_a_ca))
    assert _named(config, url) == "persistence.redis_tls_ca_file"
    empty = tmp_path / "password"
    empty.write_text("\n")
    config = replace(BASE, redis_password_file=str(empty))
    assert _named(config, url) == "persistence.redis_password_file"


def test_the_user_and_password_file_are_passed_on(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    config = replace(BASE, redis_username="devicemq", redis_password_file=str(secret))
    options = connect_options(config, "rediss://h:6379/0")
    assert options["username"] == "devicemq" and options["password"] == "s3cret"
    assert options["ssl_check_hostname"] is True and options["ssl_cert_reqs"] == "required"


def test_a_user_or_password_in_the_url_and_in_the_settings_is_refused(tmp_path: Path) -> None:
    """Found by review: redis-py lets the URL's win, silently (an old password left in
    the URL would be used while the file holds the new one)."""
    secret = tmp_path / "password"
    secret.write_text("new\n")
    with_file = replace(BASE, redis_password_file=str(secret))
    assert _named(with_file, "rediss://u:old@h:6379/0") == "persistence.redis_password_file"
    assert _named(with_file, "redis://h:6379/0?password=old") == "persistence.redis_password_file"
    with_user = replace(BASE, redis_username="devicemq")
    assert _named(with_user, "redis://someone@h:6379/0") == "persistence.redis_username"


def test_the_scheme_is_case_insensitive(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("x")
    config = replace(BASE, redis_tls_ca_file=str(ca))
    # Found by review: REDISS:// is TLS to redis-py; the CA file is then read (and
    # found to hold no certificate), not refused for a plain URL.
    with pytest.raises(ConfigError, match="holds no CA certificate"):
        connect_options(config, "REDISS://h:6379/0")


def test_the_embedded_redis_takes_none_of_them() -> None:
    """Found by review: they were sent to the embedded Redis, which has no users."""
    from persistence.redis_security import for_embedded

    for_embedded(BASE)  # nothing set: fine
    with pytest.raises(ConfigError) as caught:
        for_embedded(replace(BASE, redis_username="devicemq"))
    assert caught.value.name == "persistence.redis_username"


# ------------------------------------------------------------------ Sentinel


def _sentinel_error(config: PersistenceSettings, url: str = "redis:///0") -> tuple[str, str]:
    with pytest.raises(ConfigError) as caught:
        sentinels(config, url)
    assert caught.value.name is not None
    return caught.value.name, str(caught.value)


SENTINEL = replace(BASE, redis_sentinels="10.0.0.5:26379, [::1]:26380", redis_sentinel_master="m")


def test_sentinels_and_the_master_name_are_read() -> None:
    assert sentinels(BASE, "redis://h:6379/0") is None
    found = sentinels(SENTINEL, "rediss:///3")
    assert found == Sentinels((("10.0.0.5", 26379), ("::1", 26380)), "m", 3)


def test_sentinel_mistakes_are_named() -> None:
    no_master = replace(SENTINEL, redis_sentinel_master="")
    assert _sentinel_error(no_master)[0] == "persistence.redis_sentinel_master"
    no_sentinels = replace(BASE, redis_sentinel_master="m")
    assert _sentinel_error(no_sentinels)[0] == "persistence.redis_sentinel_master"
    for bad in ("10.0.0.5", "10.0.0.5:x", ":26379", "h:0", "h:70000"):
        named, text = _sentinel_error(replace(SENTINEL, redis_sentinels=bad))
        assert named == "persistence.redis_sentinels" and "host:port" in text
    named, text = _sentinel_error(SENTINEL, "redis://10.0.0.9:6379/0")
    assert named == "persistence.redis_url" and "redis:///0" in text
    assert _sentinel_error(SENTINEL, "redis:///0?ssl_cert_reqs=none")[0] == "persistence.redis_url"
    assert _sentinel_error(SENTINEL, "redis:///zero")[0] == "persistence.redis_url"
    both = replace(SENTINEL, redis_cluster=True)
    assert _sentinel_error(both)[0] == "persistence.redis_sentinels"


def test_the_embedded_redis_takes_no_sentinels() -> None:
    with pytest.raises(ConfigError) as caught:
        for_embedded(SENTINEL)
    assert caught.value.name == "persistence.redis_sentinels"


def test_the_pipeline_names_a_wrong_redis_setting_in_one_line_before_spark_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``devicemq pipeline --redis`` is reached as the brokers reach Redis (persistence.redis_*)."""
    from pipeline.cli import main

    monkeypatch.setenv("DEVICEMQ_PERSISTENCE_REDIS_SENTINELS", "127.0.0.1:26379")
    monkeypatch.setenv("DEVICEMQ_PERSISTENCE_REDIS_SENTINEL_MASTER", "m")
    argv = ["audit", "--bootstrap", "127.0.0.1:1", "--redis", "redis://127.0.0.1:6379/0"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "persistence.redis_url" in lines[0], lines
    monkeypatch.delenv("DEVICEMQ_PERSISTENCE_REDIS_SENTINELS")
    monkeypatch.delenv("DEVICEMQ_PERSISTENCE_REDIS_SENTINEL_MASTER")
    monkeypatch.setenv("DEVICEMQ_PERSISTENCE_REDIS_PASSWORD_FILE", str(tmp_path / "absent"))
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "persistence.redis_password_file" in lines[0], lines
