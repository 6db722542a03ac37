"""broker.auth: password file, hashing, the Authenticator, CONNECT through the sans-IO core,
and ``devicemq passwd`` (in-process; tests/e2e/test_security_auth.py runs it as a process)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from app import cli
from app.authentication import open_authenticator
from broker.auth import (
    Authenticator,
    AuthResult,
    PasswordFileError,
    certificate_identity,
    check_username,
    hash_password,
    parse_password_file,
    read_password_file,
    verify_password,
    write_password_file,
)
from broker.config import AuthSettings, ConfigError, Settings, load_settings
from broker.packets import (
    ConnAck,
    Connect,
    PingReq,
    PingResp,
    ReasonCode,
    SubAck,
    Subscribe,
    Subscription,
)
from tests.unit.core_harness import V5, V311, Client, Harness

# One hash for the whole module: each costs ~25 ms.
ALICE_PW = "correct horse"
ALICE_HASH = hash_password(ALICE_PW)


def password_file(tmp_path: Path, **users: str) -> Path:
    path = tmp_path / "passwd"
    write_password_file(path, users or {"alice": ALICE_HASH})
    return path


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Runner:
    """A run_blocking that counts hashes and can hold them back."""

    def __init__(self, deferred: bool = False) -> None:
        self.calls = 0
        self.deferred = deferred
        self.pending: list[tuple[Callable[[], bool], Callable[[bool], None]]] = []

    def __call__(self, work: Callable[[], bool], done: Callable[[bool], None]) -> None:
        self.calls += 1
        if self.deferred:
            self.pending.append((work, done))
        else:
            done(work())

    def finish(self) -> None:
        work, done = self.pending.pop(0)
        done(work())


def decide(auth: Authenticator, user: str | None, pw: bytes | None, cert: Any = None) -> AuthResult:
    results: list[AuthResult] = []
    auth.authenticate(user, pw, cert, results.append)
    assert len(results) == 1
    return results[0]


# ------------------------------------------------------------------ hashing and the file


def test_hash_is_salted_argon2id_and_verifies() -> None:
    other = hash_password(ALICE_PW)
    assert ALICE_HASH.startswith("$argon2id$v=19$m=19456,t=2,p=1$")
    assert other != ALICE_HASH  # a fresh salt each time
    assert verify_password(ALICE_HASH, ALICE_PW)
    assert verify_password(ALICE_HASH, ALICE_PW.encode())
    assert not verify_password(ALICE_HASH, "wrong")
    assert not verify_password("$argon2id$garbage", ALICE_PW)


def test_parse_password_file() -> None:
    text = f"# users\n\nalice:{ALICE_HASH}\n  bob:{ALICE_HASH}  \n# end\n"
    assert parse_password_file(text) == {"alice": ALICE_HASH, "bob": ALICE_HASH}


def test_password_file_inline_comments_like_the_acl() -> None:
    """One comment rule for both files (broker/watched_file.py): a hash followed by
    `` # note`` is the hash; it used to be the hash *and* the note, so alice could
    never log in and nothing said why."""
    text = f"alice:{ALICE_HASH}   # the admin\n   # indented\nbob:{ALICE_HASH}\t# x\n"
    assert parse_password_file(text) == {"alice": ALICE_HASH, "bob": ALICE_HASH}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("alice", "line 1: expected username:hash"),
        (":$argon2id$x", "line 1: expected username:hash"),
        ("# c\nalice:secret", "line 2: the hash of 'alice' is not an argon2 hash"),
        ("alice:$2b$12$bcrypt", "not an argon2 hash"),
        (f"alice:{ALICE_HASH} #", "line 1: the hash of 'alice' is not an argon2 hash"),
        (f"al #ice:{ALICE_HASH}", "line 1: 'al #ice': a user name cannot hold ' #'"),
        (f"a:{ALICE_HASH}\na:{ALICE_HASH}", "line 2: 'a' appears twice"),
    ],
)
def test_parse_password_file_errors_name_the_line(text: str, message: str) -> None:
    with pytest.raises(PasswordFileError, match=message):
        parse_password_file(text, "pw")


def test_write_password_file_is_0600_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "pw"
    write_password_file(path, {"alice": ALICE_HASH, "bob": ALICE_HASH})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_password_file(path) == {"alice": ALICE_HASH, "bob": ALICE_HASH}
    assert [p.name for p in tmp_path.iterdir()] == ["pw"]  # no temporary left behind


def test_read_password_file_missing(tmp_path: Path) -> None:
    with pytest.raises(PasswordFileError, match="cannot read"):
        read_password_file(tmp_path / "nope")


@pytest.mark.parametrize("name", ["", "a:b", "a\nb", " a", "#a", "a #b", "a\t#"])
def test_check_username_refuses(name: str) -> None:
    with pytest.raises(ValueError):
        check_username(name)


def test_certificate_identity() -> None:
    cert = {
        "subject": ((("countryName", "DE"),), (("commonName", "device-7"),)),
        "subjectAltName": (("IP Address", "10.0.0.1"), ("DNS", "d7.example"), ("email", "x@y")),
    }
    assert certificate_identity(cert, "cn") == "device-7"
    assert certificate_identity(cert, "san") == "d7.example"
    assert certificate_identity({"subjectAltName": (("email", "x@y"),)}, "san") == "x@y"
    assert certificate_identity({}, "cn") is None
    assert certificate_identity({}, "san") is None


def test_settings_defaults_and_env() -> None:
    auth = Settings().auth
    assert auth == AuthSettings(
        allow_anonymous=None,
        password_file="",
        acl_file="",
        use_identity_as_username=False,
        certificate_identity="cn",
        verify_cache_seconds=300.0,
    )
    env = {
        "DEVICEMQ_AUTH_ALLOW_ANONYMOUS": "false",
        "DEVICEMQ_AUTH_PASSWORD_FILE": "/etc/devicemq/passwd",
        "DEVICEMQ_AUTH_CERTIFICATE_IDENTITY": "SAN",
    }
    auth = load_settings(env=env).auth
    assert auth.allow_anonymous is False
    assert auth.password_file == "/etc/devicemq/passwd"
    assert auth.certificate_identity == "san"
    assert load_settings(env={"DEVICEMQ_AUTH_ALLOW_ANONYMOUS": "null"}).auth.allow_anonymous is None


# ------------------------------------------------------------------ the Authenticator


def test_anonymous_auto_allowed_without_password_file() -> None:
    auth = open_authenticator(AuthSettings())
    assert auth.allow_anonymous
    assert decide(auth, None, None) == AuthResult(True, None)
    # Without a password file nothing vouches for a user name: the client is anonymous.
    assert decide(auth, "anyone", b"anything") == AuthResult(True, None)


def test_anonymous_auto_refused_with_password_file(tmp_path: Path) -> None:
    auth = open_authenticator(AuthSettings(password_file=str(password_file(tmp_path))))
    assert not auth.allow_anonymous
    result = decide(auth, None, None)
    assert not result.ok and result.reason == 0x87
    explicit = open_authenticator(
        AuthSettings(password_file=str(password_file(tmp_path)), allow_anonymous=True)
    )
    assert decide(explicit, None, None).ok


def test_anonymous_refused_explicitly_without_file() -> None:
    auth = open_authenticator(AuthSettings(allow_anonymous=False))
    assert decide(auth, None, None).reason == 0x87
    assert decide(auth, "bob", b"x").reason == 0x86


def test_password_checks(tmp_path: Path) -> None:
    runner = Runner()
    auth = open_authenticator(
        AuthSettings(password_file=str(password_file(tmp_path)), allow_anonymous=True),
        run_blocking=runner,
    )
    assert decide(auth, "alice", ALICE_PW.encode()) == AuthResult(True, "alice")
    bad = decide(auth, "alice", b"wrong")
    assert not bad.ok and bad.reason == 0x86 and "wrong" not in bad.message
    # An unknown user costs a hash too (a dummy one), so timing tells nothing.
    calls = runner.calls
    unknown = decide(auth, "mallory", b"x")
    assert unknown.reason == 0x86 and runner.calls == calls + 1
    # A user name without a password never matches, even with anonymous allowed.
    assert decide(auth, "alice", None).reason == 0x86


def test_successful_verification_is_cached_for_a_while(tmp_path: Path) -> None:
    clock, runner = Clock(), Runner()
    path = password_file(tmp_path)
    auth = open_authenticator(
        AuthSettings(password_file=str(path), verify_cache_seconds=60), clock, runner
    )
    assert decide(auth, "alice", ALICE_PW.encode()).ok
    assert decide(auth, "alice", ALICE_PW.encode()).ok
    assert runner.calls == 1  # the second came from the cache
    # A wrong password is never answered from the cache, nor cached.
    assert not decide(auth, "alice", b"wrong").ok
    assert not decide(auth, "alice", b"wrong").ok
    assert runner.calls == 3
    clock.now += 61
    assert decide(auth, "alice", ALICE_PW.encode()).ok
    assert runner.calls == 4  # expired: verified again


def test_cache_off(tmp_path: Path) -> None:
    runner = Runner()
    settings = AuthSettings(password_file=str(password_file(tmp_path)), verify_cache_seconds=0)
    auth = open_authenticator(settings, run_blocking=runner)
    for _ in range(2):
        assert decide(auth, "alice", ALICE_PW.encode()).ok
    assert runner.calls == 2


def test_password_file_reloads_when_it_changes(tmp_path: Path) -> None:
    clock, runner = Clock(), Runner()
    path = password_file(tmp_path)
    auth = open_authenticator(AuthSettings(password_file=str(path)), clock, runner)
    assert decide(auth, "alice", ALICE_PW.encode()).ok
    write_password_file(path, {"bob": ALICE_HASH})
    os.utime(path, ns=(1, 1))  # make sure the mtime differs whatever the clock granularity
    # The server's sweep asks (edge/server.py), at most one look a second;
    # a password check itself never stats the file.
    assert decide(auth, "alice", ALICE_PW.encode()).ok
    clock.now += 0.5
    auth.maybe_reload()
    assert decide(auth, "alice", ALICE_PW.encode()).ok  # not noticed yet (and cached)
    clock.now += 1
    auth.maybe_reload()
    assert decide(auth, "alice", ALICE_PW.encode()).reason == 0x86  # cache cleared too
    assert decide(auth, "bob", ALICE_PW.encode()).ok
    # A broken file keeps the previous users.
    path.write_text("this is not a password file\n")
    clock.now += 2
    auth.maybe_reload()
    assert decide(auth, "bob", ALICE_PW.encode()).ok
    # A forced reload (SIGHUP) reads it even within the second.
    write_password_file(path, {"carol": ALICE_HASH})
    auth.maybe_reload(force=True)
    assert set(auth.users) == {"carol"}


def test_changed_hash_invalidates_cache(tmp_path: Path) -> None:
    clock, runner = Clock(), Runner()
    path = password_file(tmp_path)
    auth = open_authenticator(AuthSettings(password_file=str(path)), clock, runner)
    assert decide(auth, "alice", ALICE_PW.encode()).ok
    auth.users["alice"] = hash_password("new")  # as if the file were reloaded
    assert not decide(auth, "alice", ALICE_PW.encode()).ok


def test_bad_password_file_at_start_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"auth.password_file: .*cannot read"):
        open_authenticator(AuthSettings(password_file=str(tmp_path / "missing")))
    (tmp_path / "bad").write_text("alice:plain\n")
    with pytest.raises(ConfigError, match="line 1"):
        open_authenticator(AuthSettings(password_file=str(tmp_path / "bad")))


def test_certificate_identity_as_username(tmp_path: Path) -> None:
    settings = AuthSettings(
        password_file=str(password_file(tmp_path)), use_identity_as_username=True
    )
    auth = open_authenticator(settings)
    assert not auth.allow_anonymous
    cert = {"subject": ((("commonName", "device-7"),),)}
    # The certificate decides; a user name and password in CONNECT are ignored.
    assert decide(auth, "alice", b"wrong", cert) == AuthResult(True, "device-7")
    assert decide(auth, None, None, {"subject": ()}).reason == 0x87
    # Without a certificate (plain listener) the password file applies.
    assert decide(auth, "alice", ALICE_PW.encode()).ok
    san = open_authenticator(dataclasses.replace(settings, certificate_identity="san"))
    assert decide(san, None, None, {"subjectAltName": (("DNS", "d.example"),)}).username == (
        "d.example"
    )


async def test_verification_runs_in_a_thread_off_the_event_loop(tmp_path: Path) -> None:
    auth = open_authenticator(AuthSettings(password_file=str(password_file(tmp_path))))
    loop_thread = threading.get_ident()
    seen: list[int] = []
    original = auth.run_blocking

    def spy(work: Callable[[], bool], done: Callable[[bool], None]) -> None:
        def traced() -> bool:
            seen.append(threading.get_ident())
            return work()

        original(traced, done)

    auth.run_blocking = spy
    results: list[AuthResult] = []
    finished = asyncio.Event()

    def done(result: AuthResult) -> None:
        results.append(result)
        finished.set()

    auth.authenticate("alice", ALICE_PW.encode(), None, done)
    assert results == []  # not decided synchronously
    await asyncio.wait_for(finished.wait(), 5)
    assert results == [AuthResult(True, "alice")]
    assert seen and seen[0] != loop_thread
    auth.close()


# ------------------------------------------------------------------ CONNECT through the core


def auth_harness(tmp_path: Path, **auth: Any) -> Harness:
    auth.setdefault("password_file", str(password_file(tmp_path)))
    return Harness(dataclasses.replace(Settings(), auth=AuthSettings(**auth)))


def connect(
    client: Client, user: str | None = None, pw: bytes | None = None, cid: str = "c1"
) -> None:
    client.send(Connect(cid, protocol_level=client.level, username=user, password=pw))


@pytest.mark.parametrize(
    ("level", "user", "pw", "code", "reason"),
    [
        (V5, "alice", b"wrong", 0x86, "bad_user_name_or_password"),
        (V5, "nobody", b"x", 0x86, "bad_user_name_or_password"),
        (V5, None, None, 0x87, "not_authorized"),
        (V311, "alice", b"wrong", 4, "bad_user_name_or_password"),
        (V311, None, None, 5, "not_authorized"),
    ],
)
def test_connack_refusals(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    level: int,
    user: str | None,
    pw: bytes | None,
    code: int,
    reason: str,
) -> None:
    h = auth_harness(tmp_path)
    client = h.client(level)
    with caplog.at_level("INFO", "devicemq.connect"):
        connect(client, user, pw)
    assert client.read() == [ConnAck(False, code)]
    assert client.closed
    assert h.broker.stats.connections_rejected == {reason: 1}
    assert "c1" not in h.broker.sessions
    logged = caplog.text
    assert "refused" in logged and "wrong" not in logged
    if user:
        assert repr(user) in logged


@pytest.mark.parametrize("level", [V5, V311])
def test_right_password_connects(tmp_path: Path, level: int) -> None:
    h = auth_harness(tmp_path)
    client = h.client(level)
    connect(client, "alice", ALICE_PW.encode())
    connack = client.read_one()
    assert isinstance(connack, ConnAck) and connack.reason_code == 0
    assert client.conn.username == "alice"
    assert h.broker.acl.usernames == {}  # no ACL file: nothing to remember


def test_packets_sent_before_connack_wait_for_the_decision(tmp_path: Path) -> None:
    h = auth_harness(tmp_path)
    runner = Runner(deferred=True)
    h.broker.auth.run_blocking = runner
    client = h.client(V5)
    connect(client, "alice", ALICE_PW.encode())
    client.send(Subscribe(1, [Subscription("t", 1)]), PingReq())
    assert client.read() == []
    assert runner.pending
    runner.finish()
    packets = client.read()
    assert [type(p) for p in packets] == [ConnAck, SubAck, PingResp]
    # and then the connection works as usual
    client.send(PingReq())
    assert client.read() == [PingResp()]


def test_refused_connect_discards_what_followed(tmp_path: Path) -> None:
    h = auth_harness(tmp_path)
    runner = Runner(deferred=True)
    h.broker.auth.run_blocking = runner
    client = h.client(V5)
    connect(client, "alice", b"wrong")
    client.send(Subscribe(1, [Subscription("t", 1)]))
    runner.finish()
    assert client.read() == [ConnAck(False, 0x86)]
    assert client.closed
    assert h.broker.subscriptions.match("t").entries == []


def test_socket_closed_while_verifying(tmp_path: Path) -> None:
    h = auth_harness(tmp_path)
    runner = Runner(deferred=True)
    h.broker.auth.run_blocking = runner
    client = h.client(V5)
    connect(client, "alice", ALICE_PW.encode())
    client.conn.connection_lost()
    runner.finish()  # the late answer is ignored
    assert client.read() == []
    assert "c1" not in h.broker.sessions
    assert h.broker.stats.connections_rejected == {}  # a right password is no failure


def test_failed_check_of_a_closed_client_is_counted_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 19: attempts whose client hung up were neither logged nor counted."""
    h = auth_harness(tmp_path)
    runner = Runner(deferred=True)
    h.broker.auth.run_blocking = runner
    client = h.client(V5)
    connect(client, "alice", b"guess")
    client.conn.connection_lost()
    with caplog.at_level("INFO", "devicemq.connect"):
        runner.finish()
    assert h.broker.stats.connections_rejected == {"bad_user_name_or_password": 1}
    assert "'alice'" in caplog.text and "gone" in caplog.text


