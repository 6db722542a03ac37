"""devicemq against a secured Kafka (persistence/kafka_security.py, issue 18).

TLS: a real Tansu behind a TLS terminator of the test's own (tests/tls_terminator.py:
Tansu 0.6.0 serves no TLS itself), advertising the terminator's address, so every
connection a client makes, to bootstrap and to the partition leader, is TLS; with
client certificates required. Persistent sessions' messages go through it, none
acknowledged is lost; a wrong CA, a missing client certificate, plaintext towards
a TLS port each stop the broker at start with one line naming the setting; a
certificate Kafka changes to one the CA did not sign turns ``/ready`` 503 saying so.

SASL: a real Tansu with ``--authentication``. With memory storage it cannot be
given a user (``tansu user create`` is itself refused once authentication is on),
so what is tested end to end is a refused SCRAM-SHA-256/512 login, plain and over
TLS: one line naming the credentials' settings. A login that succeeds is not
tested against a server here, nor PLAIN (Tansu offers SCRAM only): the options
are unit-tested (tests/unit/test_kafka_security.py).
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.embedded_services import find_tansu, free_port
from broker.packets import ConnAck, Properties, PubAck, Publish, SubAck, Subscribe, Subscription
from tests import tls_terminator
from tests.e2e.clients import Raw
from tests.faults.conftest import HOST, DeviceMQ, RedisProcess, _wait_tcp
from tests.kafka_fixtures import _die_with_parent, stop_tansu
from tests.pki import Pki, make_pki

SASL_PASSWORD = "not-a-user-of-this-kafka"


def _start_tansu(
    directory: Path, advertised: int | None, *extra: str
) -> tuple[subprocess.Popen[bytes], int]:
    """A Tansu on a free port advertising 127.0.0.1:``advertised`` (None: that port);
    (process, port)."""
    port = free_port(HOST)
    advertised = advertised or port
    listen = f"tcp://{HOST}:{port}"
    argv = [
        find_tansu(), "broker", "--listener-url", listen,
        "--advertised-listener-url", f"tcp://{HOST}:{advertised}",
        "--storage-engine", "memory://tansu/", *extra,
    ]  # fmt: skip
    with (directory / f"tansu-{port}.log").open("ab") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
    try:
        _wait_tcp(port, lambda: proc.poll() is None, 20, "tansu")
    except BaseException:
        stop_tansu(proc)
        raise
    return proc, port


class TlsKafka:
    """Tansu behind a TLS terminator that wants client certificates of ``pki.ca``."""

    def __init__(self, directory: Path, pki: Pki) -> None:
        self.pki = pki
        self.port = free_port(HOST)  # the TLS one, advertised
        self.tansu, self.plain_port = _start_tansu(directory, self.port)
        self.terminator: subprocess.Popen[str] | None = None
        self.serve(pki.server_cert, pki.server_key)

    @property
    def bootstrap(self) -> str:
        return f"{HOST}:{self.port}"

    def serve(self, cert: Path, key: Path) -> None:
        """(Re)start the terminator with this certificate: a rotation under clients."""
        if self.terminator is not None:
            tls_terminator.stop(self.terminator)
        self.terminator = tls_terminator.start(self.port, self.plain_port, cert, key, self.pki.ca)

    def stop(self) -> None:
        if self.terminator is not None:
            tls_terminator.stop(self.terminator)
        stop_tansu(self.tansu)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("kafka-pki"))


@pytest.fixture
def tls_kafka(tmp_path: Path, pki: Pki) -> Iterator[TlsKafka]:
    kafka = TlsKafka(tmp_path, pki)
    try:
        yield kafka
    finally:
        kafka.stop()


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisProcess]:
    process = RedisProcess(tmp_path / "redis")
    process.start()
    try:
        yield process
    finally:
        process.stop()


def _names() -> dict[str, object]:
    tag = uuid.uuid4().hex[:8]
    return {
        "persistence.topic": f"kafkasec.{tag}",
        "persistence.consumer_group": f"kafkasec-{tag}",
        "persistence.partitions": 2,
        "events.topic": f"kafkasec-events.{tag}",
    }


def _tls(pki: Pki, **more: object) -> dict[str, object]:
    return {
        **_names(),
        "persistence.kafka_security_protocol": "SSL",
        "persistence.kafka_tls_ca_file": str(pki.ca),
        "persistence.kafka_tls_cert_file": str(pki.client_cert),
        "persistence.kafka_tls_key_file": str(pki.client_key),
        **more,
    }


def _start_error(broker: DeviceMQ) -> str:
    """The one line the broker ends with when it cannot start."""
    with pytest.raises(RuntimeError):
        broker.start()
    lines = [line for line in broker.log().splitlines() if line.strip()]
    return lines[-1]


def _through_kafka(broker: DeviceMQ, name: str, count: int) -> None:
    """``count`` messages to an offline persistent session (so through Kafka, then
    Redis): every one acknowledged to the publisher is delivered, in order."""
    expiry = Properties(session_expiry_interval=600)
    topic = f"{name}/t"
    sub = Raw(broker)
    assert isinstance(sub.connect(f"{name}-sub", clean_start=True, properties=expiry), ConnAck)
    sub.send(Subscribe(1, [Subscription(topic, 1)]))
    assert isinstance(sub.recv(), SubAck)
    sub.close()  # offline: what is published waits in Kafka, then Redis
    pub = Raw(broker)
    pub.connect(f"{name}-pub")
    acknowledged = []
    for i in range(count):
        pub.send(Publish(topic, f"m{i}".encode(), 1, packet_id=i + 1))
        ack = pub.recv(timeout=20)
        assert isinstance(ack, PubAck) and ack.packet_id == i + 1
        if ack.reason_code == 0:
            acknowledged.append(f"m{i}".encode())
    assert len(acknowledged) == count
    again = Raw(broker)
    connack = again.connect(f"{name}-sub", clean_start=False, properties=expiry)
    assert isinstance(connack, ConnAck) and connack.session_present
    got = []
    while len(got) < count:
        message = again.recv(timeout=20)
        assert isinstance(message, Publish), message
        got.append(message.payload)
        if message.packet_id is not None:
            again.send(PubAck(message.packet_id))
    assert got == acknowledged
    for each in (pub, again):
        each.close()


@pytest.mark.parametrize("client", ["aiokafka", "confluent"])
def test_persistent_messages_go_through_a_tls_kafka_none_lost(
    tmp_path: Path, tls_kafka: TlsKafka, redis: RedisProcess, client: str
) -> None:
    """Every message acknowledged to the publisher reaches the offline subscriber,
    through Kafka over TLS with a client certificate (both producers; the consumer,
    the admin client and the events producer are aiokafka's either way)."""
    settings = _tls(tls_kafka.pki, **{"persistence.kafka_client": client})
    broker = DeviceMQ(tmp_path / "broker", redis, tls_kafka.bootstrap, settings)
    broker.start()
    try:
        _through_kafka(broker, "tls", 50)
    finally:
        broker.stop()
    assert "Traceback" not in broker.log()


@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("a CA that did not sign it", "persistence.kafka_tls_ca_file"),
        ("no client certificate", "persistence.kafka_tls_cert_file"),
        ("plaintext towards TLS", "persistence.kafka_security_protocol"),
        ("a missing key file", "persistence.kafka_tls_key_file"),
        ("a host its certificate does not name", "persistence.kafka_tls_check_hostname"),
    ],
)
def test_what_is_wrong_with_tls_is_named_in_one_line_at_start(
    tmp_path: Path, tls_kafka: TlsKafka, redis: RedisProcess, case: str, named: str
) -> None:
    pki = tls_kafka.pki
    settings = _tls(pki)
    bootstrap = tls_kafka.bootstrap
    if case == "a host its certificate does not name":
        bootstrap = f"{tls_terminator.OTHER_HOST}:{tls_kafka.port}"
    elif case == "a CA that did not sign it":
        settings["persistence.kafka_tls_ca_file"] = str(pki.stranger_cert)
    elif case == "no client certificate":
        del settings["persistence.kafka_tls_cert_file"]
        del settings["persistence.kafka_tls_key_file"]
    elif case == "plaintext towards TLS":
        settings = _names()
    elif case == "a missing key file":
        settings["persistence.kafka_tls_key_file"] = str(tmp_path / "absent.key")
    line = _start_error(DeviceMQ(tmp_path / "broker", redis, bootstrap, settings))
    assert named in line, line
    assert line.startswith("devicemq: error: cannot use kafka at") or case == "a missing key file"
    assert "Traceback" not in line


