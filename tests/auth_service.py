"""A real HTTP authentication service for auth.chain http tests, and JWT key material.

:class:`AuthService` is a ``http.server`` on a free 127.0.0.1 port, in a thread
of the test process: it answers each POSTed CONNECT as the test set it up for
that user name, records what it was sent, and can hold an answer until the
test releases it (a slow service, without sleeping). Keys are made with
cryptography and tokens minted with PyJWT, as the user's issuer would.
"""

from __future__ import annotations

import contextlib
import json
import ssl
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa

HOST = "127.0.0.1"


@dataclass
class Answer:
    status: int = 200
    body: bytes = b""
    hold: threading.Event | None = None  # answer only once this is set


@dataclass
class AuthService:
    """Answers per user name; unknown users get 401."""

    answers: dict[str, Answer] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)
    waiting: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    server: ThreadingHTTPServer | None = None

    scheme: str = "http"

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"{self.scheme}://{HOST}:{self.server.server_address[1]}/mqtt/auth"

    def allow(self, username: str, acl: list[str] | None = None, status: int = 200) -> None:
        body = json.dumps({"acl": acl}).encode() if acl is not None else b""
        self.answers[username] = Answer(status, body)

    def answer(self, username: str, status: int, body: bytes = b"") -> None:
        self.answers[username] = Answer(status, body)

    def hold(self, username: str) -> threading.Event:
        """``username``'s answer (allowed) waits until the returned event is set."""
        release = threading.Event()
        self.answers[username] = Answer(200, b"", release)
        return release

    def asked(self, username: str) -> int:
        return sum(1 for r in self.requests if r.get("username") == username)


def _handler(service: AuthService) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            request = json.loads(self.rfile.read(length))
            request["_content_type"] = self.headers.get("Content-Type")
            service.requests.append(request)
            answer = service.answers.get(request.get("username"), Answer(401))
            if answer.hold is not None:
                service.waiting.release()  # tells the test a request is being held
                answer.hold.wait(30)
            # The broker may have given up on a held answer (its deadline): nobody reads it.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self.send_response(answer.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer.body)))
                self.end_headers()
                self.wfile.write(answer.body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


@contextmanager
def running_service(tls: ssl.SSLContext | None = None) -> Iterator[AuthService]:
    """The service on a free port; with ``tls`` (a server context) over https."""
    service = AuthService()
    server = ThreadingHTTPServer((HOST, 0), _handler(service))
    server.daemon_threads = True
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
        service.scheme = "https"
    service.server = server
    thread = threading.Thread(
        target=server.serve_forever, args=(0.05,), name="auth-service", daemon=True
    )
    thread.start()
    try:
        yield service
    finally:
        for answer in service.answers.values():
            if answer.hold is not None:
                answer.hold.set()
        server.shutdown()
        server.server_close()
        thread.join(10)


# --------------------------------------------------------------------------
# JWT
# --------------------------------------------------------------------------

SECRET = b"s" * 40  # HS256 secret, longer than the 32 bytes required


@dataclass
class SigningKey:
    """A private key and its public JWK (``kid``), as an issuer holds them."""

    kid: str
    algorithm: str  # RS256 or ES256
    private: Any

    @classmethod
    def new(cls, kid: str, algorithm: str = "RS256") -> SigningKey:
        if algorithm == "RS256":
            private: Any = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        else:
            private = ec.generate_private_key(ec.SECP256R1())
        return cls(kid, algorithm, private)

    def public_jwk(self) -> dict[str, Any]:
        algorithm = jwt.get_algorithm_by_name(self.algorithm)
        jwk: dict[str, Any] = json.loads(algorithm.to_jwk(self.private.public_key()))
        jwk.update(kid=self.kid, use="sig", alg=self.algorithm)
        return jwk

    def sign(self, claims: Mapping[str, Any], kid: str | None = "") -> str:
        headers = {"kid": self.kid if kid == "" else kid} if kid is not None else {}
        return jwt.encode(dict(claims), self.private, algorithm=self.algorithm, headers=headers)


def write_jwks(path: Path, *keys: SigningKey) -> None:
    path.write_text(json.dumps({"keys": [key.public_jwk() for key in keys]}))


def claims(client_id: str, username: str, lifetime: float = 300, **more: Any) -> dict[str, Any]:
    now = int(time.time())
    return {"sub": username, "client_id": client_id, "exp": now + lifetime, "iat": now, **more}


def hs256(claims: Mapping[str, Any], secret: bytes = SECRET) -> str:
    return jwt.encode(dict(claims), secret, algorithm="HS256")
