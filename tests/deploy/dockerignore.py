"""The Docker build context of a directory: its files that ``.dockerignore`` keeps.

Docker's rules (``docs.docker.com`` "Dockerignore file", implemented by
moby/patternmatcher), as far as a ``.dockerignore`` is likely to use them:

- one pattern a line; blank lines and lines starting with ``#`` are ignored,
  surrounding white space is trimmed; a leading ``/`` and a trailing ``/`` are
  dropped (Go's ``filepath.Clean``), so ``!broker/`` is ``!broker``;
- ``*`` is any run of characters but ``/``, ``?`` one such character,
  ``[...]`` a class, ``\\`` escapes the next character; ``**`` is any number
  of directories, zero included (``**/x`` matches ``x`` and ``a/b/x``);
- a pattern matches a path, or any of the path's parent directories (``*``
  matches ``broker/cli.py`` through ``broker``);
- ``!`` makes a pattern an exception; the last pattern that matches decides.

:func:`context_files` walks the tree as the Docker client does: an excluded
directory is skipped unless an exception pattern could lie beneath it.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DockerIgnore", "context_files", "copy_context"]


@dataclass(frozen=True)
class Pattern:
    text: str  # cleaned, without the leading "!"
    exception: bool
    regex: re.Pattern[str]


def _clean(text: str) -> str:
    parts: list[str] = []
    for part in text.split("/"):
        if part in ("", "."):
            continue
        if part == ".." and parts and parts[-1] != "..":
            parts.pop()
        else:
            parts.append(part)
    return "/".join(parts) or "."


def _compile(pattern: str) -> re.Pattern[str]:
    """patternmatcher's translation of one pattern into an anchored regex."""
    out = ["^"]
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "*":
            if i + 1 < n and pattern[i + 1] == "*":
                i += 1  # "**"
                if i + 1 < n and pattern[i + 1] == "/":
                    i += 1  # "**/": zero or more directories
                    out.append("(.*/)?")
                else:
                    out.append(".*")
            else:
                out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "\\" and i + 1 < n:
            i += 1
            out.append(re.escape(pattern[i]))
        elif c == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1 : end]
                if body.startswith("!") or body.startswith("^"):
                    body = "^" + body[1:]
                out.append(f"[{body}]")
                i = end
        else:
            out.append(re.escape(c))
        i += 1
    out.append("$")
    return re.compile("".join(out))


class DockerIgnore:
    """The patterns of one ``.dockerignore``."""

    def __init__(self, text: str) -> None:
        self.patterns: list[Pattern] = []
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            exception = line.startswith("!")
            if exception:
                line = line[1:].strip()
                if not line:
                    raise ValueError('illegal exclusion pattern: "!"')
            cleaned = _clean(line.lstrip("/"))
            self.patterns.append(Pattern(cleaned, exception, _compile(cleaned)))

    def excluded(self, path: str) -> bool:
        """Whether ``path`` (relative, ``/``-separated) is left out of the context."""
        parents = path.split("/")
        candidates = ["/".join(parents[: k + 1]) for k in range(len(parents))]
        excluded = False
        for pattern in self.patterns:
            if any(pattern.regex.match(c) for c in candidates):
                excluded = not pattern.exception
        return excluded

    def may_hold_exceptions(self, directory: str) -> bool:
        """Whether an exception pattern could match something under an excluded
        ``directory`` (else the walk skips it, as the Docker client does)."""
        prefix = directory + "/"
        for pattern in self.patterns:
            if not pattern.exception:
                continue
            if pattern.text.startswith(prefix) or re.search(r"[*?\[\\]", pattern.text):
                return True
        return False


def context_files(root: Path) -> list[str]:
    """The files of ``root`` a ``docker build root`` sends (relative, ``/``-separated)."""
    ignore_file = root / ".dockerignore"
    rules = DockerIgnore(ignore_file.read_text(encoding="utf-8") if ignore_file.exists() else "")
    kept: list[str] = []
    for current, dirs, files in os.walk(root):
        rel = Path(current).relative_to(root).as_posix()
        base = "" if rel == "." else rel + "/"
        dirs[:] = [
            d
            for d in sorted(dirs)
            if not rules.excluded(base + d) or rules.may_hold_exceptions(base + d)
        ]
        kept.extend(base + f for f in sorted(files) if not rules.excluded(base + f))
    return kept


def copy_context(root: Path, dest: Path) -> list[str]:
    """Copy the build context of ``root`` into ``dest``; the files copied."""
    files = context_files(root)
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target, follow_symlinks=True)
    return files
