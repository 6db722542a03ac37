"""A network-free harness for the sans-IO broker core, in the style of h11's tests.

A :class:`Harness` owns one :class:`~broker.core.Broker` with a fake clock.
Each :class:`Client` is an :class:`~broker.connection.MQTTConnection` with a
client-side :class:`~broker.codec.PacketDecoder`: ``send`` encodes packets
into ``receive_data``; ``read`` decodes everything ``data_to_send`` produced.
Time only moves through :meth:`Harness.advance`, which also runs
``broker.tick()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from app.authentication import open_authentication
from broker.codec import PacketDecoder, encode
from broker.config import MqttSettings, Settings
from broker.connection import MQTTConnection
from broker.core import Broker
from broker.group_queue import GroupTarget
from broker.integrations import IntegrationSink
from broker.message import Delivery
from broker.packets import (
    ConnAck,
    Connect,
    Disconnect,
    Packet,
    Properties,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    Subscription,
    UnsubAck,
    Unsubscribe,
    Will,
)
from broker.persistent_path import AcceptedCallback, InMemoryPersistentPath, PersistentPath
from broker.session import Session

Addressed = tuple[Session | GroupTarget, Delivery]
V311 = 4
V5 = 5


def make_settings(**mqtt: Any) -> Settings:
    """Default settings with some ``mqtt`` fields replaced."""
    return dataclasses.replace(Settings(), mqtt=dataclasses.replace(MqttSettings(), **mqtt))


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class Client:
    """One simulated network connection (a socket's worth of bytes)."""

    def __init__(self, harness: Harness, level: int = V5, peer: str = "peer") -> None:
        self.harness = harness
        self.level = level
        self.outputs = 0  # times on_output fired
        self.reading: list[bool] = []  # what on_input_flow said, in order
        self.conn = MQTTConnection(
            harness.broker, peer, on_output=self._on_output, on_input_flow=self.reading.append
        )
        self.decoder = PacketDecoder(protocol_level=level)
        self._next_id = 0

    def _on_output(self, conn: MQTTConnection) -> None:
        self.outputs += 1

    # -- sending -----------------------------------------------------------------------

    def send(self, *packets: Packet) -> None:
        for packet in packets:
            self.conn.receive_data(encode(packet, self.level))

    def send_raw(self, data: bytes) -> None:
        self.conn.receive_data(data)

    def next_id(self) -> int:
        self._next_id = self._next_id % 65535 + 1
        return self._next_id

    # -- reading -----------------------------------------------------------------------

    def read(self) -> list[Packet]:
        """Every packet the broker has sent this client since the last read."""
        return self.decoder.feed(self.conn.data_to_send())

    def read_one(self) -> Packet:
        packets = self.read()
        assert len(packets) == 1, packets
        return packets[0]

    def expect_nothing(self) -> None:
        assert self.read() == []

    @property
    def closed(self) -> bool:
        return self.conn.close_requested

    # -- common exchanges --------------------------------------------------------------

    def connect(
        self,
        client_id: str = "c",
        *,
        clean_start: bool = True,
        keep_alive: int = 0,
        will: Will | None = None,
        properties: Properties | None = None,
        check: bool = True,
        **props: Any,
    ) -> ConnAck:
        """Send CONNECT and return the CONNACK (asserting success unless ``check=False``)."""
        if props:
            properties = dataclasses.replace(properties or Properties(), **props)
        self.send(
            Connect(
                client_id,
                protocol_level=self.level,
                clean_start=clean_start,
                keep_alive=keep_alive,
                will=will,
                properties=properties,
            )
        )
        packets = self.read()
        assert packets and isinstance(packets[0], ConnAck), packets
        connack = packets[0]
        if check:
            assert connack.reason_code == 0, connack
        self.pending = packets[1:]  # anything resent right after CONNACK
        return connack

    def subscribe(
        self, *filters: str | Subscription, qos: int = 0, sub_id: int | None = None
    ) -> list[int]:
        """SUBSCRIBE and return the SUBACK codes; retained messages stay unread."""
        subs = [Subscription(f, qos) if isinstance(f, str) else f for f in filters]
        properties = Properties(subscription_identifiers=(sub_id,)) if sub_id else None
        packet_id = self.next_id()
        self.send(Subscribe(packet_id, subs, properties))
        packets = self.read()
        suback = packets[0]
        assert isinstance(suback, SubAck) and suback.packet_id == packet_id, packets
        self.pending = packets[1:]
        return suback.reason_codes

    def unsubscribe(self, *filters: str) -> UnsubAck:
        packet_id = self.next_id()
        self.send(Unsubscribe(packet_id, list(filters)))
        unsuback = self.read_one()
        assert isinstance(unsuback, UnsubAck) and unsuback.packet_id == packet_id
        return unsuback

    def publish(
        self,
        topic: str,
        payload: bytes = b"x",
        qos: int = 0,
        retain: bool = False,
        packet_id: int | None = None,
        properties: Properties | None = None,
        **props: Any,
    ) -> int | None:
        """Send a PUBLISH (no acknowledgement is read); returns its packet id."""
        if props:
            properties = dataclasses.replace(properties or Properties(), **props)
        if qos and packet_id is None:
            packet_id = self.next_id()
        self.send(Publish(topic, payload, qos, retain, False, packet_id, properties))
        return packet_id

    def publish_acked(self, topic: str, payload: bytes = b"x", qos: int = 1, **kw: Any) -> int:
        """Publish at QoS 1 or 2 and complete the flow; returns the ack reason code."""
        packet_id = self.publish(topic, payload, qos, **kw)
        ack = self.read_one()
        if qos == 1:
            assert isinstance(ack, PubAck) and ack.packet_id == packet_id, ack
            return ack.reason_code
        assert isinstance(ack, PubRec) and ack.packet_id == packet_id, ack
        assert packet_id is not None
        self.send(PubRel(packet_id))
        comp = self.read_one()
        assert isinstance(comp, PubComp) and comp.packet_id == packet_id and comp.reason_code == 0
        return ack.reason_code

    def ack(self, publish: Packet) -> None:
        """Acknowledge a received QoS 1/2 PUBLISH completely (PUBACK, or PUBREC+PUBCOMP)."""
        assert isinstance(publish, Publish) and publish.packet_id is not None
        if publish.qos == 1:
            self.send(PubAck(publish.packet_id))
        elif publish.qos == 2:
            self.send(PubRec(publish.packet_id))
            rel = self.read_one()
            assert isinstance(rel, PubRel) and rel.packet_id == publish.packet_id, rel
            self.send(PubComp(publish.packet_id))

    def disconnect(self, reason: int = 0, **props: Any) -> None:
        self.send(Disconnect(reason, Properties(**props) if props else None))


class DeferredPersistentPath(InMemoryPersistentPath):
    """A persistent path whose storage completes only when a test says so.

    ``complete(i, ok)`` finishes the i-th pending submission (0 = oldest still
    pending): on success the deliveries reach their sessions, then the
    publisher's ``on_accepted`` runs, as the durable path does.
    """

    def __init__(self) -> None:
        self.pending: list[
            tuple[Sequence[Addressed], AcceptedCallback, AcceptedCallback | None]
        ] = []
        self.unsettled: list[tuple[Sequence[Addressed], AcceptedCallback]] = []

    def submit(
        self,
        deliveries: Sequence[Addressed],
        on_accepted: AcceptedCallback,
        on_settled: AcceptedCallback | None = None,
    ) -> None:
        self.pending.append((list(deliveries), on_accepted, on_settled))

    def complete(self, index: int = 0, ok: bool = True, settled: bool | None = False) -> None:
        """Finish a submission. A failure is settled at once with ``settled`` (default:
        not stored), or with None later by :meth:`settle` (a store that timed out)."""
        deliveries, on_accepted, on_settled = self.pending.pop(index)
        if ok:
            _deliver(deliveries)
        on_accepted(ok)
        if ok or on_settled is None:
            return
        if settled is None:
            self.unsettled.append((deliveries, on_settled))
        else:
            on_settled(settled)

    def settle(self, index: int = 0, ok: bool = True) -> None:
        """The late outcome of a failed submission: stored after all, or not."""
        deliveries, on_settled = self.unsettled.pop(index)
        if ok:
            _deliver(deliveries)
        on_settled(ok)


def _deliver(deliveries: Sequence[Addressed]) -> None:
    for session, delivery in deliveries:
        if isinstance(session, Session):  # no group queues without persistence
            session.deliver(delivery)


class Harness:
    def __init__(
        self,
        settings: Settings | None = None,
        persistent_path: PersistentPath | None = None,
        integration_sink: IntegrationSink | None = None,
        **mqtt: Any,
    ) -> None:
        if settings is None:
            settings = make_settings(**mqtt)
        self.clock = FakeClock()
        authenticator, authorizer = open_authentication(settings, self.clock)
        self.broker = Broker(
            settings,
            clock=self.clock,
            authenticator=authenticator,
            authorizer=authorizer,
            persistent_path=persistent_path,
            wall_clock=self.clock,
            integration_sink=integration_sink,
        )

    def client(self, level: int = V5, peer: str = "peer") -> Client:
        return Client(self, level, peer)

    def connected(self, client_id: str = "c", level: int = V5, **kw: Any) -> Client:
        client = self.client(level, peer=client_id)
        client.connect(client_id, **kw)
        return client

    def advance(self, seconds: float) -> None:
        """Move the fake clock and run the broker's deadlines."""
        self.clock.now += seconds
        self.broker.tick()


def publishes(packets: list[Packet]) -> list[Publish]:
    assert all(isinstance(p, Publish) for p in packets), packets
    return packets  # type: ignore[return-value]


def payloads(packets: list[Packet]) -> list[bytes]:
    return [p.payload for p in publishes(packets)]
