"""The $ECQ topic and subscription rules (broker/ecq.py), sans IO."""

from __future__ import annotations

import pytest

from broker.ecq import (
    SubscribeVerdict,
    TopicKind,
    classify,
    consumer_topic,
    key_of,
    parse_rewind,
    subscribe_verdict,
)
from persistence.format import StoredMessage, encode_message, is_queue_record


@pytest.mark.parametrize(
    ("topic", "expected"),
    [
        ("a/b", (TopicKind.PLAIN, "", "")),
        ("$SYS/x", (TopicKind.PLAIN, "", "")),
        ("$ECQ/w/dev1/temp", (TopicKind.WRITE, "dev1", "temp")),
        ("$ECQ/w/dev1/a/b/c", (TopicKind.WRITE, "dev1", "a/b/c")),  # a key may have levels
        ("$ECQ/w/dev1/", (TopicKind.INVALID, "", "")),
        ("$ECQ/w//k", (TopicKind.INVALID, "", "")),
        ("$ECQ/w/dev1", (TopicKind.INVALID, "", "")),
        ("$ECQ/dev1/k", (TopicKind.INVALID, "", "")),  # consumers' topics are the broker's
        ("$ECQ/c/dev1/rewind", (TopicKind.REWIND, "dev1", "")),
        ("$ECQ/c/dev1/other", (TopicKind.INVALID, "", "")),
    ],
)
def test_publish_topics(topic: str, expected: tuple[TopicKind, str, str]) -> None:
    assert classify(topic) == expected


@pytest.mark.parametrize(
    ("client_id", "topic_filter", "verdict"),
    [
        ("dev1", "a/#", SubscribeVerdict.PLAIN),
        ("dev1", "$ECQ/dev1/#", SubscribeVerdict.CONSUMER),
        ("dev2", "$ECQ/dev1/#", SubscribeVerdict.REFUSED),  # exclusive
        ("dev1", "$ECQ/dev1/k", SubscribeVerdict.REFUSED),
        ("dev1", "$ECQ/#", SubscribeVerdict.REFUSED),
        ("dev1", "$ECQ/w/dev1/#", SubscribeVerdict.REFUSED),
        ("dev1", "$share/g/$ECQ/dev1/#", SubscribeVerdict.REFUSED),
        ("dev1", "$share/g/a/#", SubscribeVerdict.PLAIN),
        ("a/b", "$ECQ/a/b/#", SubscribeVerdict.REFUSED),  # a client ID with / names no queue
    ],
)
def test_subscriptions(client_id: str, topic_filter: str, verdict: SubscribeVerdict) -> None:
    assert subscribe_verdict(client_id, topic_filter) is verdict


def test_a_delivery_topic_gives_its_key_back() -> None:
    assert key_of("dev1", consumer_topic("dev1", "a/b")) == "a/b"


@pytest.mark.parametrize(
    ("text", "seq"), [("1", 1), (" 42 ", 42), ("0", None), ("-3", None), ("x", None), ("", None)]
)
def test_rewind_sequence_numbers(text: str, seq: int | None) -> None:
    assert parse_rewind(text) == seq


def test_a_queue_record_says_so_in_its_flags() -> None:
    assert is_queue_record(encode_message(StoredMessage("$ECQ/dev1/k", b"v", 1)))
    assert not is_queue_record(encode_message(StoredMessage("a/b", b"v", 1)))
