"""Which sessions are APPLICATION sessions, and their topics' names
(persistence/application_feed.py)."""

from __future__ import annotations

import re

from persistence.application_feed import Classifier, app_keys, app_topic

KAFKA_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")


def test_client_ids_match_from_the_start() -> None:
    c = Classifier(["^backend-", "etl-[0-9]+$"], [])
    assert c.is_application("backend-1", None)
    assert c.is_application("etl-42", "anyone")
    assert not c.is_application("device-backend-1", None)  # re.match: from the start
    assert not c.is_application("etl-x", None)
    assert not Classifier([], []).is_application("backend-1", None)  # empty: none


def test_user_names_narrow_the_client_ids() -> None:
    c = Classifier(["^backend-"], ["^svc-"])
    assert c.is_application("backend-1", "svc-ingest")
    assert not c.is_application("backend-1", "mallory")  # a client ID alone is not enough
    assert not c.is_application("backend-1", None)  # anonymous
    assert not c.is_application("device-1", "svc-ingest")


def test_topic_names_are_valid_and_unique() -> None:
    ids = ["backend", "backend.", "backend_", "b/a c", "ü" * 300, "", "x" * 65535, "a.b", "a_b"]
    topics = [app_topic(i) for i in ids]
    assert len(set(topics)) == len(ids)
    for topic in topics:
        assert KAFKA_TOPIC.match(topic), topic
        assert topic.startswith("devicemq.app.")
    assert app_topic("backend-1").startswith("devicemq.app.backend-1.")


def test_keys_share_the_clients_slot() -> None:
    keys = app_keys("back{end}")
    tags = {k[: k.index("}") + 1] for k in (keys.generation, keys.offsets, keys.inflight)}
    assert len(tags) == 1
