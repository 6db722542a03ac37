"""The Kafka security settings (persistence/kafka_security.py): each mistake is one
line naming its setting at start, and the options each client library gets.

Against real servers: tests/faults/test_kafka_security.py (TLS, a refused SASL
login). Tansu 0.6.0 cannot log a SASL user in with memory storage and offers no
PLAIN, so the options of a working SASL login are checked here only."""

from __future__ import annotations

import pickle
import ssl
from dataclasses import replace
from pathlib import Path

import pytest

from broker.config import ConfigError, PersistenceSettings, load_settings
from persistence.kafka_security import (
    PLAINTEXT,
    explain,
    for_embedded,
    from_options,
    from_settings,
)
from tests.pki import Pki, make_pki

BASE = PersistenceSettings()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _named(config: PersistenceSettings) -> str:
    with pytest.raises(ConfigError) as caught:
        from_settings(config)
    assert caught.value.name is not None
    return caught.value.name


def _password(tmp_path: Path, text: str = "s3cret") -> str:
    path = tmp_path / "kafka-password"
    path.write_text(text + "\n")
    return str(path)


def test_plaintext_by_default() -> None:
    security = from_settings(BASE)
    assert security == PLAINTEXT
    assert security.aiokafka() == {"security_protocol": "PLAINTEXT"}
    assert security.librdkafka() == {"security.protocol": "plaintext"}


def test_every_setting_is_loaded_from_the_environment(tmp_path: Path) -> None:
    env = {
        "DEVICEMQ_PERSISTENCE_KAFKA_SECURITY_PROTOCOL": "sasl_ssl",
        "DEVICEMQ_PERSISTENCE_KAFKA_SASL_MECHANISM": "scram-sha-256",
        "DEVICEMQ_PERSISTENCE_KAFKA_SASL_USERNAME": "devicemq",
        "DEVICEMQ_PERSISTENCE_KAFKA_SASL_PASSWORD_FILE": _password(tmp_path),
        "DEVICEMQ_PERSISTENCE_KAFKA_TLS_CHECK_HOSTNAME": "false",
    }
    config = load_settings(env=env).persistence
    assert (config.kafka_security_protocol, config.kafka_sasl_mechanism) == (
        "SASL_SSL",
        "SCRAM-SHA-256",
    )
    security = from_settings(config)
    assert security.password == "s3cret" and not security.check_hostname


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("DEVICEMQ_PERSISTENCE_KAFKA_SECURITY_PROTOCOL", "TLS"),
        ("DEVICEMQ_PERSISTENCE_KAFKA_SASL_MECHANISM", "GSSAPI"),
    ],
)
def test_an_unknown_protocol_or_mechanism_is_refused_at_load(variable: str, value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(env={variable: value})
    assert "must be one of" in str(caught.value)
    assert variable in str(caught.value)


def test_sasl_needs_a_user_and_a_readable_non_empty_password_file(tmp_path: Path) -> None:
    sasl = replace(BASE, kafka_security_protocol="SASL_PLAINTEXT")
    assert _named(sasl) == "persistence.kafka_sasl_username"
    user = replace(sasl, kafka_sasl_username="devicemq")
    assert _named(user) == "persistence.kafka_sasl_password_file"
    missing = replace(user, kafka_sasl_password_file=str(tmp_path / "absent"))
    assert _named(missing) == "persistence.kafka_sasl_password_file"
    empty = replace(user, kafka_sasl_password_file=_password(tmp_path, " "))
    assert _named(empty) == "persistence.kafka_sasl_password_file"


def test_settings_the_protocol_does_not_use_are_refused(tmp_path: Path, pki: Pki) -> None:
    """A login or TLS files given with a protocol that would ignore them: the operator
    believes the connection secured when it is not."""
    login = replace(BASE, kafka_sasl_username="devicemq")
    assert _named(login) == "persistence.kafka_sasl_username"
    tls_login = replace(login, kafka_security_protocol="SSL")
    assert _named(tls_login) == "persistence.kafka_sasl_username"
    ca = replace(BASE, kafka_tls_ca_file=str(pki.ca))
    assert _named(ca) == "persistence.kafka_tls_ca_file"
    sasl_ca = replace(ca, kafka_security_protocol="SASL_PLAINTEXT")
    assert _named(sasl_ca) == "persistence.kafka_tls_ca_file"


def test_tls_files_are_checked_at_start(tmp_path: Path, pki: Pki) -> None:
    tls = replace(BASE, kafka_security_protocol="SSL")
    missing = replace(tls, kafka_tls_ca_file=str(tmp_path / "absent.pem"))
    assert _named(missing) == "persistence.kafka_tls_ca_file"
    not_a_ca = tmp_path / "not-a-ca.pem"
    not_a_ca.write_text("hello")
    assert _named(replace(tls, kafka_tls_ca_file=str(not_a_ca))) == "persistence.kafka_tls_ca_file"
    only_cert = replace(tls, kafka_tls_cert_file=str(pki.client_cert))
    assert _named(only_cert) == "persistence.kafka_tls_key_file"
    only_key = replace(tls, kafka_tls_key_file=str(pki.client_key))
    assert _named(only_key) == "persistence.kafka_tls_cert_file"
    mismatched = replace(only_cert, kafka_tls_key_file=str(pki.server_key))
    assert _named(mismatched) == "persistence.kafka_tls_cert_file"


def test_a_key_with_a_passphrase_is_named(tmp_path: Path, pki: Pki) -> None:
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(pki.client_key.read_bytes(), None)
    locked = tmp_path / "locked.key"
    locked.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"phrase"),
        )
    )
    config = replace(
        BASE,
        kafka_security_protocol="SSL",
        kafka_tls_cert_file=str(pki.client_cert),
        kafka_tls_key_file=str(locked),
    )
    assert _named(config) == "persistence.kafka_tls_key_file"


