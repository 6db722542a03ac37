"""auth.chain (broker/external_auth.py) decided by the Authenticator: JWTs minted with
PyJWT from keys made with cryptography, and a real HTTP service on 127.0.0.1
(tests/auth_service.py). Without an event loop the HTTP request is made inline;
the tests marked asyncio run it as the broker does, in a thread."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import datetime
import hashlib
import hmac
import json
import logging
import socket
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from app.authentication import open_authenticator, open_authorizer
from broker.acl import READ, WRITE, Grant, Rule
from broker.auth import Authenticator, AuthResult, write_password_file
from broker.config import AuthSettings, ConfigError, Settings, load_settings
from broker.core import owner_policy
from broker.external_auth import HttpMember, certificate_subject
from broker.packets import ReasonCode
from edge.listeners import authentication_configured
from tests.auth_service import (
    SECRET,
    AuthService,
    SigningKey,
    claims,
    hs256,
    running_service,
    write_jwks,
)
from tests.pki import make_pki
from tests.unit.test_auth import ALICE_HASH, ALICE_PW, Clock, password_file

BAD = ReasonCode.BAD_USER_NAME_OR_PASSWORD
NOT_AUTHORIZED = ReasonCode.NOT_AUTHORIZED
UNAVAILABLE = ReasonCode.SERVER_UNAVAILABLE


def decide(
    auth: Authenticator,
    user: str | None,
    pw: str | bytes | None,
    client_id: str = "c1",
    cert: Any = None,
) -> AuthResult:
    results: list[AuthResult] = []
    password = pw.encode() if isinstance(pw, str) else pw
    auth.authenticate(user, password, cert, results.append, "10.0.0.1", None, client_id, "10.0.0.1")
    assert len(results) == 1
    return results[0]


def refused(result: AuthResult, reason: ReasonCode, words: str) -> None:
    assert not result.ok, result
    assert result.reason == reason, result
    assert words in result.message, result.message


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "jwt-secret"
    path.write_bytes(SECRET + b"\n")
    return path


def jwt_auth(secret_file: Path, **more: Any) -> Authenticator:
    return open_authenticator(AuthSettings(chain="jwt", jwt_secret_file=str(secret_file), **more))


# --------------------------------------------------------------------------
# jwt
# --------------------------------------------------------------------------


def test_hs256_token_logs_in_with_its_acl_claim(secret_file: Path) -> None:
    auth = jwt_auth(secret_file)
    token = hs256(claims("c1", "dev", acl=["readwrite devices/%c/#", "deny devices/%c/fw"]))
    result = decide(auth, "dev", token)
    assert result.ok and result.username == "dev"
    assert result.grant is not None
    assert result.grant.rules == (Rule(READ | WRITE, "devices/%c/#"), Rule(0, "devices/%c/fw"))
    # No acl claim: no grant, the ACL file's rules alone.
    assert decide(auth, "dev", hs256(claims("c1", "dev"))).grant is None
    # allow_anonymous auto: a chain is authentication, anonymous clients are refused.
    refused(decide(auth, None, None), NOT_AUTHORIZED, "anonymous clients are not allowed")


def b64(data: bytes) -> bytes:
    return base64.urlsafe_b64encode(data).rstrip(b"=")


def hs256_signed(signing_input: bytes) -> bytes:
    """A token of these parts, signed: its signature is right, the rest need not be."""
    signature = hmac.new(SECRET, signing_input, hashlib.sha256).digest()
    return signing_input + b"." + b64(signature)


def now() -> int:
    return int(claims("", "")["iat"])


REFUSALS = [
    ("expired", {"exp": -60}, BAD, "Signature has expired"),
    ("not yet valid", {"nbf": 600}, BAD, "not yet valid"),
    ("no exp", {"exp": None}, BAD, 'missing the "exp" claim'),
    ("other audience", {"aud": "other"}, BAD, "Audience doesn't match"),
    ("no audience", {"aud": None}, BAD, 'missing the "aud" claim'),
    ("other issuer", {"iss": "mallory"}, BAD, "Invalid issuer"),
    ("other user", {"sub": "admin"}, BAD, "its 'sub' is not the user name"),
    ("other client", {"client_id": "c2"}, NOT_AUTHORIZED, "its 'client_id' is not the client ID"),
    ("bad acl claim", {"acl": "devices/#"}, NOT_AUTHORIZED, "expected a list of rule strings"),
    (
        "bad acl rule",
        {"acl": ["read a/#/b"]},
        NOT_AUTHORIZED,
        "'a/#/b' is not a valid topic filter",
    ),
    (
        "queue acl rule",  # it would match every topic: refused as $share/ rules are
        {"acl": ["read $queue/jobs/#"]},
        NOT_AUTHORIZED,
        "'$queue/jobs/#' is not a valid topic filter",
    ),
]


@pytest.mark.parametrize(
    ("case", "change", "reason", "words"), REFUSALS, ids=[r[0] for r in REFUSALS]
)
def test_token_claims_are_checked(
    secret_file: Path, case: str, change: dict[str, Any], reason: ReasonCode, words: str
) -> None:
    auth = jwt_auth(secret_file, jwt_audience="devicemq", jwt_issuer="https://issuer")
    good = claims("c1", "dev", aud="devicemq", iss="https://issuer")
    assert decide(auth, "dev", hs256(good)).ok
    token_claims = dict(good)
    for key, value in change.items():
        if value is None:
            del token_claims[key]
        elif key in ("exp", "nbf"):
            token_claims[key] = now() + value
        else:
            token_claims[key] = value
    refused(decide(auth, "dev", hs256(token_claims)), reason, words)


def test_leeway_and_unchecked_claims(secret_file: Path) -> None:
    # Expired 3 s ago: within the default 5 s of leeway; aud/iss/client not checked.
    auth = jwt_auth(secret_file, jwt_client_id_claim="", jwt_username_claim="")
    token = hs256(claims("other", "someone", lifetime=-3, aud="x", iss="y"))
    assert decide(auth, "dev", token).ok
    strict = jwt_auth(secret_file, jwt_leeway_seconds=0)
    refused(decide(strict, "dev", hs256(claims("c1", "dev", lifetime=-3))), BAD, "expired")


def test_wrong_signature_and_algorithms(secret_file: Path, tmp_path: Path) -> None:
    auth = jwt_auth(secret_file)
    refused(
        decide(auth, "dev", hs256(claims("c1", "dev"), b"x" * 40)), BAD, "Signature verification"
    )
    unsigned = jwt.encode(claims("c1", "dev"), None, algorithm="none")
    refused(decide(auth, "dev", unsigned), BAD, "algorithm 'none' not accepted")
    # Not JWTs, for all they have two dots: passed on, here to nobody.
    refused(decide(auth, "dev", "my.pass.word"), BAD, "no auth.chain member vouches for 'dev'")
    odd_kid = b64(b'{"alg":"ES256","kid":[1]}') + b"." + b64(b"{}") + b"." + b64(b"sig")
    refused(decide(auth, "dev", odd_kid), BAD, "no auth.chain member vouches")
    nested = b64(b'{"alg":"HS256","x":' + b"[" * 5000 + b"]" * 5000 + b"}") + b".e30.c2ln"
    refused(decide(auth, "dev", nested), BAD, "no auth.chain member vouches")  # PyJWT: not one
    garbled = hs256_signed(b64(b'{"alg":"HS256"}') + b"." + b64(b"not json"))
    refused(decide(auth, "dev", garbled), BAD, "auth.chain jwt: token refused: ")
    key = SigningKey.new("k1")
    # An RS256 token where only a secret is configured.
    refused(decide(auth, "dev", key.sign(claims("c1", "dev"))), BAD, "no key for kid 'k1'")


def test_public_key_used_as_hs256_secret_is_refused(tmp_path: Path) -> None:
    """The classic confusion: an HS256 token "signed" with the published public key."""
    key = SigningKey.new("k1")
    jwks = tmp_path / "jwks.json"
    write_jwks(jwks, key)
    auth = open_authenticator(AuthSettings(chain="jwt", jwt_jwks_file=str(jwks)))
    assert decide(auth, "dev", key.sign(claims("c1", "dev"))).ok
    public = jwt.get_algorithm_by_name("RS256").to_jwk(key.private.public_key()).encode()
    header = base64.urlsafe_b64encode(b'{"alg":"HS256","kid":"k1","typ":"JWT"}').rstrip(b"=")
    body = base64.urlsafe_b64encode(json.dumps(claims("c1", "dev")).encode()).rstrip(b"=")
    signature = hmac.new(public, header + b"." + body, hashlib.sha256).digest()
    token = b".".join([header, body, base64.urlsafe_b64encode(signature).rstrip(b"=")])
    refused(decide(auth, "dev", token), BAD, "auth.jwt_secret_file is not set")


@pytest.mark.parametrize("algorithm", ["RS256", "ES256"])
def test_jwks_keys_by_kid_and_rotation_by_rewriting_the_file(
    tmp_path: Path, algorithm: str
) -> None:
    old, new = SigningKey.new("2025", algorithm), SigningKey.new("2026", algorithm)
    jwks = tmp_path / "jwks.json"
    write_jwks(jwks, old)
    clock = Clock()
    auth = open_authenticator(AuthSettings(chain="jwt", jwt_jwks_file=str(jwks)), clock)
    assert decide(auth, "dev", old.sign(claims("c1", "dev"))).ok
    assert decide(auth, "dev", old.sign(claims("c1", "dev"), kid=None)).ok  # the only key
    refused(decide(auth, "dev", new.sign(claims("c1", "dev"))), BAD, "no key for kid '2026'")

    # Both keys during the rotation: a token needs its kid now.
    write_jwks(jwks, old, new)
    auth.maybe_reload()
    refused(decide(auth, "dev", new.sign(claims("c1", "dev"))), BAD, "no key")  # within 1 s
    clock.now += 1.5
    auth.maybe_reload()
    assert decide(auth, "dev", new.sign(claims("c1", "dev"))).ok
    assert decide(auth, "dev", old.sign(claims("c1", "dev"))).ok
    refused(
        decide(auth, "dev", new.sign(claims("c1", "dev"), kid=None)), BAD, "no key for kid None"
    )

    # The old key withdrawn; then a broken file keeps the keys in force.
    write_jwks(jwks, new)
    clock.now += 1.5
    auth.maybe_reload()
    refused(decide(auth, "dev", old.sign(claims("c1", "dev"))), BAD, "no key for kid '2025'")
    jwks.write_text("{not json")
    clock.now += 1.5
    auth.maybe_reload()
    assert decide(auth, "dev", new.sign(claims("c1", "dev"))).ok


def test_the_secret_file_is_reloaded_too(secret_file: Path) -> None:
    auth = jwt_auth(secret_file)
    other = b"o" * 32
    secret_file.write_bytes(other)
    auth.maybe_reload(force=True)  # SIGHUP
    assert decide(auth, "dev", hs256(claims("c1", "dev"), other)).ok
    refused(decide(auth, "dev", hs256(claims("c1", "dev"))), BAD, "Signature verification")


def test_the_password_file_comes_first_and_other_passwords_pass_on(
    tmp_path: Path, secret_file: Path
) -> None:
    auth = open_authenticator(
        AuthSettings(
            password_file=str(password_file(tmp_path, alice=ALICE_HASH)),
            chain="jwt",
            jwt_secret_file=str(secret_file),
        )
    )
    assert decide(auth, "alice", ALICE_PW).ok
    # alice is the file's: a token for her does not get in, nor does a wrong password.
    refused(decide(auth, "alice", hs256(claims("c1", "alice"))), BAD, "bad password for 'alice'")
    assert decide(auth, "dev", hs256(claims("c1", "dev"))).ok
    refused(decide(auth, "dev", "not-a-token"), BAD, "no auth.chain member vouches for 'dev'")
    refused(decide(auth, None, None), NOT_AUTHORIZED, "anonymous")  # auto: off with a chain


class CountingHasher:
    """Authenticator.run_blocking that hashes inline and counts the hashes: the work
    a CONNECT cost, asserted on instead of its time."""

    def __init__(self) -> None:
        self.hashes = 0

    def __call__(self, work: Any, done: Any) -> None:
        self.hashes += 1
        done(work())


@pytest.mark.parametrize("member", ["jwt", "http"])
def test_a_name_the_file_does_not_hold_costs_what_a_file_user_costs(
    tmp_path: Path, secret_file: Path, service: AuthService, member: str
) -> None:
    """With a password file, a refused name the chain was asked about costs the hash a
    file user's wrong password costs, under the same per-address bound: neither the
    work nor the limit's answer tells which names the file holds (SECURITY.md)."""
    passwd = password_file(tmp_path, alice=ALICE_HASH)
    chain = {"jwt": {"jwt_secret_file": str(secret_file)}, "http": {"http_url": service.url}}

    def attempts(username: str, password: str, count: int = 3) -> tuple[list[int], int]:
        hasher = CountingHasher()
        settings = AuthSettings(
            password_file=str(passwd), chain=member, max_verify_rate_per_source=1, **chain[member]
        )
        auth = open_authenticator(settings, Clock(), hasher)
        codes = [int(decide(auth, username, password).reason) for _ in range(count)]
        return codes, hasher.hashes

    file_user = attempts("alice", "wrong")
    assert file_user == ([0x86, 0x9F, 0x9F], 1)  # one hash, then the bound
    assert attempts("nobody", "wrong") == file_user
    if member == "jwt":
        assert attempts("nobody", hs256(claims("c1", "nobody"), b"x" * 40)) == file_user
    # Allowed through the chain: no hash (a JWT stays ~0.1 ms, a cached answer ~10 us).
    service.allow("dev")
    assert attempts("dev", hs256(claims("c1", "dev")) if member == "jwt" else "pw", 1) == (
        [0],
        0,
    )


