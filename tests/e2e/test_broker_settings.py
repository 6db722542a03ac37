"""devicemq settings, given as DEVICEMQ_* environment variables to a real process,
change what CONNACK announces and what the broker enforces; and the process
shuts down cleanly on SIGTERM."""

from __future__ import annotations

import signal
import time

import pytest
from paho.mqtt.packettypes import PacketTypes

from broker.packets import (
    Disconnect,
    Properties,
    Publish,
    Subscribe,
    Subscription,
    Will,
)
from tests.e2e.clients import V311, props
from tests.e2e.conftest import devicemq_only, start_broker

pytestmark = [pytest.mark.e2e, devicemq_only("these are devicemq settings")]

LIMITED = {
    "mqtt.maximum_qos": 1,
    "mqtt.retain_available": False,
    "mqtt.subscription_identifiers": False,
    "mqtt.shared_subscriptions": False,
    "mqtt.topic_alias_maximum": 0,
    "mqtt.max_client_id_length": 64,
    "mqtt.max_session_expiry_interval": 2,
    "mqtt.receive_maximum": 5,
}


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    broker = start_broker(tmp_path_factory.mktemp("limited"), LIMITED)
    yield broker
    broker.stop()


def test_connack_announces_limits(limited, clients, names):
    """CONNACK carries every limit that differs from the protocol default (3.2.2.3)."""
    a = clients.paho(limited, names.client("a"))
    ack = a.connect(properties=props(PacketTypes.CONNECT, SessionExpiryInterval=100))
    assert ack.prop("MaximumQoS") == 1
    assert ack.prop("RetainAvailable") == 0
    assert ack.prop("SubscriptionIdentifierAvailable") == 0
    assert ack.prop("SharedSubscriptionAvailable") == 0
    assert ack.prop("TopicAliasMaximum", 0) == 0
    assert ack.prop("ReceiveMaximum") == 5
    assert ack.prop("SessionExpiryInterval") == 2  # the server's cap (MQTT-3.2.2-?)
    a.disconnect()


def test_maximum_qos(limited, clients, names):
    """A subscription asking QoS 2 is granted 1; a QoS 2 PUBLISH is refused with
    0x9B QoS not supported (MQTT-3.2.2-11), as is a will at QoS 2 (MQTT-3.2.2-12)."""
    a = clients.paho(limited, names.client("a"))
    a.connect()
    assert a.subscribe(names.topic(), 2) == [1]
    a.publish(names.topic(), b"two", 2, wait=False)
    gone = a.wait_disconnected()
    assert gone.from_server and gone.reason_code == 0x9B, gone

    raw = clients.raw(limited)
    ack = raw.connect(names.client("w"), will=Will(names.topic("will"), b"x", 2))
    assert ack.reason_code == 0x9B
    assert raw.expect_close() == []

    raw = clients.raw(limited, level=4)  # 3.1.1: no reason codes, the socket closes
    assert raw.connect(names.client("v3")).reason_code == 0
    raw.send(Publish(names.topic(), b"two", 2, packet_id=1))
    assert raw.expect_close() == []


def test_retain_not_available(limited, clients, names):
    """A retained PUBLISH is refused with 0x9A Retain not supported (MQTT-3.2.2-14)."""
    a = clients.paho(limited, names.client("a"))
    a.connect()
    a.publish(names.topic(), b"keep me", 1, retain=True, wait=False)
    gone = a.wait_disconnected()
    assert gone.from_server and gone.reason_code == 0x9A, gone
    raw = clients.raw(limited)
    ack = raw.connect(names.client("w"), will=Will(names.topic("will"), b"x", 0, retain=True))
    assert ack.reason_code == 0x9A


def test_subscription_identifiers_off(limited, clients, names):
    """A Subscription Identifier when they are not supported: DISCONNECT 0xA1."""
    raw = clients.raw(limited)
    raw.connect(names.client("a"))
    raw.send(
        Subscribe(1, [Subscription(names.topic(), 1)], Properties(subscription_identifiers=(7,)))
    )
    assert raw.expect_close() == [Disconnect(0xA1)]