def queue_harness(tmp_path: Path, **auth: Any) -> tuple[Harness, Runner]:
    auth.setdefault("verify_threads", 1)
    h = auth_harness(tmp_path, **auth)
    runner = Runner(deferred=True)
    h.broker.auth.run_blocking = runner
    return h, runner


def attempt(h: Harness, source: str, password: bytes = b"guess", level: int = V5) -> Client:
    client = h.client(level, peer=f"{source}:1")
    client.conn.source = source
    connect(client, "alice", password, cid=f"c-{id(client)}")
    return client


def test_password_checks_per_source_are_rate_limited(tmp_path: Path) -> None:
    h, runner = queue_harness(tmp_path, max_verify_rate_per_source=2)
    first = [attempt(h, "6.6.6.6") for _ in range(2)]
    over = attempt(h, "6.6.6.6")
    assert over.read() == [ConnAck(False, ReasonCode.CONNECTION_RATE_EXCEEDED)]
    assert runner.calls == 1 and len(h.broker.auth._waiting) == 1  # no hash for it
    other = attempt(h, "10.0.0.1", ALICE_PW.encode())  # another address: its own budget
    assert h.broker.auth.pending == 3
    while runner.pending:
        runner.finish()
    assert [c.read() for c in first] == [[ConnAck(False, 0x86)]] * 2
    assert other.read_one().reason_code == 0  # type: ignore[attr-defined]
    assert h.broker.stats.connections_rejected == {
        "auth_rate_exceeded_per_source": 1,
        "bad_user_name_or_password": 2,
    }
    h.advance(0.5)  # one token back
    attempt(h, "6.6.6.6")
    assert runner.calls == 4


