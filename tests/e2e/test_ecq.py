"""Exclusive compacted queues ($ECQ, broker/ecq.py) on a real broker with its
embedded Redis and Kafka, driven by paho-mqtt and raw-socket clients.

What must hold: messages wait for a consumer that never connected; only the
queue's client subscribes; each key gives its latest value, in sequence
order, with its sequence number; what was acknowledged is never delivered
again; what was not is, with DUP; a rewind gives every kept key from a
sequence number on.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from paho.mqtt.packettypes import PacketTypes

from app import cli
from app.admin_cli import AdminClient
from broker.packets import (
    ConnAck,
    Properties,
    PubAck,
    Publish,
    SubAck,
    Subscribe,
    Subscription,
    Unsubscribe,
    Will,
)
from tests.e2e.admin import TOKEN, admin_broker, wait_for
from tests.e2e.clients import V5, V311, Paho, Raw, props
from tests.e2e.conftest import BrokerProcess, Clients, Names, devicemq_only

pytestmark = devicemq_only("$ECQ queues are devicemq's")

SUCCESS = 0x00
NOT_AUTHORIZED = 0x87
UNSPECIFIED = 0x80
IMPLEMENTATION_SPECIFIC = 0x83
TOPIC_NAME_INVALID = 0x90


@pytest.fixture(scope="module")
def _ecq_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, AdminClient]]:
    with admin_broker(tmp_path_factory.mktemp("ecq")) as started:
        yield started


@pytest.fixture
def broker(_ecq_broker: tuple[BrokerProcess, AdminClient]) -> BrokerProcess:
    """This module's broker: persistent, with the admin API (the tests' barriers)."""
    return _ecq_broker[0]


@pytest.fixture
def api(_ecq_broker: tuple[BrokerProcess, AdminClient]) -> AdminClient:
    return _ecq_broker[1]


def _raw_consumer(
    clients: Clients, broker: BrokerProcess, queue: str, level: int = 5, **connect: Any
) -> Raw:
    """A raw-socket client ``queue`` subscribed to its queue (its SUBACK read)."""
    raw = clients.raw(broker, level=level)
    raw.connect(queue, **connect)
    raw.send(Subscribe(1, [Subscription(f"$ECQ/{queue}/#", 1)]))
    assert isinstance(raw.recv(), SubAck)
    return raw


def queue_state(api: AdminClient, queue: str, **wanted: int) -> dict[str, Any]:
    """Wait until the queue's state (GET /api/v1/queues/{id}) shows ``wanted``."""

    def there() -> dict[str, Any] | None:
        state: dict[str, Any] = api.call("GET", f"queues/{queue}")
        return state if all(state[k] == v for k, v in wanted.items()) else None

    return wait_for(there, f"queue {queue} reaches {wanted}")  # type: ignore[no-any-return]


def _seq(message: object) -> int | None:
    properties = getattr(message, "properties", None)
    for name, value in getattr(properties, "UserProperty", None) or []:
        if name == "seq":
            return int(value)
    return None


def _producer(clients: Clients, broker: BrokerProcess, names: Names) -> Paho:
    producer = clients.paho(broker, names.client("producer"))
    producer.connect()
    return producer


def _write(producer: Paho, queue: str, key: str, value: str, qos: int = 1) -> int | None:
    return producer.publish(f"$ECQ/w/{queue}/{key}", value, qos=qos)


def test_messages_wait_for_a_consumer_that_never_connected_and_each_key_gives_its_latest(
    broker: BrokerProcess, api: AdminClient, clients: Clients, names: Names
) -> None:
    queue = names.client("device")
    producer = _producer(clients, broker, names)
    assert _write(producer, queue, "k1", "a") == SUCCESS
    assert _write(producer, queue, "k2", "b") == SUCCESS
    assert _write(producer, queue, "k1", "c", qos=2) == SUCCESS  # replaces a: compacted
    # Acknowledged once Kafka has them; stored in Redis a moment later.
    queue_state(api, queue, last_seq=3, pending=2, keys=2)

    consumer = clients.paho(broker, queue)
    consumer.connect()
    assert consumer.subscribe(f"$ECQ/{queue}/#", qos=1) == [1]
    got = consumer.get_n(2)
    assert [(m.topic, m.payload, m.qos) for m in got] == [
        (f"$ECQ/{queue}/k2", b"b", 1),
        (f"$ECQ/{queue}/k1", b"c", 1),
    ]
    seqs = [_seq(m) for m in got]
    assert seqs[0] is not None and seqs[1] is not None and seqs[0] < seqs[1]
    consumer.assert_no_message()


