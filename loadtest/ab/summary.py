"""What the A/B runs measured: one record per run, the medians per side, the
ratios, and the table. Pure: no processes, no clock.

Per run: delivered msg/s (the loader's measured window), e2e latency p50 and
p99, and the CPU the server used over that window: the broker, and for a
persistent run its embedded Redis and Kafka. From these:

- **us/msg**: server CPU microseconds per delivered message;
- **in+out/core**: messages received plus messages delivered per second of
  server CPU: the "in + out messages per server core" TBMQ reports
  (~8,900).

Per scenario and side, each figure's median over the rounds (and for msg/s
its min..max). The **speed** ratio of head to base is msg/s head/base; for a
paced scenario (``fleet``, ``fan-in``: the rate is the offer, the same on
both sides) it is the lower of that and the cost ratio us/msg base/head, so
that a side which keeps up at a higher cost, or falls behind the offer, is
slower. Below :data:`FLAG_BELOW` it is flagged: a drop of more than 5% is to
be explained or undone.
"""

from __future__ import annotations

import statistics
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "FLAG_BELOW",
    "Comparison",
    "RunRecord",
    "SideSummary",
    "compare",
    "cores_between",
    "format_table",
    "paired_ratios",
    "record_from_result",
    "summarize_side",
]

FLAG_BELOW = 0.95


@dataclass
class RunRecord:
    round: int
    scenario: str
    side: str
    ok: bool = False  # ran, and the loader's per-message check passed
    error: str | None = None
    delivered: float = 0.0  # msg/s over the measured window
    acked: float = 0.0  # published msg/s the broker acknowledged
    p50_ms: float | None = None
    p99_ms: float | None = None
    cores: dict[str, float] = field(default_factory=dict)  # broker / redis / kafka
    other_cores: float | None = None  # the machine's busy cores neither server nor loader
    loader_cores: float | None = None
    check: dict[str, Any] = field(default_factory=dict)

    @property
    def server_cores(self) -> float | None:
        return sum(self.cores.values()) if self.cores else None

    @property
    def us_per_message(self) -> float | None:
        cores = self.server_cores
        if cores is None or not self.delivered:
            return None
        return cores * 1e6 / self.delivered

    @property
    def per_core(self) -> float | None:
        """Messages in (acknowledged) and out (delivered) per server core-second."""
        cores = self.server_cores
        if not cores:
            return None
        return (self.acked + self.delivered) / cores

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            server_cores=_round(self.server_cores),
            us_per_message=_round(self.us_per_message, 2),
            in_out_per_core=_round(self.per_core, 0),
        )
        return out


def record_from_result(
    round_: int, scenario: str, side: str, result: dict[str, Any], cores: dict[str, float]
) -> RunRecord:
    """A record of one run from the loader's result (``loadtest.report.summarize``)
    and the server's cores by role over the measured window."""
    check = result["check"]
    e2e = result["latency_ms"]["e2e"]
    error = None
    if not check["ok"]:
        error = (
            f"check failed: {check['lost']} lost, {check['duplicates']} duplicates, "
            f"{check['out_of_order']} out of order, {check['rejected']} rejected"
        )
    elif result["errors"]:
        error = f"loader errors: {result['errors'][0]}"
    return RunRecord(
        round=round_,
        scenario=scenario,
        side=side,
        ok=error is None,
        error=error,
        delivered=result["rates"]["delivered"],
        acked=result["rates"]["acked"],
        p50_ms=e2e["p50"],
        p99_ms=e2e["p99"],
        cores={k: round(v, 3) for k, v in cores.items()},
        other_cores=result["cpu"]["other_cores"],
        loader_cores=result["cpu"]["client_cores"],
        check={
            k: check[k]
            for k in ("acked", "delivered", "lost", "duplicates", "out_of_order", "rejected")
        },
    )


def cores_between(
    start: tuple[float, dict[str, float]] | None, end: tuple[float, dict[str, float]] | None
) -> dict[str, float]:
    """Cores used by role between two samples of (monotonic time, CPU seconds by
    role); empty when a sample is missing."""
    if start is None or end is None or end[0] <= start[0]:
        return {}
    wall = end[0] - start[0]
    return {k: max(0.0, (v - start[1].get(k, 0.0)) / wall) for k, v in end[1].items()}


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


@dataclass
class SideSummary:
    side: str
    runs: int  # that completed and checked out
    failed: int
    delivered: float | None = None  # medians over the runs
    delivered_min: float | None = None
    delivered_max: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    cores: dict[str, float | None] = field(default_factory=dict)
    server_cores: float | None = None
    us_per_message: float | None = None
    per_core: float | None = None
    other_cores: float | None = None


def summarize_side(side: str, records: Sequence[RunRecord]) -> SideSummary:
    """The medians of the runs of one side that checked out."""
    good = [r for r in records if r.ok]
    out = SideSummary(side, runs=len(good), failed=len(records) - len(good))
    if not good:
        return out
    rates = [r.delivered for r in good]
    out.delivered = _median(rates)
    out.delivered_min, out.delivered_max = min(rates), max(rates)
    out.p50_ms = _median(r.p50_ms for r in good)
    out.p99_ms = _median(r.p99_ms for r in good)
    roles = sorted({k for r in good for k in r.cores})
    out.cores = {k: _median(r.cores.get(k) for r in good) for k in roles}
    out.server_cores = _median(r.server_cores for r in good)
    out.us_per_message = _median(r.us_per_message for r in good)
    out.per_core = _median(r.per_core for r in good)
    out.other_cores = _median(r.other_cores for r in good)
    return out


