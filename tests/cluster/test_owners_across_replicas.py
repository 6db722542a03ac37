"""Client IDs and $ECQ queues bound to their owner mean the same on every replica
(issue 45, findings 1 and 2): the claims are kept in the shared Redis
(persistence/owner_store.py), so a device's ID and queue taken on replica ``a`` are
refused to another user on replica ``b``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from broker.auth import hash_password, write_password_file
from tests.cluster.conftest import running_cluster
from tests.e2e.clients import Paho

ACL = "user dev7\ntopic read $ECQ/dev-7/#\npattern read $ECQ/%c/#\n"


def test_a_client_id_and_a_queue_taken_on_one_replica_are_refused_on_the_other(
    tmp_path: Path,
) -> None:
    passwd = tmp_path / "passwd"
    write_password_file(
        passwd, {"dev7": hash_password("dev7-pw"), "mallory": hash_password("mallory-pw")}
    )
    acl = tmp_path / "acl"
    acl.write_text(ACL)
    root = tmp_path / "cluster"
    root.mkdir()
    settings = {"auth.password_file": passwd, "auth.acl_file": acl}
    with running_cluster(root, settings) as cluster:
        device = Paho(cluster.a, "dev-7", username="dev7", password="dev7-pw")
        assert device.connect().reason_code == 0
        assert device.subscribe("$ECQ/dev-7/#", 1) == [1]
        device.disconnect()
        mallory = Paho(cluster.b, "dev-7", username="mallory", password="mallory-pw")
        assert mallory.connect().reason_code == 0x87  # the ID is dev7's on b too
        other = Paho(cluster.b, "mallory-1", username="mallory", password="mallory-pw")
        assert other.connect().reason_code == 0  # her own IDs are hers
        other.disconnect()
        again = Paho(cluster.b, "dev-7", username="dev7", password="dev7-pw")
        assert again.connect().reason_code == 0
        assert again.subscribe("$ECQ/dev-7/#", 1) == [1]  # its queue, on b as on a
        again.disconnect()


def _over_budget(metrics_port: object) -> float:
    import urllib.request

    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("devicemq_owners_over_budget "):
                return float(line.split()[1])
    return 0.0


def test_one_owners_budget_and_queue_count_hold_across_replicas(tmp_path: Path) -> None:
    """Issue 45, last bullet: mallory's stores on replica ``a`` put her over
    auth.max_bytes_per_owner, and ``b``'s own tally finds it (the sessions of ``a``
    are known to ``b``, the counters are in the shared Redis): ``b`` refuses her a new
    session. Her one queue claimed on ``a`` is her ecq.max_queues_per_owner on ``b``."""
    import os
    import time

    passwd = tmp_path / "passwd"
    write_password_file(passwd, {"mallory": hash_password("mallory-pw")})
    acl = tmp_path / "acl"
    acl.write_text("user mallory\ntopic readwrite mallory/#\npattern read $ECQ/%c/#\n")
    root = tmp_path / "cluster"
    root.mkdir()
    settings = {
        "auth.password_file": passwd,
        "auth.acl_file": acl,
        "auth.max_bytes_per_owner": 300_000,
        "auth.owner_tally_interval": 0.2,
        "ecq.max_queues_per_owner": 1,
    }
    with running_cluster(root, settings, metrics=True) as cluster:

        def mallory(broker: object, client_id: str) -> Paho:
            return Paho(broker, client_id, username="mallory", password="mallory-pw")

        expiry = _expiry(600)
        held = mallory(cluster.a, "mallory-1")
        assert held.connect(clean_start=False, properties=expiry).reason_code == 0
        assert held.subscribe("mallory/#", 1) == [1]
        assert held.subscribe("$ECQ/mallory-1/#", 1) == [1]  # her one queue, on a
        held.disconnect()
        second = mallory(cluster.b, "mallory-2")
        assert second.connect().reason_code == 0
        assert second.subscribe("$ECQ/mallory-2/#", 1) == [0x97]  # one more, on b
        second.disconnect()
        publisher = mallory(cluster.a, "mallory-pub")
        assert publisher.connect().reason_code == 0
        for _ in range(6):  # 393 kB stored for her session
            assert publisher.publish("mallory/x", os.urandom(64 * 1024), qos=1) == 0
        publisher.disconnect()
        deadline = time.monotonic() + 30
        while _over_budget(cluster.b.settings["metrics.port"]) < 1:
            assert time.monotonic() < deadline, "b's tally never found mallory over"
            time.sleep(0.2)
        third = mallory(cluster.b, "mallory-3")
        assert third.connect(clean_start=False, properties=expiry).reason_code == 0x97
        resumed = mallory(cluster.b, "mallory-1")  # hers resumes, on either replica
        assert resumed.connect(clean_start=False, properties=expiry).reason_code == 0
        resumed.disconnect()


def _expiry(seconds: int) -> Any:
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    properties = Properties(PacketTypes.CONNECT)
    properties.SessionExpiryInterval = seconds
    return properties