def test_only_the_queues_client_subscribes_and_only_at_qos_1_or_more(
    broker: BrokerProcess, clients: Clients, names: Names
) -> None:
    queue = names.client("device")
    other = clients.paho(broker, names.client("other"))
    other.connect()
    assert other.subscribe(f"$ECQ/{queue}/#", qos=1) == [NOT_AUTHORIZED]
    assert other.subscribe("$ECQ/#", qos=1) == [NOT_AUTHORIZED]
    assert other.subscribe(f"$share/g/$ECQ/{names.client('other')}/#", qos=1) == [NOT_AUTHORIZED]
    old = clients.paho(broker, names.client("old"), version=V311)
    old.connect()
    assert old.subscribe(f"$ECQ/{queue}/#", qos=1) == [UNSPECIFIED]

    owner = clients.paho(broker, queue)
    owner.connect()
    assert owner.subscribe(f"$ECQ/{queue}/k1", qos=1) == [NOT_AUTHORIZED]  # the whole queue only
    assert owner.subscribe(f"$ECQ/{queue}/#", qos=0) == [UNSPECIFIED]
    assert owner.subscribe(f"$ECQ/{queue}/#", qos=2) == [1]  # delivered at QoS 1


def test_an_ecq_topic_that_is_no_queue_write_is_refused(
    broker: BrokerProcess, clients: Clients, names: Names
) -> None:
    producer = _producer(clients, broker, names)
    assert producer.publish("$ECQ/x", "v", qos=1) == TOPIC_NAME_INVALID
    assert producer.publish("$ECQ/w/device", "v", qos=1) == TOPIC_NAME_INVALID
    assert producer.publish(f"$ECQ/{names.client('d')}/k", "v", qos=1) == TOPIC_NAME_INVALID
    # Only the consumer rewinds its queue.
    assert producer.publish(f"$ECQ/c/{names.client('d')}/rewind", "1", qos=1) == NOT_AUTHORIZED


def test_what_was_acknowledged_is_not_delivered_again_after_a_reconnect(
    broker: BrokerProcess, clients: Clients, names: Names
) -> None:
    queue = names.client("device")
    producer = _producer(clients, broker, names)
    consumer = clients.paho(broker, queue)
    consumer.connect()
    assert consumer.subscribe(f"$ECQ/{queue}/#", qos=1) == [1]
    _write(producer, queue, "a", "1")  # forwarded live while the consumer is online
    _write(producer, queue, "b", "2")
    assert [m.payload for m in consumer.get_n(2)] == [b"1", b"2"]  # paho acknowledged them
    consumer.disconnect()

    _write(producer, queue, "c", "3")
    consumer.connect()  # a clean start: the queue is not the session's
    assert consumer.subscribe(f"$ECQ/{queue}/#", qos=1) == [1]
    got = consumer.get()
    assert (got.topic, got.payload) == (f"$ECQ/{queue}/c", b"3")
    consumer.assert_no_message()


def test_a_durable_session_resumes_its_queue_without_subscribing_again(
    broker: BrokerProcess, clients: Clients, names: Names
) -> None:
    queue = names.client("device")
    producer = _producer(clients, broker, names)
    consumer = clients.paho(broker, queue)
    expiry = props(PacketTypes.CONNECT, SessionExpiryInterval=300)
    consumer.connect(clean_start=True, properties=expiry)
    assert consumer.subscribe(f"$ECQ/{queue}/#", qos=1) == [1]
    consumer.disconnect()
    _write(producer, queue, "k", "while away")
    consumer.connect(clean_start=False, properties=expiry)
    got = consumer.get()
    assert (got.topic, got.payload) == (f"$ECQ/{queue}/k", b"while away")