def test_full_queue_answers_server_busy_and_gone_clients_are_not_hashed(tmp_path: Path) -> None:
    h, runner = queue_harness(tmp_path, max_pending_verifications=2, max_verify_rate_per_source=0)
    hashing = attempt(h, "1.1.1.1")  # the one thread
    waiting = [attempt(h, f"2.2.2.{i}") for i in range(2)]  # the queue
    busy = attempt(h, "3.3.3.3")
    assert busy.read() == [ConnAck(False, ReasonCode.SERVER_BUSY)] and busy.closed
    old = attempt(h, "4.4.4.4", level=V311)
    assert old.read() == [ConnAck(False, 3)]  # 3.1.1: Server unavailable
    # A waiting client that hangs up frees its place for the next one...
    waiting[0].conn.connection_lost()
    late = attempt(h, "5.5.5.5", ALICE_PW.encode())
    assert late.read() == []  # queued, not refused
    # ...and is never hashed.
    while runner.pending:
        runner.finish()
    assert runner.calls == 3  # hashing, waiting[1], late
    assert hashing.read() == [ConnAck(False, 0x86)]
    assert late.read_one().reason_code == 0  # type: ignore[attr-defined]
    assert h.broker.stats.connections_rejected == {
        "server_busy": 2,
        "auth_abandoned": 1,
        "bad_user_name_or_password": 2,
    }
    assert h.broker.auth.pending == 0


