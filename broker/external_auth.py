"""External authentication: the members of ``auth.chain`` (SECURITY.md "External
authentication"), asked in order for a user the password file does not hold.

- ``http``: the CONNECT is POSTed as JSON to ``auth.http_url``; the status
  decides (2xx allowed, 403 not authorized, other 4xx bad credentials), and
  a 2xx answer's ``"result"`` (allow, deny, ignore) overrides it
  (``auth.http_result``). A 2xx answer may carry the client's own ACL rules.
  Anything else (5xx, 3xx, no answer) decides nothing: the service is asked
  a probe that carries no client's input, and only a probe that fails too
  says the service is down (``auth.http_fail_open``). The request runs in a
  thread of its own, the decision comes back on the event loop: other
  clients are served meanwhile.
- ``jwt``: a password that is a JWT is verified (HS256 with a secret file,
  RS256/ES256 with a JWKS file, both re-read when they change) and its
  claims checked; any other password goes on to the next member.

A member answers a :class:`Verdict` through a callback, or ``None``: not its
to decide, ask the next one. Nothing here logs a password or a token.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import hmac
import http.client
import json
import logging
import secrets
import socket
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import SplitResult, urlsplit

import jwt

from broker.acl import AclError, Grant, parse_granted_rules
from broker.config import AuthSettings, ConfigError
from broker.limits import LogLimiter, SourceBuckets
from broker.packets import ReasonCode
from broker.watched_file import FileChangeWatch

__all__ = [
    "CHAIN_MEMBERS",
    "ChainMember",
    "Credentials",
    "HttpMember",
    "JwtMember",
    "Verdict",
    "build_chain",
    "certificate_subject",
]

log = logging.getLogger("devicemq.auth")

MAX_ANSWER_BYTES = 64 * 1024  # a longer answer from http_url is not understood
PROBE_FRESH = 1.0  # seconds a probe's finding (the service reachable or down) stands
# What the probe sends: a CONNECT of nobody, no client's input in it.
PROBE_BODY = json.dumps(
    {
        "client_id": "",
        "username": "",
        "password": None,
        "peer_address": "",
        "certificate_subject": None,
    }
).encode()
STOPPING = ("aborted", "the broker is stopping")  # outcomes of close(), not of the service
RESULTS = ("allow", "deny", "ignore")  # a 2xx answer's "result", as EMQX's HTTP auth reads it
MIN_SECRET_BYTES = 32  # HS256 keys as long as the hash (RFC 7518 3.2)
JWKS_ALGORITHMS = ("RS256", "ES256")


@dataclass(frozen=True, slots=True)
class Credentials:
    """What a CONNECT says about who it is, as the chain sees it."""

    client_id: str
    username: str
    password: bytes | None
    address: str  # the peer's IP address
    certificate_subject: str | None  # "CN=dev1,O=Acme" when it presented a certificate


@dataclass(frozen=True, slots=True)
class Verdict:
    """A member's decision: allowed (with the client's own rules, if any) or refused with
    ``reason``; ``counter``: the rejected-connections reason, when the code alone does
    not tell."""

    ok: bool
    reason: ReasonCode = ReasonCode.SUCCESS
    message: str = ""
    grant: Grant | None = None
    counter: str = ""


Answer = Callable[[Verdict | None], None]


class ChainMember(Protocol):
    name: str

    def check(self, credentials: Credentials, source: str, answer: Answer) -> None:
        """Call ``answer`` once, now or later: a Verdict, or None for the next member."""

    def maybe_reload(self, force: bool = False) -> None: ...

    def close(self) -> None: ...


def _denied(reason: ReasonCode, message: str) -> Verdict:
    return Verdict(False, reason, message)


_SHORT_NAMES = {
    "commonName": "CN",
    "organizationName": "O",
    "organizationalUnitName": "OU",
    "countryName": "C",
    "localityName": "L",
    "stateOrProvinceName": "ST",
    "domainComponent": "DC",
}


def _escape(value: str) -> str:
    """An attribute value escaped as RFC 4514 2.4 asks: ``, + " \\ < > ;`` anywhere,
    ``#`` or a space first, a space last, NUL as ``\\00``."""
    out = []
    for i, ch in enumerate(value):
        if ch in ',+"\\<>;' or (i == 0 and ch in "# ") or (i == len(value) - 1 and ch == " "):
            out.append("\\" + ch)
        elif ch == "\0":
            out.append("\\00")
        else:
            out.append(ch)
    return "".join(out)