def test_ready_names_a_certificate_the_ca_did_not_sign(
    tmp_path: Path, tls_kafka: TlsKafka, redis: RedisProcess
) -> None:
    """Kafka's certificate is replaced, under a running broker, by one a CA it does not
    trust signed: every reconnection fails its handshake and ``/ready`` says why."""
    from tests.faults.test_readiness import metrics_settings, wait_ready

    metrics = metrics_settings()
    settings = _tls(tls_kafka.pki, **metrics)
    broker = DeviceMQ(tmp_path / "broker", redis, tls_kafka.bootstrap, settings)
    broker.start()
    port = int(str(metrics["metrics.port"]))
    try:
        wait_ready(port, 200, 60)
        tls_kafka.serve(tls_kafka.pki.stranger_cert, tls_kafka.pki.stranger_key)
        body = wait_ready(port, 503, 30, naming="persistence.kafka_tls_ca_file")
        assert "TLS with kafka failed" in str(body["reason"]), body
    finally:
        broker.stop()


@pytest.mark.parametrize(
    ("protocol", "mechanism"),
    [
        ("SASL_PLAINTEXT", "SCRAM-SHA-256"),
        ("SASL_PLAINTEXT", "SCRAM-SHA-512"),
        ("SASL_SSL", "SCRAM-SHA-512"),
    ],
)
def test_a_refused_sasl_login_is_named_in_one_line_at_start(
    tmp_path: Path, pki: Pki, redis: RedisProcess, protocol: str, mechanism: str
) -> None:
    advertised = free_port(HOST) if protocol == "SASL_SSL" else None
    tansu, plain = _start_tansu(tmp_path, advertised, "--authentication")
    terminator = None
    try:
        bootstrap = f"{HOST}:{plain}"
        if advertised is not None:  # SASL_SSL
            terminator = tls_terminator.start(advertised, plain, pki.server_cert, pki.server_key)
            bootstrap = f"{HOST}:{advertised}"
        password = tmp_path / "kafka-password"
        password.write_text(SASL_PASSWORD + "\n")
        settings: dict[str, object] = {
            **_names(),
            "persistence.kafka_security_protocol": protocol,
            "persistence.kafka_sasl_mechanism": mechanism,
            "persistence.kafka_sasl_username": "devicemq",
            "persistence.kafka_sasl_password_file": str(password),
        }
        if protocol == "SASL_SSL":
            settings["persistence.kafka_tls_ca_file"] = str(pki.ca)
        line = _start_error(DeviceMQ(tmp_path / "broker", redis, bootstrap, settings))
        assert "kafka refused the credentials" in line, line
        assert "persistence.kafka_sasl_username" in line and mechanism in line
        assert SASL_PASSWORD not in line and "Traceback" not in line
    finally:
        if terminator is not None:
            tls_terminator.stop(terminator)
        stop_tansu(tansu)


