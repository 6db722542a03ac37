"""The admin API on two replicas: any replica answers for a client connected to the
other, and a disconnect or a block made on one reaches the connection on the
other (the cluster link), and the block list is Redis's (it survives restarts)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from paho.mqtt.packettypes import PacketTypes

from app.admin_cli import AdminClient, ApiError
from tests.cluster.conftest import Cluster, running_cluster
from tests.e2e.admin import ADMINISTRATIVE_ACTION, BANNED, TOKEN, answering, wait_for
from tests.e2e.clients import V5, V311, Paho, props
from tests.faults.conftest import DeviceMQ


def _api(broker: DeviceMQ) -> AdminClient:
    return answering(AdminClient(f"http://127.0.0.1:{broker.settings['admin.port']}", TOKEN))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tmp_path_factory.mktemp("admin-cluster"), admin_token=TOKEN) as c:
        yield c


def _connect_code(broker: DeviceMQ, client_id: str) -> int:
    client = Paho(broker, client_id, V5)
    try:
        return client.connect().reason_code
    finally:
        client.close()


def _session(api: AdminClient, client_id: str) -> dict[str, Any] | None:
    try:
        return api.call("GET", api.session_path(client_id))  # type: ignore[no-any-return]
    except ApiError as e:
        assert e.status == 404, e
        return None


def test_either_replica_answers_for_a_client_on_b(cluster: Cluster) -> None:
    api_a, api_b = _api(cluster.a), _api(cluster.b)
    cid = cluster.name("seen")
    client = Paho(cluster.b, cid, V5)
    assert client.connect().reason_code == 0
    client.subscribe("adm/seen/#", 1)
    view = wait_for(
        lambda: (s := _session(api_a, cid)) and s["subscriptions"] == 1 and s, "a knows it"
    )
    assert (view["replica"], view["connected"], view["protocol"]) == ("b", True, "5.0")
    assert view["peer"] == "127.0.0.1"
    assert api_b.call("GET", api_b.session_path(cid))["replica"] == "b"
    listed = api_a.call("GET", "subscriptions", {"client_id": cid})["items"]
    assert [(s["filter"], s["replica"]) for s in listed] == [("adm/seen/#", "b")]
    client.close()


def test_a_kick_on_a_disconnects_the_client_on_b(cluster: Cluster) -> None:
    api_a = _api(cluster.a)
    cid = cluster.name("kick")
    client = Paho(cluster.b, cid, V5)
    client.connect()
    wait_for(lambda: (s := _session(api_a, cid)) and s["connected"], "a knows it")
    api_a.call("POST", api_a.session_path(cid, "disconnect"))
    gone = client.wait_disconnected()
    assert gone.from_server and gone.reason_code == ADMINISTRATIVE_ACTION


def test_the_backlog_of_a_session_of_b_is_purged_from_a(cluster: Cluster) -> None:
    api_a = _api(cluster.a)
    cid, topic = cluster.name("purge"), f"adm/{cluster.tag}/purge"
    sub = Paho(cluster.b, cid, V311)
    sub.connect(clean_start=False)
    sub.subscribe(topic, 1)
    sub.disconnect()
    pub = Paho(cluster.a, cluster.name("purge-pub"), V5)
    pub.connect()
    for i in range(4):
        pub.publish(topic, f"p{i}".encode(), qos=1)
    pub.close()
    wait_for(lambda: (s := _session(api_a, cid)) and s["backlog"] == 4, "four stored")
    assert api_a.call("DELETE", api_a.session_path(cid, "messages"))["purged"] == 4
    assert sub.connect(clean_start=False).session_present
    sub.assert_no_message()
    sub.close()


def test_deleting_on_a_ends_the_session_connected_on_b(cluster: Cluster) -> None:
    api_a, api_b = _api(cluster.a), _api(cluster.b)
    cid = cluster.name("delete")
    client = Paho(cluster.b, cid, V5)
    expiry = props(PacketTypes.CONNECT, SessionExpiryInterval=600)
    client.connect(clean_start=False, properties=expiry)
    client.subscribe(f"adm/{cluster.tag}/delete", 1)
    wait_for(lambda: _session(api_a, cid), "a knows it")
    api_a.call("DELETE", api_a.session_path(cid))
    assert client.wait_disconnected().reason_code == ADMINISTRATIVE_ACTION
    wait_for(lambda: _session(api_b, cid) is None, "b ended it")
    wait_for(lambda: _session(api_a, cid) is None, "a forgot it")
    assert not client.connect(clean_start=False, properties=expiry).session_present
    client.close()


def test_a_block_on_a_closes_the_client_on_b_and_outlives_a_restart(
    cluster: Cluster, tmp_path: Path
) -> None:
    api_a, api_b = _api(cluster.a), _api(cluster.b)
    cid = cluster.name("blocked")
    client = Paho(cluster.b, cid, V5)
    client.connect()
    api_a.call("POST", "blocked", body={"kind": "client_id", "value": cid, "reason": "test"})
    assert client.wait_disconnected().reason_code == ADMINISTRATIVE_ACTION
    assert client.connect().reason_code == BANNED
    assert _connect_code(cluster.a, cid) == BANNED
    assert [e["value"] for e in api_b.call("GET", "blocked")["items"]] == [cid]
    # kept in Redis: a restarted replica refuses it from its first CONNECT
    cluster.b.stop()
    cluster.b.start()
    assert client.connect().reason_code == BANNED
    api_b = _api(cluster.b)
    api_b.call("DELETE", "blocked", {"kind": "client_id", "value": cid})
    wait_for(lambda: _connect_code(cluster.a, cid) == 0, "a let it in")
    assert client.connect().reason_code == 0
    client.close()


def test_presence_events_of_b_reach_a_subscriber_on_a(cluster: Cluster) -> None:
    """$SYS presence (broker/sys_topics.py) is routed as any message: across replicas."""
    watcher = Paho(cluster.a, cluster.name("watcher"), V5)
    watcher.connect()
    cid = cluster.name("present")
    watcher.subscribe(f"$SYS/brokers/+/clients/{cid}/+", 0)
    # b routes the event: it must have heard of the subscription first
    api_b = _api(cluster.b)
    wait_for(
        lambda: api_b.call("GET", "subscriptions", {"client_id": watcher.client_id})["items"],
        "b knows the watcher's subscription",
    )
    device = Paho(cluster.b, cid, V311)
    device.connect()
    device.disconnect()
    events = watcher.get_n(2)
    assert [m.topic for m in events] == [
        f"$SYS/brokers/b/clients/{cid}/connected",
        f"$SYS/brokers/b/clients/{cid}/disconnected",
    ]
    assert orjson.loads(events[1].payload)["reason"] == "normal"
    watcher.close()


def test_each_replica_lists_both_with_the_clients_connected_there(cluster: Cluster) -> None:
    api_a = _api(cluster.a)
    cid = cluster.name("replicas")
    client = Paho(cluster.b, cid, V5)
    assert client.connect().reason_code == 0
    try:

        def b_seen() -> Any:
            answer = api_a.call("GET", "replicas")
            nodes = {r["node"]: r for r in answer["items"]}
            return "b" in nodes and nodes["b"]["connected"] >= 1 and answer

        answer = wait_for(b_seen, "a lists b with the client connected there")
        assert answer["cluster"] is True
        first, b = answer["items"][0], {r["node"]: r for r in answer["items"]}["b"]
        assert (first["node"], first["here"]) == ("a", True)
        assert b["here"] is False and b["last_seen"] is not None
        # b speaks at least every tick: a's "last seen" of it moves on
        later = wait_for(
            lambda: (
                (r := {x["node"]: x for x in api_a.call("GET", "replicas")["items"]}["b"])[
                    "last_seen"
                ]
                > b["last_seen"]
                and r
            ),
            "a hears from b again",
        )
        assert later["connected"] >= 1
    finally:
        client.close()


def test_either_replica_answers_who_subscribes_to_a_topic_on_the_other(cluster: Cluster) -> None:
    api_a = _api(cluster.a)
    cid = cluster.name("who")
    client = Paho(cluster.b, cid, V5)
    assert client.connect().reason_code == 0
    try:
        assert client.subscribe("adm/who/+", 1) == [1]

        def listed() -> Any:
            items = api_a.call("GET", "subscribers", {"topic": "adm/who/x"})["items"]
            return [i for i in items if i["client_id"] == cid]

        [item] = wait_for(listed, "a answers for b's subscriber")
        assert (item["filter"], item["qos"], item["replica"]) == ("adm/who/+", 1, "b")
    finally:
        client.close()
