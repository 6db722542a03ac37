"""The audit's accounting of one client (pipeline/accounting.py), without Spark.

Each test gives a client's records, events and Redis refs as the table the
audit shuffles by client, and reads the status of each record: one rule of
pipeline/audit.py's docstring per test. The whole audit over a real broker's
traffic is tests/pipeline/test_audit.py.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from pipeline.accounting import EVENT, INPUT_SCHEMA, RECORD, REF, account_batches
from pipeline.decoding import arrow_schema

NOW = 1_000.0
GRACE = 30.0
EPOCH = 2
OLD = 100.0  # long before NOW - GRACE


def record(cid: str, off: int, pub: float = OLD, exp: float | None = None) -> dict[str, Any]:
    return {"kind": RECORD, "cid": cid, "part": 0, "off": off, "kts": pub, "pub": pub, "exp": exp}


def event(cid: str, ev: str, at_offset: int, ts: float = OLD, **fields: Any) -> dict[str, Any]:
    """An event at position ``at_offset`` of the events topic's partition 0."""
    return {"kind": EVENT, "cid": cid, "ev": ev, "ts": ts, "epart": 0, "eoff": at_offset,
            "idx": 0, **fields}  # fmt: skip


def stored(cid: str, off: int, sc: int, pid: int, at_offset: int, **fields: Any) -> dict[str, Any]:
    """The ``persisted`` event of record ``off`` of this epoch, stored as (sc, pid)."""
    return event(cid, "persisted", at_offset, part=0, off=off, sc=sc, pid=pid, ep=EPOCH, **fields)


def ref(cid: str, sc: int, has_value: bool = True) -> dict[str, Any]:
    return {"kind": REF, "cid": cid, "sc": sc, "has_value": has_value}