def test_shared_subscriptions_off(limited, clients, names):
    """A shared subscription when they are off: SUBACK 0x9E (v5), 0x80 (3.1.1)."""
    a = clients.paho(limited, names.client("a"))
    a.connect()
    assert a.subscribe([(f"$share/g/{names.topic()}", 1), (names.topic(), 1)]) == [0x9E, 1]
    a.disconnect()
    b = clients.paho(limited, names.client("b"), version=V311)
    b.connect()
    assert b.subscribe(f"$share/g/{names.topic()}", 1) == [0x80]
    b.disconnect()


def test_topic_aliases_off(limited, clients, names):
    """Topic Alias Maximum 0: any alias from the client is invalid (0x94)."""
    a = clients.paho(limited, names.client("a"))
    a.connect()
    a.publish(
        names.topic(), b"x", 1, properties=props(PacketTypes.PUBLISH, TopicAlias=1), wait=False
    )
    gone = a.wait_disconnected()
    assert gone.from_server and gone.reason_code == 0x94, gone


def test_client_id_length(limited, clients):
    """A client id above mqtt.max_client_id_length: 0x85 (v5), return code 2 (3.1.1)."""
    raw = clients.raw(limited)
    assert raw.connect("x" * 65).reason_code == 0x85
    assert raw.expect_close() == []
    raw = clients.raw(limited, level=4)
    assert raw.connect("x" * 65).reason_code == 2
    raw = clients.raw(limited)
    assert raw.connect("x" * 64).reason_code == 0
    raw.disconnect()


def test_session_expiry_capped(limited, clients, names):
    """The server's cap on Session Expiry applies: a session asking 100 s is gone
    after the 2 s the server granted."""
    a = clients.paho(limited, names.client("a"))
    session = props(PacketTypes.CONNECT, SessionExpiryInterval=100)
    a.connect(properties=session)
    a.disconnect()
    assert a.connect(clean_start=False, properties=session).session_present
    a.disconnect()
    time.sleep(3.0)  # the granted interval passing is the point
    assert not a.connect(clean_start=False, properties=session).session_present
    a.disconnect()


def test_receive_maximum_setting(broker_factory, clients, names):
    """mqtt.receive_maximum 5: five QoS 2 PUBLISHes awaiting PUBREL fill the window;
    the sixth gets DISCONNECT 0x93 Receive Maximum exceeded."""
    raw = clients.raw(broker_factory({"mqtt.receive_maximum": 5}))
    raw.connect(names.client("a"))
    for i in range(1, 7):
        raw.send(Publish(names.topic(), b"x", 1 if i == 6 else 2, packet_id=i))
    after = raw.expect_close()
    assert [p.packet_id for p in after[:-1]] == [1, 2, 3, 4, 5]
    assert after[-1] == Disconnect(0x93)


def test_connect_timeout_setting(broker_factory, clients):
    """mqtt.connect_timeout 0.5: a silent socket is closed after about that long."""
    server = broker_factory({"mqtt.connect_timeout": 0.5})
    raw = clients.raw(server)
    start = time.monotonic()
    assert raw.expect_close(timeout=3) == []
    assert time.monotonic() - start < 2.0


def test_sigterm_disconnects_clients_and_exits_zero(broker_factory, clients, names):
    """SIGTERM: every v5 client gets DISCONNECT 0x8B Server shutting down, 3.1.1
    clients a close, and the process exits 0 promptly."""
    server = broker_factory()
    v5 = clients.raw(server)
    assert v5.connect(names.client("v5")).reason_code == 0
    v3 = clients.raw(server, level=4)
    assert v3.connect(names.client("v3")).reason_code == 0
    half = clients.raw(server)  # never sent CONNECT
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert v5.expect_close() == [Disconnect(0x8B)]
    assert v3.expect_close() == []
    assert half.expect_close() == []
    assert server.proc.wait(10) == 0
    assert time.monotonic() - start < 5
    assert "Traceback" not in server.log()


def test_bad_setting_fails_fast(tmp_path):
    """An invalid DEVICEMQ_* value stops the process at once with a one-line error."""
    with pytest.raises(RuntimeError) as failure:
        start_broker(tmp_path, {"mqtt.receive_maximum": 0})
    text = str(failure.value)
    assert "DEVICEMQ_MQTT_RECEIVE_MAXIMUM" in text and "Traceback" not in text