def certificate_subject(cert: Mapping[str, Any] | None) -> str | None:
    """A certificate's subject as ``CN=dev1,O=Acme`` (its own order), from what
    ``ssl.SSLSocket.getpeercert()`` returns; None without one. Values are escaped
    as RFC 4514 does and the attributes of a multi-valued RDN joined with ``+``, so
    two different subjects never give the same text."""
    if not cert:
        return None
    rdns = [
        "+".join(f"{_SHORT_NAMES.get(key, key)}={_escape(str(value))}" for key, value in rdn)
        for rdn in cert.get("subject", ())
    ]
    return ",".join(rdns) or None


# --------------------------------------------------------------------------
# jwt
# --------------------------------------------------------------------------


def _read_secret(path: str) -> bytes:
    try:
        secret = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    secret = secret.rstrip(b"\r\n")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"{path}: the secret has {len(secret)} bytes, HS256 needs at least {MIN_SECRET_BYTES}"
        )
    return secret


def _read_jwks(path: str) -> dict[str | None, jwt.PyJWK]:
    """The keys of a JWKS file by ``kid`` (None: a key without one); ValueError says
    what is wrong with it."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"{path}: not JSON: nested too deeply") from None
    keys = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(keys, list) or not keys:
        raise ValueError(f'{path}: expected a JWKS, {{"keys": [...]}} with at least one key')
    found: dict[str | None, jwt.PyJWK] = {}
    for number, entry in enumerate(keys):
        kid = entry.get("kid") if isinstance(entry, dict) else None
        name = f"{path}: key {number}" + (f" ({kid!r})" if isinstance(kid, str) else "")
        if not isinstance(entry, dict):
            raise ValueError(f"{name}: not a JSON object")
        if kid is not None and not isinstance(kid, str):
            raise ValueError(f"{name}: its kid is {type(kid).__name__}, not a string")
        if "d" in entry:  # a private key: the broker needs only the public half
            raise ValueError(f"{name}: holds a private key; publish the public keys only")
        try:
            key = jwt.PyJWK.from_dict(entry)
        except Exception as e:  # PyJWTError, and a TypeError/ValueError on odd members
            raise ValueError(f"{name}: not a usable key: {e}") from None
        if key.algorithm_name not in JWKS_ALGORITHMS:
            raise ValueError(
                f"{name}: algorithm {key.algorithm_name} (accepted: {', '.join(JWKS_ALGORITHMS)})"
            )
        if kid in found:
            raise ValueError(f"{name}: a second key with this kid" if kid else f"{name}: no kid")
        found[kid] = key
    if None in found and len(found) > 1:
        raise ValueError(f"{path}: with several keys every key needs a kid")
    return found


def _jwt_header(password: bytes | None) -> dict[str, Any] | None:
    """The header of a password that is a JWT: three dot-separated parts, the first
    a JSON object naming an algorithm; None for any other password."""
    if password is None or password.count(b".") != 2:
        return None
    try:
        header = jwt.get_unverified_header(password.decode("ascii"))
    except (UnicodeDecodeError, jwt.PyJWTError):
        return None
    return header if "alg" in header else None


class JwtMember:
    """``auth.chain`` jwt: the MQTT password is a JWT; see the module docstring."""

    name = "jwt"

    def __init__(self, settings: AuthSettings, clock: Callable[[], float]) -> None:
        self.settings = settings
        self.secret: bytes | None = None
        self.keys: dict[str | None, jwt.PyJWK] = {}
        self._secret_watch: FileChangeWatch | None = None
        self._jwks_watch: FileChangeWatch | None = None
        if not settings.jwt_secret_file and not settings.jwt_jwks_file:
            raise ConfigError(
                "auth.chain has jwt: set it (HS256) or auth.jwt_jwks_file (RS256/ES256)",
                name="auth.jwt_secret_file",
            )
        if settings.jwt_secret_file:
            try:
                self.secret = _read_secret(settings.jwt_secret_file)
            except ValueError as e:
                raise ConfigError(str(e), name="auth.jwt_secret_file") from None
            self._secret_watch = FileChangeWatch(Path(settings.jwt_secret_file), clock)
        if settings.jwt_jwks_file:
            try:
                self.keys = _read_jwks(settings.jwt_jwks_file)
            except ValueError as e:
                raise ConfigError(str(e), name="auth.jwt_jwks_file") from None
            self._jwks_watch = FileChangeWatch(Path(settings.jwt_jwks_file), clock)
            log.info("%d JWT keys in %s", len(self.keys), settings.jwt_jwks_file)

    def maybe_reload(self, force: bool = False) -> None:
        """Re-read the secret and the JWKS file if they changed; a file that no longer
        reads keeps the previous keys in force."""
        if self._secret_watch is not None and self._secret_watch.changed(force):
            try:
                self.secret = _read_secret(self.settings.jwt_secret_file)
                log.info("JWT secret reloaded from %s", self.settings.jwt_secret_file)
            except ValueError as e:
                log.error("JWT secret not reloaded, the previous one stays in force: %s", e)
        if self._jwks_watch is not None and self._jwks_watch.changed(force):
            try:
                self.keys = _read_jwks(self.settings.jwt_jwks_file)
                log.info("JWKS reloaded: %d keys in %s", len(self.keys), self._jwks_watch.path)
            except ValueError as e:
                log.error("JWKS not reloaded, the previous keys stay in force: %s", e)

    def close(self) -> None:
        pass

    def check(self, credentials: Credentials, source: str, answer: Answer) -> None:
        """Decided here, on the event loop: a signature check costs ~0.1 ms
        (``python -m benchmarks.auth_chain_bench``), less than a hand-over to a thread."""
        header = _jwt_header(credentials.password)
        if header is None:
            answer(None)  # not a JWT (a password with two dots too): the next member's
            return
        answer(self.verify(credentials.password.decode("ascii"), header, credentials))  # type: ignore[union-attr]

    def _key(self, header: dict[str, Any]) -> tuple[Any, str] | str:
        """(key, algorithm) to verify a token with ``header``, or why there is none."""
        alg = header.get("alg")
        if alg == "HS256":
            if self.secret is None:
                return "an HS256 token, and auth.jwt_secret_file is not set"
            return self.secret, alg
        if alg not in JWKS_ALGORITHMS:
            return f"algorithm {alg!r} not accepted"
        kid = header.get("kid")  # a string: PyJWT refuses any other header
        key = self.keys.get(kid) if kid is not None else None
        if kid is None and len(self.keys) == 1:
            key = next(iter(self.keys.values()))
        if key is None:
            return f"no key for kid {kid!r} in auth.jwt_jwks_file"
        if key.algorithm_name != alg:
            return f"key {kid!r} is {key.algorithm_name}, the token says {alg}"
        return key.key, alg

    def verify(self, token: str, header: dict[str, Any], credentials: Credentials) -> Verdict:
        settings = self.settings
        found = self._key(header)
        if isinstance(found, str):
            return _denied(ReasonCode.BAD_USER_NAME_OR_PASSWORD, f"token refused: {found}")
        key, alg = found
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=[alg],
                audience=settings.jwt_audience or None,
                issuer=settings.jwt_issuer or None,
                leeway=settings.jwt_leeway_seconds,
                options={"require": ["exp"], "verify_aud": bool(settings.jwt_audience)},
            )
        except jwt.PyJWTError as e:  # expired, not yet valid, wrong aud/iss/signature
            return _denied(ReasonCode.BAD_USER_NAME_OR_PASSWORD, f"token refused: {e}")
        claim = settings.jwt_username_claim
        if claim and claims.get(claim) != credentials.username:
            return _denied(
                ReasonCode.BAD_USER_NAME_OR_PASSWORD,
                f"token refused: its {claim!r} is not the user name",
            )
        claim = settings.jwt_client_id_claim
        if claim and claims.get(claim) != credentials.client_id:
            return _denied(
                ReasonCode.NOT_AUTHORIZED, f"token refused: its {claim!r} is not the client ID"
            )
        grant = None
        claim = settings.jwt_acl_claim
        if claim and claim in claims:
            try:
                grant = Grant(parse_granted_rules(claims[claim], f"token claim {claim!r}"))
            except AclError as e:
                return _denied(ReasonCode.NOT_AUTHORIZED, f"token refused: {e}")
        return Verdict(True, grant=grant)


# --------------------------------------------------------------------------
# http
# --------------------------------------------------------------------------


_HEADERS = {"Content-Type": "application/json", "User-Agent": "devicemq", "Connection": "close"}


class _Request:
    """One POST in flight. Its worker thread's socket timeouts bound each read, not the
    whole answer: a service that trickles its answer a byte at a time would hold the
    thread (and a place of http_max_pending) for ever. So the event loop's deadline
    aborts the request, shutting its socket down, and the thread is free at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._connection: http.client.HTTPConnection | None = None
        self.aborted = False

    def connected(self, connection: http.client.HTTPConnection) -> bool:
        """The connection is open: False if the request was aborted meanwhile."""
        with self._lock:
            self._connection = connection
            return not self.aborted

    def abort(self) -> None:
        with self._lock:
            self.aborted = True
            sock = self._connection.sock if self._connection is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # the thread's read ends now