def test_the_pipelines_kafka_reader_reads_through_tls(tls_kafka: TlsKafka) -> None:
    """The pipeline's source (pipeline/kafka_source.py) reads what was written through
    TLS, its security handed on as the source's options (no Spark needed to drive it)."""
    import asyncio

    from aiokafka import AIOKafkaProducer

    from broker.config import PersistenceSettings
    from persistence.kafka_path import ensure_topic
    from persistence.kafka_security import from_settings
    from pipeline.kafka_source import KafkaSource

    pki = tls_kafka.pki
    security = from_settings(
        PersistenceSettings(
            kafka_security_protocol="SSL",
            kafka_tls_ca_file=str(pki.ca),
            kafka_tls_cert_file=str(pki.client_cert),
            kafka_tls_key_file=str(pki.client_key),
        )
    )
    topic = f"kafkasec-pipeline.{uuid.uuid4().hex[:8]}"
    sent = [f"r{i}".encode() for i in range(20)]

    async def write() -> None:
        assert await ensure_topic(tls_kafka.bootstrap, topic, 2, security=security)
        producer = AIOKafkaProducer(
            bootstrap_servers=tls_kafka.bootstrap, acks="all", **security.aiokafka()
        )
        await producer.start()
        try:
            for value in sent:
                await producer.send_and_wait(topic, value, key=value)
        finally:
            await producer.stop()

    asyncio.run(write())
    source = KafkaSource(
        {"bootstrap": tls_kafka.bootstrap, "topic": topic, **security.as_options()}
    )
    reader = source.reader(None)  # type: ignore[arg-type]  # the schema is fixed
    # Arrow record batches (pipeline/kafka_source.py read_range): the values column
    read = [
        value
        for part in reader.partitions()
        for batch in reader.read(part)
        for value in batch.column(1).to_pylist()
    ]
    assert sorted(read) == sorted(sent)


