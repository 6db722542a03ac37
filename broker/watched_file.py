"""Noticing that a configuration file changed, cheaply enough to ask per CONNECT."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

CHECK_INTERVAL = 1.0  # seconds: at most one stat() per interval


class FileChangeWatch:
    """Tells whether ``path`` changed (by mtime) since it was last read.

    Create it right after reading the file. A file that changed but fails to
    parse counts as seen: it is not re-read until it changes again.
    """

    def __init__(self, path: Path, clock: Callable[[], float]) -> None:
        self.path = path
        self._clock = clock
        self._mtime = self._stat()
        self._next_check = 0.0

    def changed(self, force: bool = False) -> bool:
        """True when the file should be read again (always when ``force``, e.g. SIGHUP)."""
        if not force:
            now = self._clock()
            if now < self._next_check:
                return False
            self._next_check = now + CHECK_INTERVAL
        mtime = self._stat()
        if not force and mtime == self._mtime:
            return False
        self._mtime = mtime
        return True

    def _stat(self) -> int | None:
        try:
            return self.path.stat().st_mtime_ns
        except OSError:
            return None