def test_an_unacknowledged_entry_comes_again_with_dup_and_a_replaced_one_does_not(
    broker: BrokerProcess, clients: Clients, names: Names
) -> None:
    queue = names.client("device")
    producer = _producer(clients, broker, names)
    _write(producer, queue, "k", "old")
    _write(producer, queue, "other", "x")

    raw = _raw_consumer(clients, broker, queue)
    first = [raw.recv(), raw.recv()]
    assert [p.payload for p in first if isinstance(p, Publish)] == [b"old", b"x"]
    assert all(isinstance(p, Publish) and not p.dup for p in first)
    # "old" is in flight, unacknowledged; a newer value of its key arrives.
    _write(producer, queue, "k", "new")
    live = raw.recv()
    assert isinstance(live, Publish) and live.payload == b"new" and not live.dup
    raw.close()

    again = _raw_consumer(clients, broker, queue)
    resent = [again.recv(), again.recv()]
    # "old" was replaced: not sent again; "x" and "new" may have been seen: DUP.
    assert sorted((p.payload, p.dup) for p in resent if isinstance(p, Publish)) == [
        (b"new", True),
        (b"x", True),
    ]
    for packet in resent:
        assert isinstance(packet, Publish) and packet.packet_id is not None
        again.send(PubAck(packet.packet_id))
    assert again.recv_or_none(0.5) is None


def test_a_rewind_gives_the_latest_value_of_every_key_from_a_sequence_number(
    broker: BrokerProcess, api: AdminClient, clients: Clients, names: Names
) -> None:
    queue = names.client("device")
    producer = _producer(clients, broker, names)
    for key, value in [("a", "1"), ("b", "2"), ("a", "3"), ("c", "4")]:
        _write(producer, queue, key, value)
    queue_state(api, queue, last_seq=4)
    consumer = clients.paho(broker, queue)
    consumer.connect()
    consumer.subscribe(f"$ECQ/{queue}/#", qos=1)
    got = consumer.get_n(3)  # b=2, a=3, c=4 (a=1 was compacted)
    assert [m.payload for m in got] == [b"2", b"3", b"4"]
    by_payload = {m.payload: _seq(m) for m in got}
    queue_state(api, queue, pending=0)  # paho's acknowledgements have landed

    # SUBSCRIBE with rewind=<seq of a=3>: a and c again, b (older) not.
    rewind = props(PacketTypes.SUBSCRIBE, UserProperty=[("rewind", str(by_payload[b"3"]))])
    consumer.subscribe(f"$ECQ/{queue}/#", qos=1, properties=rewind)
    again = consumer.get_n(2)
    assert [(m.payload, _seq(m)) for m in again] == [
        (b"3", by_payload[b"3"]),
        (b"4", by_payload[b"4"]),
    ]
    queue_state(api, queue, pending=0)

    # 3.1.1 has no user properties: the control topic, only for the queue's client.
    old = clients.paho(broker, queue, version=V311)
    old.connect()
    old.subscribe(f"$ECQ/{queue}/#", qos=1)
    old.publish(f"$ECQ/c/{queue}/rewind", "1", qos=1)
    assert sorted(m.payload for m in old.get_n(3)) == [b"2", b"3", b"4"]


def test_a_malformed_rewind_is_refused(
    broker: BrokerProcess, clients: Clients, names: Names
) -> None:
    queue = names.client("device")
    consumer = clients.paho(broker, queue)
    consumer.connect()
    rewind = props(PacketTypes.SUBSCRIBE, UserProperty=[("rewind", "yesterday")])
    assert consumer.subscribe(f"$ECQ/{queue}/#", 1, rewind) == [IMPLEMENTATION_SPECIFIC]
    assert consumer.publish(f"$ECQ/c/{queue}/rewind", "-3", qos=1) == 0x99


def test_a_311_consumer_gets_its_queue_without_properties(
    broker: BrokerProcess, clients: Clients, names: Names
) -> None:
    queue = names.client("device")
    producer = _producer(clients, broker, names)
    _write(producer, queue, "k", "v")
    raw = _raw_consumer(clients, broker, queue, level=4)
    message = raw.recv()
    assert isinstance(message, Publish) and message.payload == b"v" and message.qos == 1
    assert message.properties is None or message.properties == Properties()


