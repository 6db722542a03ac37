"""A one-line progress display on stderr.

On a terminal the line rewrites itself (``\\r``) a few times a second; into a
file or pipe it prints a plain line every few seconds instead, so logs stay
readable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]

_WIDTH = 24


def _count(n: float) -> str:
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    if n >= 1e4:
        return f"{n / 1e3:.1f}k"
    return f"{n:.0f}"


class Progress:
    def __init__(
        self, label: str, total_seconds: float, enabled: bool = True, stream: TextIO | None = None
    ) -> None:
        self.label = label
        self.total = total_seconds
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self._last: tuple[float, int, int] | None = None  # time, acked, delivered
        self._rates = (0.0, 0.0)
        self._printed = 0.0
        self._open = False

    def update(self, elapsed: float, phase: str, sent: int, acked: int, delivered: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self._last is not None and now - self._last[0] >= 0.9:
            dt = now - self._last[0]
            self._rates = ((acked - self._last[1]) / dt, (delivered - self._last[2]) / dt)
            self._last = (now, acked, delivered)
        elif self._last is None:
            self._last = (now, acked, delivered)
        fraction = min(1.0, max(0.0, elapsed / self.total)) if self.total else 1.0
        filled = int(fraction * _WIDTH)
        bar = "#" * filled + "." * (_WIDTH - filled)
        line = (
            f"{self.label} [{bar}] {min(elapsed, self.total):5.1f}/{self.total:.0f}s {phase:<7} "
            f"pub {_count(self._rates[0])}/s  deliv {_count(self._rates[1])}/s  "
            f"total {_count(delivered)}"
        )
        if self.tty:
            self.stream.write("\r\x1b[2K" + line)
            self.stream.flush()
            self._open = True
        elif now - self._printed >= 5.0:
            self._printed = now
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self, message: str = "") -> None:
        if not self.enabled:
            return
        if self.tty and self._open:
            self.stream.write("\r\x1b[2K")
        if message:
            self.stream.write(message + "\n")
        self.stream.flush()
        self._open = False