# --------------------------------------------------------------------------
# settings
# --------------------------------------------------------------------------


def start_error(tmp_path: Path, env: dict[str, str]) -> str:
    settings = load_settings(env=env)
    with pytest.raises(ConfigError) as caught:
        open_authenticator(settings.auth)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_chain_counts_as_authentication(secret_file: Path) -> None:
    """It puts the listeners on every interface and binds sessions to user names, as a
    password file does (SECURITY.md "Defaults")."""
    settings = Settings(auth=AuthSettings(chain="jwt", jwt_secret_file=str(secret_file)))
    assert authentication_configured(settings) and owner_policy(settings) == "username"
    assert not authentication_configured(Settings()) and owner_policy(Settings()) == "none"


def test_bad_settings_are_one_line_naming_the_setting(tmp_path: Path, secret_file: Path) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"too short\n")
    jwks = tmp_path / "jwks.json"
    jwks.write_text('{"keys": [')
    private = tmp_path / "private.json"
    key = SigningKey.new("k")
    private_jwk = json.loads(jwt.get_algorithm_by_name("RS256").to_jwk(key.private))
    private.write_text(json.dumps({"keys": [private_jwk]}))
    hs = tmp_path / "hs.json"
    hs.write_text(json.dumps({"keys": [{"kty": "oct", "k": "c2VjcmV0", "alg": "HS256"}]}))
    odd_kids = []
    for kid in (["a"], {"a": 1}, 5):
        odd = tmp_path / f"kid-{type(kid).__name__}.json"
        odd.write_text(json.dumps({"keys": [{**SigningKey.new("k").public_jwk(), "kid": kid}]}))
        message = f"its kid is {type(kid).__name__}, not a string"
        odd_kids.append(({"CHAIN": "jwt", "JWT_JWKS_FILE": str(odd)}, message))
    cases = [
        *odd_kids,
        ({"CHAIN": ","}, "auth.chain: ',' names no member (known: http, jwt)"),
        ({"CHAIN": "http", "HTTP_URL": "http://[::1/"}, "auth.http_url: not a URL: "),
        (
            {"CHAIN": "http", "HTTP_URL": "http://127.0.0.1:99999/"},
            "auth.http_url: not a URL: Port out of range",
        ),
        ({"CHAIN": "http", "HTTP_URL": "http://host:0/"}, "auth.http_url: port 0 is not a port"),
        (
            {"CHAIN": "http", "HTTP_URL": "https://u:hunter2@host/auth"},
            "auth.http_url: holds a user name or password",
        ),
        ({"CHAIN": "http", "HTTP_URL": "http://u@host/"}, "auth.http_url: holds a user name"),
        ({"CHAIN": "http,ldap"}, "auth.chain: unknown member 'ldap' (known: http, jwt)"),
        (
            {"CHAIN": "jwt,jwt", "JWT_SECRET_FILE": str(secret_file)},
            "auth.chain: 'jwt' appears twice",
        ),
        ({"CHAIN": "http"}, "auth.http_url: auth.chain has http: give the service's URL"),
        (
            {"CHAIN": "http", "HTTP_URL": "ftp://x/"},
            "auth.http_url: expected an http:// or https://",
        ),
        ({"HTTP_URL": "http://x/"}, "auth.http_url: set, but auth.chain has no http"),
        (
            {"CHAIN": "http", "HTTP_URL": "http://x/", "HTTP_CA_FILE": str(secret_file)},
            "auth.http_ca_file: set, but auth.http_url is not https://",
        ),
        (
            {"CHAIN": "http", "HTTP_URL": "https://x/", "HTTP_CA_FILE": str(tmp_path / "none")},
            "auth.http_ca_file: cannot load",
        ),
        ({"CHAIN": "jwt"}, "auth.jwt_secret_file: auth.chain has jwt: set it"),
        ({"JWT_JWKS_FILE": str(jwks)}, "auth.jwt_jwks_file: set, but auth.chain has no jwt"),
        (
            {"CHAIN": "jwt", "JWT_SECRET_FILE": str(tmp_path / "none")},
            f"auth.jwt_secret_file: cannot read {tmp_path / 'none'}: No such file",
        ),
        (
            {"CHAIN": "jwt", "JWT_SECRET_FILE": str(short)},
            "the secret has 9 bytes, HS256 needs at least 32",
        ),
        ({"CHAIN": "jwt", "JWT_JWKS_FILE": str(jwks)}, f"auth.jwt_jwks_file: {jwks}: not JSON"),
        ({"CHAIN": "jwt", "JWT_JWKS_FILE": str(private)}, "holds a private key"),
        ({"CHAIN": "jwt", "JWT_JWKS_FILE": str(hs)}, "algorithm HS256 (accepted: RS256, ES256)"),
    ]
    for env, words in cases:
        message = start_error(tmp_path, {f"DEVICEMQ_AUTH_{k}": v for k, v in env.items()})
        assert words in message, (env, message)
        assert "hunter2" not in message


