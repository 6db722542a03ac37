"""$SYS topics (broker/sys_topics.py): the formatting, publishing through the core's
routing and retained store, presence events, the read-only rule and the ACL."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from broker.auth import hash_password, write_password_file
from broker.config import AuthSettings, ClusterSettings, Settings
from broker.message import Message
from broker.packets import ConnAck, Connect, Publish, PubRec, ReasonCode, Will
from broker.sys_topics import (
    SysNumbers,
    connected_payload,
    disconnected_payload,
    presence_topic,
    sys_messages,
)
from tests.unit.core_harness import V5, V311, Client, Harness, publishes

NODE = "edge-1"
WALL = 1_700_000_000.25


def sys_harness(**settings: object) -> Harness:
    """A broker named NODE whose wall clock stands still at WALL."""
    base = dataclasses.replace(Settings(), cluster=ClusterSettings(node_id=NODE))
    h = Harness(dataclasses.replace(base, **settings))  # type: ignore[arg-type]
    if h.broker.sys_topics is not None:
        h.broker.sys_topics.wall = lambda: WALL
    return h


def local_watcher(h: Harness) -> Client:
    """A client on this host: without an ACL file only those get presence events."""
    client = h.client(V5, peer="127.0.0.1")
    client.connect("watcher")
    return client


def by_topic(packets: list[Publish]) -> dict[str, bytes]:
    return {p.topic: p.payload for p in packets}


# ------------------------------------------------------------------ formatting


NUMBERS = SysNumbers(
    uptime=61.9,
    clients_connected=2,
    clients_total=5,
    messages_received=10,
    messages_sent=12,
    bytes_received=300,
    bytes_sent=400,
    subscriptions=7,
    retained=3,
)


def test_sys_messages_use_mosquitto_names_and_plain_text() -> None:
    assert dict(sys_messages(NUMBERS, version="1.2.3")) == {
        "$SYS/broker/version": b"devicemq version 1.2.3",
        "$SYS/broker/uptime": b"61 seconds",
        "$SYS/broker/clients/connected": b"2",
        "$SYS/broker/clients/disconnected": b"3",
        "$SYS/broker/clients/total": b"5",
        "$SYS/broker/messages/received": b"10",
        "$SYS/broker/messages/sent": b"12",
        "$SYS/broker/publish/messages/received": b"10",
        "$SYS/broker/publish/messages/sent": b"12",
        "$SYS/broker/bytes/received": b"300",
        "$SYS/broker/bytes/sent": b"400",
        "$SYS/broker/subscriptions/count": b"7",
        "$SYS/broker/retained messages/count": b"3",
    }


def test_persistence_numbers_only_when_known_zero_included() -> None:
    with_persistence = dataclasses.replace(NUMBERS, persisted_backlog=0, kafka_consumer_lag=42)
    extra = dict(sys_messages(with_persistence)).items() - dict(sys_messages(NUMBERS)).items()
    assert dict(extra) == {
        "$SYS/broker/devicemq/persisted/backlog": b"0",
        "$SYS/broker/devicemq/kafka/consumer_lag": b"42",
    }


def test_presence_topic_keeps_the_client_id_one_level() -> None:
    assert presence_topic("n1", "dev-1", "connected") == "$SYS/brokers/n1/clients/dev-1/connected"
    assert (
        presence_topic("a/b", "x/y+z#%", "disconnected")
        == "$SYS/brokers/a%2Fb/clients/x%2Fy%2Bz%23%25/disconnected"
    )


def test_presence_payloads_are_emqx_shaped_json() -> None:
    assert orjson.loads(connected_payload("c", "u", "10.0.0.7", 4, 30, False, 60, 1234)) == {
        "clientid": "c",
        "username": "u",
        "ipaddress": "10.0.0.7",
        "proto_name": "MQTT",
        "proto_ver": 4,
        "keepalive": 30,
        "clean_start": False,
        "expiry_interval": 60,
        "connected_at": 1234,
        "ts": 1234,
    }
    assert orjson.loads(disconnected_payload("c", None, "peer", 3, "normal", 99)) == {
        "clientid": "c",
        "username": None,
        "ipaddress": "peer",
        "proto_name": "MQIsdp",
        "proto_ver": 3,
        "reason": "normal",
        "disconnected_at": 99,
        "ts": 99,
    }


# ------------------------------------------------------------------ $SYS/broker/...


def test_numbers_reach_subscribers_and_new_subscribers_get_them_retained() -> None:
    h = sys_harness()
    gone = h.connected("gone", clean_start=False, session_expiry_interval=600)
    gone.disconnect()
    watcher = local_watcher(h)
    assert watcher.subscribe("$SYS/broker/#") == [0]
    assert watcher.pending == []  # nothing published yet
    h.clock.now += 42.5
    sys_topics = h.broker.sys_topics
    assert sys_topics is not None
    sys_topics.publish_numbers()
    live = publishes(watcher.read())
    assert all(p.qos == 0 and not p.retain for p in live)  # live: RETAIN 0 (MQTT-3.3.1-12)
    values = by_topic(live)
    assert values["$SYS/broker/uptime"] == b"42 seconds"
    assert values["$SYS/broker/clients/connected"] == b"1"  # the watcher itself
    assert values["$SYS/broker/clients/disconnected"] == b"1"  # the kept session
    assert values["$SYS/broker/clients/total"] == b"2"
    assert values["$SYS/broker/subscriptions/count"] == b"1"
    assert "$SYS/broker/devicemq/persisted/backlog" not in values
    late = h.connected("late")
    late.subscribe("$SYS/broker/clients/+")
    retained = publishes(late.pending)
    assert all(p.retain for p in retained)
    assert by_topic(retained) == {
        "$SYS/broker/clients/connected": b"1",
        "$SYS/broker/clients/disconnected": b"1",
        "$SYS/broker/clients/total": b"2",
    }


def test_own_retained_messages_are_outside_the_limits_and_not_shared() -> None:
    h = sys_harness(mqtt=dataclasses.replace(Settings().mqtt, max_retained_messages=1))
    written: list[str] = []

    def on_change(message: Message, done: Callable[[bool], None] | None) -> None:
        written.append(message.topic)
        if done is not None:
            done(True)

    h.broker.retained.on_change = on_change
    sys_topics = h.broker.sys_topics
    assert sys_topics is not None
    sys_topics.publish_numbers()
    assert len(h.broker.retained) == 0 and h.broker.retained.topics() == []
    assert written == []  # never to Redis, never to the other replicas
    pub = h.connected("pub")
    assert pub.publish_acked("t", b"kept", retain=True) == ReasonCode.NO_MATCHING_SUBSCRIBERS
    assert written == ["t"]  # the one retained message allowed
    sys_topics.publish_numbers()
    watcher = local_watcher(h)
    watcher.subscribe("$SYS/broker/retained messages/count")
    assert by_topic(publishes(watcher.pending)) == {"$SYS/broker/retained messages/count": b"1"}


def test_application_sessions_lag_per_session_and_removed_when_the_session_is_gone() -> None:
    h = sys_harness()
    sys_topics = h.broker.sys_topics
    assert sys_topics is not None
    watcher = local_watcher(h)
    watcher.subscribe("$SYS/broker/devicemq/application/#")
    sys_topics.publish_numbers(None, 0, {"backend-1": (250, 3.26), "etl/2": (0, None)})
    prefix = "$SYS/broker/devicemq/application"
    assert by_topic(publishes(watcher.read())) == {
        f"{prefix}/sessions": b"2",
        f"{prefix}/backend-1/lag/messages": b"250",
        f"{prefix}/backend-1/lag/seconds": b"3.3",
        f"{prefix}/etl%2F2/lag/messages": b"0",  # the client ID one level
        f"{prefix}/etl%2F2/lag/seconds": b"0.0",  # nothing waits
    }
    sys_topics.publish_numbers(None, 0, {"backend-1": (0, None)})  # etl/2's session ended
    live = publishes(watcher.read())
    gone = [p for p in live if p.payload == b""]
    assert sorted(p.topic for p in gone) == [
        f"{prefix}/etl%2F2/lag/messages",
        f"{prefix}/etl%2F2/lag/seconds",
    ]
    assert by_topic([p for p in live if p.payload])[f"{prefix}/sessions"] == b"1"
    late = h.client(V5, peer="127.0.0.1")
    late.connect("late")
    late.subscribe("$SYS/broker/devicemq/application/#")
    assert by_topic(publishes(late.pending)) == {  # retained: the ended session's are gone
        f"{prefix}/sessions": b"1",
        f"{prefix}/backend-1/lag/messages": b"0",
        f"{prefix}/backend-1/lag/seconds": b"0.0",
    }
    sys_topics.publish_numbers()  # not counted (no /metrics): none, and the rest go
    assert {p.topic for p in publishes(late.read()) if p.payload == b""} == {
        f"{prefix}/sessions",
        f"{prefix}/backend-1/lag/messages",
        f"{prefix}/backend-1/lag/seconds",
    }
    assert h.broker.retained.matching("$SYS/broker/devicemq/#", h.clock.now) == []


def test_sys_interval_0_publishes_no_sys_topics() -> None:
    h = sys_harness(sys_interval=0.0)
    assert h.broker.sys_topics is None
    watcher = local_watcher(h)
    watcher.subscribe("$SYS/#")
    h.connected("other").disconnect()
    watcher.expect_nothing()


# ------------------------------------------------------------------ presence


def presence(watcher: Client) -> list[tuple[str, dict[str, object]]]:
    return [(p.topic, orjson.loads(p.payload)) for p in publishes(watcher.read())]


def test_connected_event() -> None:
    h = sys_harness()
    watcher = local_watcher(h)
    watcher.subscribe("$SYS/brokers/+/clients/+/connected")
    device = h.client(V311, peer="192.0.2.1")
    device.connect("dev-1", keep_alive=30, clean_start=False)
    [event] = publishes(watcher.read())
    assert (event.topic, event.qos, event.retain) == (
        f"$SYS/brokers/{NODE}/clients/dev-1/connected",
        0,
        False,
    )
    assert orjson.loads(event.payload) == {
        "clientid": "dev-1",
        "username": None,
        "ipaddress": "192.0.2.1",
        "proto_name": "MQTT",
        "proto_ver": 4,
        "keepalive": 30,
        "clean_start": False,
        "expiry_interval": Settings().mqtt.max_session_expiry_interval,
        "connected_at": 1_700_000_000_250,
        "ts": 1_700_000_000_250,
    }


def reasons(watcher: Client) -> list[tuple[str, object]]:
    """(client id / event, reason) of the presence events the watcher got."""
    out = []
    for topic, body in presence(watcher):
        *_, client_id, event = topic.split("/")
        out.append((f"{client_id}/{event}", body.get("reason")))
    return out


def test_disconnected_reasons() -> None:
    h = sys_harness()
    watcher = local_watcher(h)
    watcher.subscribe("$SYS/brokers/#")
    h.connected("normal").disconnect()
    lost = h.connected("lost")
    lost.conn.connection_lost()
    h.connected("idle", keep_alive=10)
    h.connected("taken")
    h.connected("taken")  # a second connection with the same client id
    assert reasons(watcher) == [
        ("normal/connected", None),
        ("normal/disconnected", "normal"),
        ("lost/connected", None),
        ("lost/disconnected", "connection_lost"),
        ("idle/connected", None),
        ("taken/connected", None),
        ("taken/disconnected", "session_taken_over"),
        ("taken/connected", None),
    ]
    h.advance(16)  # 1.5 x keep alive
    assert reasons(watcher) == [("idle/disconnected", "keep_alive_timeout")]


def test_disconnected_event_payload() -> None:
    h = sys_harness()
    watcher = local_watcher(h)
    watcher.subscribe("$SYS/brokers/+/clients/+/disconnected")
    h.client(V5, peer="::1").connect("odd/id")
    conn = h.broker.sessions["odd/id"].connection
    assert conn is not None
    conn.disconnect(ReasonCode.ADMINISTRATIVE_ACTION)
    assert presence(watcher) == [
        (
            f"$SYS/brokers/{NODE}/clients/odd%2Fid/disconnected",
            {
                "clientid": "odd/id",
                "username": None,
                "ipaddress": "::1",
                "proto_name": "MQTT",
                "proto_ver": 5,
                "reason": "administrative_action",
                "disconnected_at": 1_700_000_000_250,
                "ts": 1_700_000_000_250,
            },
        )
    ]


# ------------------------------------------------------------------ read-only


@pytest.mark.parametrize("topic", ["$SYS/broker/uptime", "$SYS", "$SYStem/x"])
def test_publish_to_sys_is_refused_v5(topic: str) -> None:
    """Mosquitto's rule (a topic beginning with "$SYS"), told as 0x87 Not authorized."""
    h = sys_harness()
    pub = h.connected("pub")
    watcher = local_watcher(h)
    watcher.subscribe("$SYS/#", "$SYStem/#", "$SYS")
    assert pub.publish_acked(topic, b"fake", qos=1, retain=True) == ReasonCode.NOT_AUTHORIZED
    packet_id = pub.publish(topic, b"fake", qos=2)
    assert pub.read_one() == PubRec(packet_id, ReasonCode.NOT_AUTHORIZED)  # the flow ends
    pub.publish(topic, b"fake", qos=0)
    pub.expect_nothing()
    watcher.expect_nothing()
    assert h.broker.retained.topics() == []
    assert h.broker.stats.dropped["not_authorized"] == 3