@dataclass(slots=True)
class _Remembered:
    expires_at: float
    grant: Grant | None


Outcome = tuple[int, bytes] | str  # (status, body) or what went wrong


@dataclass(frozen=True, slots=True)
class _Undecided:
    """The service decided nothing (a 5xx, a 3xx, no answer): ``what`` happened."""

    what: str


def _service_url(url: str) -> SplitResult:
    """auth.http_url taken apart; ConfigError says what is wrong with it, never
    repeating the URL (it could hold a password)."""

    def wrong(what: str) -> ConfigError:
        return ConfigError(what, name="auth.http_url")

    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError: not a number or out of 0-65535
    except ValueError as e:
        raise wrong(f"not a URL: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise wrong(f"expected an http:// or https:// URL with a host (scheme {parts.scheme!r})")
    if parts.username is not None or parts.password is not None:
        raise wrong("holds a user name or password: put credentials in the service, not the URL")
    if port == 0:
        raise wrong("port 0 is not a port")
    return parts


class HttpMember:
    """``auth.chain`` http: the service at ``auth.http_url`` decides."""

    name = "http"

    def __init__(self, settings: AuthSettings, clock: Callable[[], float]) -> None:
        self.settings = settings
        self.clock = clock
        url = settings.http_url
        if not url:
            raise ConfigError("auth.chain has http: give the service's URL", name="auth.http_url")
        parts = _service_url(url)
        self._parts = parts
        self._tls: ssl.SSLContext | None = None
        if parts.scheme == "https" and not settings.http_ca_file:
            self._tls = ssl.create_default_context()
        if settings.http_ca_file:
            if parts.scheme != "https":
                raise ConfigError(
                    "set, but auth.http_url is not https://", name="auth.http_ca_file"
                )
            try:
                self._tls = ssl.create_default_context(cafile=settings.http_ca_file)
            except (OSError, ssl.SSLError) as e:
                raise ConfigError(
                    f"cannot load {settings.http_ca_file}: {getattr(e, 'strerror', None) or e}",
                    name="auth.http_ca_file",
                ) from None
        self._in_flight: set[_Request] = set()
        self._cache: OrderedDict[bytes, _Remembered] = OrderedDict()
        self._cache_key = secrets.token_bytes(32)  # never leaves this process
        rate = settings.max_verify_rate_per_source
        self._by_source = SourceBuckets(rate) if rate > 0 else None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.pending = 0  # requests in flight (threads busy)
        self._down_log = LogLimiter(log, "auth service failures")
        # The probe's finding: None (never probed), True (down), False (it answers).
        self._down: bool | None = None
        self._probe_finding = ""
        self._probed_at = 0.0
        self._probe_waiting: list[Callable[[bool], None]] = []

    def maybe_reload(self, force: bool = False) -> None:
        pass

    def close(self) -> None:
        for request in list(self._in_flight):
            request.abort()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def check(self, credentials: Credentials, source: str, answer: Answer) -> None:
        password = credentials.password
        try:
            text = None if password is None else password.decode("utf-8")
        except UnicodeDecodeError:
            answer(None)  # cannot go in JSON as text: not this member's to decide
            return
        body = json.dumps(
            {
                "client_id": credentials.client_id,
                "username": credentials.username,
                "password": text,
                "peer_address": credentials.address,
                "certificate_subject": credentials.certificate_subject,
            }
        ).encode()
        # Remembered by an HMAC of everything sent, under a key only this process has.
        digest = hmac.new(self._cache_key, body, hashlib.sha256).digest()
        remembered = self._cache.get(digest)
        if remembered is not None:
            if remembered.expires_at > self.clock():
                self._cache.move_to_end(digest)
                answer(Verdict(True, grant=remembered.grant))
                return
            del self._cache[digest]
        settings = self.settings
        if self._by_source is not None and not self._by_source.take(source, self.clock()):
            answer(
                Verdict(
                    False,
                    ReasonCode.CONNECTION_RATE_EXCEEDED,
                    "too many auth service requests from its address",
                    counter="auth_rate_exceeded_per_source",
                )
            )
            return
        if self.pending >= settings.http_max_pending:
            answer(
                Verdict(
                    False,
                    ReasonCode.SERVER_BUSY,
                    f"{self.pending} auth service requests already waiting",
                    counter="auth_service_busy",
                )
            )
            return

        def finished(outcome: Outcome) -> None:
            try:
                verdict = self._decide(outcome)
            except Exception as e:  # a bug: refused, never let in, and always answered
                log.exception("auth.chain http: the answer could not be decided")
                verdict = Verdict(
                    False,
                    ReasonCode.UNSPECIFIED_ERROR,
                    f"the answer could not be decided: {type(e).__name__}",
                    counter="auth_chain_failed",
                )
            if isinstance(verdict, _Undecided):
                # No decision (5xx, 3xx, no answer): is the service down, or did this
                # request alone fail (its input)? The probe tells.
                what = verdict.what
                self._when_probed(lambda down: answer(self._failed(what, down)))
                return
            allowed = isinstance(outcome, tuple) and 200 <= outcome[0] < 300
            if allowed and verdict is not None and verdict.ok and settings.http_cache_seconds > 0:
                self._remember(digest, verdict.grant)  # never a fail-open acceptance
            answer(verdict)

        self._run(body, finished)

    # -- the answer ------------------------------------------------------------------------

    def _decide(self, outcome: Outcome) -> Verdict | _Undecided | None:
        """The service's decision (None: ``"result": "ignore"``, the next member's), or
        :class:`_Undecided` when it decided nothing (5xx, 3xx, no answer)."""
        if isinstance(outcome, tuple):
            status, body = outcome
            if 200 <= status < 500 and not 300 <= status < 400:  # it decided: it is up
                self._reachable(f"it answered {status}")
            if 200 <= status < 300:
                return self._allowed(body)
            if status == 403:
                return _denied(ReasonCode.NOT_AUTHORIZED, "the auth service answered 403")
            if 400 <= status < 500:
                return _denied(
                    ReasonCode.BAD_USER_NAME_OR_PASSWORD, f"the auth service answered {status}"
                )
            return _Undecided(f"it answered {status}")
        return _Undecided(outcome)

    def _allowed(self, body: bytes) -> Verdict | None:
        """2xx: allowed, unless its JSON object's "result" says otherwise
        (``auth.http_result``); "acl" gives the client its own rules. Rules that do
        not parse, or a "result" that is not understood, refuse the client (0x88):
        the service meant to restrict it."""
        mode = self.settings.http_result
        if len(body) > MAX_ANSWER_BYTES:
            return self._wrong(f"its answer is over {MAX_ANSWER_BYTES} bytes")
        text = body.strip()
        try:
            data = json.loads(text) if text else None
        except RecursionError:
            return self._wrong("its answer is JSON nested too deeply")
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            if text.startswith(b"{"):  # meant as an object, perhaps with rules
                return self._wrong(f"its answer is not a JSON object: {e}")
            data = None  # plain text: allowed, no rules of its own
        if not isinstance(data, dict):
            data = {}
        if mode != "status":
            result = data.get("result")
            if result is None and mode == "required":
                return self._wrong('its answer has no "result" (auth.http_result: required)')
            if result is not None and result not in RESULTS:
                return self._wrong(f'its "result" is {str(result)[:40]!r}, not allow/deny/ignore')
            if result == "deny":
                return _denied(
                    ReasonCode.BAD_USER_NAME_OR_PASSWORD, 'the auth service answered "deny"'
                )
            if result == "ignore":
                return None  # not its to decide: the next member's
        if data.get("acl") is None:
            return Verdict(True)
        try:
            return Verdict(True, grant=Grant(parse_granted_rules(data["acl"], "answer's acl")))
        except AclError as e:
            return self._wrong(str(e))

    def _wrong(self, what: str) -> Verdict:
        self._down_log.log(self.clock(), logging.ERROR, "auth.http_url answered 2xx but: %s", what)
        return Verdict(
            False,
            ReasonCode.SERVER_UNAVAILABLE,
            f"the auth service's answer is not understood: {what}",
            counter="auth_service_unavailable",
        )

    def _failed(self, what: str, down: bool) -> Verdict:
        """A request that got no decision: accepted unchecked only with
        ``http_fail_open`` and the service down by the probe's finding."""
        if down and self.settings.http_fail_open:
            self._down_log.log(
                self.clock(),
                logging.WARNING,
                "auth.http_url is down (%s; probe: %s): a client is accepted unchecked "
                "(auth.http_fail_open)",
                what,
                self._probe_finding,
            )
            return Verdict(True, message=f"auth service down ({what}), accepted unchecked")
        if down:
            message = f"the auth service is down: {what}"
        else:  # the probe got an answer: this request's failure was its own
            message = f"the auth service failed this request: {what} (a probe was answered)"
        return Verdict(
            False, ReasonCode.SERVER_UNAVAILABLE, message, counter="auth_service_unavailable"
        )

    # -- is the service down? the probe ---------------------------------------------------

    def _reachable(self, finding: str) -> None:
        """The service answered (a client's request or the probe): it is up."""
        if self._down is True:
            log.warning("auth.http_url answers again (%s)", finding)
        self._down = False
        self._probe_finding = finding
        self._probed_at = self.clock()

    def _when_probed(self, then: Callable[[bool], None]) -> None:
        """``then(down)`` once the service's state is known: the finding of a probe
        younger than PROBE_FRESH, or of a new one. The probe is a fixed request that
        carries no client's input, so no input can make it fail: it fails (no answer,
        or a 5xx) only when the service fails every request. One probe at a time; the
        requests waiting for it share its finding."""
        now = self.clock()
        if self._down is not None and now - self._probed_at < PROBE_FRESH:
            then(self._down)
            return
        self._probe_waiting.append(then)
        if len(self._probe_waiting) > 1:
            return  # a probe is under way

        def probed(outcome: Outcome) -> None:
            if outcome in STOPPING:  # no finding: refused, the state left as it was
                waiting, self._probe_waiting = self._probe_waiting, []
                for waiter in waiting:
                    waiter(False)
                return
            if isinstance(outcome, tuple) and outcome[0] < 500:
                self._reachable(f"it answered {outcome[0]}")
            else:
                finding = f"it answered {outcome[0]}" if isinstance(outcome, tuple) else outcome
                if self._down is not True:
                    log.error(
                        "auth.http_url is down (probe: %s): clients it would decide are %s",
                        finding,
                        "accepted unchecked (auth.http_fail_open)"
                        if self.settings.http_fail_open
                        else "refused 0x88",
                    )
                self._down = True
                self._probe_finding = finding
                self._probed_at = self.clock()
            waiting, self._probe_waiting = self._probe_waiting, []
            for waiter in waiting:
                waiter(bool(self._down))

        self._run(PROBE_BODY, probed)

    def _remember(self, digest: bytes, grant: Grant | None) -> None:
        cache = self._cache
        cache[digest] = _Remembered(self.clock() + self.settings.http_cache_seconds, grant)
        cache.move_to_end(digest)
        while len(cache) > self.settings.http_cache_size:
            cache.popitem(last=False)

    # -- the request, off the event loop ------------------------------------------------

    def _post(self, body: bytes, request: _Request) -> Outcome:
        """Runs in a worker thread: one POST, its status and (capped) body. Each socket
        operation waits at most http_timeout_seconds; ``request.abort()`` ends it."""
        parts = self._parts
        timeout = self.settings.http_timeout_seconds
        host, port = parts.hostname or "", parts.port
        connection: http.client.HTTPConnection
        if self._tls is not None:
            connection = http.client.HTTPSConnection(host, port, timeout=timeout, context=self._tls)
        else:
            connection = http.client.HTTPConnection(host, port, timeout=timeout)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        try:
            connection.connect()
            if not request.connected(connection):
                return "aborted"
            connection.request("POST", path, body, _HEADERS)
            response = connection.getresponse()
            return response.status, response.read(MAX_ANSWER_BYTES + 1)
        except (OSError, http.client.HTTPException, ValueError) as e:
            if request.aborted:
                return "aborted"
            if isinstance(e, OSError) and str(e):
                return str(e)  # "[Errno 111] Connection refused", "timed out", TLS errors
            return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        finally:
            connection.close()

    def _run(self, body: bytes, finished: Callable[[Outcome], None]) -> None:
        """``finished`` once, on the event loop: the outcome, or "no answer" when
        http_timeout_seconds pass first (a late answer is dropped)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None:  # no event loop (sans-IO use): asked inline
            finished(self._post(body, _Request()))
            return
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                self.settings.http_max_pending, thread_name_prefix="devicemq-auth-http"
            )
        self.pending += 1
        decided = False
        timeout = self.settings.http_timeout_seconds
        request = _Request()
        self._in_flight.add(request)

        def decide(outcome: Outcome) -> None:
            nonlocal decided
            if not decided:
                decided = True
                timer.cancel()
                finished(outcome)

        def done(future: asyncio.Future[Outcome]) -> None:
            self.pending -= 1
            self._in_flight.discard(request)
            if future.cancelled():
                decide(STOPPING[1])
            elif future.exception() is not None:
                decide(f"{type(future.exception()).__name__}")
            else:
                decide(future.result())

        def expired() -> None:
            request.abort()  # the thread, and its place in `pending`, are free at once
            decide(f"no answer within {timeout:g} s")

        timer = loop.call_later(timeout, expired)
        future = loop.run_in_executor(self._executor, self._post, body, request)
        future.add_done_callback(done)


# --------------------------------------------------------------------------
# The chain
# --------------------------------------------------------------------------

CHAIN_MEMBERS: dict[str, Callable[[AuthSettings, Callable[[], float]], ChainMember]] = {
    "http": HttpMember,
    "jwt": JwtMember,
}


def build_chain(
    settings: AuthSettings, clock: Callable[[], float] = time.monotonic
) -> list[ChainMember]:
    """The members of auth.chain in order; ConfigError names the setting that is wrong
    (an unknown or repeated member, a member's missing or unreadable file, a member's
    setting given while the member is not in the chain)."""
    names = list(settings.chain_members)
    if settings.chain.strip() and not names:
        raise ConfigError(
            f"{settings.chain!r} names no member (known: {', '.join(CHAIN_MEMBERS)})",
            name="auth.chain",
        )
    for name in names:
        if name not in CHAIN_MEMBERS:
            raise ConfigError(
                f"unknown member {name!r} (known: {', '.join(CHAIN_MEMBERS)})", name="auth.chain"
            )
        if names.count(name) > 1:
            raise ConfigError(f"{name!r} appears twice", name="auth.chain")
    for field in dataclasses.fields(AuthSettings):
        member = field.name.partition("_")[0]
        unused = member in CHAIN_MEMBERS and member not in names
        if unused and getattr(settings, field.name) != field.default:
            raise ConfigError(f"set, but auth.chain has no {member}", name=f"auth.{field.name}")
    return [CHAIN_MEMBERS[name](settings, clock) for name in names]
