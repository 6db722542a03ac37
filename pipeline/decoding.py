"""Kafka records of the two topics -> the pipeline's tables, as Arrow batches.

Pure functions (no Spark, no I/O), run inside the Spark workers: by the Python
Kafka source on the batches it has just fetched (one pass, no second trip
through the JVM), or as Arrow UDFs over the raw rows of another source
(pipeline/common.py). Records' columns are built field
by field from plain Python lists; events, decoded by orjson (persistence/
format.py, "Delivery event record": positional arrays, or the keyed objects
of the records written before them), become one Arrow struct array whose
fields are the columns: each event a tuple in the schema's order, taken from
its array by one itemgetter per layout, or from its object (Arrow reads the
tuples itself, faster than Python lists a field at a time). The audit's fold
takes a message's facts (delivered, acked, ...) from the arrays, no dict made
for them; the rows it keeps are dicts, the facts written into them.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from operator import itemgetter
from typing import Any

import orjson

from persistence.format import EVENT_LAYOUTS, EVENTS_LAYOUT, event_fields, header_fields

__all__ = [
    "EVENT_COLUMNS",
    "EVENT_SCHEMA",
    "FACTS_SCHEMA",
    "FOLDED_COLUMNS",
    "RECORD_SCHEMA",
    "event_batch",
    "event_lists",
    "folded_batch",
    "header_structs",
    "least",
    "record_batch",
]

RECORD_SCHEMA = (
    "cid string, part int, off long, kts double, topic string, size int, pub double, exp double"
)
# One delivery event (persistence/events.py): the fields the jobs read ...
EVENT_SCHEMA = (
    "ev string, cid string, ts double, pid int, sc long, part int, off long, ep int, "
    "topic string, size int, pub double, exp double, dup boolean, at string, "
    "pids array<int>, n long"
)
# ... and its position: Kafka partition and offset of its record, index in the record
# (one client's events are in one partition, in order: they order its events).
EVENT_COLUMNS = f"{EVENT_SCHEMA}, epart int, eoff long, idx int"
# What a fetch's events say of one stored message (client, score), folded into one
# row for the audit (:func:`folded_batch`): first acknowledgement and delivery, the
# number of deliveries, and :data:`MARKS` of the events that remove a message.
FACTS_SCHEMA = "acked double, delivered double, deliveries int, marks int"
FOLDED_COLUMNS = f"{EVENT_SCHEMA}, {FACTS_SCHEMA}, epart int, eoff long, idx int"
MARKS = {"expired": 1, "dropped": 2, "trimmed": 4, "purged": 8, "compacted": 16}
_FACTS = frozenset(("acked", "delivered", "deliveries", "marks", "epart", "eoff", "idx"))
_EVENT_NAMES = tuple(c.split(" ", 1)[0] for c in EVENT_SCHEMA.split(", "))
# events about a stored message whose order does not matter: folded per message
FOLDED = {"acked", "delivered", *MARKS}
# The positional layouts (persistence/format.py) of those that name a score, by number:
# (ev, the index of ``sc`` in the event's array, the array's length). An expiry at
# arrival is the record's, not a stored message's: not among them.
_FOLDS = {
    number: (ev, 3 + names.index("sc"), 3 + len(names))
    for number, (ev, fixed, names) in enumerate(EVENT_LAYOUTS)
    if ev in FOLDED
    and "sc" in names
    and (ev != "expired" or fixed.get("at") in ("delivery", "retention"))
}

_ARROW_TYPES = {
    "string": "string",
    "double": "float64",
    "int": "int32",
    "long": "int64",
    "boolean": "bool_",
    "binary": "binary",
}


def _arrow_schema(spark_schema: str) -> Any:
    import pyarrow as pa

    fields = []
    for column in spark_schema.split(", "):
        name, kind = column.split(" ", 1)
        if kind == "array<int>":
            fields.append(pa.field(name, pa.list_(pa.int32())))
        else:
            fields.append(pa.field(name, getattr(pa, _ARROW_TYPES[kind])()))
    return pa.schema(fields)


_schemas: dict[str, Any] = {}


def arrow_schema(spark_schema: str) -> Any:
    """A Spark DDL schema of this module as an Arrow schema (made once per process)."""
    found = _schemas.get(spark_schema)
    if found is None:
        found = _schemas[spark_schema] = _arrow_schema(spark_schema)
    return found


def _header(value: bytes | None) -> tuple[str | None, int | None, float | None, float | None]:
    if value is None:
        return None, None, None, None
    try:
        return header_fields(value)
    except (ValueError, struct.error):
        return None, None, None, None


def record_batch(
    keys: Sequence[bytes | None],
    values: Sequence[bytes | None],
    partitions: Sequence[int],
    offsets: Sequence[int],
    seconds: Sequence[float | None],
) -> Any:
    """Records of the persisted topic -> a batch of :data:`RECORD_SCHEMA`: the
    subscriber (the record's key), its position, Kafka's timestamp (``kts``) and
    the stored message's topic, payload size, publish time and expiry, read from
    its header (persistence/format.py); a value that is no stored message gives
    nulls there."""
    import pyarrow as pa

    headers = [_header(v) for v in values]
    topic, size, pub, exp = zip(*headers, strict=True) if headers else ((), (), (), ())
    cids = [k.decode("utf-8", "replace") if k is not None else None for k in keys]
    return pa.RecordBatch.from_arrays(
        [
            pa.array(cids, pa.string()),
            pa.array(partitions, pa.int32()),
            pa.array(offsets, pa.int64()),
            pa.array(seconds, pa.float64()),
            pa.array(topic, pa.string()),
            pa.array(size, pa.int32()),
            pa.array(pub, pa.float64()),
            pa.array(exp, pa.float64()),
        ],
        schema=arrow_schema(RECORD_SCHEMA),
    )


def _event_structs(values: Sequence[bytes | None]) -> tuple[Any, list[int], list[int]]:
    """(an Arrow struct array of :data:`EVENT_SCHEMA`, one per event, which value each
    event came from, its index in that value) (:func:`_event_rows`)."""
    import pyarrow as pa

    found, source, idx = _event_rows(values)
    # Arrow reads the tuples itself: a third of the time of a Python list per field
    # made with dict.get, which was most of an event read's CPU (761k events)
    structs = pa.array(found, pa.struct(list(arrow_schema(EVENT_SCHEMA))))
    return structs, source, idx


def _record_events(value: bytes | None) -> tuple[list[Any], bool]:
    """(the events of one record of the events topic, whether they are positional):
    arrays of a layout (persistence/format.py, "Delivery event record"), or the
    objects of the keyed records written before it. Not JSON or not an array:
    none."""
    if value is None:
        return [], False
    try:
        decoded = orjson.loads(value)
    except orjson.JSONDecodeError:
        return [], False
    if not isinstance(decoded, list):
        return [], False
    if decoded and decoded[0] == EVENTS_LAYOUT and type(decoded[0]) is int:
        return [e for e in decoded[1:] if _known(e)], True
    return [e for e in decoded if isinstance(e, dict)], False


def _known(event: Any) -> bool:
    return (
        type(event) is list
        and bool(event)
        and type(event[0]) is int
        and 0 <= event[0] < len(EVENT_LAYOUTS)
    )


def _event_rows(
    values: Sequence[bytes | None],
) -> tuple[list[tuple[Any, ...]], list[int], list[int]]:
    """(the events of ``values`` as tuples of :data:`EVENT_SCHEMA`'s fields, which
    value each event came from, its index in that value).

    A value that is not a JSON array gives no event, an element that is not an
    object (keyed records) or an array of a known layout (positional) is
    skipped, keys outside the schema are left out; a field of another type, or a
    positional event of the wrong length, fails the job (the broker writes them,
    persistence/events.py: a wrong type is a bug to see, not to count around)."""
    found: list[tuple[Any, ...]] = []
    source: list[int] = []
    idx: list[int] = []
    for i, value in enumerate(values):
        events, positional = _record_events(value)
        if positional:
            rows = [_positional_row(e) for e in events]
        else:
            rows = [tuple(map(e.get, _EVENT_NAMES)) for e in events]
        n = len(rows)
        found.extend(rows)
        source.extend([i] * n)
        idx.extend(range(n))
    return found, source, idx


def _positional_row(event: list[Any]) -> tuple[Any, ...]:
    row, tail, length = _ROWS[event[0]]
    if len(event) != length:
        raise ValueError(f"an event of layout {event[0]} with {len(event)} fields: {event!r}")
    return row(event + tail)  # type: ignore[no-any-return]


def _row_of_layout(
    ev: str, fixed: dict[str, Any], names: tuple[str, ...]
) -> tuple[Any, list[Any], int]:
    """(an itemgetter of :data:`EVENT_SCHEMA`'s fields from an event's array extended
    by the tail, the tail: its kind, null and its fixed values, the array's length)."""
    array = ["", "cid", "ts", *names]
    tail: list[Any] = [ev, None, *fixed.values()]
    at = {**{n: i for i, n in enumerate(array) if i}, "ev": len(array)}
    at.update({n: len(array) + 2 + i for i, n in enumerate(fixed)})
    missing = len(array) + 1
    return itemgetter(*(at.get(n, missing) for n in _EVENT_NAMES)), tail, len(array)


_ROWS = tuple(_row_of_layout(*layout) for layout in EVENT_LAYOUTS)


def event_batch(
    values: Sequence[bytes | None], partitions: Sequence[int], offsets: Sequence[int]
) -> Any:
    """Records of the events topic (each a JSON array of one client's events) -> a
    batch of :data:`EVENT_COLUMNS`, one row per event (:func:`_event_structs`)."""
    import pyarrow as pa

    structs, source, idx = _event_structs(values)
    return pa.RecordBatch.from_arrays(
        [
            *structs.flatten(),
            pa.array([partitions[i] for i in source], pa.int32()),
            pa.array([offsets[i] for i in source], pa.int64()),
            pa.array(idx, pa.int32()),
        ],
        schema=arrow_schema(EVENT_COLUMNS),
    )


def folded_batch(
    values: Sequence[bytes | None], partitions: Sequence[int], offsets: Sequence[int]
) -> Any:
    """As :func:`event_batch`, :data:`FOLDED_COLUMNS`, with the events of :data:`FOLDED`
    that name a score folded per (client, score) into the facts of its
    ``persisted`` event of this fetch, or into one ``message`` row made where
    the first of them is when none came before it in the fetch: a message's
    three events (persisted, delivered, acked) become one row, a third of the
    rows for Spark to take in and shuffle.
    Folding is a sum, a minimum and an or, so folded rows of several fetches,
    and unfolded events, add up to the same (pipeline/accounting.py)."""
    import pyarrow as pa

    kept: list[dict[str, Any]] = []
    # (client, score) -> the row its facts are folded into: its persisted event, or
    # a message row made where the first of them was. The facts and the position
    # are written into the dicts, and Arrow reads them all at once.
    owner: dict[tuple[Any, Any], dict[str, Any]] = {}
    for i, value in enumerate(values):
        events, positional = _record_events(value)
        for n, event in enumerate(events):
            if positional:
                # a fact of a message read from its array: no dict made for it
                fold = _FOLDS.get(event[0])
                if fold is not None:
                    ev, at, length = fold
                    if len(event) != length:
                        raise ValueError(f"a {ev} event of {len(event)} fields: {event!r}")
                    if event[at] is not None:
                        _fold(owner, kept, ev, event[1], event[at], event[2], partitions[i],
                              offsets[i], n)  # fmt: skip
                        continue
                event = event_fields(event)
            ev, sc = event.get("ev"), event.get("sc")
            # an expiry at arrival is the record's, not the stored message's: kept as is
            if (
                sc is not None
                and ev in FOLDED
                and (ev != "expired" or event.get("at") in ("delivery", "retention"))
            ):
                _fold(owner, kept, ev, event.get("cid"), sc, event.get("ts"), partitions[i],
                      offsets[i], n)  # fmt: skip
                continue
            if not _FACTS.isdisjoint(event):  # facts come from the fold only
                for name in _FACTS:
                    event.pop(name, None)
            event["epart"], event["eoff"], event["idx"] = partitions[i], offsets[i], n
            if ev == "persisted" and sc is not None:
                owner.setdefault((event.get("cid"), sc), event)
            kept.append(event)
    folded = pa.array(kept, pa.struct(list(arrow_schema(FOLDED_COLUMNS))))
    return pa.RecordBatch.from_struct_array(folded)


def _fold(
    owner: dict[tuple[Any, Any], dict[str, Any]],
    kept: list[dict[str, Any]],
    ev: str,
    cid: Any,
    sc: Any,
    ts: Any,
    part: int,
    off: int,
    n: int,
) -> None:
    """The fact ``ev`` (at ``ts``) of the message (``cid``, ``sc``) into its row."""
    key = (cid, sc)
    row = owner.get(key)
    if row is None:
        row = owner[key] = {"ev": "message", "cid": cid, "sc": sc}
        row.update(epart=part, eoff=off, idx=n, deliveries=0, marks=0)
        kept.append(row)
    elif row.get("deliveries") is None:  # a persisted event's first fact
        row["deliveries"], row["marks"] = 0, 0
    if ev == "acked":
        row["acked"] = least(row.get("acked"), ts)
    elif ev == "delivered":
        row["delivered"] = least(row.get("delivered"), ts)
        row["deliveries"] += 1
    else:
        row["marks"] |= MARKS[ev]


def least(a: Any, b: Any) -> Any:
    """min ignoring None, as SQL's ``min`` (here and in pipeline/accounting.py)."""
    if a is None:
        return b
    if b is None:
        return a
    return a if a <= b else b


def event_lists(values: Any) -> Any:
    """An Arrow UDF: the values of event records -> a list of events each (the
    records of another source, e.g. Spark's Kafka connector, are exploded in the
    JVM)."""
    import pyarrow as pa

    structs, source, _idx = _event_structs(values.to_pylist())
    counts = [0] * len(values)
    for i in source:
        counts[i] += 1
    ends = [0]
    for n in counts:
        ends.append(ends[-1] + n)
    return pa.ListArray.from_arrays(pa.array(ends, pa.int32()), structs)


def header_structs(values: Any) -> Any:
    """An Arrow UDF: stored values -> their (topic, size, pub, exp), a struct each."""
    import pyarrow as pa

    headers = [_header(v) for v in values.to_pylist()]
    topic, size, pub, exp = zip(*headers, strict=True) if headers else ((), (), (), ())
    return pa.StructArray.from_arrays(
        [
            pa.array(topic, pa.string()),
            pa.array(size, pa.int32()),
            pa.array(pub, pa.float64()),
            pa.array(exp, pa.float64()),
        ],
        names=["topic", "size", "pub", "exp"],
    )
