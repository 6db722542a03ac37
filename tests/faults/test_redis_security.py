"""devicemq against a secured redis-server: TLS (rediss://, a CA of the test's
own, a client certificate) and an ACL user with a password, the default user
switched off (persistence/redis_security.py, issue 18).

A persistent session's message goes through the secured Redis and comes back;
wrong credentials, a CA that does not sign the server's certificate, and a
missing file each stop the broker at start with one line naming the setting.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import redis

from app.embedded_services import find_redis_server
from broker.packets import ConnAck, Properties, PubAck, Publish, SubAck, Subscribe, Subscription
from tests.e2e.clients import Raw
from tests.faults.conftest import HOST, DeviceMQ, RedisProcess

USER, PASSWORD = "devicemq", "s3cret-for-tests"


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _certificates(root: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 it signs, a client certificate it
    signs, and another CA that signs nothing here."""
    root.mkdir(parents=True, exist_ok=True)
    files = {name: root / name for name in (
        "ca.crt", "ca.key", "server.crt", "server.key", "client.crt", "client.key",
        "other-ca.crt", "other-ca.key",
    )}  # fmt: skip
    for ca in ("ca", "other-ca"):
        _openssl(
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={ca}",
            "-keyout", str(files[f"{ca}.key"]), "-out", str(files[f"{ca}.crt"]),
        )  # fmt: skip
    ext = root / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    for who in ("server", "client"):
        csr = root / f"{who}.csr"
        _openssl(
            "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={who}",
            "-keyout", str(files[f"{who}.key"]), "-out", str(csr),
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", str(csr), "-CA", str(files["ca.crt"]),
            "-CAkey", str(files["ca.key"]), "-CAcreateserial", "-days", "2",
            "-out", str(files[f"{who}.crt"]), "-extfile", str(ext),
        )  # fmt: skip
    return files


class SecuredRedis(RedisProcess):
    """redis-server on TLS only, client certificates required, one ACL user."""

    def __init__(self, directory: Path, certs: dict[str, Path]) -> None:
        super().__init__(directory)
        self.certs = certs

    @property
    def url(self) -> str:
        return f"rediss://{HOST}:{self.port}/0"

    def start(self) -> None:
        argv = [
            find_redis_server(),
            "--port", "0", "--tls-port", str(self.port), "--bind", HOST,
            "--tls-cert-file", str(self.certs["server.crt"]),
            "--tls-key-file", str(self.certs["server.key"]),
            "--tls-ca-cert-file", str(self.certs["ca.crt"]),
            "--tls-auth-clients", "yes",
            "--user", "default", "off",
            "--user", USER, "on", f">{PASSWORD}", "~*", "&*", "+@all",
            "--dir", str(self.dir), "--appendonly", "yes", "--save", "",
            "--daemonize", "no", "--loglevel", "warning",
            "--logfile", str(self.dir / f"redis-{self.starts}.log"),
        ]  # fmt: skip
        self.starts += 1
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while not self.ping():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server (TLS) did not start on {self.port}")
            time.sleep(0.05)

    def client(self, **options: object) -> redis.Redis:
        """A client of this Redis as the ACL user, with the client certificate."""
        return redis.Redis(
            host=HOST,
            port=self.port,
            ssl=True,
            ssl_ca_certs=str(self.certs["ca.crt"]),
            ssl_certfile=str(self.certs["client.crt"]),
            ssl_keyfile=str(self.certs["client.key"]),
            username=USER,
            password=PASSWORD,
            **options,  # type: ignore[arg-type]
        )

    def ping(self) -> bool:
        client = self.client(socket_timeout=1)
        try:
            return bool(client.ping())
        except (redis.RedisError, OSError):
            return False
        finally:
            client.close()


@pytest.fixture
def secured(tmp_path: Path) -> SecuredRedis:
    certs = _certificates(tmp_path / "certs")
    redis = SecuredRedis(tmp_path / "redis", certs)
    redis.start()
    yield redis  # type: ignore[misc]
    redis.stop()


def _settings(redis: SecuredRedis, password_file: Path, **more: object) -> dict[str, object]:
    tag = password_file.parent.name[-8:]
    return {
        "persistence.topic": f"secured.{tag}",
        "persistence.consumer_group": f"secured-{tag}",
        "persistence.partitions": 2,
        "persistence.redis_username": USER,
        "persistence.redis_password_file": str(password_file),
        "persistence.redis_tls_ca_file": str(redis.certs["ca.crt"]),
        "persistence.redis_tls_cert_file": str(redis.certs["client.crt"]),
        "persistence.redis_tls_key_file": str(redis.certs["client.key"]),
        **more,
    }


def _password(tmp_path: Path, text: str = PASSWORD) -> Path:
    path = tmp_path / "redis-password"
    path.write_text(text + "\n")
    return path


