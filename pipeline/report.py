"""Self-contained HTML reports: tables and matplotlib plots embedded as base64 PNG.

Charts over time go through :func:`plot_over_time`, readable at any window, a
minute or a week: markers when there are few points (one point drawn as a line
is nothing), the time axis fitted to the data (matplotlib widens a single
date to years), in UTC, with ticks from its concise date formatter. Each
embedded figure says how many data points it drew (``data-points``), so a
test (tests/pipeline/test_report_charts.py) can tell a chart from an empty
frame.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import io
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["Report", "figure", "plot_over_time"]

MARKERS_UP_TO = 60  # points in a series drawn with markers as well as lines
UTC = dt.UTC


class Report:
    """Sections appended in order, written as one HTML file an operator can open."""

    def __init__(self, title: str) -> None:
        self.title = title
        self._parts: list[str] = []

    def heading(self, text: str) -> None:
        self._parts.append(f"<h2>{html.escape(text)}</h2>")

    def paragraph(self, text: str, *, warn: bool = False) -> None:
        cls = ' class="warn"' if warn else ""
        self._parts.append(f"<p{cls}>{html.escape(text)}</p>")

    def table(self, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
        head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row) + "</tr>"
            for row in rows
        )
        self._parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")

    def figure(self, fig: Any, caption: str = "") -> None:
        """A matplotlib figure, embedded as a PNG (the figure is closed), with the
        number of data points it drew and, over time, its axis's span (epoch s)."""
        import matplotlib.pyplot as plt

        points = _points_drawn(fig)
        span = ""
        for ax in fig.axes:
            if getattr(ax, "devicemq_time_axis", False):
                low, high = (_epoch(x) for x in ax.get_xlim())
                span = f' data-x-from="{low:.0f}" data-x-to="{high:.0f}"'
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
        plt.close(fig)
        data = base64.b64encode(buf.getvalue()).decode()
        cap = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
        self._parts.append(
            f'<figure data-points="{points}"{span}>'
            f'<img src="data:image/png;base64,{data}">{cap}</figure>'
        )

    def render(self) -> str:
        return (
            "<!doctype html><html><head><meta charset='utf-8'>"
            f"<title>{html.escape(self.title)}</title><style>{_CSS}</style></head><body>"
            f"<h1>{html.escape(self.title)}</h1>" + "\n".join(self._parts) + "</body></html>"
        )

    def write(self, path: Any) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.render())


def figure(width: float = 7.0, height: float = 3.5) -> tuple[Any, Any]:
    """A new (figure, axes) on the non-interactive backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width, height))


def plot_over_time(
    ax: Any, series: Sequence[tuple[str | None, Sequence[Any], Sequence[float]]], *, step: bool
) -> None:
    """Draw (label, times, values) series on ``ax`` over a time axis in UTC fitted
    to the data. Times are epoch seconds or datetimes (naive ones, as PySpark
    returns timestamps, are in this process's local time)."""
    import matplotlib.dates

    mdates: Any = matplotlib.dates  # untyped in parts
    every: list[dt.datetime] = []
    for label, times, values in series:
        xs = [_utc(t) for t in times]
        every += xs
        style: dict[str, Any] = {"label": label}
        if len(xs) <= MARKERS_UP_TO:
            style.update(marker="o", markersize=4)
        if step:
            ax.step(xs, values, where="post", **style)
        else:
            ax.plot(xs, values, **style)
    if not every:
        return
    low, high = min(every), max(every)
    pad = max((high - low) * 0.05, dt.timedelta(seconds=30))
    ax.set_xlim(low - pad, high + pad)
    locator = mdates.AutoDateLocator(tz=UTC)
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator, tz=UTC))
    ax.set_xlabel("time (UTC)")
    ax.devicemq_time_axis = True


def _utc(value: Any) -> dt.datetime:
    if isinstance(value, dt.datetime):
        return dt.datetime.fromtimestamp(value.timestamp(), tz=UTC)
    return dt.datetime.fromtimestamp(float(value), tz=UTC)


def _epoch(axis_value: float) -> float:
    """A matplotlib date number as epoch seconds."""
    import matplotlib.dates

    mdates: Any = matplotlib.dates
    return float(mdates.num2date(axis_value).timestamp())


def _points_drawn(fig: Any) -> int:
    """Data points in a figure: line vertices, bars and histogram bins, scatter dots."""
    total = 0
    for ax in fig.axes:
        total += sum(len(line.get_xdata()) for line in ax.get_lines())
        total += sum(1 for patch in ax.patches if patch.get_height())
        total += sum(len(c.get_offsets()) for c in ax.collections)
    return total


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


_CSS = """
body { font-family: sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: right; }
th { background: #f0f0f0; }
td:first-child, th:first-child { text-align: left; }
.warn { color: #a00; font-weight: bold; }
figure { margin: 1em 0; }
"""