def test_client_gone_while_waiting_is_skipped_when_its_turn_comes(tmp_path: Path) -> None:
    h, runner = queue_harness(tmp_path, max_verify_rate_per_source=0)
    attempt(h, "1.1.1.1")
    gone = [attempt(h, "2.2.2.2") for _ in range(5)]
    for client in gone:
        client.conn.connection_lost()
    runner.finish()
    assert runner.calls == 1 and h.broker.auth.pending == 0
    assert h.broker.stats.connections_rejected == {
        "bad_user_name_or_password": 1,
        "auth_abandoned": 5,
    }


def test_cached_login_needs_no_thread_and_no_token(tmp_path: Path) -> None:
    h, runner = queue_harness(tmp_path, max_verify_rate_per_source=1, max_pending_verifications=1)
    first = attempt(h, "7.7.7.7", ALICE_PW.encode())
    runner.finish()
    assert first.read_one().reason_code == 0  # type: ignore[attr-defined]
    attempt(h, "8.8.8.8")  # hashing
    attempt(h, "8.8.8.9")  # waiting: the queue is full
    again = attempt(h, "7.7.7.7", ALICE_PW.encode())  # rate used up, queue full: cached
    assert again.read_one().reason_code == 0  # type: ignore[attr-defined]


def test_initial_user_creates_a_missing_password_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """docker-compose.yml starts with authentication on: the password file is made
    from DEVICEMQ_AUTH_INITIAL_USER / _PASSWORD when it does not exist yet."""
    from broker.config import load_settings

    path = tmp_path / "passwd"
    env = {
        "DEVICEMQ_AUTH_PASSWORD_FILE": str(path),
        "DEVICEMQ_AUTH_INITIAL_USER": "admin",
        "DEVICEMQ_AUTH_INITIAL_PASSWORD": "s3cret-from-env",
    }
    settings = load_settings(env=env)
    assert "s3cret" not in repr(settings)  # a debug log of the settings does not show it
    with caplog.at_level("DEBUG"):
        auth = open_authenticator(settings.auth)
    assert "s3cret" not in caplog.text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "s3cret" not in path.read_text()
    assert decide(auth, "admin", b"s3cret-from-env").ok
    assert not auth.allow_anonymous
    # An existing file is left alone: a changed password in the environment does nothing.
    changed = dict(env, DEVICEMQ_AUTH_INITIAL_PASSWORD="other")
    again = open_authenticator(load_settings(env=changed).auth)
    assert decide(again, "admin", b"s3cret-from-env").ok
    assert not decide(again, "admin", b"other").ok