def test_a_broker_without_persistence_refuses_queues_with_a_reason(
    broker_factory: Callable[[Mapping[str, object] | None], BrokerProcess],
    clients: Clients,
    names: Names,
) -> None:
    broker = broker_factory(None)  # persistence.enabled false
    client = clients.paho(broker, names.client("device"), version=V5)
    client.connect()
    assert client.publish(f"$ECQ/w/{names.client('d')}/k", "v", qos=1) == IMPLEMENTATION_SPECIFIC
    assert client.subscribe(f"$ECQ/{names.client('device')}/#", qos=1) == [IMPLEMENTATION_SPECIFIC]


@pytest.mark.parametrize("qos", [0, 1])
def test_a_queue_write_is_never_delivered_by_ordinary_routing(
    broker: BrokerProcess, clients: Clients, names: Names, qos: int
) -> None:
    queue = names.client("device")
    watcher = clients.paho(broker, names.client("watcher"))
    watcher.connect()
    assert watcher.subscribe("#", qos=1) == [1]  # '#' never matches '$' topics (MQTT-4.7.2-1)
    assert watcher.subscribe("$ECQ/w/#", qos=1) == [NOT_AUTHORIZED]
    producer = _producer(clients, broker, names)
    _write(producer, queue, "k", "v", qos=qos)
    consumer = clients.paho(broker, queue)
    consumer.connect()
    consumer.subscribe(f"$ECQ/{queue}/#", qos=1)
    assert consumer.get().payload == b"v"
    assert [m for m in watcher.drain() if m.topic.startswith("$ECQ")] == []


def test_a_resumed_session_gets_its_unacknowledged_entry_again_under_its_packet_id(
    broker: BrokerProcess, api: AdminClient, clients: Clients, names: Names
) -> None:
    queue = names.client("device")
    producer = _producer(clients, broker, names)
    _write(producer, queue, "k", "v")
    queue_state(api, queue, last_seq=1)
    expiry = Properties(session_expiry_interval=300)
    raw = _raw_consumer(clients, broker, queue, clean_start=True, properties=expiry)
    first = raw.recv()
    assert isinstance(first, Publish) and not first.dup
    raw.close()  # not acknowledged

    again = clients.raw(broker)
    connack = again.connect(queue, clean_start=False, properties=expiry)
    assert getattr(connack, "session_present", False)
    resent = again.recv()
    # MQTT-4.4.0-1: the unacknowledged PUBLISH again, with its packet identifier.
    assert isinstance(resent, Publish)
    assert (resent.packet_id, resent.payload, resent.dup) == (first.packet_id, b"v", True)
    assert first.packet_id is not None
    again.send(PubAck(first.packet_id))
    queue_state(api, queue, pending=0)
    assert again.recv_or_none(0.5) is None


def test_an_acl_file_without_queue_rules_still_delivers_a_queue(
    tmp_path: Path, clients: Clients, names: Names
) -> None:
    """An ACL whose ``#`` cannot match ``$`` topics must not make a queue's entries
    undeliverable (and acknowledged): the consumer's read rule is asked at SUBSCRIBE
    (issue 45: the ACL governs queue reads), never per entry."""
    acl = tmp_path / "acl"
    acl.write_text("topic readwrite #\ntopic write $ECQ/w/#\npattern read $ECQ/%c/#\n")
    with admin_broker(tmp_path / "b", **{"auth.acl_file": str(acl)}) as (broker, api):
        queue = names.client("device")
        producer = _producer(clients, broker, names)
        assert _write(producer, queue, "k", "v") == SUCCESS
        queue_state(api, queue, last_seq=1)
        consumer = clients.paho(broker, queue)
        consumer.connect()
        assert consumer.subscribe(f"$ECQ/{queue}/#", qos=1) == [1]
        assert consumer.get().payload == b"v"