def _sasl_ssl(tmp_path: Path, pki: Pki, mechanism: str = "SCRAM-SHA-512") -> PersistenceSettings:
    return replace(
        BASE,
        kafka_security_protocol="SASL_SSL",
        kafka_sasl_mechanism=mechanism,
        kafka_sasl_username="devicemq",
        kafka_sasl_password_file=_password(tmp_path),
        kafka_tls_ca_file=str(pki.ca),
        kafka_tls_cert_file=str(pki.client_cert),
        kafka_tls_key_file=str(pki.client_key),
    )


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_aiokafka_options_of_sasl_over_tls(tmp_path: Path, pki: Pki, mechanism: str) -> None:
    security = from_settings(_sasl_ssl(tmp_path, pki, mechanism))
    options = security.aiokafka()
    context = options.pop("ssl_context")
    assert options == {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": mechanism,
        "sasl_plain_username": "devicemq",
        "sasl_plain_password": "s3cret",
    }
    assert isinstance(context, ssl.SSLContext)
    assert context.check_hostname and context.verify_mode == ssl.CERT_REQUIRED
    assert "s3cret" not in repr(security)


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_aiokafka_takes_the_options(tmp_path: Path, pki: Pki, mechanism: str) -> None:
    """aiokafka checks its arguments when a client is made: these pass."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient

    options = from_settings(_sasl_ssl(tmp_path, pki, mechanism)).aiokafka()

    async def make() -> None:  # aiokafka's clients want a running loop
        AIOKafkaAdminClient(bootstrap_servers="127.0.0.1:1", **options)
        AIOKafkaProducer(bootstrap_servers="127.0.0.1:1", **options)
        AIOKafkaConsumer(bootstrap_servers="127.0.0.1:1", **options)

    import asyncio

    asyncio.run(make())


def test_librdkafka_options_and_confluent_takes_them(tmp_path: Path, pki: Pki) -> None:
    from confluent_kafka import Producer

    config = replace(_sasl_ssl(tmp_path, pki, "SCRAM-SHA-256"), kafka_tls_check_hostname=False)
    options = from_settings(config).librdkafka()
    assert options == {
        "security.protocol": "sasl_ssl",
        "ssl.ca.location": str(pki.ca),
        "ssl.certificate.location": str(pki.client_cert),
        "ssl.key.location": str(pki.client_key),
        "ssl.endpoint.identification.algorithm": "none",
        "sasl.mechanism": "SCRAM-SHA-256",
        "sasl.username": "devicemq",
        "sasl.password": "s3cret",
    }
    Producer({"bootstrap.servers": "127.0.0.1:1", **options})  # librdkafka accepts them


def test_the_pipeline_options_carry_file_names_not_the_password(tmp_path: Path, pki: Pki) -> None:
    security = from_settings(_sasl_ssl(tmp_path, pki))
    options = security.as_options()
    assert "s3cret" not in str(options)
    spark_like = {name.upper(): value for name, value in options.items()}  # any case
    assert from_options(spark_like) == security
    assert from_options({}) == PLAINTEXT
    assert pickle.loads(pickle.dumps(security)) == security  # shipped to Spark's workers
    with pytest.raises(ConfigError) as caught:
        from_options({"kafka.security.protocol": "TLS"})
    assert caught.value.name == "persistence.kafka_security_protocol"


def test_the_embedded_kafka_takes_none_of_them(tmp_path: Path) -> None:
    assert for_embedded(BASE) == PLAINTEXT
    for key, value in [
        ("kafka_security_protocol", "SSL"),
        ("kafka_sasl_username", "devicemq"),
        ("kafka_tls_ca_file", "ca.pem"),
    ]:
        with pytest.raises(ConfigError) as caught:
            for_embedded(replace(BASE, **{key: value}))
        assert caught.value.name == f"persistence.{key}"


def test_failures_are_explained_with_their_settings() -> None:
    from aiokafka.errors import SaslAuthenticationFailed, UnsupportedSaslMechanismError

    sasl = replace(PLAINTEXT, protocol="SASL_SSL", mechanism="PLAIN")
    refused = explain(SaslAuthenticationFailed("bad password"), sasl)
    assert "refused the credentials" in refused and "kafka_sasl_password_file" in refused
    # aiokafka's SCRAM, refused, fails reading the server's signature:
    assert "refused the credentials" in explain(KeyError("v"), sasl)
    assert "kafka_sasl_mechanism" in explain(UnsupportedSaslMechanismError("no PLAIN"), sasl)
    unverified = ssl.SSLCertVerificationError(1, "certificate verify failed")
    unverified.reason = "CERTIFICATE_VERIFY_FAILED"
    assert "persistence.kafka_tls_ca_file" in explain(unverified, sasl)
    assert explain(ConnectionRefusedError("refused"), sasl) == "refused"


def test_the_pipeline_names_a_wrong_setting_in_one_line_before_spark_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline.cli import main

    monkeypatch.setenv("DEVICEMQ_PERSISTENCE_KAFKA_SECURITY_PROTOCOL", "SSL")
    monkeypatch.setenv("DEVICEMQ_PERSISTENCE_KAFKA_TLS_CA_FILE", str(tmp_path / "absent.pem"))
    argv = ["audit", "--bootstrap", "127.0.0.1:1", "--redis", "redis://127.0.0.1:1/0"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "persistence.kafka_tls_ca_file" in lines[0], lines
