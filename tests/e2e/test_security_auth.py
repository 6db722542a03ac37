"""Authentication and ACLs against a real devicemq process (settings through DEVICEMQ_AUTH_*),
with paho-mqtt logging in with user names and passwords, raw 3.1.1 sockets for the return codes,
and ``devicemq passwd`` run as a command."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import ssl
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from broker.packets import ConnAck
from tests.conftest import free_port
from tests.e2e.clients import Paho
from tests.e2e.conftest import HOST, REPO, BrokerProcess, Clients, Names, devicemq_only
from tests.pki import make_pki

pytestmark = [pytest.mark.e2e, devicemq_only("auth.* settings and devicemq passwd")]

Factory = Callable[[Mapping[str, object] | None], BrokerProcess]


def passwd(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "passwd", *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=30,
    )


@contextlib.contextmanager
def credentials(username: str | None, password: str | None) -> Iterator[None]:
    """paho clients made inside the block log in as ``username``."""
    real = mqtt.Client

    def make(*args: Any, **kwargs: Any) -> mqtt.Client:
        client = real(*args, **kwargs)
        if username is not None:
            client.username_pw_set(username, password)
        return client

    mqtt.Client = make  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        mqtt.Client = real  # type: ignore[misc]


def login(client: Paho, username: str | None, password: str | None) -> int:
    with credentials(username, password):
        return client.connect().reason_code


@pytest.fixture
def secured(tmp_path: Path, broker_factory: Factory) -> tuple[BrokerProcess, Path, Path]:
    pw = tmp_path / "passwd"
    done = passwd("--password-stdin", str(pw), "alice", stdin="alice-pw\n")
    assert done.returncode == 0, done.stderr
    done = passwd("-b", str(pw), "bob", "bob-pw")
    assert done.returncode == 0, done.stderr
    assert "prefer --password-stdin" in done.stderr
    assert stat.S_IMODE(pw.stat().st_mode) == 0o600
    acl = tmp_path / "acl"
    acl.write_text(
        "user alice\n"
        "topic readwrite alice/#\n"
        "topic deny alice/secret/#\n"
        "user bob\n"
        "topic write alice/#\n"
        "pattern readwrite devices/%c/#\n"
    )
    broker = broker_factory({"auth.password_file": pw, "auth.acl_file": acl})
    return broker, pw, acl


def test_passwords_and_connack_codes(
    secured: tuple[BrokerProcess, Path, Path], clients: Clients, names: Names
) -> None:
    broker, pw, _ = secured
    client = clients.paho(broker, names.client("a"))
    assert login(client, "alice", "alice-pw") == 0
    client.disconnect()
    assert login(client, "alice", "wrong") == 0x86
    assert login(client, "nobody", "x") == 0x86
    assert login(client, None, None) == 0x87  # anonymous: off once a password file is set
    with clients.raw(broker, level=4) as raw:
        assert raw.connect(names.client("r"), username="alice", password=b"no") == ConnAck(False, 4)
    with clients.raw(broker, level=4) as raw:
        assert raw.connect(names.client("r")) == ConnAck(False, 5)
    log = broker.log()
    assert "refused" in log and "'alice'" in log
    assert "wrong" not in log and "alice-pw" not in log  # passwords are never logged

    # A user added while the broker runs can log in a second later (the file is watched),
    # with a client ID of her own: alice's stays alice's (auth.client_id_owner first).
    done = passwd("--password-stdin", str(pw), "carol", stdin="carol-pw\n")
    assert done.returncode == 0, done.stderr
    assert login(client, "bob", "bob-pw") == 0x87
    client = clients.paho(broker, names.client("c"))
    deadline = time.monotonic() + 5
    while login(client, "carol", "carol-pw") != 0:
        assert time.monotonic() < deadline, "carol never got in"
        time.sleep(0.3)
    client.disconnect()
    # ...and a deleted one cannot, once SIGHUP forced the reload.
    assert passwd("-D", str(pw), "carol").returncode == 0
    broker.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 5
    while login(client, "carol", "carol-pw") != 0x86:
        assert time.monotonic() < deadline, "carol still gets in"
        time.sleep(0.3)
    assert "SIGHUP: reloading" in broker.log()
    assert broker.alive()


def test_acl_publish_subscribe_receive(
    secured: tuple[BrokerProcess, Path, Path], clients: Clients, names: Names
) -> None:
    broker = secured[0]
    alice = clients.paho(broker, "dev1")
    assert login(alice, "alice", "alice-pw") == 0
    assert alice.subscribe([("alice/#", 1), ("bob/#", 1), ("devices/dev1/#", 1)]) == [1, 0x87, 1]
    bob = clients.paho(broker, "dev2")
    assert login(bob, "bob", "bob-pw") == 0
    assert bob.subscribe("alice/#", 1) == [0x87]  # bob may only write there
    # Allowed to write, but nobody may read it: 0x10 No matching subscribers.
    assert bob.publish("alice/secret/plan", b"hidden", qos=1) == 0x10
    assert bob.publish("alice/news", b"hello", qos=1) == 0
    messages = alice.get_n(1)
    assert [m.payload for m in messages] == [b"hello"]  # ...but alice may not read the secret
    alice.assert_no_message()
    assert bob.publish("devices/dev1/cmd", b"x", qos=1) == 0x87  # not bob's device
    assert alice.publish("devices/dev1/temp", b"21", qos=1) == 0
    assert alice.get().payload == b"21"


def _tls_login(port: int, context: ssl.SSLContext) -> tuple[int, mqtt.Client]:
    connacks: queue.Queue[Any] = queue.Queue()
    client = mqtt.Client(
        CallbackAPIVersion.VERSION2,
        client_id="tls-client",
        reconnect_on_failure=False,
        protocol=mqtt.MQTTv5,
    )
    client.tls_set_context(context)
    client.on_connect = lambda c, u, f, rc, p=None: connacks.put(rc)
    client.connect(HOST, port, keepalive=30)
    client.loop_start()
    return int(connacks.get(timeout=5).value), client


def test_certificate_identity_as_username(
    tmp_path: Path, broker_factory: Factory, clients: Clients
) -> None:
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    acl = tmp_path / "acl"
    acl.write_text("pattern readwrite devices/%u/#\n")
    tls_port = free_port(HOST)
    broker = broker_factory(
        {
            "tls.enabled": True,
            "tls.host": HOST,
            "tls.port": tls_port,
            "tls.certfile": pki.server_cert,
            "tls.keyfile": pki.server_key,
            "tls.cafile": pki.ca,
            "auth.use_identity_as_username": True,
            "auth.acl_file": acl,
        }
    )
    deadline = time.monotonic() + 5
    while True:
        with socket.socket() as probe:
            if probe.connect_ex((HOST, tls_port)) == 0:
                break
        assert time.monotonic() < deadline, "no TLS listener"
        time.sleep(0.05)
    context = ssl.create_default_context(cafile=str(pki.ca))
    context.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    code, device = _tls_login(tls_port, context)
    try:
        assert code == 0  # CN device-1 is the user name
        subacks: queue.Queue[Any] = queue.Queue()
        device.on_subscribe = lambda c, u, mid, rcs, p=None: subacks.put(rcs)
        device.subscribe([("devices/device-1/#", 1), ("devices/#", 1)])
        assert [rc.value for rc in subacks.get(timeout=5)] == [1, 0x87]
    finally:
        device.disconnect()
        device.loop_stop()
    # A TLS client without a certificate is anonymous: refused.
    code, stranger = _tls_login(tls_port, ssl.create_default_context(cafile=str(pki.ca)))
    stranger.loop_stop()
    assert code == 0x87
    # So is an anonymous client on plain TCP.
    assert login(clients.paho(broker, "plain"), None, None) == 0x87