def test_a_will_cannot_be_a_queue_write(
    broker: BrokerProcess, clients: Clients, names: Names
) -> None:
    raw = clients.raw(broker)
    for topic in (f"$ECQ/{names.client('victim')}/cmd", f"$ECQ/w/{names.client('v')}/k"):
        connack = raw.connect(names.client("attacker"), will=Will(topic, b"forged", 1, True))
        assert isinstance(connack, ConnAck) and connack.reason_code == TOPIC_NAME_INVALID
        raw.close()
        raw = clients.raw(broker)


def test_a_311_producer_never_hears_success_for_a_write_no_queue_keeps(
    broker_factory: Callable[[Mapping[str, object] | None], BrokerProcess],
    clients: Clients,
    names: Names,
) -> None:
    broker = broker_factory(None)  # persistence.enabled false: no queues
    raw = clients.raw(broker, level=4)
    raw.connect(names.client("producer"))
    raw.send(Publish(f"$ECQ/w/{names.client('d')}/k", b"v", 1, packet_id=1))
    assert not [p for p in raw.expect_close() if isinstance(p, PubAck)]


def test_the_consumer_gets_the_brokers_seq_and_its_subscription_identifier(
    broker: BrokerProcess, api: AdminClient, clients: Clients, names: Names
) -> None:
    queue = names.client("device")
    producer = _producer(clients, broker, names)
    forged = props(PacketTypes.PUBLISH, UserProperty=[("seq", "999"), ("unit", "C")])
    assert producer.publish(f"$ECQ/w/{queue}/k", "v", 1, properties=forged) == SUCCESS
    queue_state(api, queue, last_seq=1)
    consumer = clients.paho(broker, queue)
    consumer.connect()
    subscription = props(PacketTypes.SUBSCRIBE, SubscriptionIdentifier=7)
    assert consumer.subscribe(f"$ECQ/{queue}/#", 1, subscription) == [1]
    message = consumer.get()
    assert message.properties.UserProperty == [("unit", "C"), ("seq", "1")]
    assert message.properties.SubscriptionIdentifier == [7]


def test_a_new_subscription_does_not_send_again_what_is_in_flight(
    broker: BrokerProcess, api: AdminClient, clients: Clients, names: Names
) -> None:
    queue = names.client("device")
    producer = _producer(clients, broker, names)
    _write(producer, queue, "k", "v")
    queue_state(api, queue, last_seq=1)
    raw = _raw_consumer(clients, broker, queue)
    first = raw.recv()
    assert isinstance(first, Publish) and first.packet_id is not None
    raw.send(Unsubscribe(2, [f"$ECQ/{queue}/#"]))
    raw.recv()  # UNSUBACK
    raw.send(Subscribe(3, [Subscription(f"$ECQ/{queue}/#", 1)]))
    assert isinstance(raw.recv(), SubAck)
    assert raw.recv_or_none(0.5) is None  # still in flight under its first packet id
    raw.send(PubAck(first.packet_id))
    queue_state(api, queue, pending=0)


def test_the_cli_shows_and_rewinds_a_queue(
    broker: BrokerProcess,
    api: AdminClient,
    clients: Clients,
    names: Names,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    queue = names.client("device")
    producer = _producer(clients, broker, names)
    for key in ("a", "b"):
        _write(producer, queue, key, key)
    queue_state(api, queue, last_seq=2)
    consumer = clients.paho(broker, queue)
    consumer.connect()
    consumer.subscribe(f"$ECQ/{queue}/#", qos=1)
    assert [m.payload for m in consumer.get_n(2)] == [b"a", b"b"]
    queue_state(api, queue, pending=0)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    common = ["--url", api.url, "--token-file", str(token_file)]
    assert cli.main(["queues", "show", queue, *common, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["pending"], shown["keys"], shown["last_seq"], shown["acked_seq"]) == (0, 2, 2, 2)
    assert cli.main(["queues", "rewind", queue, "--seq", "2", *common]) == 0
    assert "1 entries pending again" in capsys.readouterr().out
    assert consumer.get().payload == b"b"
    assert cli.main(["queues", "rewind", queue, "--seq", "0", *common]) == 1  # 400: seq >= 1
    assert "seq" in capsys.readouterr().err
