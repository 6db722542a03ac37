"""The per-message check catches what it should, on made-up worker results."""

from __future__ import annotations

import pytest

from loadtest.report import summarize
from loadtest.scenarios import LoadConfig, make_plan
from loadtest.worker import PublisherResult, SubscriberResult, WorkerResult


def _sub(counts: bytes, **extra: int | bytes) -> SubscriberResult:
    fields: dict[str, int | bytes] = dict(
        received=sum(counts),
        duplicates=0,
        duplicates_flagged=0,
        out_of_order=0,
        foreign=0,
        reconnects=0,
        lost_connections=0,
    )
    fields.update(extra)
    return SubscriberResult(counts={0: bytearray(counts)}, **fields)


def _summary(acked: bytes, sub: SubscriberResult) -> dict[str, object]:
    config = LoadConfig("p2p", pairs=1, duration=1, warmup=0, seed=1).resolved()
    plan = make_plan(config)
    result = WorkerResult(
        worker=0,
        t0=0,
        buckets=[(len(acked), sum(acked), b"", b"")],
        cpu=[],
        publishers={0: PublisherResult(len(acked), bytearray(acked), 0, 0, 0)},
        subscribers={0: sub},
    )
    check = summarize(config, plan, [result], label="x")["check"]
    assert isinstance(check, dict)
    return check


def test_all_delivered() -> None:
    check = _summary(b"\x01" * 4, _sub(b"\x01" * 4))
    assert (check["lost"], check["delivered"], check["expected"], check["ok"]) == (0, 4, 4, True)


def test_lost_message_is_named() -> None:
    check = _summary(b"\x01" * 4, _sub(b"\x01\x00\x01"))
    assert check["lost"] == 2  # seq 1 never came, seq 3 neither
    assert check["lost_examples"] == ["subscriber 0 publisher 0 seq 1"]
    assert not check["ok"]


def test_unacknowledged_messages_are_not_lost() -> None:
    check = _summary(b"\x01\x01\x00", _sub(b"\x01\x01\x01"))
    assert (check["lost"], check["delivered_unacked"], check["ok"]) == (0, 1, True)


@pytest.mark.parametrize("field", ["duplicates", "out_of_order"])
def test_duplicates_and_disorder_fail_the_check(field: str) -> None:
    check = _summary(b"\x01\x01", _sub(b"\x01\x01", **{field: 1}))
    assert check[field] == 1
    assert not check["ok"]


def test_scenario_defaults() -> None:
    p2p = LoadConfig("p2p", pairs=3).resolved()
    assert (p2p.publishers, p2p.subscribers, p2p.persistent) == (3, 3, True)
    fan_in = LoadConfig("fan-in").resolved()
    assert (fan_in.publishers, fan_in.subscribers, fan_in.persistent) == (100, 2, False)
    plan = make_plan(LoadConfig("fan-out", subscribers=5, processes=2, seed=3).resolved())
    assert sorted(j for share in plan.worker_subscribers for j in share) == list(range(5))
    assert all(s.publishers == [0] for s in plan.subscribers)
    with pytest.raises(ValueError):
        LoadConfig("p2p", payload_size=10).resolved()


def test_the_tail_by_client_names_the_slow_one() -> None:
    """Per-client percentiles: one slow subscriber shows as the worst client even
    where the run's own p99 hides it among many fast deliveries."""
    from array import array

    config = LoadConfig("p2p", pairs=3, duration=1, warmup=0, seed=1).resolved()
    plan = make_plan(config)
    fast = array("I", [1_000] * 200).tobytes()  # 1 ms
    slow = array("I", [1_000] * 196 + [900_000] * 4).tobytes()  # 2% at 900 ms
    subs = {j: _sub(b"", received=200, latencies=slow if j == 2 else fast) for j in range(3)}
    result = WorkerResult(
        worker=0, t0=0, buckets=[(0, 0, b"", b"")], cpu=[], publishers={}, subscribers=subs
    )
    by_client = summarize(config, plan, [result], label="x")["by_client"]
    assert isinstance(by_client, dict)
    assert by_client["clients"] == 3
    assert by_client["p99_ms"] == {"median": 1.0, "p90": 900.0, "max": 900.0}
    assert by_client["worst"] == {
        "client_id": plan.subscribers[2].client_id,
        "p99_ms": 900.0,
        "deliveries": 200,
    }
