"""Topic-to-Kafka integration rules: which published messages become records of the
user's own Kafka topics, under which key, with which value (docs/integrations.md).

Sans-IO: this module decides the records; a :class:`IntegrationSink` (the Kafka
one is persistence/integration_sink.py) produces them and says when Kafka has
them, and the publisher's PUBACK/PUBREC waits for that as it waits for the
persistent path (broker/handlers/publish.py).
"""

from __future__ import annotations

import base64
import enum
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from broker.topics import is_valid_topic_filter, topic_matches

if TYPE_CHECKING:
    from broker.config import IntegrationRule
    from broker.message import Message

AcceptedCallback = Callable[[bool], None]

# Kafka's own rule for topic names (its Topic.validate): at most 249 of these.
_KAFKA_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")
# A key template's placeholders: {client_id}, {username}, {topic}, {topic[N]}.
_PLACEHOLDER = re.compile(r"(client_id|username|topic)(?:\[(-?\d+)\])?")


@dataclass(slots=True, frozen=True)
class IntegrationRecord:
    """One Kafka record a rule makes of one message."""

    rule: str  # the rule's name (metrics, audit counts, log lines)
    topic: str  # the Kafka topic
    key: bytes | None  # None: an empty key template, no key
    value: bytes


class Refusal(enum.Enum):
    """Why a sink refused a PUBLISH's records at once, before any was handed to Kafka."""

    MISSING_TOPIC = "a rule's kafka topic does not exist"
    FULL = "too much waits for kafka"  # the waiting bound: 0x97 Quota exceeded (MQTT 5)


class IntegrationSink(Protocol):
    def submit(
        self,
        records: Sequence[IntegrationRecord],
        on_accepted: AcceptedCallback,
        on_settled: AcceptedCallback | None = None,
        *,
        best_effort: bool = False,
    ) -> Refusal | None:
        """Produce ``records`` (acks=all), then ``on_accepted(True)``, or
        ``on_accepted(False)`` if one failed or the deadline passed; after a failure,
        ``on_settled(ok)`` once no record can still be taken (``ok``: all were),
        as :meth:`broker.persistent_path.PersistentPath.submit`.

        A :class:`Refusal` returned: nothing was handed over, and neither callback
        runs (the caller answers its publisher). ``best_effort`` (QoS 0, wills: no
        re-send comes): the records of rules whose topic is missing are dropped and
        the others produced; refused only when too much waits."""

    def counts(self) -> dict[str, tuple[int, int]]:
        """The audit count per rule name: (records Kafka acknowledged, records failed)."""


# -- key templates --------------------------------------------------------------------

# One part of a parsed template: literal text, or (field, level index or None).
KeyPart = str | tuple[str, int | None]


def parse_key_template(template: str) -> tuple[KeyPart, ...]:
    """The parts of a key template; ValueError naming the problem.

    ``{client_id}``, ``{username}`` (empty for anonymous clients), ``{topic}`` and
    ``{topic[N]}``, the topic's level N (0 the first, -1 the last; empty if the
    topic has no such level); ``{{`` and ``}}`` are braces.
    """
    parts: list[KeyPart] = []
    text: list[str] = []
    i, n = 0, len(template)
    while i < n:
        char = template[i]
        if char in "{}" and template[i : i + 2] == char * 2:
            text.append(char)
            i += 2
            continue
        if char == "}":
            raise ValueError(f"a '}}' without its '{{' at character {i + 1} (write '}}}}')")
        if char != "{":
            text.append(char)
            i += 1
            continue
        end = template.find("}", i)
        if end < 0:
            raise ValueError(f"a '{{' without its '}}' at character {i + 1} (write '{{{{')")
        inner = template[i + 1 : end]
        match = _PLACEHOLDER.fullmatch(inner)
        if match is None or (match.group(2) is not None and match.group(1) != "topic"):
            raise ValueError(
                f"unknown placeholder {{{inner}}}: use {{client_id}}, {{username}}, "
                "{topic} or {topic[N]}"
            )
        if text:
            parts.append("".join(text))
            text = []
        level = match.group(2)
        parts.append((match.group(1), int(level) if level is not None else None))
        i = end + 1
    if text:
        parts.append("".join(text))
    return tuple(parts)