def test_publish_to_sys_is_acknowledged_and_dropped_v311() -> None:
    """3.1.1 cannot say no: acknowledged as usual and dropped, as Mosquitto does."""
    h = sys_harness()
    pub = h.connected("pub", V311)
    watcher = local_watcher(h)
    watcher.subscribe("$SYS/#")
    assert pub.publish_acked("$SYS/broker/uptime", qos=1) == 0
    assert pub.publish_acked("$SYS/broker/uptime", qos=2) == 0
    assert not pub.closed
    watcher.expect_nothing()


@pytest.mark.parametrize(("level", "code"), [(V5, ReasonCode.NOT_AUTHORIZED), (V311, 5)])
def test_will_on_sys_is_refused(level: int, code: int) -> None:
    h = sys_harness()
    client = h.client(level)
    client.send(Connect("c", protocol_level=level, will=Will("$SYS/broker/x", b"gone")))
    assert client.read_one() == ConnAck(False, code)


# ------------------------------------------------------------------ with an ACL file


PASSWORD = b"pw"


def acl_harness(tmp_path: Path) -> Harness:
    """ops may read $SYS; dev may read and write everything else."""
    acl = tmp_path / "acl"
    acl.write_text("user ops\ntopic read $SYS/#\nuser dev\ntopic readwrite #\n")
    passwd = tmp_path / "passwd"
    write_password_file(passwd, dict.fromkeys(("ops", "dev"), hash_password(PASSWORD)))
    auth = AuthSettings(acl_file=str(acl), password_file=str(passwd))
    return sys_harness(auth=auth)


