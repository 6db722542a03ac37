"""ACL ``user`` sections mean the same on every replica (issue 19, finding 4).

A replica decided a remote client's read rules without knowing who it was: the
username stayed with the replica holding the connection, so with alice's
subscriber on replica ``a``, messages published on ``b`` to ``alice/#``
(granted by her ``user`` section) were dropped after PUBACK, and her ``deny``
rule did not hold for messages published on ``b``. The username now travels
with the session record, and ``b`` decides as ``a`` does.
"""

from __future__ import annotations

from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from broker.auth import hash_password, write_password_file
from tests.cluster.conftest import running_cluster
from tests.cluster.test_replicas import Client, probe, publish, wait_until

ACL = """\
user alice
topic readwrite alice/#
topic deny alice/secret/#
user bob
topic write alice/#
"""


def test_a_users_read_rules_hold_for_messages_published_on_the_other_replica(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    passwd = tmp_path / "passwd"
    write_password_file(passwd, {"alice": hash_password("a-pw"), "bob": hash_password("b-pw")})
    acl = tmp_path / "acl"
    acl.write_text(ACL)
    settings = {"auth.password_file": passwd, "auth.acl_file": acl}
    root = tmp_path / "cluster"
    root.mkdir()
    with running_cluster(root, settings) as cluster:
        real = mqtt.Client
        logins = {"alice-dev": ("alice", "a-pw"), "bob-pub": ("bob", "b-pw")}

        def with_login(*args: object, **kwargs: object) -> mqtt.Client:
            client = real(*args, **kwargs)  # type: ignore[arg-type]
            username, password = logins[str(kwargs["client_id"])]
            client.username_pw_set(username, password)
            return client

        monkeypatch.setattr(mqtt, "Client", with_login)
        alice = Client(cluster.a, "alice-dev", expiry=600)
        bob = Client(cluster.b, "bob-pub")
        try:
            alice.subscribe("alice/#", 1)
            probe(bob, alice, "alice/in", 1, 30)  # also waits for the consumer group
            publish(bob, "alice/secret/plan", [b"secret"], 1)
            publish(bob, "alice/in", [b"granted"], 1)
            wait_until(lambda: alice.received(b"granted") == [b"granted"], 20, "alice's message")
            assert alice.received(b"secret") == [], "her deny rule was bypassed on b"
        finally:
            bob.close()
            alice.close()
