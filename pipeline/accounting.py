"""One client's records, events and stored refs -> one status per record.

Pure Python, no Spark, no I/O: :func:`account_batches` runs inside a Spark
task over whole clients, all three inputs side by side in one table
(:data:`INPUT_SCHEMA`, ``kind`` telling them apart): a task of one Kafka
partition of co-partitioned topics, its input made by :func:`input_table`, or
a partition of the shuffle by client (``mapInArrow``; pipeline/audit.py).
Every join of the audit is within one client (the subscriber is the key of
its records and the ``cid`` of its events), so grouping by client replaces
the joins, groupings and windows a plan of Spark SQL needed for it, and a
client is accounted for in one pass over its rows with dicts (measured in
BENCHMARKS.md "The audit, accounted per client").

The statuses and their order are pipeline/audit.py's docstring; each rule is
written once, in :func:`_account_client`.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator
from typing import Any

from pipeline.decoding import MARKS, least

__all__ = [
    "EVENT",
    "INPUT_SCHEMA",
    "MESSAGE_SCHEMA",
    "READ_EVENTS",
    "RECORD",
    "REF",
    "STATUSES",
    "TAKEN_IN",
    "account_batches",
    "input_table",
]

# ``kind`` of an input row
RECORD, EVENT, REF = 0, 1, 2

# a record's status, first match wins (pipeline/audit.py's docstring: what each means)
STATUSES = (
    "acked",
    "expired",
    "dropped",
    "trimmed",
    "purged",
    "compacted",
    "pending",
    "discarded",
    "duplicate",
    "in_flight",
    "lost",
)

# The three inputs as one table (absent fields null): records (pipeline/decoding.py
# RECORD_SCHEMA), the events the audit reads (EVENT_COLUMNS less topic, size, pub,
# dup) and Redis refs (``sc``, ``has_value``). ``exp`` is a record's expiry on a
# record and a stored message's on a ``persisted`` event. A trim naming packet ids
# comes as one ``trimmed`` event per id, in ``pid`` with no ``sc``: a list column
# costs Spark's Arrow writer time quadratic in a batch's rows (it sizes the batch
# after every row, walking each list's offsets; 31 s for 1M rows, Spark 4.3).
# ``acked`` ... ``marks``: a message's events folded as they were read (pipeline/
# decoding.py FACTS_SCHEMA), on its ``persisted`` event or a ``message`` row. ``n``:
# how many events a ``gap`` event stands for (the broker dropped them).
INPUT_SCHEMA = (
    "kind int, cid string, part int, off long, kts double, topic string, size int, "
    "pub double, exp double, ev string, ts double, pid int, sc long, ep int, at string, "
    "acked double, delivered double, deliveries int, marks int, "
    "epart int, eoff long, idx int, has_value boolean, n long"
)
INPUT_COLUMNS = [c.split(" ", 1)[0] for c in INPUT_SCHEMA.split(", ")]

# One row per record: its status and times (pipeline/audit.py's messages.parquet).
MESSAGE_SCHEMA = (
    "cid string, sc long, part int, off long, topic string, size int, pub double, "
    "exp double, pid int, stored_ts double, delivered_ts double, acked_ts double, "
    "deliveries long, status string, delivery_latency double, ack_latency double, "
    "reason string, live boolean"
)

# the kinds of event the accounting reads (the others are left in Spark)
READ_EVENTS = (
    "persisted",
    "message",
    "acked",
    "delivered",
    "expired",
    "dropped",
    "trimmed",
    "purged",
    "compacted",
    "discarded",
    "duplicate",
    "session_expired",
    "session_ended",
    "connected",
    "disconnected",
    "gap",  # counted, not accounted (:data:`TAKEN_IN`)
)
# events that place a record of this epoch: stored, or why not
_ARRIVAL = {"expired", "trimmed", "discarded"}
# events about a stored message (client, score)
_OF_MESSAGE = {"acked", "delivered", "expired", "dropped", "purged", "compacted", "trimmed"}
_ENDS = {"session_expired", "session_ended"}
_LIFE = {"connected", "disconnected"}
_OUT_ROWS = 65_536  # rows per output batch
# what account_batches took in: rows of each kind, and the events the broker dropped
# (named apart from pipeline/tally.py's Tally: what the messages add up to)
TAKEN_IN = ("records", "events", "refs", "gaps")
_KINDS_TAKEN = {RECORD: "records", EVENT: "events", REF: "refs"}


class _Record:
    """What the events say of one Kafka record (part, off) of this epoch."""

    __slots__ = ("discarded", "duplicate", "exp", "expired", "pid", "sc", "trimmed", "ts")

    def __init__(self) -> None:
        self.sc: int | None = None
        self.pid: int | None = None
        self.ts: float | None = None
        self.exp: float | None = None
        self.expired = self.trimmed = self.discarded = self.duplicate = False


class _Message:
    """What the events say of one stored message (score)."""

    __slots__ = (
        "acked",
        "compacted",
        "delivered",
        "deliveries",
        "dropped",
        "expired",
        "purged",
        "trimmed",
    )

    def __init__(self) -> None:
        self.acked: float | None = None
        self.delivered: float | None = None
        self.deliveries = 0
        self.expired = self.dropped = self.trimmed = self.purged = self.compacted = False


def _position(event: tuple[Any, ...]) -> tuple[int, int, int]:
    return (event[-3] or 0, event[-2] or 0, event[-1] or 0)


def _account_client(
    cid: Any,
    records: list[tuple[Any, ...]],
    events: list[tuple[Any, ...]],
    refs: dict[int, bool],
    epoch: int,
    now: float,
    grace: float,
) -> Iterator[tuple[Any, ...]]:
    """The rows of :data:`MESSAGE_SCHEMA` of one client's records.

    ``records``: (part, off, kts, topic, size, pub, exp); ``events``: (ev, ts, pid,
    sc, part, off, ep, exp, at, acked, delivered, deliveries, marks, epart, eoff,
    idx); ``refs``: score -> whether
    its message string exists."""
    events.sort(key=_position)  # one client's events are in one partition, in order
    placed: dict[tuple[int, int], _Record] = {}
    stored: dict[int, _Message] = {}
    last_stored: dict[int, int] = {}  # packet id -> score of the last message stored under it
    ended: float | None = None
    life: list[tuple[float, bool]] = []
    # every field named: a starred target made a list per event (a fifth of the time)
    for event in events:
        ev, ts, pid, sc, part, off, ep, exp, at, acked, delivered, count, marks, _p, _o, _i = event
        if ev == "persisted":
            if pid is not None and sc is not None:
                last_stored[pid] = sc
            if ep == epoch:
                r = placed.get((part, off))
                if r is None:
                    r = placed[(part, off)] = _Record()
                r.sc = least(r.sc, sc)
                r.pid = least(r.pid, pid)
                r.ts = least(r.ts, ts)
                r.exp = least(r.exp, exp)
        elif ep == epoch and (ev == "duplicate" or (ev in _ARRIVAL and at == "arrival")):
            r = placed.get((part, off))
            if r is None:
                r = placed[(part, off)] = _Record()
            if ev == "duplicate":
                r.duplicate = True
            elif ev == "expired":
                r.expired = True
            elif ev == "trimmed":
                r.trimmed = True
            else:
                r.discarded = True
        if ev in _OF_MESSAGE:
            owner = sc
            if owner is None and ev == "trimmed" and pid is not None:
                # a trim names a packet id: the last message stored under it before the trim
                owner = last_stored.get(pid)
            if owner is not None:
                m = stored.get(owner)
                if m is None:
                    m = stored[owner] = _Message()
                if ev == "acked":
                    m.acked = least(m.acked, ts)
                elif ev == "delivered":
                    m.deliveries += 1
                    m.delivered = least(m.delivered, ts)
                elif ev == "expired":
                    m.expired = m.expired or at in ("delivery", "retention")
                elif ev == "dropped":
                    m.dropped = True
                elif ev == "trimmed":
                    m.trimmed = True
                elif ev == "purged":
                    m.purged = True
                else:
                    m.compacted = True
        elif ev in _ENDS:
            ended = ts if ended is None or (ts is not None and ts > ended) else ended
        elif ev in _LIFE:
            life.append((ts if ts is not None else float("-inf"), ev == "connected"))
        if count is not None and sc is not None:
            _add_facts(stored, sc, acked, delivered, count, marks)
    # live: the client's last connect or disconnect at or before the publish was a connect
    life.sort(key=lambda change: change[0])
    times = [t for t, _up in life]
    young = now - grace
    for part, off, kts, topic, size, pub, exp in records:
        r = placed.get((part, off))
        sc = r.sc if r is not None else None
        m = stored.get(sc) if sc is not None else None
        has_value = refs.get(sc) if sc is not None else None
        stored_ts = r.ts if r is not None else None
        acked = m.acked if m is not None else None
        delivered = m.delivered if m is not None else None
        if acked is not None:
            status = "acked"
        elif (r is not None and r.expired) or (m is not None and m.expired):
            status = "expired"
        elif m is not None and m.dropped:
            status = "dropped"
        elif (m is not None and m.trimmed) or (r is not None and r.trimmed):
            status = "trimmed"
        elif m is not None and m.purged:
            status = "purged"
        elif m is not None and m.compacted:
            status = "compacted"
        elif has_value:
            status = "pending"
        elif _discarded(r, sc, stored_ts, ended):
            status = "discarded"
        elif sc is None and r is not None and r.duplicate:
            status = "duplicate"
        elif sc is not None and _expired(r, exp, now):
            status = "expired"
        elif _young(kts if sc is None else stored_ts, young):
            status = "in_flight"
        else:
            status = "lost"
        reason = None
        if status == "lost":
            if sc is None:
                reason = "never stored in redis"
            elif has_value is not None:
                reason = "ref without its message string in redis"
            else:
                reason = "missing from redis"
        live = False
        if sc is not None and pub is not None and life:
            at = bisect_right(times, pub)
            live = at > 0 and life[at - 1][1]
        yield (
            cid,
            sc,
            part,
            off,
            topic,
            size,
            pub,
            exp,
            r.pid if r is not None else None,
            stored_ts,
            delivered,
            acked,
            m.deliveries if m is not None else 0,
            status,
            delivered - pub if delivered is not None and pub is not None else None,
            acked - pub if acked is not None and pub is not None else None,
            reason,
            live,
        )


def _add_facts(
    stored: dict[int, _Message],
    sc: int,
    acked: float | None,
    delivered: float | None,
    deliveries: int,
    marks: int | None,
) -> None:
    """A message's events folded as they were read: the same as each in turn."""
    m = stored.get(sc)
    if m is None:
        m = stored[sc] = _Message()
    m.acked = least(m.acked, acked)
    m.delivered = least(m.delivered, delivered)
    m.deliveries += deliveries
    if marks:
        m.expired = m.expired or bool(marks & MARKS["expired"])
        m.dropped = m.dropped or bool(marks & MARKS["dropped"])
        m.trimmed = m.trimmed or bool(marks & MARKS["trimmed"])
        m.purged = m.purged or bool(marks & MARKS["purged"])
        m.compacted = m.compacted or bool(marks & MARKS["compacted"])


