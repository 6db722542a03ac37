"""Self-contained HTML reports: tables and matplotlib plots embedded as base64 PNG."""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["Report"]


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
        """A matplotlib figure, embedded as a PNG (the figure is closed)."""
        import matplotlib.pyplot as plt

        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
        plt.close(fig)
        data = base64.b64encode(buf.getvalue()).decode()
        cap = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
        self._parts.append(f'<figure><img src="data:image/png;base64,{data}">{cap}</figure>')

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