def render_key(parts: Sequence[KeyPart], client_id: str, username: str | None, topic: str) -> str:
    out: list[str] = []
    levels: list[str] | None = None
    for part in parts:
        if isinstance(part, str):
            out.append(part)
            continue
        name, index = part
        if name == "client_id":
            out.append(client_id)
        elif name == "username":
            out.append(username or "")
        elif index is None:
            out.append(topic)
        else:
            if levels is None:
                levels = topic.split("/")
            if -len(levels) <= index < len(levels):
                out.append(levels[index])
    return "".join(out)


def rule_problem(rule: IntegrationRule) -> tuple[str, str] | None:
    """(field, what is wrong) for the first bad field of ``rule``; None: it is good.
    Asked once at start (broker/config.py), so a bad rule stops the start."""
    topic_filter = rule.topic_filter
    if not topic_filter or not is_valid_topic_filter(topic_filter):
        return "topic_filter", f"{topic_filter!r} is not a valid MQTT topic filter"
    if topic_filter.startswith(("$share/", "$queue/")):
        return "topic_filter", "a rule sees every matching message: no $share/ or $queue/"
    if not _KAFKA_TOPIC.fullmatch(rule.kafka_topic) or rule.kafka_topic in (".", ".."):
        return "kafka_topic", (
            f"{rule.kafka_topic!r} is not a Kafka topic name (1 to 249 of a-z A-Z 0-9 . _ -)"
        )
    try:
        parse_key_template(rule.key)
    except ValueError as error:
        return "key", str(error)
    return None


# -- the rules ------------------------------------------------------------------------


class _Compiled:
    __slots__ = ("envelope", "kafka_topic", "key", "name", "topic_filter")

    def __init__(self, rule: IntegrationRule) -> None:
        self.name = rule.name
        self.topic_filter = rule.topic_filter
        self.kafka_topic = rule.kafka_topic
        self.key = parse_key_template(rule.key)
        self.envelope = rule.payload == "envelope"


class IntegrationRules:
    """The configured rules, asked once per PUBLISH (a linear scan: rules are few)."""

    def __init__(self, rules: Sequence[IntegrationRule]) -> None:
        self._rules = [_Compiled(rule) for rule in rules]

    @property
    def names(self) -> list[str]:
        return [rule.name for rule in self._rules]

    def records(
        self, message: Message, client_id: str, username: str | None, wall_time: float
    ) -> list[IntegrationRecord]:
        """One record per rule whose filter matches ``message``'s topic (none for
        a topic starting with ``$`` unless a rule names it: MQTT-4.7.2-1)."""
        topic = message.topic
        records: list[IntegrationRecord] = []
        envelope: bytes | None = None
        for rule in self._rules:
            if not topic_matches(rule.topic_filter, topic):
                continue
            key = render_key(rule.key, client_id, username, topic) if rule.key else ""
            if rule.envelope:
                if envelope is None:
                    envelope = _envelope(message, client_id, username, wall_time)
                value = envelope
            else:
                value = message.payload
            records.append(
                IntegrationRecord(rule.name, rule.kafka_topic, key.encode() or None, value)
            )
        return records


def _envelope(message: Message, client_id: str, username: str | None, wall_time: float) -> bytes:
    """The JSON envelope: the payload with what the broker knows of it. A UTF-8 payload
    is kept as text; any other is base64 (``payload_encoding`` says which)."""
    try:
        payload, encoding = message.payload.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        payload, encoding = base64.b64encode(message.payload).decode("ascii"), "base64"
    document: dict[str, object] = {
        "topic": message.topic,
        "client_id": client_id,
        "username": username,
        "qos": message.qos,
        "retain": message.retain,
        "timestamp_ms": int(wall_time * 1000),
        "payload": payload,
        "payload_encoding": encoding,
    }
    properties = message.properties
    if properties is not None:
        if properties.content_type is not None:
            document["content_type"] = properties.content_type
        if properties.user_properties:
            document["user_properties"] = [list(pair) for pair in properties.user_properties]
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()