def _discarded(
    r: _Record | None, sc: int | None, stored_ts: float | None, ended: float | None
) -> bool:
    """Its session ended after it was stored, or it was routed for one already ended."""
    if sc is None:
        return r is not None and r.discarded
    return ended is not None and stored_ts is not None and ended >= stored_ts


def _young(since: float | None, young: float) -> bool:
    """Arrived (not stored) or stored less than ``grace`` before Redis was read."""
    return since is not None and since > young


def _expired(r: _Record | None, exp: float | None, now: float) -> bool:
    """A stored message past its expiry (the stored one's, else the record's)."""
    expiry = r.exp if r is not None and r.exp is not None else exp
    return expiry is not None and expiry <= now


def account_batches(
    batches: Iterable[Any],
    epoch: int,
    now: float,
    grace: float,
    taken: dict[str, int] | None = None,
) -> Iterator[Any]:
    """Arrow batches of :data:`INPUT_SCHEMA` (whole clients) -> Arrow batches of
    :data:`MESSAGE_SCHEMA`: a ``mapInArrow`` function. Each input is read a
    kind at a time, a column at a time (Arrow's ``to_pylist`` of a column is
    fast; of a row, slow). ``taken`` (:data:`TAKEN_IN`) gets what was taken in."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from pipeline.decoding import arrow_schema

    taken = taken if taken is not None else {}
    for name in TAKEN_IN:
        taken.setdefault(name, 0)
    clients: dict[Any, tuple[list[Any], list[Any], dict[int, bool]]] = {}
    for batch in batches:
        kinds = batch.column(0)
        for kind, fields in (
            (RECORD, ("part", "off", "kts", "topic", "size", "pub", "exp")),
            (
                EVENT,
                (
                    *("ev", "ts", "pid", "sc", "part", "off", "ep", "exp", "at"),
                    *("acked", "delivered", "deliveries", "marks", "epart", "eoff", "idx"),
                ),
            ),
            (REF, ("sc", "has_value")),
        ):
            some = batch.filter(pc.equal(kinds, kind))
            if not some.num_rows:
                continue
            taken[_KINDS_TAKEN[kind]] += some.num_rows
            if kind == EVENT:
                gaps = some.filter(pc.equal(some.column("ev"), "gap")).column("n")
                taken["gaps"] += pc.sum(gaps).as_py() or 0
            cids = some.column(1).to_pylist()
            columns = [some.column(INPUT_COLUMNS.index(f)).to_pylist() for f in fields]
            for cid, values in zip(cids, zip(*columns, strict=True), strict=True):
                found = clients.get(cid)
                if found is None:
                    found = clients[cid] = ([], [], {})
                if kind == RECORD:
                    found[0].append(values)
                elif kind == EVENT:
                    found[1].append(values)
                else:
                    sc, there = values
                    found[2][sc] = found[2].get(sc, False) or bool(there)
    schema = arrow_schema(MESSAGE_SCHEMA)
    out: list[tuple[Any, ...]] = []
    for cid, (records, events, refs) in clients.items():
        out.extend(_account_client(cid, records, events, refs, epoch, now, grace))
        if len(out) >= _OUT_ROWS:
            yield _batch(out, schema, pa)
            out = []
    if out:
        yield _batch(out, schema, pa)


def input_table(kind: int, batch: Any) -> Any:
    """One input as an Arrow table of :data:`INPUT_SCHEMA`, in one Python task: a
    batch of records (pipeline/decoding.py RECORD_SCHEMA), of events (its
    EVENT_COLUMNS or FOLDED_COLUMNS) or of refs (``cid``, ``sc``, ``has_value``).
    Of events, :data:`READ_EVENTS` only, and a trim naming packet ids as one
    event per id (an empty list stays one event). pipeline/audit.py
    ``_accounting_input`` is the same in Spark, for inputs that are Spark's rows."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from pipeline.decoding import arrow_schema

    table = pa.Table.from_batches([batch])
    if kind == EVENT:
        table = table.filter(pc.is_in(table.column("ev"), pa.array(READ_EVENTS)))
        pids = table.column("pids")
        by_pids = pc.and_(
            pc.equal(table.column("ev"), "trimmed"),
            pc.greater(pc.fill_null(pc.list_value_length(pids), 0), 0),
        )
        if pc.any(by_pids).as_py():
            trims = table.filter(by_pids)
            each = trims.take(pc.list_parent_indices(trims.column("pids")))
            each = each.set_column(
                each.schema.get_field_index("pid"), "pid", pc.list_flatten(trims.column("pids"))
            )
            table = pa.concat_tables([table.filter(pc.invert(by_pids)), each])
    schema = arrow_schema(INPUT_SCHEMA)
    n = table.num_rows
    have = set(table.column_names)
    columns = [pa.repeat(pa.scalar(kind, pa.int32()), n)] + [
        table.column(f.name).cast(f.type) if f.name in have else pa.nulls(n, f.type)
        for f in list(schema)[1:]
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def _batch(rows: list[tuple[Any, ...]], schema: Any, pa: Any) -> Any:
    # Arrow reads the tuples as structs itself: an eighth of the time of a list per column
    return pa.RecordBatch.from_struct_array(pa.array(rows, pa.struct(list(schema))))
