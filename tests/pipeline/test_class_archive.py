"""pipeline/class_archive.py: the first command-line job writes the archive of Spark's
classes whole, the next one's JVM maps it; a partial one of a killed run goes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.class_archive import PREFIX, SUFFIX, ClassArchive
from tests.pipeline.conftest import REPO, Workload


def _audit(workload: Workload, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "app.cli", "pipeline", "audit"]
    argv += ["--bootstrap", workload.endpoints.bootstrap, "--redis", workload.endpoints.redis_url]
    argv += ["--out", str(tmp_path / "out"), "--since", "2999-01-01T00:00:00"]  # a small job
    return subprocess.run(
        argv,
        cwd=REPO,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")},
        capture_output=True,
        text=True,
        timeout=300,
    )


# Two cold JVMs, the first writing ~200 MB at its exit: 60 s in CI, and past the
# default 120 s (a hang's limit) on a machine at load 15.
@pytest.mark.timeout(300)
def test_the_first_job_writes_the_archive_and_the_next_maps_it(
    workload: Workload, tmp_path: Path
) -> None:
    first = _audit(workload, tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "saving Spark's classes for faster starts (once)" in first.stderr
    # nothing of Spark's on a stderr that is not a terminal but its log: no progress
    # bar, and no warning that the audit's messages directory (a dot name) is ignored
    assert "[Stage" not in first.stderr and "All paths were ignored" not in first.stderr
    directory = tmp_path / "cache" / "devicemq"
    [archive] = list(directory.iterdir())  # whole, renamed: no partial file left
    assert archive.name.startswith(PREFIX) and archive.name.endswith(SUFFIX)
    assert archive.stat().st_size > 10_000_000
    written = archive.stat().st_mtime_ns
    # The next session is given it; -Xshare:on: a JVM that cannot map the archive
    # it is given refuses to start.
    session = (
        "from pipeline.class_archive import ClassArchive; from pipeline.common import make_spark; "
        "archive = ClassArchive.here(); assert archive.writing is None, archive; "
        "print(make_spark('local[1]', 'next', archive.java_options).range(3).count())"
    )
    second = subprocess.run(
        [sys.executable, "-c", session],
        cwd=REPO,
        env={
            **os.environ,
            "XDG_CACHE_HOME": str(tmp_path / "cache"),
            "JAVA_TOOL_OPTIONS": "-Xshare:on",
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert second.returncode == 0 and second.stdout.strip() == "3", second.stderr[-2000:]
    assert [p.name for p in directory.iterdir()] == [archive.name]
    assert archive.stat().st_mtime_ns == written


def test_a_partial_archive_of_a_killed_run_is_removed_once_stale(tmp_path: Path) -> None:
    here = ClassArchive.here(tmp_path)
    assert here is not None and here.writing is not None
    assert "-XX:ArchiveClassesAtExit=" in here.java_options
    stale = tmp_path / f"{here.path.name}.1.tmp"
    fresh = tmp_path / f"{here.path.name}.2.tmp"  # perhaps a job still running
    for partial in (stale, fresh):
        partial.write_bytes(b"partial")
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    ClassArchive.here(tmp_path)
    assert not stale.exists() and fresh.exists()
    here.path.write_bytes(b"archive")
    using = ClassArchive.here(tmp_path)
    assert using is not None and using.writing is None
    assert f"-XX:SharedArchiveFile={here.path}" in using.java_options
