"""auth.chain against a real devicemq process: a real HTTP authentication service run
by the test (tests/auth_service.py), JWTs minted with PyJWT from keys made with
cryptography, paho-mqtt clients and raw sockets for the 3.1.1 return codes."""

from __future__ import annotations

import json
import os
import queue
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from broker.packets import ConnAck, Connect, Will
from tests.auth_service import AuthService, SigningKey, claims, running_service, write_jwks
from tests.conftest import free_port
from tests.e2e.clients import V5, Paho
from tests.e2e.conftest import HOST, REPO, BrokerProcess, Clients, Names, devicemq_only
from tests.pki import make_pki

pytestmark = [pytest.mark.e2e, devicemq_only("auth.chain")]

MOSQUITTO_PUB = shutil.which("mosquitto_pub") or "/usr/bin/mosquitto_pub"

Factory = Callable[[Mapping[str, object] | None], BrokerProcess]
V311 = 4


@pytest.fixture
def service() -> Iterator[AuthService]:
    with running_service() as service:
        yield service


def paho(
    clients: Clients,
    broker: BrokerProcess,
    client_id: str,
    username: str,
    password: str,
    version: int = V5,
) -> Paho:
    client = Paho(broker, client_id, version, username=username, password=password)
    clients._made.append(client)
    return client


def raw_connack(clients: Clients, broker: BrokerProcess, level: int, **connect: object) -> object:
    with clients.raw(broker, level=level) as raw:
        return raw.connect(**connect)


def wait_for_log(broker: BrokerProcess, words: str, timeout: float = 10) -> None:
    """Until the broker logged ``words`` (an event the test waits for, not a delay)."""
    deadline = time.monotonic() + timeout
    while words not in broker.log():
        assert broker.alive(), broker.log()[-3000:]
        assert time.monotonic() < deadline, f"never logged {words!r}:\n{broker.log()[-3000:]}"
        time.sleep(0.05)


def test_http_service_decides_and_its_rules_are_enforced(
    service: AuthService, broker_factory: Factory, clients: Clients, names: Names
) -> None:
    service.allow("dev", acl=["readwrite devices/%c/#", "read news/#"])
    service.allow("reader", acl=["read devices/#"])
    service.answer("banned", 403)
    broker = broker_factory({"auth.chain": "http", "auth.http_url": service.url})

    device = paho(clients, broker, "d1", "dev", "dev-secret")
    assert device.connect().reason_code == 0
    sent = service.requests[-1]
    assert sent["client_id"] == "d1" and sent["password"] == "dev-secret"
    assert sent["peer_address"] == "127.0.0.1" and sent["certificate_subject"] is None
    assert device.subscribe([("devices/d1/#", 1), ("devices/d2/#", 1), ("news/#", 1)]) == [
        1,
        0x87,
        1,
    ]
    assert device.publish("devices/d2/cmd", b"x", qos=1) == 0x87  # not its device
    reader = paho(clients, broker, "r1", "reader", "pw")
    assert reader.connect().reason_code == 0
    assert reader.subscribe("devices/#", 1) == [1]
    assert device.publish("devices/d1/temp", b"21", qos=1) == 0
    assert device.get().payload == b"21"
    assert reader.get().payload == b"21"
    assert reader.publish("devices/r1/x", b"y", qos=1) == 0x87  # read only

    assert paho(clients, broker, "m", "mallory", "guess").connect().reason_code == 0x86
    assert paho(clients, broker, "b", "banned", "pw").connect().reason_code == 0x87
    bad = ConnAck(False, 4)
    assert (
        raw_connack(clients, broker, V311, client_id="m", username="mallory", password=b"g") == bad
    )
    banned = raw_connack(clients, broker, V311, client_id="b", username="banned", password=b"pw")
    assert banned == ConnAck(False, 5)
    # A will outside the client's rules is refused at CONNECT; inside them it is taken.
    for topic, expected in (("devices/d2/gone", 0x87), ("devices/w1/gone", 0)):
        connack = raw_connack(
            clients,
            broker,
            V5,
            client_id="w1",
            username="dev",
            password=b"dev-secret",
            will=Will(topic, b"bye"),
        )
        assert connack.reason_code == expected, topic  # type: ignore[attr-defined]
    log = broker.log()
    assert "the auth service answered 401" in log and "'mallory'" in log
    assert "dev-secret" not in log and "guess" not in log  # passwords are never logged