def test_a_persistent_sessions_message_goes_through_a_secured_redis(
    tmp_path: Path, secured: SecuredRedis, kafka: tuple[str, int | None]
) -> None:
    broker = DeviceMQ(
        tmp_path / "broker", secured, kafka[0], _settings(secured, _password(tmp_path))
    )
    broker.start()
    try:
        expiry = Properties(session_expiry_interval=600)
        sub = Raw(broker)
        assert isinstance(sub.connect("sec-sub", clean_start=True, properties=expiry), ConnAck)
        sub.send(Subscribe(1, [Subscription("sec/t", 1)]))
        assert isinstance(sub.recv(), SubAck)
        sub.close()  # offline: the message waits in Redis
        pub = Raw(broker)
        pub.connect("sec-pub")
        pub.send(Publish("sec/t", b"through TLS", 1, packet_id=1))
        ack = pub.recv()
        assert isinstance(ack, PubAck) and ack.reason_code == 0
        again = Raw(broker)
        connack = again.connect("sec-sub", clean_start=False, properties=expiry)
        assert isinstance(connack, ConnAck) and connack.session_present
        got = again.recv(timeout=20)
        assert isinstance(got, Publish) and got.payload == b"through TLS"
        for client in (pub, again):
            client.close()
    finally:
        broker.stop()


def _start_error(broker: DeviceMQ) -> str:
    """The one line the broker ends with when it cannot start."""
    with pytest.raises(RuntimeError):
        broker.start()
    lines = [line for line in broker.log().splitlines() if line.strip()]
    return lines[-1]


@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("wrong password", "persistence.redis_password_file"),
        ("another CA", "persistence.redis_tls_ca_file"),
        ("no client certificate", "persistence.redis_tls_cert_file"),
        ("missing CA file", "persistence.redis_tls_ca_file"),
        ("wrong host name", "persistence.redis_tls_check_hostname"),
        ("key of another certificate", "persistence.redis_tls_cert_file"),
    ],
)
def test_what_is_wrong_is_named_in_one_line_at_start(
    tmp_path: Path,
    secured: SecuredRedis,
    kafka: tuple[str, int | None],
    case: str,
    named: str,
) -> None:
    settings = _settings(secured, _password(tmp_path))
    if case == "wrong password":
        settings["persistence.redis_password_file"] = str(_password(tmp_path, "nope"))
    elif case == "another CA":
        settings["persistence.redis_tls_ca_file"] = str(secured.certs["other-ca.crt"])
    elif case == "no client certificate":
        del settings["persistence.redis_tls_cert_file"], settings["persistence.redis_tls_key_file"]
    elif case == "missing CA file":
        settings["persistence.redis_tls_ca_file"] = str(tmp_path / "absent.crt")
    elif case == "wrong host name":  # its certificate names 127.0.0.1 only
        settings["persistence.redis_url"] = f"rediss://localhost:{secured.port}/0"
    else:
        settings["persistence.redis_tls_key_file"] = str(secured.certs["server.key"])
    line = _start_error(DeviceMQ(tmp_path / "broker", secured, kafka[0], settings))
    assert named in line, line
    assert "Traceback" not in line and PASSWORD not in line


def test_ready_names_a_refused_login_while_running(
    tmp_path: Path, secured: SecuredRedis, kafka: tuple[str, int | None]
) -> None:
    """The password is changed in Redis under a running broker and its connections
    are closed: ``/ready`` turns 503 naming the credentials' settings (issue 18)."""
    from tests.faults.test_readiness import metrics_settings, wait_ready

    metrics = metrics_settings()
    settings = _settings(secured, _password(tmp_path), **metrics)
    broker = DeviceMQ(tmp_path / "broker", secured, kafka[0], settings)
    broker.start()
    port = int(str(metrics["metrics.port"]))
    admin = secured.client()
    try:
        wait_ready(port, 200, 60)
        admin.execute_command("ACL", "SETUSER", USER, "resetpass", ">rotated-elsewhere")
        admin.execute_command("CLIENT", "KILL", "USER", USER, "SKIPME", "yes")
        body = wait_ready(port, 503, 30, naming="persistence.redis_password_file")
        assert PASSWORD not in str(body)
    finally:
        admin.close()
        broker.stop()


def test_the_pipeline_reads_the_stored_messages_of_a_secured_redis(
    tmp_path: Path, secured: SecuredRedis
) -> None:
    """The audit's Redis reads (pipeline/audit.py ``stored_refs``) use the brokers'
    TLS files and ACL user (``devicemq pipeline --redis rediss://...``)."""
    from dataclasses import replace

    from broker.config import PersistenceSettings
    from persistence.format import client_keys
    from persistence.redis_security import connect_options
    from pipeline.audit import stored_refs
    from pipeline.common import Endpoints

    client = secured.client()
    try:
        client.zadd(client_keys("pipe-sub").messages, {"9": 4})
    finally:
        client.close()
    password = _password(tmp_path)
    config = PersistenceSettings()
    for key, value in _settings(secured, password).items():
        if key.startswith("persistence.redis_"):
            config = replace(config, **{key.removeprefix("persistence."): value})
    endpoints = Endpoints(
        "unused:1", secured.url, redis_connect=connect_options(config, secured.url)
    )
    assert list(stored_refs(endpoints, [("pipe-sub",)])) == [("pipe-sub", 4, 9, False)]
