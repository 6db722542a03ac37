"""Topic-to-Kafka integration rules (broker/integrations.py): the ``integrations``
settings, key templates, the JSON envelope, and the sans-IO core holding the
publisher's acknowledgement until the records are produced. The Kafka side, against
a real Kafka, is tests/faults/test_integrations.py."""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from broker.config import (
    AuthSettings,
    ConfigError,
    IntegrationRule,
    Settings,
    load_settings,
)
from broker.integrations import (
    AcceptedCallback,
    IntegrationRecord,
    IntegrationRules,
    parse_key_template,
    render_key,
)
from broker.message import Message
from broker.packets import (
    Disconnect,
    Properties,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    ReasonCode,
    Will,
)
from tests.unit.core_harness import V5, V311, DeferredPersistentPath, Harness, payloads

REPO = Path(__file__).resolve().parents[2]


def rules_error(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_settings(env={"DEVICEMQ_INTEGRATIONS": text})
    message = str(info.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------- settings


def test_rules_from_a_file_with_defaults(tmp_path: Path) -> None:
    path = tmp_path / "devicemq.yml"
    path.write_text(
        "integrations:\n"
        "  - topic_filter: sensors/+/telemetry\n"
        "    kafka_topic: plant.telemetry\n"
        "  - name: alarms\n"
        "    topic_filter: alarms/#\n"
        "    kafka_topic: ${ALARM_TOPIC:plant.alarms}\n"
        "    key: '{topic[1]}-{username}'\n"
        "    payload: Envelope\n"
    )
    rules = load_settings(path, env={}).integrations
    assert rules == (
        IntegrationRule("plant.telemetry", "sensors/+/telemetry", "plant.telemetry"),
        IntegrationRule("alarms", "alarms/#", "plant.alarms", "{topic[1]}-{username}", "envelope"),
    )


def test_rules_from_the_environment_and_the_command_line() -> None:
    text = '[{"name": "t", "topic_filter": "a/#", "kafka_topic": "k"}]'
    assert load_settings(env={"DEVICEMQ_INTEGRATIONS": text}).integrations[0].name == "t"
    given = [{"topic_filter": "b/#", "kafka_topic": "k2"}]
    assert load_settings(env={}, overrides={"integrations": given}).integrations[0].name == "k2"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[{topic_filter: a/#}]", "integrations[0].kafka_topic: required"),
        ("[{kafka_topic: k}]", "integrations[0].topic_filter: required"),
        ("[{topic_filter: a/#/b, kafka_topic: k}]", "integrations[0].topic_filter: 'a/#/b'"),
        ("[{topic_filter: $share/g/a, kafka_topic: k}]", "integrations[0].topic_filter: a rule"),
        ("[{topic_filter: a, kafka_topic: 'k k'}]", "integrations[0].kafka_topic: 'k k' is not"),
        ("[{topic_filter: a, kafka_topic: k, key: '{clientid}'}]", "[0].key: unknown placeholder"),
        ("[{topic_filter: a, kafka_topic: k, key: '{username[1]}'}]", "[0].key: unknown"),
        ("[{topic_filter: a, kafka_topic: k, key: 'x{topic'}]", "[0].key: a '{' without its '}'"),
        ("[{topic_filter: a, kafka_topic: k, key: 'x}'}]", "[0].key: a '}' without its '{'"),
        ("[{topic_filter: a, kafka_topic: k, payload: json}]", "[0].payload: must be one of"),
        ("[{topic_filter: a, kafka_topic: k, kye: x}]", "[0].kye: unknown setting (did you mean"),
        ("[{topic_filter: a, kafka_topic: k, key: 3}]", "[0].key: expected a string"),
        ("[{topic_filter: a, kafka_topic: k}, {topic_filter: b, kafka_topic: k}]", "[1].name"),
        ("[{topic_filter: a, kafka_topic: devicemq.events}]", "[0].kafka_topic: 'devicemq.events'"),
        ("[{topic_filter: a, kafka_topic: devicemq.device.persisted}]", "is persistence.topic"),
        ("[x]", "integrations[0]: expected a mapping"),
        ("{a: 1}", "integrations: expected a list of rules"),
        ("[{", "integrations: invalid YAML"),
    ],
)
def test_a_bad_rule_is_one_line_naming_the_field(text: str, expected: str) -> None:
    message = rules_error(text)
    assert message.startswith("env DEVICEMQ_INTEGRATIONS: ")
    assert expected in message


def test_a_bad_rule_in_a_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "devicemq.yml"
    path.write_text("integrations:\n  - topic_filter: a\n    kafka_topic: ''\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, env={})
    assert str(info.value) == f"{path}: integrations[0].kafka_topic: required, and missing or empty"


def test_the_shipped_yml_documents_every_rule_field() -> None:
    text = (REPO / "config" / "devicemq.yml").read_text()
    block = text[text.index("# Topic-to-Kafka integration") :]
    for field in dataclasses.fields(IntegrationRule):
        assert f"#   {field.name} " in block, field.name


# ---------------------------------------------------------------- keys and values


@pytest.mark.parametrize(
    ("template", "key"),
    [
        ("{client_id}", "dev-1"),
        ("{username}", "alice"),
        ("{topic}", "plant/line-4/temp"),
        ("{topic[0]}/{topic[-1]}", "plant/temp"),
        ("{topic[7]}", ""),  # no such level
        ("{{{client_id}}}", "{dev-1}"),
        ("fixed", "fixed"),
    ],
)
def test_key_templates(template: str, key: str) -> None:
    parts = parse_key_template(template)
    assert render_key(parts, "dev-1", "alice", "plant/line-4/temp") == key


def _records(rules: Sequence[IntegrationRule], message: Message) -> list[IntegrationRecord]:
    return IntegrationRules(rules).records(message, "dev-1", None, 1_700_000_000.5)


def test_one_record_per_matching_rule_raw_and_keyless() -> None:
    rules = [
        IntegrationRule("all", "#", "k-all"),
        IntegrationRule("temp", "plant/+/temp", "k-temp", key=""),
        IntegrationRule("other", "other/#", "k-other"),
    ]
    records = _records(rules, Message("plant/4/temp", b"\x00\x01", 1, False))
    assert records == [
        IntegrationRecord("all", "k-all", b"dev-1", b"\x00\x01"),
        IntegrationRecord("temp", "k-temp", None, b"\x00\x01"),
    ]
    assert _records(rules, Message("$SYS/broker/uptime", b"1", 0, False)) == []  # 4.7.2-1


def test_the_envelope() -> None:
    rule = IntegrationRule("e", "#", "k", payload="envelope")
    properties = Properties(content_type="text/plain", user_properties=(("a", "1"), ("a", "2")))
    message = Message("t/1", "héllo".encode(), 2, True, properties=properties)
    (record,) = _records([rule], message)
    assert json.loads(record.value) == {
        "topic": "t/1",
        "client_id": "dev-1",
        "username": None,
        "qos": 2,
        "retain": True,
        "timestamp_ms": 1_700_000_000_500,
        "payload": "héllo",
        "payload_encoding": "utf-8",
        "content_type": "text/plain",
        "user_properties": [["a", "1"], ["a", "2"]],
    }
    (binary,) = _records([rule], Message("t/1", b"\xff\x00", 0, False))
    document = json.loads(binary.value)
    assert document["payload_encoding"] == "base64"
    assert base64.b64decode(document["payload"]) == b"\xff\x00"


# ---------------------------------------------------------------- the core


class DeferredSink:
    """An integration sink whose records are produced when the test says so."""

    def __init__(self) -> None:
        self.pending: list[tuple[list[IntegrationRecord], AcceptedCallback, object]] = []
        self.produced: list[IntegrationRecord] = []

    def submit(
        self,
        records: Sequence[IntegrationRecord],
        on_accepted: AcceptedCallback,
        on_settled: AcceptedCallback | None = None,
        *,
        best_effort: bool = False,
    ) -> None:
        self.pending.append((list(records), on_accepted, on_settled))

    def complete(self, ok: bool = True) -> None:
        records, on_accepted, _ = self.pending.pop(0)
        if ok:
            self.produced.extend(records)
        on_accepted(ok)

    def counts(self) -> dict[str, tuple[int, int]]:
        return {}


RULES = (
    IntegrationRule("telemetry", "sensors/#", "k.telemetry"),
    IntegrationRule("temp", "sensors/+/temp", "k.temp", key="{topic[1]}"),
)


def harness(tmp_path: Path | None = None, acl: str = "") -> tuple[Harness, DeferredSink]:
    settings = dataclasses.replace(Settings(), integrations=RULES)
    if acl:
        assert tmp_path is not None
        path = tmp_path / "acl"
        path.write_text(acl)
        settings = dataclasses.replace(settings, auth=AuthSettings(acl_file=str(path)))
    sink = DeferredSink()
    return Harness(settings, integration_sink=sink), sink


def test_puback_waits_for_the_records() -> None:
    h, sink = harness()
    pub = h.connected("dev-1")
    pub.publish("sensors/d1/temp", b"21.5", qos=1, packet_id=1)
    (records, _, _) = sink.pending[0]
    assert [(r.rule, r.topic, r.key) for r in records] == [
        ("telemetry", "k.telemetry", b"dev-1"),
        ("temp", "k.temp", b"d1"),
    ]
    assert pub.read() == []  # nobody subscribes: only the rules take it
    sink.complete()
    assert pub.read() == [PubAck(1)]  # a rule counts as a receiver: not 0x10


def test_a_failed_record_is_no_success() -> None:
    h, sink = harness()
    v5 = h.connected("dev-5")
    v5.publish("sensors/a", b"x", qos=1, packet_id=1)
    sink.complete(ok=False)
    assert v5.read() == [PubAck(1, ReasonCode.UNSPECIFIED_ERROR)]
    v311 = h.connected("dev-3", level=V311)
    v311.publish("sensors/a", b"x", qos=1, packet_id=1)
    sink.complete(ok=False)
    assert v311.read() == [] and v311.closed  # 3.1.1: closed, it sends again


def test_puback_waits_for_the_subscribers_and_the_records() -> None:
    h, sink = harness()
    sub = h.connected("sub")
    sub.subscribe("sensors/#", qos=1)
    pub = h.connected("dev-1")
    pub.publish("sensors/a", b"x", qos=1, packet_id=7)
    assert payloads(sub.read()) == [b"x"]
    assert pub.read() == []
    sink.complete()
    assert pub.read() == [PubAck(7)]


def test_puback_waits_for_the_persistent_path_and_the_records_either_failing_fails() -> None:
    path, sink = DeferredPersistentPath(), DeferredSink()
    settings = dataclasses.replace(Settings(), integrations=RULES)
    h = Harness(settings, persistent_path=path, integration_sink=sink)
    durable = h.connected("durable", session_expiry_interval=3600)
    durable.subscribe("sensors/#", qos=1)
    pub = h.connected("dev-1")
    pub.publish("sensors/a", b"1", qos=1, packet_id=1)
    pub.publish("sensors/a", b"2", qos=1, packet_id=2)
    sink.complete()
    assert pub.read() == []  # Kafka has the records, not yet the delivery
    path.complete()
    assert pub.read() == [PubAck(1)]
    path.complete()  # the delivery is in, the records fail
    sink.complete(ok=False)
    assert pub.read() == [PubAck(2, ReasonCode.UNSPECIFIED_ERROR)]


def test_qos0_is_not_waited_for() -> None:
    h, sink = harness()
    pub = h.connected("dev-1")
    pub.publish("sensors/a", b"x", qos=0)
    assert len(sink.pending) == 1
    pub.publish("elsewhere", b"x", qos=1, packet_id=1)
    assert pub.read() == [PubAck(1, ReasonCode.NO_MATCHING_SUBSCRIBERS)]
    assert len(sink.pending) == 1  # no rule matched


def test_only_what_the_acl_lets_through_reaches_a_rule(tmp_path: Path) -> None:
    h, sink = harness(tmp_path, acl="topic write sensors/allowed/#\n")
    pub = h.connected("dev-1")
    pub.publish("sensors/denied/temp", b"x", qos=1, packet_id=1)
    assert pub.read() == [PubAck(1, ReasonCode.NOT_AUTHORIZED)]
    assert sink.pending == []
    pub.publish("sensors/allowed/temp", b"x", qos=1, packet_id=2)
    assert len(sink.pending) == 1


def test_a_retained_message_makes_records_when_published_not_when_sent() -> None:
    h, sink = harness()
    pub = h.connected("dev-1")
    pub.publish("sensors/a", b"r", qos=1, packet_id=1, retain=True)
    sink.complete()
    assert pub.read() == [PubAck(1)]
    sub = h.connected("sub")
    sub.subscribe("sensors/#", qos=1)
    assert payloads(sub.pending) == [b"r"]
    assert sink.pending == [] and len(sink.produced) == 1


def test_a_will_reaches_the_rules() -> None:
    h, sink = harness()
    dev = h.client()
    dev.connect("dev-1", will=Will("sensors/dev-1/status", b"gone", qos=1))
    dev.send(Disconnect(ReasonCode.DISCONNECT_WITH_WILL))
    (records, _, _) = sink.pending[0]
    assert [r.value for r in records] == [b"gone"]


def test_a_311_qos2_resend_after_a_late_record_is_not_routed_again() -> None:
    """The record timed out, then Kafka took it (settled True): the re-send on the
    next connection gets PUBREC, and no second record."""
    h, sink = harness()
    pub = h.connected("dev-3", level=V311, clean_start=False)
    pub.publish("sensors/a", b"x", qos=2, packet_id=9)
    (_, on_accepted, on_settled) = sink.pending.pop(0)
    on_accepted(False)
    assert pub.closed
    again = h.client(V311)
    again.connect("dev-3", clean_start=False)
    again.send(Publish("sensors/a", b"x", 2, False, True, 9))  # DUP
    assert again.read() == []  # waits for the first one's outcome
    assert callable(on_settled)
    on_settled(True)
    assert again.read() == [PubRec(9)]
    assert sink.pending == []
    again.send(PubRel(9))
    assert again.read() == [PubComp(9)]


def test_v5_is_unaffected_by_a_harness_without_rules() -> None:
    h = Harness()
    pub = h.connected("dev-1", level=V5)
    pub.publish("sensors/a", b"x", qos=1, packet_id=1)
    assert pub.read() == [PubAck(1, ReasonCode.NO_MATCHING_SUBSCRIBERS)]