def test_no_host_name_check_reaches_kafka_by_another_name(
    tmp_path: Path, tls_kafka: TlsKafka, redis: RedisProcess
) -> None:
    """``kafka_tls_check_hostname: false``: a bootstrap address the certificate does not
    name is accepted (the certificate is still verified against the CA)."""
    settings = _tls(tls_kafka.pki, **{"persistence.kafka_tls_check_hostname": False})
    bootstrap = f"{tls_terminator.OTHER_HOST}:{tls_kafka.port}"
    broker = DeviceMQ(tmp_path / "broker", redis, bootstrap, settings)
    broker.start()
    try:
        _through_kafka(broker, "nocheck", 5)
    finally:
        broker.stop()


def test_an_integration_rules_records_go_through_a_tls_kafka(
    tmp_path: Path, tls_kafka: TlsKafka, redis: RedisProcess
) -> None:
    """The integration producer (persistence/integration_sink.py) reaches Kafka with the
    same TLS settings as the persistent path: the PUBACK comes once the rule's record
    is in the user's topic, read back over TLS."""
    import asyncio
    import json

    from aiokafka import AIOKafkaConsumer

    from broker.config import PersistenceSettings
    from persistence.kafka_path import ensure_topic
    from persistence.kafka_security import from_settings

    pki = tls_kafka.pki
    security = from_settings(
        PersistenceSettings(
            kafka_security_protocol="SSL",
            kafka_tls_ca_file=str(pki.ca),
            kafka_tls_cert_file=str(pki.client_cert),
            kafka_tls_key_file=str(pki.client_key),
        )
    )
    topic = f"kafkasec-rule.{uuid.uuid4().hex[:8]}"
    asyncio.run(ensure_topic(tls_kafka.bootstrap, topic, 1, security=security))
    rule = {"name": "plant", "topic_filter": "plant/#", "kafka_topic": topic}
    settings = _tls(pki, integrations=json.dumps([rule]))
    broker = DeviceMQ(tmp_path / "broker", redis, tls_kafka.bootstrap, settings)
    broker.start()
    try:
        pub = Raw(broker)
        assert isinstance(pub.connect("rule-pub"), ConnAck)
        pub.send(Publish("plant/line1", b"through TLS", 1, packet_id=1))
        ack = pub.recv(timeout=30)
        assert isinstance(ack, PubAck) and ack.reason_code == 0, ack
        pub.close()
    finally:
        broker.stop()

    async def read() -> list[bytes]:
        consumer = AIOKafkaConsumer(
            topic,
            bootstrap_servers=tls_kafka.bootstrap,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            **security.aiokafka(),
        )
        await consumer.start()
        try:
            batches = await consumer.getmany(timeout_ms=10_000)
            return [r.value for records in batches.values() for r in records]
        finally:
            await consumer.stop()

    assert asyncio.run(read()) == [b"through TLS"]
    assert "Traceback" not in broker.log()