def test_a_slow_service_does_not_stall_other_clients(
    service: AuthService, broker_factory: Factory, clients: Clients, names: Names
) -> None:
    service.allow("fast")
    release = service.hold("slow")
    # A timeout far beyond the test: the answer comes when the test releases it.
    broker = broker_factory(
        {"auth.chain": "http", "auth.http_url": service.url, "auth.http_timeout_seconds": 60}
    )
    watcher = paho(clients, broker, "w", "fast", "pw")
    assert watcher.connect().reason_code == 0
    assert watcher.subscribe(names.topic("#"), 1) == [1]

    with clients.raw(broker, level=V5) as slow:
        slow.send(Connect("slow-1", protocol_level=V5, username="slow", password=b"pw"))
        assert service.waiting.acquire(timeout=10), "the service never got the slow CONNECT"
        # While the service holds that answer, others connect, publish and receive.
        other = paho(clients, broker, "f", "fast", "pw2")
        assert other.connect().reason_code == 0
        assert other.publish(names.topic("t"), b"meanwhile", qos=1) == 0
        assert watcher.get().payload == b"meanwhile"
        assert slow.recv_or_none(timeout=0.2) is None  # still waiting for its answer
        release.set()
        assert slow.recv().reason_code == 0  # type: ignore[attr-defined]


