"""A class-data-sharing archive of Spark's classes, so that a job's JVM starts warm.

A job on a small data set spends a fifth of its time in a cold JVM loading
and linking the ~20,000 classes of Spark (BENCHMARKS.md, "The delivery
audit"). Java 13+ can write the classes a run loaded into an archive at exit
(``-XX:ArchiveClassesAtExit``) and map it into the next JVM
(``-XX:SharedArchiveFile``): the session then starts in about a third of the
time. The first job of a given Java and Spark writes it (a few seconds more at
its end, ~200 MB under ``$XDG_CACHE_HOME/devicemq``, else ``~/.cache/devicemq``);
later jobs use it. The file's name holds a digest of the JVM and of Spark's
jars, so an upgrade writes a new one (and removes the old); a JVM that finds an
archive not its own ignores it (``-Xshare:auto``, Java's default) and runs as
before.

Only the command line's jobs use it (pipeline/cli.py): the archive is written
as the JVM exits, and only a job that owns its session can make the JVM exit
and wait for the file (:meth:`ClassArchive.finish`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ClassArchive"]

PREFIX = "spark-classes-"
SUFFIX = ".jsa"
DUMP_TIMEOUT = 120.0  # seconds for the JVM to write the archive and exit
STALE = 3600.0  # a partial archive this old is of a run that was killed


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "devicemq"


def _fingerprint() -> str:
    """A digest of what the archive depends on: the java binary Spark runs and the
    jars on its class path (names, sizes, times)."""
    import pyspark

    digest = hashlib.sha256()
    java = (
        os.path.join(os.environ["JAVA_HOME"], "bin", "java") if "JAVA_HOME" in os.environ else None
    )
    java = java or shutil.which("java") or "java"
    real = os.path.realpath(java)
    digest.update(real.encode())
    with contextlib.suppress(OSError):
        stat = os.stat(real)
        digest.update(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
    jars = Path(pyspark.__file__).parent / "jars"
    for jar in sorted(jars.glob("*.jar")):
        stat = jar.stat()
        digest.update(f"{jar.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    digest.update(pyspark.__version__.encode())
    return digest.hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class ClassArchive:
    """The archive of this Java and Spark: :attr:`java_options` for the driver's
    JVM, then :meth:`finish` once the job is done."""

    path: Path
    writing: Path | None  # where this run's JVM writes it at exit (None: it exists)

    @classmethod
    def here(cls, directory: Path | None = None) -> ClassArchive | None:
        """The archive to use or write; None when there is no place to keep it."""
        directory = directory or cache_dir()
        try:
            directory.mkdir(parents=True, exist_ok=True)
            path = directory / f"{PREFIX}{_fingerprint()}{SUFFIX}"
        except OSError:
            return None
        if path.is_file():
            return cls(path, None)
        for partial in directory.glob(f"{PREFIX}*{SUFFIX}.*.tmp"):
            with contextlib.suppress(OSError):
                if time.time() - partial.stat().st_mtime > STALE:
                    partial.unlink()
        return cls(path, directory / f"{path.name}.{os.getpid()}.tmp")

    @property
    def java_options(self) -> str:
        # cds logging off: an archive of another JVM is ignored without a warning
        quiet = "-XX:+VerifySharedSpaces -Xlog:cds=off -Xlog:cds+dynamic=off"
        if self.writing is None:
            return f"-XX:SharedArchiveFile={self.path} {quiet}"
        return f"-XX:ArchiveClassesAtExit={self.writing} {quiet}"

    def finish(self, spark_context_class: Any, say: Any = None) -> None:
        """After ``SparkContext.stop()``: when this run writes the archive, end the
        JVM (it exits when its stdin closes: pyspark's gateway), wait for it to
        write the file, and put the file in place whole (rename); others' old
        archives go."""
        if self.writing is None:
            return
        gateway = getattr(spark_context_class, "_gateway", None)
        proc = getattr(gateway, "proc", None)
        if gateway is None or proc is None or proc.stdin is None:
            return
        if say is not None:
            say(f"saving Spark's classes for faster starts (once): {self.path}")
        try:
            gateway.shutdown()
            proc.stdin.close()
            try:
                code = proc.wait(timeout=DUMP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                return
            if code == 0 and self.writing.is_file():
                self.writing.replace(self.path)
                for old in self.path.parent.glob(f"{PREFIX}*{SUFFIX}"):
                    if old != self.path:
                        old.unlink(missing_ok=True)
        except OSError:  # a failed dump costs the next run its speed, nothing else
            pass
        finally:
            self.writing.unlink(missing_ok=True)
            spark_context_class._gateway = None
            spark_context_class._jvm = None
