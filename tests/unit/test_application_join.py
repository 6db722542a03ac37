"""One PUBLISH made durable by the device path and the APPLICATION sessions' at once
(persistence/device_persistence.py, _Join): accepted only when both are."""

from __future__ import annotations

from persistence.device_persistence import _Join


def test_accepted_once_both_parts_are() -> None:
    accepted: list[bool] = []
    settled: list[bool] = []
    join = _Join(2, accepted.append, settled.append)
    join.accepted(True)
    assert accepted == []
    join.accepted(True)
    assert accepted == [True] and settled == []


def test_one_failed_part_fails_the_publish_and_settles_once_it_is_known() -> None:
    accepted: list[bool] = []
    settled: list[bool] = []
    join = _Join(2, accepted.append, settled.append)
    join.accepted(False)  # a deadline: the outcome is still unknown
    join.accepted(True)
    assert accepted == [False] and settled == []
    join.settled(True)  # Kafka took it after all
    assert settled == [True]


def test_a_failure_after_the_deadline_settles_false() -> None:
    accepted: list[bool] = []
    settled: list[bool] = []
    join = _Join(2, accepted.append, settled.append)
    join.accepted(True)
    join.accepted(False)
    join.settled(False)
    assert accepted == [False] and settled == [False]
