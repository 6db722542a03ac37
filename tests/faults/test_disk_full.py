"""Disk full under the Redis AOF, with traffic to persistent subscribers.

redis-server keeps its AOF on a tiny filesystem of its own (a 4 MiB tmpfs,
or a loop-mounted ext4 image if tmpfs cannot be mounted); the test fills it
with a filler file. What Redis does then depends on the fsync policy:

- ``appendfsync everysec``: Redis stays up and refuses every write, and
  PING too (``MISCONF Errors writing to the AOF file``), until a write
  succeeds again, which it retries by itself once space is back;
- ``appendfsync always``: Redis cannot keep its promise and exits
  ("Can't recover from AOF write error when the AOF fsync policy is
  'always'"); the supervisor (here, the test) starts it again once space is
  back.

Either way a publisher's PUBACK waits for Kafka, not Redis: publishers keep
getting success while Redis takes nothing. The guarantee is that those
Kafka-acknowledged messages are not lost: the persistence consumer retries
the batch without committing, and once space is back they are stored and
delivered. Meanwhile the broker stays up and ``/ready`` says why it is not
ready; afterwards it is ready again by itself.
"""

from __future__ import annotations

import contextlib
import errno
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.checker import (
    V5,
    V311,
    PahoSubscriber,
    Publisher,
    assert_ok,
    check,
    start_publishers,
    wait_until,
)
from tests.faults.conftest import Stack
from tests.faults.test_readiness import HealthWatch, http_get, metrics_settings, wait_ready

FS_SIZE_MB = 4


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A directory on a filesystem of its own, FS_SIZE_MB big; unmounted afterwards."""
    mnt = tmp_path / "aof"
    mnt.mkdir()
    tried: list[str] = []
    done = _run("mount", "-t", "tmpfs", "-o", f"size={FS_SIZE_MB}m", "tmpfs", str(mnt))
    if done.returncode != 0:
        tried.append(f"tmpfs: {done.stderr.strip() or done.returncode}")
        image = tmp_path / "aof.img"
        with image.open("wb") as f:
            f.truncate(FS_SIZE_MB * 1024 * 1024)
        made = _run("mkfs.ext4", "-q", "-F", str(image))
        done = made if made.returncode else _run("mount", "-o", "loop", str(image), str(mnt))
        if done.returncode != 0:
            tried.append(f"loop ext4: {done.stderr.strip() or done.returncode}")
            pytest.skip("no small filesystem can be mounted here: " + "; ".join(tried))
    try:
        yield mnt
    finally:
        if _run("umount", str(mnt)).returncode != 0:
            _run("umount", "-l", str(mnt))


def fill(directory: Path) -> Path:
    """Write a filler file until the filesystem is full (ENOSPC)."""
    filler = directory / "filler"
    chunk = b"\0" * 65536
    with filler.open("wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
        # the last partial block too
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 512)
    return filler


def _grows(pubs: list[Publisher], by: int, timeout: float, what: str) -> None:
    before = [len(p.acked) for p in pubs]
    wait_until(
        lambda: all(len(p.acked) >= b + by for p, b in zip(pubs, before, strict=True)),
        timeout,
        what,
    )


def _traffic(stack: Stack) -> tuple[list[PahoSubscriber], list[Publisher]]:
    topic = stack.topic("t")
    subs = [
        PahoSubscriber(stack.broker.address, stack.client(f"sub-{v}"), version=v)
        for v in (V5, V311)
    ]
    for sub in subs:
        sub.connect()
        sub.subscribe(topic + "/#", qos=1)
    pubs: list[Publisher] = []
    start_publishers(pubs, stack, topic)
    return subs, pubs


@pytest.mark.parametrize("appendfsync", ["everysec", "always"])
def test_disk_full_for_the_redis_aof(tiny_fs: Path, stack_factory, appendfsync: str) -> None:  # type: ignore[no-untyped-def]
    settings = metrics_settings()
    stack: Stack = stack_factory(settings, redis_dir=tiny_fs, appendfsync=appendfsync)
    port = int(settings["metrics.port"])  # type: ignore[call-overload]
    wait_ready(port, 200, 15)
    health = HealthWatch(port)
    subs, pubs = _traffic(stack)
    filler: Path | None = None
    try:
        _grows(pubs, 200, 15, "traffic before the disk filled up")
        filler = fill(tiny_fs)
        # Redis notices at its next AOF write (traffic makes one at once).
        body = wait_ready(port, 503, 8, naming="redis")
        if appendfsync == "everysec":
            # Redis 7 answers even PING with MISCONF while its last AOF write failed,
            # so the readiness probe's PING carries the reason.
            assert stack.redis.alive(), f"Redis should refuse writes, not exit: {body}"
            reason = str(body["reason"]).lower()
            assert "refuses" in reason and "aof" in reason, body
        else:
            wait_until(lambda: not stack.redis.alive(), 5, "redis-server exiting")
        # PUBACKs wait for Kafka, not Redis: publishers keep getting success.
        _grows(pubs, 150, 15, "Kafka-acknowledged traffic while the disk is full")
        time.sleep(1.0)
        code, body = http_get(port, "/ready")
        assert code == 503 and "redis" in str(body.get("reason")).lower(), (code, body)
        # The consumer holds the refused batch and retries it, committing nothing.
        assert "client batches failed, retrying" in stack.broker.log(), stack.broker.log()[-3000:]
        acked_while_full = {p.name: set(p.acked) for p in pubs}
        filler.unlink()
        filler = None
        if appendfsync == "always":
            stack.redis.start()  # the supervisor's part; the broker needs no help
        wait_ready(port, 200, 20)
        _grows(pubs, 200, 20, "traffic after space came back")
        for pub in pubs:
            pub.stop()
        for sub in subs:
            sub.wait_all(pubs, timeout=30)
            assert_ok(check(pubs, sub))
            for name, seqs in acked_while_full.items():
                assert seqs <= sub.seqs(name)
        statuses = health.stop()
        assert statuses and set(statuses) == {200}, statuses
        assert stack.broker.alive(), stack.broker.log()[-3000:]
        assert stack.broker.exit_codes == []
    finally:
        health.stop()
        for sub in subs:
            sub.close()
        for pub in pubs:
            pub.close()
        stack.broker.stop()
        stack.redis.stop()
        if filler is not None:
            with contextlib.suppress(OSError):
                filler.unlink()
