"""Client IDs and $ECQ queues bound to their owner mean the same on every replica
(issue 45, findings 1 and 2): the claims are kept in the shared Redis
(persistence/owner_store.py), so a device's ID and queue taken on replica ``a`` are
refused to another user on replica ``b``."""

from __future__ import annotations

from pathlib import Path

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