def test_service_down_fails_closed_and_can_fail_open(
    broker_factory: Factory, clients: Clients
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/auth"  # closed when the block ends
    closed = broker_factory({"auth.chain": "http", "auth.http_url": url})
    assert paho(clients, closed, "d1", "dev", "pw").connect().reason_code == 0x88
    connack = raw_connack(clients, closed, V311, client_id="d1", username="dev", password=b"pw")
    assert connack == ConnAck(False, 3)
    assert "the auth service is down" in closed.log()

    opened = broker_factory(
        {"auth.chain": "http", "auth.http_url": url, "auth.http_fail_open": True}
    )
    assert paho(clients, opened, "d1", "dev", "pw").connect().reason_code == 0
    wait_for_log(opened, "a client is accepted unchecked (auth.http_fail_open)")


def test_input_that_breaks_the_service_does_not_log_in_with_fail_open(
    service: AuthService, broker_factory: Factory, clients: Clients
) -> None:
    """Issue 45 #6: a user name the service chokes on (500, as a SQL quote would
    make it) used to count as "the service is down" and, with http_fail_open, logged
    in unchecked. Now the broker's own probe (no client's input) is answered, so
    that request alone failed: 0x88. Only a service that fails the probe too is down."""
    service.answer("x' OR '1'='1", 500)
    service.answer("alice", 401)
    broker = broker_factory(
        {"auth.chain": "http", "auth.http_url": service.url, "auth.http_fail_open": True}
    )
    attack = paho(clients, broker, "m1", "x' OR '1'='1", "pw")
    assert attack.connect().reason_code == 0x88
    v311 = raw_connack(
        clients, broker, V311, client_id="m2", username="x' OR '1'='1", password=b"pw"
    )
    assert v311 == ConnAck(False, 3)
    assert service.asked("") >= 1  # the probe, a CONNECT of nobody
    assert "(a probe was answered)" in broker.log()
    assert "accepted unchecked" not in broker.log()
    # The service failing everything (the probe too, 503 from a proxy) is down.
    service.answer("", 503)
    deadline = time.monotonic() + 10  # the probe's finding stands for a second
    while paho(clients, broker, "m3", "x' OR '1'='1", "pw").connect().reason_code != 0:
        assert time.monotonic() < deadline, broker.log()[-2000:]
        time.sleep(0.2)
    wait_for_log(broker, "a client is accepted unchecked (auth.http_fail_open)")


def test_a_result_of_deny_in_a_2xx_answer_refuses(
    service: AuthService, broker_factory: Factory, clients: Clients
) -> None:
    """Issue 45 #7: a service written for EMQX's convention (200 with a "result")
    denied with a 200, and every 2xx used to be an allow."""
    service.answer("eve", 200, b'{"result": "deny"}')
    service.answer("dev", 200, b'{"result": "allow", "acl": ["readwrite d/%c/#"]}')
    service.answer("someone", 200, b'{"result": "ignore"}')
    broker = broker_factory({"auth.chain": "http", "auth.http_url": service.url})
    assert paho(clients, broker, "e1", "eve", "pw").connect().reason_code == 0x86
    v311 = raw_connack(clients, broker, V311, client_id="e2", username="eve", password=b"pw")
    assert v311 == ConnAck(False, 4)
    assert paho(clients, broker, "s1", "someone", "pw").connect().reason_code == 0x86
    device = paho(clients, broker, "d1", "dev", "pw")
    assert device.connect().reason_code == 0
    assert device.subscribe([("d/d1/#", 1), ("d/d2/#", 1)]) == [1, 0x87]
    # The status-only mode, for a service that puts something else in "result".
    legacy = broker_factory(
        {"auth.chain": "http", "auth.http_url": service.url, "auth.http_result": "status"}
    )
    assert paho(clients, legacy, "e3", "eve", "pw").connect().reason_code == 0


def test_jwt_login_claims_and_key_rotation(
    tmp_path: Path, broker_factory: Factory, clients: Clients, names: Names
) -> None:
    old, new = SigningKey.new("k-old", "ES256"), SigningKey.new("k-new", "RS256")
    jwks = tmp_path / "jwks.json"
    write_jwks(jwks, old)
    broker = broker_factory(
        {
            "auth.chain": "jwt",
            "auth.jwt_jwks_file": jwks,
            "auth.jwt_audience": "devicemq",
            "auth.jwt_issuer": "https://issuer.example",
        }
    )

    sent: list[str] = []  # every token a client logged in with, good or bad

    def token(key: SigningKey, client_id: str = "d1", **more: object) -> str:
        base = {"aud": "devicemq", "iss": "https://issuer.example", "acl": ["readwrite d/%c/#"]}
        return key.sign(claims(client_id, "dev", **{**base, **more}))

    def sending(password: str) -> str:
        sent.append(password)
        return password

    device = paho(clients, broker, "d1", "dev", sending(token(old)))
    assert device.connect().reason_code == 0
    assert device.subscribe([("d/d1/#", 1), ("d/d2/#", 1)]) == [1, 0x87]  # the acl claim
    assert device.publish("d/d1/x", b"1", qos=1) == 0
    assert device.get().payload == b"1"
    assert device.publish("elsewhere", b"1", qos=1) == 0x87

    def code(password: str, client_id: str = "d1", username: str = "dev") -> int:
        return paho(clients, broker, client_id, username, sending(password)).connect().reason_code

    now = int(time.time())
    assert code(token(old, exp=now - 60)) == 0x86  # expired
    assert code(token(old, nbf=now + 600)) == 0x86  # not yet valid
    assert code(token(old, aud="other")) == 0x86
    assert code(token(old, iss="https://mallory")) == 0x86
    assert code(token(old), client_id="d2") == 0x87  # a token for another client
    assert code(token(old), username="admin") == 0x86  # for another user
    assert code(token(new)) == 0x86  # a key the JWKS does not hold (yet)
    forged = token(old).rsplit(".", 1)[0] + "." + token(new).rsplit(".", 1)[1]
    assert code(forged) == 0x86  # wrong signature
    v311 = raw_connack(
        clients,
        broker,
        V311,
        client_id="d1",
        username="dev",
        password=sending(token(old, exp=now - 60)).encode(),
    )
    assert v311 == ConnAck(False, 4)

    # Rotation: the file is rewritten; the broker notices it by itself.
    write_jwks(jwks, new)
    wait_for_log(broker, "JWKS reloaded: 1 keys")
    assert code(token(new)) == 0
    assert code(token(old)) == 0x86
    # mosquitto_pub logs in with its token as the password (docs/authentication.md's example).
    watcher = paho(clients, broker, "w", "dev", sending(token(new, "w", acl=["read d/#"])))
    assert watcher.connect().reason_code == 0
    assert watcher.subscribe("d/#", 1) == [1]
    login = ["-i", "d3", "-u", "dev", "-P", sending(token(new, "d3"))]
    published = subprocess.run(
        [MOSQUITTO_PUB, "-h", HOST, "-p", str(broker.port), *login, "-t", "d/d3/temp", "-m", "21"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert published.returncode == 0, published.stderr
    assert watcher.get().payload == b"21"
    log = broker.log()
    assert "Signature has expired" in log and "no key for kid 'k-old'" in log
    assert len(sent) == 14
    for password in sent:  # tokens are never logged, nor any part of their signatures
        signature = password.split(".")[2]
        assert signature[:16] not in log and signature[-16:] not in log, password


def run_devicemq(env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DEVICEMQ_")}
    clean.update(env, PYTHONPATH=str(REPO), DEVICEMQ_PERSISTENCE_ENABLED="false")
    clean["DEVICEMQ_ADMIN_ENABLED"] = "false"
    port = str(free_port(HOST))
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "run", "--host", HOST, "--port", port],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=clean,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("env", "line"),
    [
        ({"DEVICEMQ_AUTH_CHAIN": "ldap"}, "auth.chain: unknown member 'ldap' (known: http, jwt)"),
        ({"DEVICEMQ_AUTH_CHAIN": "jwt", "DEVICEMQ_AUTH_JWT_JWKS_FILE": "JWKS"}, "not JSON"),
        ({"DEVICEMQ_AUTH_CHAIN": ","}, "auth.chain: ',' names no member"),
        ({"DEVICEMQ_AUTH_HTTP_FAIL_OPEN": "true"}, "auth.http_fail_open: set, but auth.chain"),
        (
            {"DEVICEMQ_AUTH_CHAIN": "http", "DEVICEMQ_AUTH_HTTP_URL": "http://[::1/"},
            "auth.http_url: not a URL",
        ),
    ],
)
def test_a_bad_chain_stops_the_start_with_one_line(
    tmp_path: Path, env: dict[str, str], line: str
) -> None:
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps({"keys": "none"})[:-3])
    env = {k: str(jwks) if v == "JWKS" else v for k, v in env.items()}
    env["DEVICEMQ_DATA_DIR"] = str(tmp_path / "data")
    done = run_devicemq(env)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("devicemq: error: ") and line in last, done.stderr


def test_the_service_sees_the_client_certificate(
    tmp_path: Path, broker_factory: Factory, clients: Clients
) -> None:
    """A TLS listener with client certificates, the user name and password checked by a
    service over https: the service is sent the certificate's subject."""
    pki = make_pki(tmp_path)
    server_side = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_side.load_cert_chain(pki.server_cert, pki.server_key)
    with running_service(server_side) as service:
        service.allow("dev")
        tls_port = free_port(HOST)
        broker_factory(
            {
                "tls.enabled": True,
                "tls.host": HOST,
                "tls.port": tls_port,
                "tls.certfile": pki.server_cert,
                "tls.keyfile": pki.server_key,
                "tls.cafile": pki.ca,
                "auth.chain": "http",
                "auth.http_url": service.url,
                "auth.http_ca_file": pki.ca,
            }
        )
        deadline = time.monotonic() + 10  # the TLS listener opens next to the plain one
        while True:
            with socket.socket() as probe:
                if probe.connect_ex((HOST, tls_port)) == 0:
                    break
            assert time.monotonic() < deadline, "no TLS listener"
            time.sleep(0.05)
        context = ssl.create_default_context(cafile=str(pki.ca))
        context.load_cert_chain(str(pki.client_cert), str(pki.client_key))
        connacks: queue.Queue[Any] = queue.Queue()
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="tls-1", protocol=mqtt.MQTTv5)
        client.username_pw_set("dev", "pw")
        client.tls_set_context(context)
        client.on_connect = lambda c, u, f, rc, p=None: connacks.put(rc)
        client.connect(HOST, tls_port, keepalive=30)
        client.loop_start()
        try:
            assert int(connacks.get(timeout=10).value) == 0
        finally:
            client.loop_stop()
            client.disconnect()
        assert service.requests[-1]["certificate_subject"] == "CN=device-1"
