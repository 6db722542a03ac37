"""Authentication: who may connect (SECURITY.md "Authentication").

Four ways in, decided per CONNECT by :class:`Authenticator`:

- a TLS client certificate, when ``auth.use_identity_as_username`` is on and
  the listener put the peer's certificate on the connection
  (``MQTTConnection.peer_certificate``): its CN or first SAN is the user name;
- a user name and password checked against the password file;
- a user name the password file does not hold, decided by the members of
  ``auth.chain`` in order (:mod:`broker.external_auth`: an HTTP service, a JWT);
- no user name at all (anonymous), if ``auth.allow_anonymous`` allows it.

The password file holds one ``username:hash`` per line, ``#`` comments (the
rule of :mod:`broker.watched_file`, as in the ACL file) and blank lines
allowed; a hash is an argon2id PHC string
(``$argon2id$v=19$m=19456,t=2,p=1$salt$hash``) made by ``devicemq passwd``.

Verifying an argon2 hash costs tens of milliseconds of CPU by design, far too
long to spend on the event loop. The check is therefore asynchronous: the
sans-IO core asks :meth:`Authenticator.authenticate` and gets the decision
through a callback, called at once when no hashing is needed (anonymous,
unknown file, a recently verified password) and otherwise from a worker
thread's completion on the event loop (``run_blocking``). Without a running
event loop (the sans-IO tests) the hash is verified inline.

Hashing is bounded before it starts (SECURITY.md "Hash cost and the event
loop"): ``auth.max_verify_rate_per_source`` hashes a second per address (over:
0x9F), ``auth.verify_threads`` at once and ``auth.max_pending_verifications``
waiting (a full queue: 0x89 Server busy at once); a check whose client is
gone before a thread takes it is not computed.

With a password file and ``auth.chain``, a name the file does not hold that
the chain refuses (0x86) costs a dummy hash under the same bounds before the
answer, so neither the work nor the bounds' answer tells the file's names
(SECURITY.md "External authentication").

Successful verifications are remembered for ``auth.verify_cache_seconds``
keyed by user and stored hash, as an HMAC of the password under a key that
lives only in this process, compared in constant time; a changed password
file entry invalidates them. A wrong password is never cached, so every
failed attempt costs the full hash.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import hmac
import logging
import os
import secrets
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError

from broker.acl import Grant
from broker.config import AuthSettings
from broker.external_auth import ChainMember, Credentials, Verdict, certificate_subject
from broker.limits import SourceBuckets
from broker.packets import ReasonCode
from broker.watched_file import FileChangeWatch, content_lines, has_comment_marker

__all__ = [
    "AuthResult",
    "Authenticator",
    "PasswordFileError",
    "certificate_identity",
    "hash_password",
    "parse_password_file",
    "read_password_file",
    "verify_password",
    "write_password_file",
]

log = logging.getLogger("devicemq.auth")

# argon2id with OWASP's minimum (m=19 MiB, t=2, p=1): ~25 ms per verify on the
# development machine, against ~150 ms for argon2-cffi's default (64 MiB, t=3,
# p=4). Either is too slow for the event loop, so verification runs in
# threads anyway; the cheaper one keeps a reconnect storm of thousands of
# devices to seconds of CPU rather than minutes, and memory per concurrent
# check at 19 MiB. Existing hashes keep the parameters they were made with.
_HASHER = PasswordHasher(time_cost=2, memory_cost=19 * 1024, parallelism=1)
HASH_PREFIX = "$argon2"
MAX_CACHE_ENTRIES = 100_000

BlockingRunner = Callable[[Callable[[], bool], Callable[[bool], None]], None]


class PasswordFileError(ValueError):
    """A password file that cannot be used; the message names the line."""


# --------------------------------------------------------------------------
# Hashing and the file format
# --------------------------------------------------------------------------


def hash_password(password: str | bytes) -> str:
    """A new salted argon2id PHC string for ``password``."""
    return _HASHER.hash(password)


def verify_password(stored_hash: str, password: str | bytes) -> bool:
    """Whether ``password`` matches ``stored_hash`` (constant time in argon2)."""
    try:
        return _HASHER.verify(stored_hash, password)
    except (VerifyMismatchError, VerificationError, InvalidHashError):
        return False


def check_username(username: str) -> None:
    """Raise ValueError if ``username`` cannot be stored in a password file."""
    if not username:
        raise ValueError("the user name is empty")
    if ":" in username or any(ch in username for ch in "\r\n\x00"):
        raise ValueError("a user name cannot contain ':', a newline or NUL")
    if username != username.strip() or username.startswith("#"):
        raise ValueError("a user name cannot start with '#' or begin or end with spaces")
    if has_comment_marker(username):
        raise ValueError("a user name cannot hold a '#' after a space (it reads as a comment)")


def parse_password_file(text: str, source: str = "password file") -> dict[str, str]:
    """``{username: hash}`` from the file's text; PasswordFileError names the bad line.

    Comments follow the one rule of :mod:`broker.watched_file`: a line starting
    with ``#``, or `` # `` (whitespace on both sides) to the end of a line.
    """
    users: dict[str, str] = {}
    for number, line in content_lines(text):
        username, colon, stored = line.partition(":")
        where = f"{source}: line {number}"
        if not colon or not username:
            raise PasswordFileError(f"{where}: expected username:hash")
        if has_comment_marker(username):
            raise PasswordFileError(f"{where}: {username!r}: a user name cannot hold ' #'")
        if not stored.startswith(HASH_PREFIX) or any(ch.isspace() for ch in stored):
            raise PasswordFileError(f"{where}: the hash of {username!r} is not an argon2 hash")
        if username in users:
            raise PasswordFileError(f"{where}: {username!r} appears twice")
        users[username] = stored
    return users


def read_password_file(path: str | Path) -> dict[str, str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PasswordFileError(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from e
    return parse_password_file(text, str(path))


def write_password_file(path: str | Path, users: Mapping[str, str]) -> None:
    """Replace the file atomically, readable by its owner only (mode 0600)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("# devicemq password file: username:argon2id-hash (devicemq passwd)\n")
            for username, stored in users.items():
                f.write(f"{username}:{stored}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------
# Certificates
# --------------------------------------------------------------------------


def certificate_identity(cert: Mapping[str, Any], kind: str) -> str | None:
    """The user name a certificate stands for: subject CN, or first DNS/email SAN.

    ``cert`` is what ``ssl.SSLSocket.getpeercert()`` returns.
    """
    if kind == "san":
        for key, value in cert.get("subjectAltName", ()):
            if key in ("DNS", "email") and value:
                return str(value)
        return None
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName" and value:
                return str(value)
    return None


# --------------------------------------------------------------------------
# The decision
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AuthResult:
    """The answer to one CONNECT: accepted as ``username``, or refused with ``reason``.

    ``counter`` names the rejected-connections reason a refusal is counted
    under when the reason code alone would not tell (default: the code's name).
    ``grant``: the client's own ACL rules, from auth.chain.
    """

    ok: bool
    username: str | None = None
    reason: ReasonCode = ReasonCode.SUCCESS
    message: str = ""
    counter: str = ""
    grant: Grant | None = None


def _refused(reason: ReasonCode, message: str) -> AuthResult:
    return AuthResult(False, None, reason, message)


@dataclass(slots=True)
class _CacheEntry:
    stored_hash: str
    digest: bytes
    expires_at: float


@dataclass(slots=True)
class _Check:
    """A password check waiting for a verify thread."""

    work: Callable[[], bool]
    finished: Callable[[bool], None]
    alive: Callable[[], bool]  # False once its client is gone: not worth a hash any more
    abandoned: Callable[[], None]


def verify_threads(setting: int) -> int:
    """auth.verify_threads: the setting, or with 0 one less than the CPUs (1 to 4), so
    a flood of password checks leaves a core to the event loop."""
    if setting > 0:
        return setting
    return max(1, min(4, (os.cpu_count() or 1) - 1))


class Authenticator:
    """Decides CONNECTs from the ``auth`` settings; see the module docstring."""

    def __init__(
        self,
        settings: AuthSettings,
        clock: Callable[[], float] = time.monotonic,
        run_blocking: BlockingRunner | None = None,
        *,
        users: Mapping[str, str] | None = None,
        chain: Sequence[ChainMember] | None = None,
    ) -> None:
        """``users``: the password file as read, ``chain``: auth.chain's members as built;
        both by the composition root (app/authentication.py ``open_authenticator``),
        which does the file and network set-up; this class only decides, and
        re-reads the password file when it changes."""
        self.settings = settings
        self.clock = clock
        self.run_blocking: BlockingRunner = run_blocking or self._run_in_thread
        self.password_path = Path(settings.password_file) if settings.password_file else None
        self.allow_anonymous = settings.allow_anonymous
        if (settings.password_file and users is None) or (settings.chain_members and not chain):
            raise ValueError(
                "auth.password_file and auth.chain are set up at the composition root: "
                "build the Authenticator with app.authentication.open_authenticator"
            )
        self.chain: list[ChainMember] = list(chain or ())
        if self.allow_anonymous is None:  # auto: only while nothing else can log in
            self.allow_anonymous = (
                self.password_path is None
                and not settings.use_identity_as_username
                and not self.chain
            )
        self.users: dict[str, str] = dict(users or {})
        self._watch: FileChangeWatch | None = None
        self._cache: dict[str, _CacheEntry] = {}
        self._cache_key = secrets.token_bytes(32)  # never leaves this process
        self._dummy_hash: str | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        # Password checks: at most `threads` hashing, `max_pending_verifications`
        # waiting for one, `max_verify_rate_per_source` a second from one address.
        self.threads = verify_threads(settings.verify_threads)
        self._running = 0
        self._waiting: deque[_Check] = deque()
        rate = settings.max_verify_rate_per_source
        self._verify_by_source = SourceBuckets(rate) if rate > 0 else None
        if self.password_path is not None:
            self._watch = FileChangeWatch(self.password_path, clock)
            log.info("%d users in %s", len(self.users), self.password_path)
        if self.allow_anonymous and settings.allow_anonymous is None:
            log.warning(
                "no authentication configured: every client is accepted; set "
                "auth.password_file before exposing devicemq (SECURITY.md)"
            )

    # -- the password file ---------------------------------------------------------------

    def maybe_reload(self, force: bool = False) -> None:
        """Re-read the password file, and auth.chain's key files, if they changed (at
        most one stat a second each)."""
        for member in self.chain:
            try:
                member.maybe_reload(force)
            except Exception as e:  # a bug: the member's keys stay, the file still reloads
                log.error("auth.chain %s: not reloaded: %s: %s", member.name, type(e).__name__, e)
        if self._watch is None or not self._watch.changed(force):
            return
        try:
            users = read_password_file(self._watch.path)
        except PasswordFileError as e:
            log.error("password file not reloaded, the previous one stays in force: %s", e)
            return
        self.users = users
        self._cache.clear()
        log.info("password file reloaded: %d users in %s", len(users), self.password_path)

    # -- deciding ------------------------------------------------------------------------

    def authenticate(
        self,
        username: str | None,
        password: bytes | None,
        peer_certificate: Mapping[str, Any] | None,
        done: Callable[[AuthResult], None],
        source: str = "",
        alive: Callable[[], bool] | None = None,
        client_id: str = "",
        address: str = "",
    ) -> None:
        """Decide a CONNECT; ``done`` is called now or later, exactly once.

        ``source`` is the client's address (:func:`broker.limits.source_key`) for
        ``auth.max_verify_rate_per_source``; ``alive`` tells whether the client
        still waits for the answer: a check whose client is gone before a
        thread takes it up is not computed (``done`` gets a refusal counted as
        ``auth_abandoned``). ``client_id`` and ``address`` (the peer's IP address)
        are for auth.chain.
        """
        settings = self.settings
        if settings.use_identity_as_username and peer_certificate is not None:
            identity = certificate_identity(peer_certificate, settings.certificate_identity)
            if identity is None:
                done(_refused(ReasonCode.NOT_AUTHORIZED, "the certificate names nobody"))
            else:
                done(AuthResult(True, identity))
            return
        if username is None:
            if self.allow_anonymous:
                done(AuthResult(True, None))
            else:
                done(_refused(ReasonCode.NOT_AUTHORIZED, "anonymous clients are not allowed"))
            return
        if self.chain and username not in self.users:
            # A user of the password file is the file's alone; any other, the chain's.
            credentials = Credentials(
                client_id, username, password, address, certificate_subject(peer_certificate)
            )
            costly = self._as_costly(username, password, source, alive, done)
            self._ask_chain(0, credentials, source, costly)
            return
        if self.password_path is None:
            # No password file: nothing vouches for the name, so the client is
            # anonymous (it must not claim a user's ACL rules).
            if self.allow_anonymous:
                done(AuthResult(True, None))
            else:
                done(_refused(ReasonCode.BAD_USER_NAME_OR_PASSWORD, "no password file"))
            return
        bad = _refused(ReasonCode.BAD_USER_NAME_OR_PASSWORD, f"bad password for {username!r}")
        if password is None:
            done(_refused(ReasonCode.BAD_USER_NAME_OR_PASSWORD, f"no password for {username!r}"))
            return
        stored = self.users.get(username)
        digest = hmac.new(self._cache_key, password, hashlib.sha256).digest()
        if stored is not None and self._cached(username, stored, digest):
            done(AuthResult(True, username))
            return
        if stored is None:
            bad = _refused(ReasonCode.BAD_USER_NAME_OR_PASSWORD, f"unknown user {username!r}")

        def verify() -> bool:
            # An unknown user costs the same hash time (against a dummy hash,
            # made in the worker too), so timing does not tell which names exist.
            return verify_password(stored if stored is not None else self._dummy(), password)

        def verified(ok: bool) -> None:
            if ok and stored is not None:
                self._remember(username, stored, digest)
                done(AuthResult(True, username))
            else:
                done(bad)

        self._hash(verify, verified, username, source, alive, done)

    def _hash(
        self,
        work: Callable[[], bool],
        finished: Callable[[bool], None],
        username: str,
        source: str,
        alive: Callable[[], bool] | None,
        done: Callable[[AuthResult], None],
    ) -> None:
        """Run ``work``, a full hash, in a verify thread; ``finished`` gets its result,
        or ``done`` the refusal of the bounds in front of it: per address, then the
        threads and the queue. Refusals by the bounds cost no hash."""
        by_source = self._verify_by_source
        if by_source is not None and not by_source.take(source, self.clock()):
            done(
                AuthResult(
                    False,
                    None,
                    ReasonCode.CONNECTION_RATE_EXCEEDED,
                    "too many password checks from its address",
                    "auth_rate_exceeded_per_source",
                )
            )
            return

        def abandoned() -> None:
            done(
                AuthResult(
                    False,
                    None,
                    ReasonCode.UNSPECIFIED_ERROR,
                    f"gone before the password of {username!r} was checked",
                    "auth_abandoned",
                )
            )

        check = _Check(work, finished, alive or _always, abandoned)
        if not self._queue(check):
            done(
                AuthResult(
                    False,
                    None,
                    ReasonCode.SERVER_BUSY,
                    f"{len(self._waiting)} password checks already waiting",
                )
            )

    def _as_costly(
        self,
        username: str,
        password: bytes | None,
        source: str,
        alive: Callable[[], bool] | None,
        done: Callable[[AuthResult], None],
    ) -> Callable[[AuthResult], None]:
        """``done`` for the chain's answer, so that a name the password file does not
        hold is refused at the cost of a file user's wrong password: with a password
        file, a 0x86 refusal of a CONNECT with a password is answered only after a
        hash against the dummy, under the same per-address bound, threads and queue
        (over the bound: 0x9F, as for a file user). Otherwise neither the time nor
        the limit's answer would tell a file's user from any other name."""
        if self.password_path is None or password is None:
            return done  # no names to tell apart; without a password no hash either

        def answered(result: AuthResult) -> None:
            if result.ok or result.reason != ReasonCode.BAD_USER_NAME_OR_PASSWORD:
                done(result)
                return

            def verify() -> bool:
                return verify_password(self._dummy(), password)

            self._hash(verify, lambda _: done(result), username, source, alive, done)

        return answered

    # -- auth.chain ----------------------------------------------------------------------

    def _ask_chain(
        self, index: int, credentials: Credentials, source: str, done: Callable[[AuthResult], None]
    ) -> None:
        """Ask member ``index``; one that does not decide passes to the next."""
        if index == len(self.chain):
            done(
                _refused(
                    ReasonCode.BAD_USER_NAME_OR_PASSWORD,
                    f"no auth.chain member vouches for {credentials.username!r}",
                )
            )
            return
        member = self.chain[index]

        def answered(verdict: Verdict | None) -> None:
            if verdict is None:
                self._ask_chain(index + 1, credentials, source, done)
                return
            message = f"auth.chain {member.name}: {verdict.message}" if verdict.message else ""
            if verdict.ok:  # (a fail-open acceptance is logged by its member, rate-limited)
                done(AuthResult(True, credentials.username, grant=verdict.grant))
            else:
                done(AuthResult(False, None, verdict.reason, message, verdict.counter))

        try:
            member.check(credentials, source, answered)
        except Exception:  # a bug, not the client's doing: refused, never let in
            log.exception("auth.chain %s failed", member.name)
            done(
                AuthResult(
                    False,
                    None,
                    ReasonCode.UNSPECIFIED_ERROR,
                    f"auth.chain {member.name} failed",
                    "auth_chain_failed",
                )
            )

    # -- the queue of password checks ------------------------------------------------------

    @property
    def pending(self) -> int:
        """Password checks hashing or waiting for a thread."""
        return self._running + len(self._waiting)

    def _queue(self, check: _Check) -> bool:
        """Start ``check`` or queue it; False if the queue is full (nothing done)."""
        if self._running < self.threads:
            self._start(check)
            return True
        waiting = self._waiting
        if len(waiting) >= self.settings.max_pending_verifications:
            # Checks whose clients left free their places before anyone is refused.
            gone = [c for c in waiting if not c.alive()]
            if not gone:
                return False
            self._waiting = deque(c for c in waiting if c.alive())
            for c in gone:
                c.abandoned()
        self._waiting.append(check)
        return True

    def _start(self, check: _Check) -> None:
        self._running += 1

        def finished(ok: bool) -> None:
            self._running -= 1
            try:
                check.finished(ok)
            finally:
                self._start_waiting()

        self.run_blocking(check.work, finished)

    def _start_waiting(self) -> None:
        while self._waiting and self._running < self.threads:
            check = self._waiting.popleft()
            if check.alive():
                self._start(check)
            else:
                check.abandoned()

    def _dummy(self) -> str:
        if self._dummy_hash is None:
            self._dummy_hash = hash_password(secrets.token_bytes(16))
        return self._dummy_hash

    def _cached(self, username: str, stored: str, digest: bytes) -> bool:
        entry = self._cache.get(username)
        if entry is None:
            return False
        if entry.expires_at <= self.clock() or entry.stored_hash != stored:
            del self._cache[username]
            return False
        return hmac.compare_digest(entry.digest, digest)

    def _remember(self, username: str, stored: str, digest: bytes) -> None:
        ttl = self.settings.verify_cache_seconds
        if ttl <= 0:
            return
        cache = self._cache
        cache.pop(username, None)
        if len(cache) >= MAX_CACHE_ENTRIES:
            del cache[next(iter(cache))]  # the oldest insertion
        cache[username] = _CacheEntry(stored, digest, self.clock() + ttl)

    # -- running the hash off the event loop ---------------------------------------------

    def _run_in_thread(self, work: Callable[[], bool], done: Callable[[bool], None]) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (sans-IO use): verify inline
            done(_safely(work))
            return
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                self.threads, thread_name_prefix="devicemq-auth"
            )
        future = loop.run_in_executor(self._executor, _safely, work)

        def finished(f: asyncio.Future[bool]) -> None:
            done(not f.cancelled() and f.exception() is None and f.result())

        future.add_done_callback(finished)

    def close(self) -> None:
        for member in self.chain:
            member.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def _always() -> bool:
    return True


def _safely(work: Callable[[], bool]) -> bool:
    try:
        return work()
    except Exception:
        log.exception("password verification failed")
        return False