def test_initial_user_without_password_is_a_config_error(tmp_path: Path) -> None:
    settings = AuthSettings(password_file=str(tmp_path / "pw"), initial_user="admin")
    with pytest.raises(ConfigError, match=r"auth\.initial_password"):
        open_authenticator(settings)
    bad = AuthSettings(password_file=str(tmp_path / "pw"), initial_user="a:b", initial_password="x")
    with pytest.raises(ConfigError, match=r"auth\.initial_user"):
        open_authenticator(bad)
    assert not (tmp_path / "pw").exists()


def test_verify_threads_default_leaves_a_core() -> None:
    from broker.auth import verify_threads

    cpus = os.cpu_count() or 1
    assert verify_threads(0) == max(1, min(4, cpus - 1))
    assert verify_threads(3) == 3


def test_connect_timeout_covers_a_slow_verification(tmp_path: Path) -> None:
    h = auth_harness(tmp_path)
    runner = Runner(deferred=True)
    h.broker.auth.run_blocking = runner
    client = h.client(V5)
    connect(client, "alice", ALICE_PW.encode())
    h.advance(h.broker.settings.mqtt.connect_timeout + 1)
    assert client.closed
    runner.finish()
    assert client.read() == []


def test_flood_while_verifying_closes(tmp_path: Path) -> None:
    h = auth_harness(tmp_path)
    h.broker.auth.run_blocking = Runner(deferred=True)
    client = h.client(V5)
    connect(client, "alice", ALICE_PW.encode())
    junk = bytes([0xC0, 0x00]) * (h.broker.settings.mqtt.max_packet_size + 1)  # PINGREQs
    client.send_raw(junk)
    assert client.closed
    assert h.broker.stats.connections_rejected == {"flood_before_connack": 1}