def login(h: Harness, user: str, client_id: str) -> Client:
    client = h.client(V5, peer=client_id)
    client.send(Connect(client_id, username=user, password=PASSWORD))
    connack = client.read_one()
    assert isinstance(connack, ConnAck) and connack.reason_code == 0, connack
    return client


def test_with_an_acl_only_clients_granted_sys_see_it(tmp_path: Path) -> None:
    h = acl_harness(tmp_path)
    sys_topics = h.broker.sys_topics
    assert sys_topics is not None
    sys_topics.publish_numbers()
    ops, dev = login(h, "ops", "ops-1"), login(h, "dev", "dev-1")
    assert ops.subscribe("$SYS/broker/uptime", "$SYS/brokers/#") == [0, 0]
    assert [p.topic for p in publishes(ops.pending)] == ["$SYS/broker/uptime"]
    # '#' never reaches $SYS (MQTT-4.7.2-1), and no rule grants dev $SYS
    assert dev.subscribe("#", "$SYS/#", "$SYS/broker/uptime") == [0, 0x87, 0x87]
    assert dev.pending == []
    sys_topics.publish_numbers()
    login(h, "dev", "dev-2").disconnect()  # two presence events
    assert {p.topic.split("/")[1] for p in publishes(ops.read())} == {"broker", "brokers"}
    dev.expect_nothing()
    assert h.broker.acl.can_publish("ops", "ops", "$SYS/broker/uptime") is False


def test_without_an_acl_presence_goes_to_clients_on_this_host_only() -> None:
    """Presence names every client, its user and address: as EMQX's default rules,
    only clients on this host get it unless an ACL file grants it."""
    h = sys_harness()
    remote = h.client(V5, peer="192.0.2.7")
    remote.connect("remote")
    assert remote.subscribe("$SYS/brokers/+/clients/+/+", "$SYS/#", "#", "$SYS/broker/#") == [
        0x87,
        0x87,
        0,
        0,
    ]
    local = h.client(V5, peer="::1")
    local.connect("local")
    assert local.subscribe("$SYS/brokers/#", "$share/g/$SYS/#") == [0, 0]