def account(*batches: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """(cid, off) -> its message row, the inputs given as these batches."""
    schema = arrow_schema(INPUT_SCHEMA)
    arrow = [pa.RecordBatch.from_pylist(rows, schema=schema) for rows in batches]
    out = [row for b in account_batches(arrow, EPOCH, NOW, GRACE) for row in b.to_pylist()]
    return {(row["cid"], row["off"]): row for row in out}


def status(rows: list[dict[str, Any]], cid: str = "c", off: int = 0) -> str:
    return account(rows)[(cid, off)]["status"]


def test_an_acknowledged_message_is_acked_with_its_times_and_deliveries() -> None:
    got = account(
        [
            record("c", 0, pub=10.0),
            stored("c", 0, sc=7, pid=1, at_offset=0, ts=10.5),
            event("c", "delivered", 1, ts=11.0, sc=7, pid=1),
            event("c", "delivered", 2, ts=12.0, sc=7, pid=1),
            event("c", "acked", 3, ts=12.5, sc=7, pid=1),
        ]
    )[("c", 0)]
    assert got["status"] == "acked"
    assert (got["sc"], got["pid"], got["stored_ts"]) == (7, 1, 10.5)
    assert (got["delivered_ts"], got["acked_ts"], got["deliveries"]) == (11.0, 12.5, 2)
    assert (got["delivery_latency"], got["ack_latency"]) == (1.0, 2.5)
    assert got["reason"] is None


def test_the_first_rule_that_matches_wins() -> None:
    # acknowledged and expired: acked; expired and trimmed: expired; ...
    both = [record("c", 0), stored("c", 0, sc=1, pid=1, at_offset=0)]
    assert status([*both, event("c", "expired", 1, sc=1, at="delivery"),
                   event("c", "acked", 2, sc=1)]) == "acked"  # fmt: skip
    assert status([*both, event("c", "trimmed", 1, sc=1),
                   event("c", "expired", 2, sc=1, at="retention")]) == "expired"  # fmt: skip
    assert status([*both, event("c", "dropped", 1, sc=1),
                   event("c", "trimmed", 2, sc=1)]) == "dropped"  # fmt: skip
    assert status([*both, event("c", "purged", 1, sc=1), ref("c", 1)]) == "purged"
    assert status([*both, event("c", "compacted", 1, sc=1), ref("c", 1)]) == "compacted"
    assert status([*both, ref("c", 1)]) == "pending"


def test_a_trim_names_the_last_message_stored_under_its_packet_id_before_it() -> None:
    rows = [
        record("c", 0),
        record("c", 1),
        record("c", 2),
        record("c", 3),
        stored("c", 0, sc=1, pid=5, at_offset=0),
        event("c", "acked", 1, sc=1, pid=5),
        stored("c", 1, sc=2, pid=6, at_offset=2),
        stored("c", 3, sc=4, pid=5, at_offset=3),  # packet id 5 again: the trim's
        event("c", "trimmed", 4, pid=5),  # a trim of packet ids: one event per id
        stored("c", 2, sc=3, pid=5, at_offset=5),  # and again after the trim
        ref("c", 2),
        ref("c", 3),
    ]
    got = account(rows)
    assert [got[("c", off)]["status"] for off in range(4)] == [
        "acked",
        "pending",
        "pending",
        "trimmed",
    ]


def test_records_not_stored_say_why_from_their_arrival_events() -> None:
    def arrival(ev: str, **fields: Any) -> str:
        on = {"part": 0, "off": 0, "ep": EPOCH}
        return status([record("c", 0), event("c", ev, 0, **on, **fields)])

    assert arrival("expired", at="arrival") == "expired"
    assert arrival("trimmed", at="arrival") == "trimmed"
    assert arrival("discarded", at="arrival") == "discarded"
    assert arrival("duplicate") == "duplicate"
    # an expiry at delivery says nothing of a record never stored
    assert arrival("expired", at="delivery") == "lost"


def test_only_this_epochs_events_place_a_record() -> None:
    # the same (part, off) of the topic before it was made again is another record
    rows = [record("c", 0), {**stored("c", 0, sc=1, pid=1, at_offset=0), "ep": EPOCH - 1},
            event("c", "acked", 1, sc=1)]  # fmt: skip
    got = account(rows)[("c", 0)]
    assert (got["status"], got["reason"], got["sc"]) == ("lost", "never stored in redis", None)


def test_a_lost_message_says_what_redis_lacks() -> None:
    base = [record("c", 0), stored("c", 0, sc=1, pid=1, at_offset=0)]
    assert account([record("c", 0)])[("c", 0)]["reason"] == "never stored in redis"
    assert account(base)[("c", 0)]["reason"] == "missing from redis"
    assert (
        account([*base, ref("c", 1, has_value=False)])[("c", 0)]["reason"]
        == "ref without its message string in redis"
    )


def test_a_session_ended_after_the_message_was_stored_discarded_it() -> None:
    base = [record("c", 0), stored("c", 0, sc=1, pid=1, at_offset=0, ts=50.0)]
    assert status([*base, event("c", "session_ended", 1, ts=60.0)]) == "discarded"
    assert status([*base, event("c", "session_expired", 1, ts=60.0)]) == "discarded"
    # ended before it was stored: the message belongs to the next session
    assert status([*base, event("c", "session_ended", 1, ts=40.0)]) == "lost"


def test_a_stored_message_past_its_expiry_is_expired_with_no_event() -> None:
    stored_at = [record("c", 0, exp=None), stored("c", 0, sc=1, pid=1, at_offset=0, exp=NOW - 1)]
    assert status(stored_at) == "expired"
    assert status([record("c", 0, exp=NOW - 1), stored("c", 0, sc=1, pid=1, at_offset=0)]) == (
        "expired"
    )
    assert status([record("c", 0, exp=NOW + 60), stored("c", 0, sc=1, pid=1, at_offset=0)]) == (
        "lost"
    )


def test_within_grace_of_arriving_or_being_stored_it_is_in_flight() -> None:
    young = NOW - GRACE / 2
    assert status([record("c", 0, pub=young)]) == "in_flight"
    assert status([record("c", 0), stored("c", 0, sc=1, pid=1, at_offset=0, ts=young)]) == (
        "in_flight"
    )
    assert status([record("c", 0), stored("c", 0, sc=1, pid=1, at_offset=0)]) == "lost"


def test_live_when_the_client_was_connected_as_the_message_was_published() -> None:
    rows = [
        event("c", "connected", 0, ts=10.0),
        event("c", "disconnected", 1, ts=20.0),
        event("c", "connected", 2, ts=30.0),
        record("c", 0, pub=15.0),
        record("c", 1, pub=25.0),
        record("c", 2, pub=30.0),  # at the instant of the connect: the connect came first
        record("c", 3, pub=5.0),  # before any change
        record("c", 4, pub=15.0),  # never stored: not a delivery to time
    ]
    rows += [stored("c", off, sc=off + 1, pid=off + 1, at_offset=10 + off) for off in range(4)]
    got = account(rows)
    assert [got[("c", off)]["live"] for off in range(5)] == [True, False, True, False, False]


def test_clients_are_apart_and_a_client_split_across_batches_is_one() -> None:
    first = [record("a", 0), stored("a", 0, sc=1, pid=1, at_offset=0), record("b", 1)]
    second = [event("a", "acked", 1, sc=1), stored("b", 1, sc=1, pid=1, at_offset=2)]
    got = account(first, second)
    assert got[("a", 0)]["status"] == "acked"
    # b's score 1 is not a's: b's message is still unaccounted for
    assert got[("b", 1)]["status"] == "lost"
    assert got[("b", 1)]["reason"] == "missing from redis"


def test_a_messages_events_folded_as_read_count_as_the_events_one_by_one() -> None:
    # pipeline/decoding.py folded_batch: facts on the persisted event's row, or on a
    # "message" row when the fetch had none; several fetches' facts add up
    def facts(acked: float | None, delivered: float | None, n: int, marks: int) -> dict[str, Any]:
        return {"acked": acked, "delivered": delivered, "deliveries": n, "marks": marks}

    one_by_one = [
        record("c", 0, pub=10.0),
        stored("c", 0, sc=7, pid=1, at_offset=0, ts=10.5),
        event("c", "delivered", 1, ts=12.0, sc=7),
        event("c", "delivered", 2, ts=11.0, sc=7),
        event("c", "acked", 3, ts=12.5, sc=7),
        record("c", 1),
        stored("c", 1, sc=8, pid=2, at_offset=4),
        event("c", "dropped", 5, sc=8),
    ]
    folded = [
        record("c", 0, pub=10.0),
        {**stored("c", 0, sc=7, pid=1, at_offset=0, ts=10.5), **facts(None, 12.0, 1, 0)},
        {**event("c", "message", 2, sc=7), **facts(12.5, 11.0, 1, 0)},
        record("c", 1),
        {**stored("c", 1, sc=8, pid=2, at_offset=4), **facts(None, None, 0, 2)},
    ]
    assert account(folded) == account(one_by_one)
    got = account(folded)
    assert (got[("c", 0)]["status"], got[("c", 1)]["status"]) == ("acked", "dropped")
    assert (got[("c", 0)]["delivered_ts"], got[("c", 0)]["deliveries"]) == (11.0, 2)


def test_what_was_taken_in_is_tallied_and_a_gap_counts_the_events_it_stands_for() -> None:
    schema = arrow_schema(INPUT_SCHEMA)
    rows = [
        record("c", 0),
        stored("c", 0, sc=7, pid=1, at_offset=0),
        event("c", "gap", 1, n=5),
        ref("c", 7),
        event("d", "gap", 2, n=2),
    ]
    taken: dict[str, int] = {}
    batches = [pa.RecordBatch.from_pylist(rows[:3], schema=schema)]
    batches.append(pa.RecordBatch.from_pylist(rows[3:], schema=schema))
    out = [row for b in account_batches(batches, EPOCH, NOW, GRACE, taken) for row in b.to_pylist()]
    assert taken == {"records": 1, "events": 3, "refs": 1, "gaps": 7}
    assert [(row["cid"], row["status"]) for row in out] == [("c", "pending")]  # a gap is no message