def test_certificate_on_the_connection(tmp_path: Path) -> None:
    h = auth_harness(tmp_path, use_identity_as_username=True)
    client = h.client(V5)
    client.conn.peer_certificate = {"subject": ((("commonName", "device-7"),),)}
    connect(client, cid="device-7")
    connack = client.read_one()
    assert isinstance(connack, ConnAck) and connack.reason_code == 0
    assert client.conn.username == "device-7"
    other = h.client(V5)  # no certificate, no password
    connect(other, cid="x")
    assert other.read() == [ConnAck(False, 0x87)]


# ------------------------------------------------------------------ devicemq passwd


def run_cli(monkeypatch: pytest.MonkeyPatch, *argv: str, stdin: str = "") -> int:
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    return cli.main(["passwd", *argv])


def test_passwd_is_a_command() -> None:
    assert "passwd" in cli.COMMANDS


def test_passwd_stdin_add_change_delete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "sub" / "pw"
    path.parent.mkdir()
    assert run_cli(monkeypatch, "--password-stdin", str(path), "alice", stdin="s3cret\n") == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    users = read_password_file(path)
    assert verify_password(users["alice"], "s3cret")
    assert run_cli(monkeypatch, "--password-stdin", str(path), "bob", stdin="b\n") == 0
    assert run_cli(monkeypatch, "--password-stdin", str(path), "alice", stdin="new\n") == 0
    users = read_password_file(path)
    assert list(users) == ["alice", "bob"] and verify_password(users["alice"], "new")
    assert run_cli(monkeypatch, "-D", str(path), "alice") == 0
    assert list(read_password_file(path)) == ["bob"]
    assert run_cli(monkeypatch, "-D", str(path), "alice") == 1  # not there