def changed(value: object) -> object:
    """A value other than ``value``, of its type."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    return f"{value}x"


def test_every_setting_of_a_member_not_in_the_chain_stops_the_start(secret_file: Path) -> None:
    members = {"http": {"chain": "jwt", "jwt_secret_file": str(secret_file)}, "jwt": {}}
    names = [
        f.name for f in dataclasses.fields(AuthSettings) if f.name.startswith(("http_", "jwt_"))
    ]
    assert len(names) == 16
    for name in names:
        member = name.partition("_")[0]
        default = next(f.default for f in dataclasses.fields(AuthSettings) if f.name == name)
        settings = AuthSettings(**{**members[member], name: changed(default)})  # type: ignore[arg-type]
        with pytest.raises(ConfigError) as caught:
            open_authenticator(settings)
        assert str(caught.value) == f"auth.{name}: set, but auth.chain has no {member}"
    # At its default it is no setting at all.
    assert open_authenticator(AuthSettings(http_timeout_seconds=5.0, jwt_audience=""))


def test_an_empty_member_list_is_no_chain_anywhere() -> None:
    """ " , " names no member: refused at start, and no check takes it for a chain (it
    put the listeners on every interface while letting anonymous clients in)."""
    settings = Settings(auth=AuthSettings(chain=" , "))
    assert settings.auth.chain_members == ()
    assert not authentication_configured(settings) and owner_policy(settings) == "none"
    with pytest.raises(ConfigError, match=r"auth\.chain: ' , ' names no member"):
        open_authenticator(settings.auth)


def test_a_jwks_reload_that_fails_keeps_its_keys_and_the_other_reloads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key = SigningKey.new("k1")
    jwks = tmp_path / "jwks.json"
    write_jwks(jwks, key)
    passwd = password_file(tmp_path, alice=ALICE_HASH)
    clock = Clock()
    settings = AuthSettings(password_file=str(passwd), chain="jwt", jwt_jwks_file=str(jwks))
    auth = open_authenticator(settings, clock)
    # A kid that is a list, and a new user in the password file, in one sweep.
    jwks.write_text(json.dumps({"keys": [{**key.public_jwk(), "kid": ["k1"]}]}))
    write_password_file(passwd, {"alice": ALICE_HASH, "bob": ALICE_HASH})
    clock.now += 1.5
    with caplog.at_level(logging.INFO, logger="devicemq.auth"):
        auth.maybe_reload()
    assert decide(auth, "dev", key.sign(claims("c1", "dev"))).ok  # the old key in force
    assert decide(auth, "bob", ALICE_PW).ok  # the password file was reloaded
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None
    assert "JWKS not reloaded" in errors[0].getMessage()
    assert "its kid is list, not a string" in errors[0].getMessage()


# --------------------------------------------------------------------------
# http
# --------------------------------------------------------------------------


@pytest.fixture
def service() -> Iterator[AuthService]:
    with running_service() as service:
        yield service


def http_auth(url: str, clock: Clock | None = None, **more: Any) -> Authenticator:
    settings = AuthSettings(chain="http", http_url=url, **more)
    if clock is None:
        return open_authenticator(settings)
    return open_authenticator(settings, clock)


CERT = {
    "subject": (
        (("countryName", "DE"),),
        (("organizationName", "Acme"),),
        (("commonName", "dev1"),),
    )
}


def test_http_allow_with_rules_and_what_is_sent(service: AuthService) -> None:
    service.allow("dev", acl=["readwrite devices/%c/#"])
    auth = http_auth(service.url)
    result = decide(auth, "dev", "pw", cert=CERT)
    assert result.ok and result.username == "dev"
    assert result.grant is not None and result.grant.rules == (Rule(READ | WRITE, "devices/%c/#"),)
    assert service.requests == [
        {
            "client_id": "c1",
            "username": "dev",
            "password": "pw",
            "peer_address": "10.0.0.1",
            "certificate_subject": "C=DE,O=Acme,CN=dev1",
            "_content_type": "application/json",
        }
    ]
    # 2xx without a JSON object: allowed, no rules of its own.
    service.answer("plain", 204)
    assert decide(auth, "plain", "pw").grant is None
    service.answer("text", 200, b"OK")
    assert decide(auth, "text", "pw").ok
    service.answer("null", 200, b'{"acl": null, "note": "no rules"}')
    assert decide(auth, "null", "pw").grant is None
    # An empty list: rules of its own, none granting anything.
    service.allow("nothing", acl=[])
    empty = decide(auth, "nothing", "pw").grant
    assert empty is not None and empty.rules == ()


def subject_of(tmp_path: Path, *rdns: list[tuple[Any, str]]) -> str | None:
    """certificate_subject of a real certificate with these RDNs, made with cryptography
    and decoded by the ssl module as a peer's certificate is."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [x509.RelativeDistinguishedName([x509.NameAttribute(o, v) for o, v in r]) for r in rdns]
    )
    moment = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(moment)
        .not_valid_after(moment + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    path = tmp_path / f"{x509.random_serial_number()}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return certificate_subject(ssl._ssl._test_decode_cert(str(path)))  # type: ignore[attr-defined]


def test_certificate_subjects_are_escaped_as_rfc_4514_does(tmp_path: Path) -> None:
    cn, org = NameOID.COMMON_NAME, NameOID.ORGANIZATION_NAME
    assert subject_of(tmp_path, [(cn, "dev1")], [(org, "Acme")]) == "CN=dev1,O=Acme"
    # A CN that spells another subject is not that subject.
    assert subject_of(tmp_path, [(cn, "dev1,O=Acme")]) == "CN=dev1\\,O=Acme"
    # A multi-valued RDN joins with '+', its values escaped too.
    assert subject_of(tmp_path, [(cn, "dev1"), (org, "Acme")]) == "CN=dev1+O=Acme"
    assert subject_of(tmp_path, [(cn, "dev1+O=Acme")]) == "CN=dev1\\+O=Acme"
    assert subject_of(tmp_path, [(cn, '#a "b" <c>;\\d ')]) == 'CN=\\#a \\"b\\" \\<c\\>\\;\\\\d\\ '
    assert subject_of(tmp_path, [(cn, " lead")]) == "CN=\\ lead"


def test_http_refusals_map_to_reason_codes(service: AuthService) -> None:
    service.answer("banned", 403)
    service.answer("teapot", 418)
    service.answer("broken", 500)
    service.answer("moved", 302)
    service.answer("bad-acl", 200, b'{"acl": ["read a/#/b"]}')
    service.answer("nested", 200, NESTED)
    service.answer("cut", 200, b'{"acl": ["read a/#"')
    auth = http_auth(service.url)
    refused(decide(auth, "mallory", "pw"), BAD, "auth.chain http: the auth service answered 401")
    refused(decide(auth, "teapot", "pw"), BAD, "answered 418")
    refused(decide(auth, "banned", "pw"), NOT_AUTHORIZED, "answered 403")
    # No decision, and a probe is answered (401): this request failed, the service is up.
    refused(decide(auth, "broken", "pw"), UNAVAILABLE, "failed this request: it answered 500")
    refused(decide(auth, "moved", "pw"), UNAVAILABLE, "it answered 302")
    result = decide(auth, "bad-acl", "pw")
    refused(result, UNAVAILABLE, "not understood: answer's acl[0]: 'a/#/b' is not a valid")
    assert result.counter == "auth_service_unavailable"
    refused(decide(auth, "nested", "pw"), UNAVAILABLE, "not understood: its answer is JSON nested")
    refused(decide(auth, "cut", "pw"), UNAVAILABLE, "not understood: its answer is not a JSON obj")
    # A password that is not UTF-8 cannot be sent: nobody vouches.
    refused(decide(auth, "dev", b"\xff\xfe"), BAD, "no auth.chain member vouches")


def test_https_service_verified_with_http_ca_file(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(pki.server_cert, pki.server_key)
    with running_service(tls) as service:
        service.allow("dev")
        assert service.url.startswith("https://127.0.0.1:")
        assert decide(http_auth(service.url, http_ca_file=str(pki.ca)), "dev", "pw").ok
        # Without the CA the service's certificate is not trusted: it counts as down.
        result = decide(http_auth(service.url), "dev", "pw")
        refused(result, UNAVAILABLE, "CERTIFICATE_VERIFY_FAILED")
        assert service.asked("dev") == 1


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/auth"  # nothing listens there any more


def test_service_down_fails_closed_or_open() -> None:
    url = closed_port()
    closed = decide(http_auth(url), "dev", "pw")
    refused(closed, UNAVAILABLE, "the auth service is down: [Errno 111] Connection refused")
    opened = http_auth(url, http_fail_open=True)
    result = decide(opened, "dev", "pw")
    assert result.ok and result.username == "dev" and result.grant is None


def test_successes_are_cached_refusals_never(service: AuthService) -> None:
    clock = Clock()
    auth = http_auth(service.url, clock, http_cache_seconds=60, http_cache_size=2)
    service.allow("dev", acl=["read a/#"])
    first = decide(auth, "dev", "pw")
    again = decide(auth, "dev", "pw")
    assert again.ok and again.grant == first.grant and service.asked("dev") == 1
    # Anything else sent makes another question: another password, client or address.
    decide(auth, "dev", "other")
    decide(auth, "dev", "pw", client_id="c2")
    assert service.asked("dev") == 3
    # A remembered success outlives the service's change of mind until it expires...
    service.answer("dev", 401)
    assert decide(auth, "dev", "other").ok
    clock.now += 61
    refused(decide(auth, "dev", "other"), BAD, "401")
    # ...and refusals are asked every time.
    asked = service.asked("dev")
    decide(auth, "dev", "other")
    assert service.asked("dev") == asked + 1
    # The cache holds http_cache_size entries: the oldest is forgotten.
    service.allow("dev")
    for password in ("1", "2", "3"):
        decide(auth, "dev", password)
    asked = service.asked("dev")
    decide(auth, "dev", "1")
    assert service.asked("dev") == asked + 1


def test_requests_per_address_are_bounded_cache_hits_are_not(service: AuthService) -> None:
    service.allow("dev")
    auth = http_auth(service.url, Clock(), max_verify_rate_per_source=1)
    assert decide(auth, "dev", "pw").ok
    result = decide(auth, "dev", "other")  # a second request from 10.0.0.1 this second
    refused(result, ReasonCode.CONNECTION_RATE_EXCEEDED, "too many auth service requests")
    assert result.counter == "auth_rate_exceeded_per_source"
    assert decide(auth, "dev", "pw").ok  # remembered: no request
    assert service.asked("dev") == 1


def test_a_fail_open_acceptance_is_not_cached(service: AuthService) -> None:
    clock = Clock()
    service.answer("dev", 503)
    service.answer("", 503)  # the probe (a CONNECT of nobody) too: the service is down
    auth = http_auth(service.url, clock, http_fail_open=True)
    assert decide(auth, "dev", "pw").ok
    service.answer("dev", 401)
    refused(decide(auth, "dev", "pw"), BAD, "401")


def test_fail_open_needs_the_probe_to_fail_not_one_request(service: AuthService) -> None:
    """Input that makes the service fail (a quote in the user name: 500, or a hang)
    lets nobody in unchecked: the probe, which carries no client's input, is
    answered. Probes are asked at most once a PROBE_FRESH second."""
    clock = Clock()
    service.answer("o'brien", 500)
    auth = http_auth(service.url, clock, http_fail_open=True)
    refused(decide(auth, "o'brien", "pw"), UNAVAILABLE, "failed this request: it answered 500")
    assert service.asked("") == 1  # the probe
    assert [r["password"] for r in service.requests if r["username"] == ""] == [None]
    refused(decide(auth, "o'brien", "pw2"), UNAVAILABLE, "(a probe was answered)")
    assert service.asked("") == 1  # its finding still fresh
    # The whole service fails: the next probe finds it down, and fail-open applies.
    service.answer("", 503)
    clock.now += 1.5
    result = decide(auth, "o'brien", "pw3")
    assert result.ok and result.username == "o'brien" and service.asked("") == 2
    # A client's request that is answered says the service is up again, at once.
    service.answer("dev", 401)
    refused(decide(auth, "dev", "pw"), BAD, "401")
    refused(decide(auth, "o'brien", "pw4"), UNAVAILABLE, "(a probe was answered)")
    assert service.asked("") == 2


def test_a_result_in_the_answer_decides(service: AuthService) -> None:
    """A 2xx answer's "result" (EMQX's HTTP auth convention) decides, under the
    default auth.http_result: auto; a 2xx without one is decided by its status."""
    service.answer("allowed", 200, b'{"result": "allow", "acl": ["read a/#"]}')
    service.answer("denied", 200, b'{"result": "deny"}')
    service.answer("ignored", 200, b'{"result": "ignore"}')
    service.answer("odd", 200, b'{"result": "maybe"}')
    service.answer("plain", 200, b"")
    auth = http_auth(service.url)
    allowed = decide(auth, "allowed", "pw")
    assert allowed.ok and allowed.grant is not None
    refused(decide(auth, "denied", "pw"), BAD, 'the auth service answered "deny"')
    refused(decide(auth, "ignored", "pw"), BAD, "no auth.chain member vouches")
    refused(decide(auth, "odd", "pw"), UNAVAILABLE, "its \"result\" is 'maybe'")
    assert decide(auth, "plain", "pw").ok
    required = http_auth(service.url, http_result="required")
    refused(decide(required, "plain", "pw"), UNAVAILABLE, 'has no "result"')
    refused(decide(required, "denied", "pw"), BAD, '"deny"')
    assert decide(required, "allowed", "pw").ok
    # status: the status alone, as before "result" was read (a deny lets in).
    status_only = http_auth(service.url, http_result="status")
    assert decide(status_only, "denied", "pw").ok
    assert decide(status_only, "odd", "pw").ok


async def decide_async(
    auth: Authenticator, user: str, client_id: str = "c1"
) -> asyncio.Future[AuthResult]:
    future: asyncio.Future[AuthResult] = asyncio.get_running_loop().create_future()
    auth.authenticate(user, b"pw", None, future.set_result, "10.0.0.1", None, client_id, "10.0.0.1")
    return future


@pytest.mark.asyncio
async def test_requests_wait_in_threads_bounded(service: AuthService) -> None:
    auth = http_auth(service.url, http_max_pending=1, http_timeout_seconds=60)
    release = service.hold("slow")
    slow = await decide_async(auth, "slow")
    await asyncio.to_thread(service.waiting.acquire, True, 10)  # the service holds it
    assert not slow.done()  # the event loop is free meanwhile: this test runs on it
    busy = await decide_async(auth, "other")
    assert busy.done()  # at once: over http_max_pending
    refused(busy.result(), ReasonCode.SERVER_BUSY, "1 auth service requests already waiting")
    release.set()
    assert (await asyncio.wait_for(slow, 10)).ok
    auth.close()


NESTED = b'{"acl":' + b"[" * 30000 + b"]" * 30000 + b"}"  # deeper than json can go


@pytest.mark.asyncio
async def test_an_answer_nested_too_deeply_is_answered_0x88(service: AuthService) -> None:
    """Decided on the event loop, as the broker does: the CONNECT gets its answer."""
    service.answer("nested", 200, NESTED)
    auth = http_auth(service.url)
    result = await asyncio.wait_for(await decide_async(auth, "nested"), 10)
    refused(result, UNAVAILABLE, "its answer is JSON nested too deeply")
    auth.close()


@pytest.mark.asyncio
async def test_no_answer_within_the_timeout_is_the_service_down(service: AuthService) -> None:
    auth = http_auth(service.url, http_timeout_seconds=0.5)
    release = service.hold("slow")  # answered only when the test ends
    result = await asyncio.wait_for(await decide_async(auth, "slow"), 10)
    # The probe (a CONNECT of nobody, 401) is answered: this request failed alone.
    refused(result, UNAVAILABLE, "failed this request: no answer within 0.5 s")
    release.set()
    auth.close()


class Trickler:
    """A real HTTP service that answers a byte at a time, never finishing its headers:
    each read of the broker's gets a byte, so no socket timeout ever fires."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.closed = threading.Event()  # the broker hung up on it
        trickler = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                try:
                    self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Pad: ")
                    while not trickler.stop.wait(0.02):
                        self.wfile.write(b"a")
                        self.wfile.flush()
                except OSError:
                    trickler.closed.set()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,))

    def __enter__(self) -> Trickler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


@pytest.mark.asyncio
async def test_a_trickling_service_frees_its_request_at_the_deadline() -> None:
    """http_timeout_seconds bounds the whole request, not each read: at the deadline
    the request's socket is closed, so its thread and its place in http_max_pending
    are free for the next client (before, 0x89 Server busy as long as it trickled)."""
    with Trickler() as service:
        auth = http_auth(service.url, http_timeout_seconds=0.5, http_max_pending=1)
        member = auth.chain[0]
        assert isinstance(member, HttpMember)
        first = await asyncio.wait_for(await decide_async(auth, "a"), 10)
        refused(first, UNAVAILABLE, "no answer within 0.5 s")
        assert await asyncio.to_thread(service.closed.wait, 10), "the request was never closed"

        async def freed() -> None:
            while member.pending:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(freed(), 10)
        service.closed.clear()
        second = await asyncio.wait_for(await decide_async(auth, "b"), 10)
        refused(second, UNAVAILABLE, "no answer within 0.5 s")  # asked, not 0x89
        assert await asyncio.to_thread(service.closed.wait, 10)
        auth.close()


# --------------------------------------------------------------------------
# grants and the ACL
# --------------------------------------------------------------------------


def test_a_grant_restricts_its_client_without_an_acl_file() -> None:
    acl = open_authorizer("", grants=True)
    assert acl.active
    grant = Grant((Rule(READ | WRITE, "devices/%c/#"), Rule(0, "devices/%c/secret")))
    acl.client_connected("c1", "dev", grant)
    acl.client_connected("c2", "other")
    assert acl.can_publish("c1", "dev", "devices/c1/temp")
    assert not acl.can_publish("c1", "dev", "devices/c2/temp")
    assert acl.can_subscribe("c1", "dev", "devices/c1/#")
    assert not acl.can_subscribe("c1", "dev", "#")
    assert acl.can_receive("c1", "devices/c1/x") and not acl.can_receive("c1", "devices/c1/secret")
    # A client without a grant: everything, as without an ACL file.
    assert acl.can_publish("c2", "other", "devices/c1/temp") and acl.can_receive("c2", "any")
    # Reconnecting under another grant: no cached decision of the old one is used.
    acl.client_connected("c1", "dev", Grant((Rule(READ, "devices/c1/secret"),)))
    assert acl.can_receive("c1", "devices/c1/secret") and not acl.can_receive("c1", "devices/c1/x")
    acl.client_connected("c1", "dev")
    assert acl.can_receive("c1", "devices/c1/x")
    acl.client_connected("c1", "dev", grant)
    acl.forget("c1")
    assert acl.can_publish("c1", "dev", "devices/c2/temp")


def test_a_grant_and_the_acl_file_combine(tmp_path: Path) -> None:
    path = tmp_path / "acl"
    path.write_text("user dev\ntopic read news/#\ntopic deny devices/+/fw\n")
    acl = open_authorizer(str(path), grants=True)
    acl.client_connected(
        "c1", "dev", Grant((Rule(READ | WRITE, "devices/%u/#"), Rule(0, "news/x")))
    )
    assert acl.can_receive("c1", "news/y")  # the file grants
    assert acl.can_publish("c1", "dev", "devices/dev/t")  # the grant grants
    assert not acl.can_publish("c1", "dev", "devices/dev/fw")  # the file's deny wins
    assert not acl.can_receive("c1", "news/x")  # the grant's deny wins
    assert not acl.can_publish("c1", "dev", "$SYS/x")
    # The will: checked under the grant it was made with, also once it is forgotten.
    will_grant = acl.grants["c1"]
    acl.forget("c1")
    assert acl.may_publish("c1", "dev", will_grant, "devices/dev/t")
    assert not acl.can_publish("c1", "dev", "devices/dev/t")
