"""The password and ACL files: their comments, and noticing that they changed.

Both files are read line by line with one comment rule (:func:`content_lines`):

- a line whose first non-blank character is ``#`` is a comment;
- elsewhere a comment starts at a ``#`` with whitespace on both sides
  (``user alice    # restricted account``) and runs to the end of the line.

A ``#`` inside a word is data: ``alice/#`` and a lone ``#`` ending a line
(``topic read #``) are topic filters, not comments. So the filter ``#``
cannot carry an inline comment (the comment goes on the line above), and
a user name cannot hold a ``#`` after whitespace (``devicemq passwd`` refuses
one; in either file it is an error naming the line, never a silent user).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

CHECK_INTERVAL = 1.0  # seconds: at most one stat() per interval

_INLINE_COMMENT = re.compile(r"\s#\s")


def strip_comment(line: str) -> str:
    """``line`` without its comment (see the module docstring), whitespace trimmed."""
    text = line.strip()
    if text.startswith("#"):
        return ""
    found = _INLINE_COMMENT.search(text)
    return text if found is None else text[: found.start()].rstrip()


def has_comment_marker(value: str) -> bool:
    """Whether ``value`` holds a ``#`` right after whitespace: in a user name, a hash or
    after a rule's topic that is a comment gone wrong (``user alice #``), never data."""
    return re.search(r"\s#", value) is not None


def content_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, content) of every line that is not blank or a comment."""
    for number, raw in enumerate(text.splitlines(), 1):
        line = strip_comment(raw)
        if line:
            yield number, line


class FileChangeWatch:
    """Tells whether ``path`` changed (by mtime) since it was last read.

    Create it right after reading the file. A file that changed but fails to
    parse counts as seen: it is not re-read until it changes again.
    """

    def __init__(self, path: Path, clock: Callable[[], float]) -> None:
        self.path = path
        self._clock = clock
        self._mtime = self._stat()
        self._next_check = clock() + CHECK_INTERVAL  # just read

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