def test_passwd_prompts_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    answers = iter(["pw1", "pw1", "a", "b"])
    monkeypatch.setattr("getpass.getpass", lambda prompt="": next(answers))
    path = tmp_path / "pw"
    assert cli.main(["passwd", str(path), "alice"]) == 0
    assert verify_password(read_password_file(path)["alice"], "pw1")
    assert cli.main(["passwd", str(path), "bob"]) == 1  # mismatch
    assert list(read_password_file(path)) == ["alice"]


def test_passwd_batch_warns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "pw"
    assert run_cli(monkeypatch, "-b", str(path), "alice", "pw") == 0
    assert "prefer --password-stdin" in capsys.readouterr().err
    assert verify_password(read_password_file(path)["alice"], "pw")


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["FILE", "alice", "pw"], 2),  # a password without -b
        (["-b", "FILE", "alice"], 2),  # -b without a password
        (["--password-stdin", "FILE", "a:b"], 2),  # ':' in a user name
        (["--password-stdin", "FILE", "alice"], 1),  # empty password
    ],
)
def test_passwd_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], code: int
) -> None:
    argv = [str(tmp_path / "pw") if a == "FILE" else a for a in argv]
    assert run_cli(monkeypatch, *argv, stdin="\n") == code
    assert not (tmp_path / "pw").exists()


def test_passwd_refuses_a_broken_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "pw"
    path.write_text("garbage\n")
    assert run_cli(monkeypatch, "--password-stdin", str(path), "alice", stdin="x\n") == 1
    assert path.read_text() == "garbage\n"