@dataclass
class Comparison:
    """``side`` against ``reference`` (head against base, or a side against Mosquitto)."""

    side: str
    reference: str
    rate: float | None  # msg/s side / reference
    p99: float | None  # e2e p99 side / reference (above 1: a longer tail)
    cost: float | None  # us/msg side / reference (above 1: dearer)
    speed: float | None  # rate, or for a paced scenario the lower of rate and 1 / cost
    flagged: bool


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b:
        return None
    return a / b


def compare(
    side: SideSummary, reference: SideSummary, paced: bool, *, flag: bool = True
) -> Comparison:
    """``side`` against ``reference``; ``flag``: whether a speed below
    :data:`FLAG_BELOW` is flagged (a regression of head against base; against
    Mosquitto the ratio is a goal's number, not a regression)."""
    rate = _ratio(side.delivered, reference.delivered)
    cost = _ratio(side.us_per_message, reference.us_per_message)
    speed = rate
    if paced:
        # the offer is the same on both sides: while both keep up the cost tells them
        # apart; a side that falls behind the offer is slower whatever its cost
        speed = min((v for v in (rate, 1 / cost if cost else None) if v is not None), default=None)
    return Comparison(
        side.side,
        reference.side,
        rate=rate,
        p99=_ratio(side.p99_ms, reference.p99_ms),
        cost=cost,
        speed=speed,
        flagged=flag and speed is not None and speed < FLAG_BELOW,
    )


def paired_ratios(
    records: Sequence[RunRecord], scenario: str, reference: str
) -> dict[str, list[float]]:
    """Per side, delivered msg/s of ``scenario`` over that of ``reference`` in the
    same round: the two ran back to back on the same tree (``fan-in-application``
    against ``fan-in``), so each ratio pairs runs that saw the same machine. Only
    rounds where both checked out (nothing lost) count."""
    done = {(r.scenario, r.side, r.round): r for r in records if r.ok and r.delivered}
    out: dict[str, list[float]] = {}
    for (name, side, round_), record in sorted(done.items()):
        if name != scenario:
            continue
        ref = done.get((reference, side, round_))
        if ref is not None:
            out.setdefault(side, []).append(record.delivered / ref.delivered)
    return out


# -- the table ------------------------------------------------------------------------


def _n(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


_HEAD = (
    ("scenario", "<", 26),
    ("side", "<", 14),
    ("msg/s", ">", 9),
    ("min..max", ">", 15),
    ("p50 ms", ">", 8),
    ("p99 ms", ">", 8),
    ("cores b+r+k", ">", 16),
    ("us/msg", ">", 8),
    ("in+out/core", ">", 12),
    ("other", ">", 6),
)


def _line(cells: Sequence[str]) -> str:
    parts = []
    for (_, align, width), cell in zip(_HEAD, cells, strict=True):
        parts.append(f"{cell:{align}{width}}")
    return "  ".join(parts).rstrip()


def _side_cells(title: str, s: SideSummary) -> list[str]:
    if s.delivered is None:
        if not s.failed:
            return [title, s.side, "not run", *[""] * 7]
        return [title, s.side, "failed", f"({s.failed} of {s.failed} runs)", *[""] * 6]
    cores = s.cores
    split = "+".join(_n(cores.get(k), 2) for k in ("broker", "redis", "kafka") if k in cores)
    if len(cores) > 1 and any(cores.get(k) for k in ("redis", "kafka")):
        shown = split
    else:
        shown = _n(s.server_cores, 2)
    spread = f"{_n(s.delivered_min)}..{_n(s.delivered_max)}"
    if s.failed:
        spread += f" ({s.failed} failed)"
    return [
        title,
        s.side,
        _n(s.delivered),
        spread,
        _n(s.p50_ms, 1),
        _n(s.p99_ms, 1),
        shown,
        _n(s.us_per_message, 1),
        _n(s.per_core),
        _n(s.other_cores, 2),
    ]


def _comparison_cells(c: Comparison, paced: bool) -> list[str]:
    speed = f"speed {_x(c.speed)}" + (" !" if c.flagged else "")
    return [
        "",
        f"{c.side}/{c.reference}",
        _x(c.rate),
        speed,
        "",
        _x(c.p99),
        "(cost)" if paced else "",
        _x(c.cost),
        "",
        "",
    ]


def format_table(
    scenarios: Sequence[tuple[str, bool, dict[str, SideSummary], list[Comparison]]],
    *,
    markdown: bool = False,
) -> str:
    """The report: per scenario (title, paced, its sides' summaries, comparisons)
    one row per side with the medians over the rounds, then one row per
    comparison with the ratios (msg/s, speed, p99, us/msg). ``markdown``: a
    Markdown table (for BENCHMARKS.md or a commit message) instead of columns."""
    rows: list[list[str]] = []
    for title, paced, sides, comparisons in scenarios:
        first = True
        for summary in sides.values():
            rows.append(_side_cells(title if first else "", summary))
            first = False
        rows += [_comparison_cells(c, paced) for c in comparisons]
    names = [name for name, _, _ in _HEAD]
    if markdown:
        lines = ["| " + " | ".join(names) + " |"]
        lines.append("|" + "|".join("---" if a == "<" else "---:" for _, a, _ in _HEAD) + "|")
        lines += ["| " + " | ".join(cells) + " |" for cells in rows]
        lines.append("")
    else:
        lines = [_line(names)] + [_line(cells) for cells in rows]
    lines += textwrap.wrap(
        "Medians over the rounds. us/msg: server CPU (broker + Redis + Kafka) per delivered "
        "message; in+out/core: messages received + delivered per second of server CPU; "
        "other: busy cores of the machine that neither the server nor the loader used "
        "(noise). speed: the msg/s ratio; for a paced scenario (cost) the lower of it and the "
        f"us/msg ratio inverted; below {FLAG_BELOW:g} it is flagged with !.",
        width=100,
    )
    return "\n".join(lines)
